export PYTHONPATH=$PWD/python OUT=${OUT:-/tmp/o}
STEPS=none bash bench/mlx_anchors.sh >/dev/null 2>&1
python3 bench/mlx_op_cost.py 2>&1 | tail -14
STEPS=decode DECODE_ARGS="--builds blocks,fused --rounds 7" bash bench/mlx_anchors.sh 2>&1 | sed -n '/^== mlx-lm Llama decode/,$p'
