#!/usr/bin/env bash
# The Megatron learner's CPU emulation on the megatron-core that Python 3.12 resolves (the
# `test` extra pins 0.19.2 there; 0.17+ publish cp312 wheels only, so CI's Python 3.11 gets
# 0.16.1). Not in the default suite: PyPI's Linux torch is the CUDA build, several GB with its
# nvidia-* wheels. Builds (once) a Python 3.12 venv outside the checkout with the `test` extra,
# then runs every Megatron CPU test (the `slow` cases too):
#   bash tests/megatron_py312.sh [VENV_DIR]     # default /tmp/asyncrl-py312; python3.12 on PATH
#   PYTHON312=/path/to/python3.12 bash tests/megatron_py312.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/asyncrl-py312}
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON312:-python3.12}" -m venv "$venv"
fi
# torch as CI pins it (constraints-cpu.txt)
"$venv/bin/pip" install -q -c constraints-cpu.txt -e ".[test]"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
import sys
print(f"python {sys.version.split()[0]}, torch {version('torch')}, "
      f"megatron-core {version('megatron-core')}")
PY
exec "$venv/bin/python" -m pytest -p no:cacheprovider -m "not gpu" \
    tests/test_megatron_versions.py tests/test_megatron_cpu_emulation.py \
    tests/test_megatron_moe_emulation.py tests/test_reference_worker.py
