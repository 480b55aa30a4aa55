#!/usr/bin/env bash
# Speed-ups of shipped kernels measured by two ksearch binaries (e.g. before and after a change
# to evaluation), interleaved in one call so both see the same machine: each pair of lines is
# the same kernel against the same seed, through `ksearch bench`.
#
#   bench/judge_compare.sh OLD_KSEARCH NEW_KSEARCH BACKEND [TASKS_DIR] [ROUNDS]
#   e.g. bench/judge_compare.sh .gpu/ksearch-old .gpu/ksearch cuda .gpu/tasks 2
set -uo pipefail
OLD=$1 NEW=$2 BACKEND=$3 TASKS=${4:-tasks} ROUNDS=${5:-2}
case "$BACKEND" in
    cpu) CASES="softmax:cpu/rows_simd.cpp:rows_simd rmsnorm:cpu/rows_simd.cpp:rows_simd mamba_scan:cpu/chan_simd.cpp:chan_simd" ;;
    cuda) CASES="softmax:cuda/block_row.cu:block_row rmsnorm:cuda/block_row.cu:block_row mamba_scan:cuda/seq_scan.cu:seq_scan attention:cuda/flash_wgmma.cu:flash_wgmma" ;;
    *) echo "backend: cpu or cuda" >&2; exit 2 ;;
esac
dir=$(mktemp -d)
printf '%-11s %-12s %-4s %-8s %s\n' task kernel run binary "result (kernel vs seed, same call)"
for r in $(seq 1 "$ROUNDS"); do
    for c in $CASES; do
        IFS=: read -r task file like <<<"$c"
        [[ -f "$TASKS/$task/$file" ]] || continue
        for which in old new; do
            bin=$OLD; [[ $which == new ]] && bin=$NEW
            line=$("$bin" --tasks-dir "$TASKS" --store "$dir/$which.db" bench "$task" "$TASKS/$task/$file" \
                --like "$like" --backend "$BACKEND" 2>&1 | grep -E "x   max err|FAILED" | head -3 |
                sed -E 's/ +/ /g' | tr '\n' ';')
            printf '%-11s %-12s %-4s %-8s %s\n' "$task" "$like" "$r" "$which" "$line"
        done
    done
done
rm -rf "$dir"
