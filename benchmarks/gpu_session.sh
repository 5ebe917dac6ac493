#!/usr/bin/env bash
# Issue 19's GPU checks in one prepared run, for a lent NVIDIA GPU machine (Hopper: H100/H200):
#   1. benchmarks/gpu_fp8.py: which GEMMs XLA picks for the FP8 matmuls (cuBLASLt FP8 or not),
#      FP8 vs BF16 decode tokens/s on Qwen3-1.7B/8B shapes at batch 64 and 256, and BF16
#      decode as a fraction of the HBM-bandwidth bound;
#   2. benchmarks/grpo_step.py on the GPU: ais_jax (bf16 and FP8 rollouts) beside TRL's
#      GRPOTrainer, which runs in the machine's own python3 (torch, transformers, accelerate)
#      with the wheels TRL needs beyond those carried in .whl/ (see below). tunix is not run
#      there: its dependencies (grain, qwix, metrax, tensorflow-datasets, ...) are not on the
#      machine.
#
# Prepare here, once (Python 3.12 wheels for the GPU machine, ignored by git):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
# then run it there with .whl carried:  bash benchmarks/gpu_session.sh
# Results go to $OUT (the device tool's folder; /tmp/gpu_session elsewhere). Environment:
# FP8_ARGS (gpu_fp8.py's arguments, default "--models qwen3-8b"), FP8_TIMEOUT, STEP_SIZES
# (default small), STEP_ENGINES, STEP_ARGS (more grpo_step.py arguments, e.g. --ais-remat),
# STEP_TIMEOUT (seconds), PYTHON and TRL_PYTHON (default python3), PARTS (default "fp8 step":
# both; one of them alone, as two calls of the device tool).
#
# Time on an H200 (2026-12-04, jax 0.11.2): the whole gpu_fp8.py ran about 9.5 minutes, most of
# it compiling (25-57 s per generate program, FP8 the slower, 12-23 s per prefill), more than a
# call may run beside the step benchmark (3 minutes for the small size). On a 15-minute lease,
# split it: the default FP8_ARGS, the target's shape (~5 minutes), with the step benchmark in one
# call; then FP8_ARGS="--models qwen3-1.7b" PARTS=fp8; and to see where an FP8 matmul's time
# goes, FP8_ARGS="--models qwen3-8b --linears --no-decode" PARTS=fp8.
# Second lease (2026-12-04): one arm of the 8B batch-64 row took about 65-80 s (compiles), the
# --linears part about 80 s; the step benchmark with TRL did not finish in 150 s (ais_jax alone
# 71 s), give it 240. FP8_ARGS is split on spaces: names in it (--arms, --linear-variants) have
# none. Still unmeasured: `generate` as it now runs (FP8 prefill, bf16-operand steps) against
# FP8 GEMMs throughout at the threshold's untested point, 128 rows:
# FP8_ARGS="--models qwen3-8b --batches 128 --arms bf16,fp8,fp8-storage" PARTS=fp8. And
# whether the decode step's per-kernel cost (~3.2 us a launch, docs/benchmarks.md) shrinks
# when XLA records the whole loop as one CUDA graph: the same call with XLA_FLAGS=
# "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" set.
# Session 32 added the fused-projection arms (fewer launches: q/k/v and gate/up one matmul
# each, `model.fuse_projections`, decode layout out_in_fused). The next lease's plan, two calls
# of about 5 minutes each, then give the machine back:
#   1. FP8_ARGS="--models qwen3-8b --arms bf16,fp8,bf16-fused,fp8-fused" PARTS=fp8 FP8_TIMEOUT=450
#   2. the same with XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_session}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

PARTS="${PARTS:-fp8 step}"
if [[ " $PARTS " == *" fp8 "* ]]; then
  t0=$(date +%s)
  timeout "${FP8_TIMEOUT:-360}" "$PY" benchmarks/gpu_fp8.py --hlo-dir /tmp/gpu_fp8_hlo \
    ${FP8_ARGS:---models qwen3-8b} 2> "$OUT/gpu_fp8.err" | tee "$OUT/gpu_fp8.jsonl"
  echo "gpu_fp8.py: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
  tar -cf "$OUT/gpu_fp8_hlo.tar" -C /tmp gpu_fp8_hlo 2> /dev/null  # one file back, not eight
  tail -n 5 "$OUT/gpu_fp8.err"
fi

if [[ " $PARTS " == *" step "* ]]; then
  t0=$(date +%s)
  timeout "${STEP_TIMEOUT:-210}" "$PY" benchmarks/grpo_step.py --sizes "${STEP_SIZES:-small}" \
    --engines "${STEP_ENGINES:-ais_jax-bf16,ais_jax-fp8,trl}" --steps 3 --warmup 1 \
    --trl-python "${TRL_PYTHON:-$(command -v "$PY")}" ${STEP_ARGS:-} 2>&1 \
    | tee "$OUT/grpo_step.txt"
  echo "grpo_step.py: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
fi
