#!/usr/bin/env bash
# One device lease: the GPU smoke test of the zoo (NCCL, real Triton), the fused-op tests on CUDA, and the GPU
# benchmarks, each bounded so one slow step cannot take the others' time. Writes logs and JSON under $OUT.
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh          (Liger's wheel, if carried in .whl/, is installed first)
set -u
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, transformers, triton, accelerate; print('torch', torch.__version__, 'transformers',
 transformers.__version__, 'triton', triton.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/machine.txt"
step() { local limit=$1 name=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "^(#|\||[a-z0-9_]+ +(ok|FAIL)|FAILED|ERROR|[0-9]+ (passed|failed))" "$OUT/$name.log" | tail -45; }
# correctness first, side by side (neither is timed)
step 120 smoke torchrun --nproc_per_node 1 benchmarks/gpu_smoke.py --json "$OUT/gpu_smoke.json" &
step 150 fused_tests python3 -m pytest -q -x -n 6 -p no:cacheprovider tests/fused_ops &
wait
# the whole fused-op table is in BENCHMARKS.md; FUSED_OPS_ARGS narrows a later session to the open questions
step 110 fused_ops python3 benchmarks/fused_ops.py ${FUSED_OPS_ARGS:---iters 10} --json "$OUT/fused_ops.json"
step 150 throughput_gpt2 python3 benchmarks/train_throughput.py --device cuda --model gpt2 \
  --variants transformers transformers+liger oslo transformers+compile oslo+compile --json "$OUT/throughput_gpt2.json"
step 100 throughput_llama python3 benchmarks/train_throughput.py --device cuda --model llama \
  --variants transformers transformers+liger oslo --json "$OUT/throughput_llama.json"
