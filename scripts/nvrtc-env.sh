#!/usr/bin/env bash
# NVRTC 13 and the CUDA headers from pip (nvidia-cuda-nvrtc, nvidia-cuda-runtime: no GPU needed),
# installed under target/ and never into the system's Python. Prints the folder that holds
# lib/libnvrtc.so.13 and include/cuda_fp16.h.
#   PYTHON=<interpreter>   install into that interpreter's environment instead (a virtual
#                          environment; scripts/test.sh passes the one of scripts/mlx-venv.sh)
#   KSEARCH_NVRTC_DIR      where to install otherwise (default target/nvrtc), with pip --target
set -euo pipefail
cd "$(dirname "$0")/.."
want=("nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*")
ok() { [[ -n "$1" && -e "$1/lib/libnvrtc.so.13" && -e "$1/include/cuda_fp16.h" ]]; }
if [[ -n "${PYTHON:-}" ]]; then
    site() { "$PYTHON" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true; }
    CU13=$(site)
    if ! ok "$CU13"; then
        echo "nvrtc-env: installing ${want[*]} for $PYTHON" >&2
        # A wrapper made by scripts/mlx-venv.sh (no venv module) keeps its packages in ../site.
        wrapped=$(dirname "$PYTHON")/../site
        if [[ -d "$wrapped" ]]; then
            "$PYTHON" -m pip install -q --disable-pip-version-check --target "$wrapped" "${want[@]}" >&2
        else
            "$PYTHON" -m pip install -q --disable-pip-version-check "${want[@]}" >&2
        fi
        CU13=$(site)
    fi
else
    DIR=${KSEARCH_NVRTC_DIR:-target/nvrtc}
    CU13="$DIR/nvidia/cu13"
    if ! ok "$CU13"; then
        echo "nvrtc-env: installing ${want[*]} into $DIR" >&2
        rm -rf "$DIR"
        python3 -m pip install -q --disable-pip-version-check --target "$DIR" "${want[@]}" >&2
    fi
    CU13=$(cd "$CU13" 2>/dev/null && pwd || true)
fi
if ! ok "$CU13"; then
    echo "nvrtc-env: libnvrtc.so.13 or the CUDA headers not found after pip install" >&2
    exit 2
fi
echo "$CU13"
