#!/usr/bin/env bash
# The README's test command, on a clean clone: installs everything, prints versions, runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 --version
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -e ".[test]"
python -m numba --sysinfo | sed -n '1,40p' || true
python -c "import numpy, numba, torch, transformers; print('numpy', numpy.__version__, 'numba', numba.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
python -m pytest -q -n auto --maxprocesses 4
