#!/usr/bin/env bash
# Make the separate environment NVIDIA ModelOpt runs in: the oracle trtmoe's unified-HF conformance tests
# compare against (tests/test_unified_hf_conformance.py). ModelOpt is never a trtmoe dependency; it pins
# transformers < 5.15, so it gets its own venv.
#
#   scripts/modelopt_env.sh [VENV_DIR]        (default /work/venvs/modelopt)
#   TRTMOE_MODELOPT_PYTHON=VENV_DIR/bin/python pytest tests/test_unified_hf_conformance.py
#
# CPU-only torch keeps it small (about 1.5 GB); the install takes a few minutes on a CI runner.
set -euo pipefail
VENV=${1:-/work/venvs/modelopt}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install --index-url https://download.pytorch.org/whl/cpu torch
"$VENV/bin/python" -m pip install "nvidia-modelopt==0.47.0" "transformers<5.15" safetensors requests
"$VENV/bin/python" -c "import modelopt, transformers; print('modelopt', modelopt.__version__, 'transformers', transformers.__version__)"
