#!/usr/bin/env bash
# Create the peer engines' virtual environments for benchmarks/sampler.py and
# benchmarks/grpo_step.py.
#
# Each peer gets its own venv so its pins (jax, flax, transformers, ...) never touch the
# ais_jax environment; nothing from the peers is vendored or committed. Hugging Face runs in the
# ais_jax venv by default (transformers and torch are test dependencies); pass --hf to also
# build a separate CPU-only HF venv and point the benchmark at it with --hf-python.
#
#   bash benchmarks/peers_setup.sh                # /work/peers/tunix-venv
#   PEERS=/somewhere bash benchmarks/peers_setup.sh --hf
#   bash benchmarks/peers_setup.sh --trl          # also /work/peers/trl-venv (grpo_step.py)
#   bash benchmarks/peers_setup.sh --trl-only     # only the TRL venv
#
# Environment: PEERS (root folder, default /work/peers), PYTHON (default python3, >= 3.11),
# TUNIX_VERSION (default 0.1.7), TRL_VERSION (default 1.16.0), TORCH_INDEX_URL (--hf, --trl),
# TORCH_VERSION (--trl: pin the torch wheel first, e.g. 2.13.0+cpu where a CPU wheel is local).
set -euo pipefail

PEERS="${PEERS:-/work/peers}"
PYTHON="${PYTHON:-python3}"
TUNIX_VERSION="${TUNIX_VERSION:-0.1.7}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"
mkdir -p "$PEERS"

make_venv() {
  local dir="$1"
  if [ ! -x "$dir/bin/python" ]; then
    "$PYTHON" -m venv "$dir"
  fi
  "$dir/bin/python" -m pip install --quiet --upgrade pip
}

if [ "${1:-}" != "--trl-only" ]; then
  # tunix: google-tunix from PyPI (pulls its own jax / flax / transformers).
  make_venv "$PEERS/tunix-venv"
  "$PEERS/tunix-venv/bin/pip" install "google-tunix==$TUNIX_VERSION"
  "$PEERS/tunix-venv/bin/python" -c \
    "import tunix.generate.sampler, tunix.models.qwen3.params, tunix.models.llama3.params, \
tunix.rl.grpo.grpo_learner; \
print('tunix venv ok')"
fi

if [ "${1:-}" = "--trl" ] || [ "${1:-}" = "--trl-only" ]; then
  # TRL's GRPOTrainer (transformers + torch, no vLLM). torch first, so TORCH_VERSION /
  # TORCH_INDEX_URL pick the wheel (a CPU-only one where it is available) before trl's pins.
  make_venv "$PEERS/trl-venv"
  "$PEERS/trl-venv/bin/pip" install "torch${TORCH_VERSION:+==$TORCH_VERSION}" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "$PEERS/trl-venv/bin/pip" install "trl==$TRL_VERSION" \
    "torch${TORCH_VERSION:+==$TORCH_VERSION}"
  "$PEERS/trl-venv/bin/python" -c "import trl, torch; print('trl venv ok', trl.__version__)"
fi

if [ "${1:-}" = "--hf" ]; then
  # Separate Hugging Face venv. TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu)
  # picks a CPU-only torch wheel where that index is reachable; the default is PyPI.
  make_venv "$PEERS/hf-venv"
  "$PEERS/hf-venv/bin/pip" install torch ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "$PEERS/hf-venv/bin/pip" install transformers safetensors numpy
  "$PEERS/hf-venv/bin/python" -c "import transformers, torch; print('hf venv ok')"
  echo "run: python benchmarks/sampler.py --hf-python $PEERS/hf-venv/bin/python"
fi
