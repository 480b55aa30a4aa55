#!/usr/bin/env bash
# On the GPU machine, with MLX's CUDA back-end: mlx-lm's Llama prefill stock against the patch
# (python/ksearch_mlx/export_llama.py) in one call:
#   1. every GPU kernel of one prefill per mode (bench/mlx_llama_trace.py, CUPTI), the patch as
#      by default and without fuse_mlp (KS_LLAMA_MLP=0), with the host time of building each
#      mode's graph and where the patched one goes (cProfile);
#   2. bench/mlx_llama.py, the patch as by default: the fused RoPE and swiglu checked and timed
#      against stock's, attention alone, prefill (wall clock, with each mode's graph-building time),
#      decode, logits;
#   3. the same with the patch's default choice (choose="measured") where RUN_MEASURED=1, without
#      fuse_qkv where RUN_NOQKV=1, without fuse_mlp where RUN_NOMLP=1, uncompiled (KS_LLAMA_COMPILE=0) where
#      RUN_NOCOMPILE=1, without the fused RoPE (KS_LLAMA_ROPE=0) where RUN_NOROPE=1.
# Here:   ../shared/tools/stage-mlx-cuda        (stages .mlx-a/ and .mlx-b/)
# There:  call 1, carry [".mlx-a"]:  mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/
#         call 2, carry [".mlx-b"]:  cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh && bash bench/llama_gpu.sh
# Environment: KS_ATT_KERNEL (flash_ws), LENS (2048,4096), REPS (11), TOP (12), PROFILE (10 graph
# builds profiled per trace), TRACE (1: step 1), RUN_MEASURED (0), RUN_NOQKV (0), RUN_NOMLP (0), RUN_NOCOMPILE (0),
# RUN_NOROPE (0).
# Output in $OUT: llama_trace{,_nomlp}.txt, llama.txt, mlx_llama_default.json (and llama_noqkv.txt,
# llama_nomlp.txt, llama_nocompile.txt, llama_norope.txt, mlx_llama.json of the last).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/ksearch-llama}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KS_ATT_KERNEL=${KS_ATT_KERNEL:-flash_ws}
REPS=${REPS:-11}
date -u +"%F %T UTC" | tee "$OUTDIR/llama_date.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a "$OUTDIR/llama_date.txt"
TR=(--lens "${LENS:-2048,4096}" --top "${TOP:-12}" --profile "${PROFILE:-10}")
if [ "${TRACE:-1}" = 1 ]; then
  python3 bench/mlx_llama_trace.py "${TR[@]}" 2>&1 | tee "$OUTDIR/llama_trace.txt"
  KS_LLAMA_MLP=0 python3 bench/mlx_llama_trace.py "${TR[@]}" 2>&1 | tee "$OUTDIR/llama_trace_nomlp.txt"
fi
python3 bench/mlx_llama.py --budget 150 --no-f32 --reps "$REPS" 2>&1 | tee "$OUTDIR/llama.txt"
mv "$OUTDIR/mlx_llama.json" "$OUTDIR/mlx_llama_default.json"
if [ "${RUN_MEASURED:-0}" = 1 ]; then
  python3 bench/mlx_llama.py --budget 120 --no-f32 --reps "$REPS" --choose measured 2>&1 | tee "$OUTDIR/llama_measured.txt"
fi
if [ "${RUN_NOQKV:-0}" = 1 ]; then
  KS_LLAMA_QKV=0 python3 bench/mlx_llama.py --budget 120 --no-f32 --reps "$REPS" 2>&1 | tee "$OUTDIR/llama_noqkv.txt"
fi
if [ "${RUN_NOMLP:-0}" = 1 ]; then
  KS_LLAMA_MLP=0 python3 bench/mlx_llama.py --budget 120 --no-f32 --reps "$REPS" 2>&1 | tee "$OUTDIR/llama_nomlp.txt"
fi
if [ "${RUN_NOCOMPILE:-0}" = 1 ]; then
  KS_LLAMA_COMPILE=0 python3 bench/mlx_llama.py --budget 90 --no-f32 --reps "$REPS" 2>&1 | tee "$OUTDIR/llama_nocompile.txt"
fi
if [ "${RUN_NOROPE:-0}" = 1 ]; then
  KS_LLAMA_ROPE=0 python3 bench/mlx_llama.py --budget 90 --no-f32 --reps "$REPS" 2>&1 | tee "$OUTDIR/llama_norope.txt"
fi
