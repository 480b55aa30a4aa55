#!/usr/bin/env bash
# An environment for the MLX worker's tests on a machine without a GPU: MLX with its CPU
# back-end (custom kernels cannot run there; the worker says so), mlx-lm for the export tests,
# pytest. Prints the interpreter's path last. Pinned versions: python/pyproject.toml.
#   KSEARCH_MLX_VENV   where to build it (default target/mlx-venv)
# A virtual environment where `python3 -m venv` works; otherwise the packages go into
# $KSEARCH_MLX_VENV/site with `pip --target` and bin/python is a wrapper that puts them on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KSEARCH_MLX_VENV:-target/mlx-venv}
PY=${PYTHON:-python3}
want=(mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 "numpy>=1.26,<3" pytest==8.3.4)
ready() { "$VENV/bin/python" -c 'import mlx.core, mlx_lm, pytest, numpy' >/dev/null 2>&1; }
if [[ ! -x "$VENV/bin/python" ]] || ! ready; then
    echo "mlx-venv: creating $VENV (${want[*]})" >&2
    rm -rf "$VENV"
    if "$PY" -m venv "$VENV" >&2 2>/dev/null && [[ -x "$VENV/bin/python" ]]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${want[@]}" >&2
    else
        echo "mlx-venv: no venv module here; installing with pip --target" >&2
        rm -rf "$VENV"
        mkdir -p "$VENV/bin"
        "$PY" -m pip install -q --disable-pip-version-check --target "$VENV/site" "${want[@]}" >&2
        site=$(cd "$VENV/site" && pwd)
        real=$(command -v "$PY")
        printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec "%s" "$@"\n' "$site" "$real" > "$VENV/bin/python"
        chmod +x "$VENV/bin/python"
    fi
fi
"$VENV/bin/python" -c 'import mlx.core as mx; assert mx.__version__ == "0.32.4", mx.__version__' >&2
echo "$(cd "$VENV/bin" && pwd)/python"
