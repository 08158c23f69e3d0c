#!/usr/bin/env bash
# One H200 session: environment facts, the GPU contract suite, then the benchmarks.
# Usage (on the GPU machine, repo root): bash eval/gpu_session.sh [STAGES...]
#   stages: env tests bench_ops sweep_linear bench_attn probe_attn check bench_rollout
# Each device call runs at most 10 minutes: pass the stages that fit.
# Logs (one per stage) and CSVs are written to a work folder and packed into one
# tarball under $OUT (default eval/results/run), so that one file comes back.
set -u
OUT=${OUT:-eval/results/run}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/csv"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${*:-env tests bench_ops bench_attn}
COMMIT=${AREAL_TIK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
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
  tests) run tests 420 python3 -m pytest -q -m gpu --timeout=300 -rfE tests/ ;;
  bench_ops) run bench_linear 150 python3 eval/bench_linear.py --out "$W/csv"
             run bench_pointwise 90 python3 eval/bench_pointwise.py --out "$W/csv"
             run bench_logprob 60 python3 eval/bench_logprob.py --out "$W/csv" ;;
  sweep_linear) run sweep_linear 240 python3 eval/bench_linear.py --sweep --out "$W/csv" ;;
  bench_attn) run bench_attention 120 python3 eval/bench_attention.py --out "$W/csv" ;;
  probe_attn) run probe_attention 160 python3 eval/probe_attention.py ;;
  check) for m in qwen3-0.6b qwen3-1.7b llama-3.2-1b; do
           run "check_$m" 150 python3 -m areal_tik.cli check --model "$m" --num-prompts 64 --max-new-tokens 256 --no-progress
         done ;;
  bench_rollout) run bench_rollout 300 python3 eval/bench_rollout.py --out "$W/csv" ;;
esac; done
tar czf "$OUT/results.tgz" -C "$W" .
log done
