#!/usr/bin/env bash
# A virtual environment for the MLX worker's tests on a machine without a GPU: MLX with its CPU
# back-end (custom kernels cannot run there; the worker says so), mlx-lm for the export tests,
# pytest. Prints the interpreter's path last. Pinned versions: python/pyproject.toml.
#   KSEARCH_MLX_VENV   where to build it (default target/mlx-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KSEARCH_MLX_VENV:-target/mlx-venv}
PY=${PYTHON:-python3}
want="mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 numpy>=1.26,<3 pytest==8.3.4"
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import mlx.core, mlx_lm, pytest, numpy' >/dev/null 2>&1; then
    echo "mlx-venv: creating $VENV ($want)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $want >&2
fi
"$VENV/bin/python" -c 'import mlx.core as mx; assert mx.__version__ == "0.32.4", mx.__version__' >&2
echo "$PWD/$VENV/bin/python"
