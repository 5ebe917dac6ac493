#!/usr/bin/env bash
# Create the peer engines' virtual environments for benchmarks/sampler.py.
#
# Each peer gets its own venv so its pins (jax, flax, transformers, ...) never touch the
# ais_jax environment; nothing from the peers is vendored or committed. Hugging Face runs in the
# ais_jax venv by default (transformers and torch are test dependencies); pass --hf to also
# build a separate CPU-only HF venv and point the benchmark at it with --hf-python.
#
#   bash benchmarks/peers_setup.sh                # /work/peers/tunix-venv
#   PEERS=/somewhere bash benchmarks/peers_setup.sh --hf
#
# Environment: PEERS (root folder, default /work/peers), PYTHON (default python3, >= 3.11),
# TUNIX_VERSION (default 0.1.7), TORCH_INDEX_URL (only with --hf).
set -euo pipefail

PEERS="${PEERS:-/work/peers}"
PYTHON="${PYTHON:-python3}"
TUNIX_VERSION="${TUNIX_VERSION:-0.1.7}"
mkdir -p "$PEERS"

make_venv() {
  local dir="$1"
  if [ ! -x "$dir/bin/python" ]; then
    "$PYTHON" -m venv "$dir"
  fi
  "$dir/bin/python" -m pip install --quiet --upgrade pip
}

# tunix: google-tunix from PyPI (pulls its own jax / flax / transformers).
make_venv "$PEERS/tunix-venv"
"$PEERS/tunix-venv/bin/pip" install "google-tunix==$TUNIX_VERSION"
"$PEERS/tunix-venv/bin/python" -c \
  "import tunix.generate.sampler, tunix.models.qwen3.params; print('tunix venv ok')"

if [ "${1:-}" = "--hf" ]; then
  # Separate Hugging Face venv. TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu)
  # picks a CPU-only torch wheel where that index is reachable; the default is PyPI.
  make_venv "$PEERS/hf-venv"
  "$PEERS/hf-venv/bin/pip" install torch ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "$PEERS/hf-venv/bin/pip" install transformers safetensors numpy
  "$PEERS/hf-venv/bin/python" -c "import transformers, torch; print('hf venv ok')"
  echo "run: python benchmarks/sampler.py --hf-python $PEERS/hf-venv/bin/python"
fi
