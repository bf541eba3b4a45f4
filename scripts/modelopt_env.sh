#!/usr/bin/env bash
# Make the separate environment NVIDIA ModelOpt runs in: the oracle trtmoe's conformance tests compare
# against (tests/test_unified_hf_conformance.py, tests/test_quant_fpformats.py). ModelOpt is never a
# trtmoe dependency; it pins transformers < 5.15, so it gets its own venv.
#
#   scripts/modelopt_env.sh [VENV_DIR]      (default: .venv-modelopt at the repository root, git-ignored,
#                                            where tests/conftest.py looks first)
#   TRTMOE_MODELOPT_PYTHON=VENV_DIR/bin/python pytest ...   (for any other VENV_DIR)
#
# Does nothing when VENV_DIR's python already imports ModelOpt's exporter; a run that failed half-way
# is finished by the next one. Everything comes from the package index pip is configured with (PyPI
# by default). torch is the project's own pin (pyproject.toml) unless overridden:
#   TRTMOE_MODELOPT_TORCH        requirement for torch (default: the pin in pyproject.toml)
#   TRTMOE_MODELOPT_TORCH_INDEX  index URL for torch alone, e.g. https://download.pytorch.org/whl/cpu
#                                for a CPU-only build where PyPI's default wheel is the CUDA one
#   PYTHON                       interpreter the venv is made from (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${1:-$ROOT/.venv-modelopt}
PYTHON=${PYTHON:-python3}
CHECK="import modelopt, modelopt.torch.export, transformers, torch; print('modelopt', modelopt.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"

if [ -x "$VENV/bin/python" ] && (cd /tmp && "$VENV/bin/python" -c "$CHECK") 2>/dev/null; then
    echo "modelopt_env: $VENV is ready"
    exit 0
fi

TORCH=${TRTMOE_MODELOPT_TORCH:-$("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(next(d for d in deps if re.match(r"torch\b", d)).replace(" ", ""))
EOF
)}
echo "modelopt_env: making $VENV with $TORCH"
"$PYTHON" -m venv "$VENV"
if [ -n "${TRTMOE_MODELOPT_TORCH_INDEX:-}" ]; then
    "$VENV/bin/python" -m pip install -q --index-url "$TRTMOE_MODELOPT_TORCH_INDEX" "$TORCH"
fi
# torch in the same request keeps pip from replacing the one installed above.
"$VENV/bin/python" -m pip install -q "$TORCH" "nvidia-modelopt==0.47.0" "transformers<5.15" safetensors requests
(cd /tmp && "$VENV/bin/python" -c "$CHECK")
