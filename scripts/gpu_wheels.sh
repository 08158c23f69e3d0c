#!/usr/bin/env bash
# Builds the parts that carry AReaL's runtime dependencies to a GPU machine without a
# package index (see eval/gpu_session.sh: "stage" copies one part per call, "deps"
# installs them). Run from the repo root on a machine with pip access:
#   bash scripts/gpu_wheels.sh [OUTDIR]    -> OUTDIR/part00, part01, ... (50 MiB each: a call carries at most 64 MiB, the working tree included)
# Wheels are cp312 manylinux x86-64 (the GPU image's Python); a package without such a
# wheel (pycosat) travels as its sdist and is built there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-.gpu-wheels}
WORK=$(mktemp -d)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  PLATFORMS+=(--platform "$p")
done
grep -v '^#' requirements/gpu-carry.txt | while read -r req; do
  [ -n "$req" ] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$WORK" "$req" 2>/dev/null && continue
  # pure-Python sdists become wheels here; others (C extensions) go as sdists
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$WORK/src" "$req"
  sdist=$(ls "$WORK/src"/*.tar.gz | head -1)
  python3 -m pip wheel -q --no-deps -w "$WORK/pure" "$sdist" 2>/dev/null \
    && ls "$WORK/pure"/*-py3-none-any.whl >/dev/null 2>&1 && mv "$WORK/pure"/*.whl "$WORK"/ \
    || mv "$sdist" "$WORK"/
  rm -rf "$WORK/src" "$WORK/pure"
done
mkdir -p "$OUTDIR"
tar cf - -C "$WORK" . | split -b 50M -d - "$OUTDIR/part"
ls -la "$OUTDIR"
rm -rf "$WORK"
