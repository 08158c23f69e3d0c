#!/usr/bin/env bash
# Builds the parts that carry vLLM 0.26.0 (requirements/gpu-vllm.txt, its own site) and the
# training-side kernel baselines (requirements/gpu-kernels.txt: Liger-Kernel, flash-attn-4
# and the CuTe DSL, another site) to the GPU image. Run from the repo root with pip access:
#   bash scripts/vllm_wheels.sh OUTDIR    -> OUTDIR/part00, part01, part02, part03 (56 MiB each)
# The tarball holds vllm/*.whl and kernels/*.whl; vLLM's wheel loses the members its
# `# prune:` lines name (FA2, MoE, the Rust front end, ...: 304 -> ~110 MB) before packing.
# On the GPU machine: one `vllm_stage` per part (copy it into .carry/ first), then
# `vllm_deps` (eval/gpu_session.sh). Download into a folder outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: bash scripts/vllm_wheels.sh OUTDIR" >&2; exit 2; }
OUTDIR=$1
source scripts/gpu_wheels.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
download_list requirements/gpu-vllm.txt "$WORK/vllm"
python3 -m eval.wheels prune "$WORK/vllm" requirements/gpu-vllm.txt
download_list requirements/gpu-kernels.txt "$WORK/kernels"
du -sh "$WORK/vllm" "$WORK/kernels"
split_parts "$WORK" "$OUTDIR" 56M  # 56 MiB + the ~4 MB tree stays under a call's 64 MiB
