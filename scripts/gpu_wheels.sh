#!/usr/bin/env bash
# Builds the parts that carry AReaL's runtime dependencies to a GPU machine without a
# package index (see eval/gpu_session.sh: "stage" copies one part per call, "deps"
# installs them). Run from the repo root on a machine with pip access:
#   bash scripts/gpu_wheels.sh [OUTDIR]    -> OUTDIR/part00, part01, ... (40 MiB each: a call carries at most 64 MiB,
#                                             the working tree included, ~18 MiB at 3fd70e2)
# Wheels are cp312 manylinux x86-64 (the GPU image's Python); a package without such a
# wheel (pycosat) travels as its sdist and is built there.
# Sourced (scripts/vllm_wheels.sh), it only defines download_list and split_parts.
set -euo pipefail
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  PLATFORMS+=(--platform "$p")
done

download_list() {  # download_list LIST DEST: every exact pin of LIST (eval/wheels.py) into DEST
  local list=$1 dest=$2 req sdist
  mkdir -p "$dest"
  python3 -m eval.wheels pins "$list" | while read -r req; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$dest" "$req" 2>/dev/null && continue
    # pure-Python sdists become wheels here; others (C extensions) go as sdists
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest/src" "$req"
    sdist=$(ls "$dest/src"/*.tar.gz | head -1)
    python3 -m pip wheel -q --no-deps -w "$dest/pure" "$sdist" 2>/dev/null \
      && ls "$dest/pure"/*-py3-none-any.whl >/dev/null 2>&1 && mv "$dest/pure"/*.whl "$dest"/ \
      || mv "$sdist" "$dest"/
    rm -rf "$dest/src" "$dest/pure"
  done
}

split_parts() {  # split_parts SRC OUTDIR [SIZE]: a tarball of SRC's contents in parts
  mkdir -p "$2"
  tar cf - -C "$1" . | split -b "${3:-40M}" -d - "$2/part"
  ls -la "$2"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cd "$(dirname "$0")/.."
  OUTDIR=${1:-.gpu-wheels}
  WORK=$(mktemp -d)
  download_list requirements/gpu-carry.txt "$WORK"
  split_parts "$WORK" "$OUTDIR"
  rm -rf "$WORK"
fi
