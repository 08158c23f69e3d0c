#!/usr/bin/env bash
# Builds the parts that carry vLLM 0.26.0 (requirements/gpu-vllm.txt, its own site) and the
# training-side kernel baselines (requirements/gpu-kernels.txt: Liger-Kernel, flash-attn-4
# and the CuTe DSL, another site) to the GPU image. Run from the repo root with pip access:
#   bash scripts/vllm_wheels.sh OUTDIR    -> OUTDIR/vllm-part00..03 (40 MiB each)
# vLLM's wheel loses the members its `# prune:` lines name (FA2, MoE, the Rust front end, ...:
# 304 -> ~110 MB) first. Both lists are installed here into cp312 sites, vllm/ and kernels/,
# which travel as one xz tarball (measured: 124 + 98 MB of wheels -> 86.5 + 73.5 MB, four
# parts; the wheels alone would take six 40 MiB parts). A call carries at most 64 MiB with the
# working tree (~18 MiB), so a part is 40 MiB (the 56 MiB parts of before no longer fit).
# On the GPU machine: one `vllm_stage` per part (copy it into .carry/ first), then
# `vllm_deps` (eval/gpu_session.sh), which unpacks the two sites into $VSITE and $KSITE.
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
if ls "$WORK"/vllm/*.tar.gz "$WORK"/kernels/*.tar.gz >/dev/null 2>&1; then
  echo "an sdist in the vLLM or kernel list: vllm_deps builds none; pin a version with a cp312 wheel" >&2; exit 1
fi
du -sh "$WORK/vllm" "$WORK/kernels"
install_site "$WORK/vllm" "$WORK/sites/vllm"
install_site "$WORK/kernels" "$WORK/sites/kernels"
xz_parts "$WORK/sites" "$OUTDIR" vllm-part 40M
