#!/usr/bin/env bash
# One H200 session: environment facts, the GPU contract suite, then the benchmarks.
# Usage (on the GPU machine, repo root): bash eval/gpu_session.sh [STAGES...]
#   stages: env tests bench_ops bench_attn probe_attn tests_model bench_rollout check
# Logs (one per stage) and CSVs are written to a work folder and packed into one
# tarball under $OUT (default eval/results/run), so that one file comes back.
set -u
OUT=${OUT:-eval/results/run}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/csv"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${*:-env tests bench_ops bench_attn}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export AREAL_TIK_COMMIT=$COMMIT
log() { echo "== $(date -u +%H:%M:%S) $*"; }
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1; local rc=$?
  tail -n 25 "$W/$name.log"; log "$name rc=$rc"
}
for s in $STAGES; do case $s in
  env) run env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"' ;;
  tests) run tests 900 python3 -m pytest -q -m gpu -x --timeout=600 tests/test_linear.py tests/test_rms_norm.py tests/test_rope.py tests/test_swiglu.py tests/test_logprob.py tests/test_attention.py ;;
  bench_ops) run bench_linear 300 python3 eval/bench_linear.py --out "$W/csv"
             run bench_pointwise 240 python3 eval/bench_pointwise.py --out "$W/csv"
             run bench_logprob 300 python3 eval/bench_logprob.py --out "$W/csv" ;;
  bench_attn) run bench_attention 300 python3 eval/bench_attention.py --out "$W/csv" ;;
  probe_attn) run probe_attention 240 python3 eval/probe_attention.py ;;
  tests_model) run tests_model 900 python3 -m pytest -q -m gpu --timeout=600 tests/test_model.py tests/test_engine.py ;;
  bench_rollout) run bench_rollout 400 python3 eval/bench_rollout.py --out "$W/csv" ;;
  check) run check 400 python3 -m areal_tik.cli check --model qwen3-0.6b --num-prompts 64 --max-new-tokens 256 ;;
esac; done
tar czf "$OUT/results.tgz" -C "$W" .
log done
