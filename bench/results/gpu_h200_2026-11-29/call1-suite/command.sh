#!/usr/bin/env bash
# One lease, in order of value; every part bounded, its summary copied to $OUT when it ends.
set -u
END=${END_S:-530}
[[ -n ${EXTRA:-} ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m tools.device_wheels --verify 2>&1 | tail -5
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
S=bench/suite/gpu_suite.sh
G=/tmp/gs; mkdir -p $G
left() { echo $(( END - SECONDS )); }
save() {
  for d in $G/*/; do n=$(basename $d); [[ -f $d/summary.md ]] && { echo "## $n"; cat $d/summary.md; }; done > $OUT/summaries.md
  tar czf $OUT/gs.tgz --exclude='model-*' --exclude='tmp' -C /tmp gs 2>/dev/null
}
part() {  # part NAME OWN_DEADLINE ARGS...
  local name=$1 own=$2; shift 2
  local l=$(left); local d=$(( own < l ? own : l ))
  if (( d < 40 )); then echo "#### $name skipped at ${SECONDS}s (${l}s left)"; return; fi
  echo "#### $name at ${SECONDS}s, deadline ${d}s"
  bash $S $G/$name --deadline-s $d ${EXTRA:-} "$@" 2>&1 | grep -E '^== |rc [0-9]+ in|skipped'
  save
}
# 1. The 8B shape: serial loop (graphs vs eager, mixed step), then the async loop with HF and the profiler.
part l8b 100 --core --only smoke --only throughput
part l8b-async 115 --only throughput-hf
# 2. Gemma-3-12B: capture with two KV groups, TPOT against the bound.
part gemma 105 --core --shape gemma-3-12b --only smoke --only throughput --limit throughput=90
# 3. The kernels' new variants compiled (windows, soft-caps, sinks, MoE, FP8).
l=$(left); t=$(( 90 < l ? 90 : l ))
if (( t > 30 )); then
  echo "#### compiled tests at ${SECONDS}s, ${t}s"
  TRITON_INTERPRET=0 timeout $t python3 -m pytest -v -p no:cacheprovider --durations=8 \
    tests/kernels/test_attention_variants.py tests/kernels/test_triton_moe.py tests/gpu/test_fp8_gpu.py \
    tests/kernels/test_triton_kernels.py > $G/compiled-tests.log 2>&1
  echo "rc $?"; grep -E "passed|failed|FAILED|Error" $G/compiled-tests.log | tail -25
  cp $G/compiled-tests.log $OUT/
fi
# 4. Gemma's SLO burst at budget 2048 (calibrate first).
part gemma-burst 200 --core --shape gemma-3-12b --only calibrate --only burst-http-2048
# 5. The MoE and FP8 shapes (the 8B bf16 throughput is part 1's).
part moe 90 --core --shape qwen3-30b-a3b --only smoke --only throughput --limit throughput=80
part fp8 80 --core --shape llama-3.1-8b-fp8 --only smoke --only throughput
save
echo "#### done at ${SECONDS}s"
