#!/usr/bin/env bash
# On the GPU machine: flash_ws with wider key tiles (BLOCK_N 160 / 176: fewer tile steps, so fewer
# barriers, row reductions and rescales of the output per key; STAGES 2 to fit shared memory) and
# with K and V released apart (KVS 1: a stage's K is reloaded once the S products have read it),
# against the defaults and cuDNN's SDPA, one call, through bench/cuda_dev.py (every element checked
# against the float32 SDPA reference, NaN-poisoned outputs, CUDA events with L2 flushed, medians;
# the peer timed in the same process):
#   1. per configuration of CFGS: one checked launch at the first anchor shape under a 60 s
#      timeout, then the stress suite (ragged L 1..1500, grouped- and multi-query heads, D 64 / 96 /
#      128; TMA and cp.async loads, persistent and not); a configuration failing either is not timed;
#   2. timing at the anchor, search and held-out shapes (TIME_SUITES: bench/cuda_dev.py's KS_SUITES):
#      BASE and every configuration that passed.
# Here:   ATT_PREPARE=1 bash bench/attention_blockn.sh   (NVRTC into .att-cubins)
# There:  bash bench/attention_blockn.sh                 (carry .att-cubins)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/attention-blockn}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.att-cubins} KS_BACKENDS=cuda KS_KERNELS=flash_ws
CFGS=${CFGS:-"BLOCK_N=176,STAGES=2,KVS=1;BLOCK_N=160,STAGES=2,KVS=1;BLOCK_N=128,STAGES=3,KVS=1;BLOCK_N=128,STAGES=2,KVS=1"}
BASE=${BASE:-"BLOCK_N=128,STAGES=3,KVS=0"}
mode=run
[ "${ATT_PREPARE:-0}" = 1 ] && mode=prepare
# $1: label, $2: suites, $3: KS_TIME, $4: KS_FIX, $5: timeout (s)
pass() {
    if [ "$mode" = prepare ]; then
        KS_SUITES=$2 KS_TIME=$3 KS_FIX=$4 python3 bench/cuda_dev.py prepare attention | grep -E "^prepare"
        return
    fi
    local log="$OUTDIR/$1.log"
    KS_SUITES=$2 KS_TIME=$3 KS_FIX=$4 timeout "$5" python3 bench/cuda_dev.py run attention > "$log" 2>&1
    local rc=$?
    echo "$1: exit $rc ($log): $(grep -E '^==== checked' "$log" || echo 'no summary: cut off or crashed')"
    [ $rc = 0 ] && ! grep -q "^FAILED" "$log"
}
IFS=';' read -r -a cfgs <<< "$CFGS"
timed="$BASE,PP=1,CTAS=132,TMA=1"
for c in "${cfgs[@]}"; do
    l=$(echo "$c" | tr -c 'A-Za-z0-9\n' '-')
    KS_MAXCFG=1 KS_HELDOUT=0 pass "$l-smoke" anchor 0 "$c,PP=1,CTAS=132,TMA=1" 60 &&
        KS_STRESS_DIST=1 pass "$l-stress" stress 0 "$c,PP=1,CTAS=132|1048576,TMA=0|1" 240 &&
        timed="$timed;$c,PP=1,CTAS=132,TMA=1"
done
[ "$mode" = prepare ] && timed="$BASE,PP=1,CTAS=132,TMA=1;${CFGS//;/,PP=1,CTAS=132,TMA=1;},PP=1,CTAS=132,TMA=1"
pass time "${TIME_SUITES:-anchor,search,heldout}" 1 "$timed" 400
[ "$mode" = prepare ] && exit 0
echo "== summary (bench/cuda_dev.py's: the best correct configuration per workload, the peer of the same process) =="
sed -n '/^==== summary/,$p' "$OUTDIR/time.log" | tail -n +2
grep -h "^FAILED" "$OUTDIR"/*.log | head -20
