#!/usr/bin/env python3
"""How fast L2 can feed shared memory the key/value tiles of an attention call, with no arithmetic: the
bandwidth ceiling that a FlashAttention-style kernel with 128-row query blocks meets on Hopper (sm_90).

    python3 bench/l2_stream.py prepare      # here: NVRTC into KS_CUBIN_DIR (default .l2-cubins)
    python3 bench/l2_stream.py run          # the GPU machine (CuPy): a table of TB/s per case

Each block (one per SM, 132) walks work items as flash_ws does without the mask (item w = (head w / QB,
query block w % QB), block b taking items b, b + 132, ...); for every item it copies the item's head's K
and V, tile by tile (BN keys x 128 columns of f16: BN * 256 bytes each), from global memory into a ring
of STAGES shared-memory stages with the bulk copy engine (cp.async.bulk, completion by bytes on the
stage's full mbarrier); one consumer thread waits on each full barrier and hands the stage straight back
(empty mbarrier). Nothing is computed, so the time is the copies' alone. The items of a head run at about
the same time and the heads in use at once (about 8 of 1 MB at the anchor) fit L2 (50 MB on an H100) many
times over, so each head leaves HBM once and its other query blocks' copies are L2 hits, as flash_ws's
are. Bytes moved = items x 2 x keys x 256 (each item copies its head's K and V whole).

Cases: the shape of issue #13's anchor (4,32,2048,128 without the mask: 128 heads x 16 query blocks of
2048 keys, the bytes flash_ws moves: 2.15 GB) at BN 128 with 2 or 3 stages (4 do not fit), BN 192 with 2; one with every
block on the same head; and one reading each head once (no reuse: HBM). The table gives the time per
call, TB/s, and the time flash_ws would need at that rate for its bytes, next to its measured time.
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cuda_dev as cd  # noqa: E402

SMS = 132
HD = 128
# (label, BN, STAGES, heads, query blocks a head, keys) ; heads = 1 puts every block on one head
CASES = [
    ("anchor BN 128 x 3", 128, 3, 128, 16, 2048),
    ("anchor BN 128 x 2", 128, 2, 128, 16, 2048),
    ("anchor BN 192 x 2", 192, 2, 128, 16, 2048),
    ("one head, 2048 items", 128, 3, 1, 2048, 2048),
    ("no reuse (HBM)", 128, 3, 2048, 1, 2048),
]

SRC = r"""
__device__ __forceinline__ void mbar_init(unsigned a, unsigned n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned a, unsigned tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(tx) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned a, unsigned ph) {
    asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n"
                 ::"r"(a), "r"(ph) : "memory");
}
__device__ __forceinline__ void bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// kv: heads x (K: keys x 128, then V: keys x 128) f16. Item w: head w / qb.
extern "C" __global__ void __launch_bounds__(64, 1) stream(const unsigned char* kv, long long* cycles, int items,
                                                           int qb, int keys) {
    extern __shared__ __align__(1024) unsigned char sm[];
    const unsigned base = (unsigned)__cvta_generic_to_shared(sm);
    const unsigned tb = BN * 256;  // bytes of one K or V tile
    const unsigned bars = base + 2 * ST * tb;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (ST + s), 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const long long t0 = clock64();
    const int nt = (keys + BN - 1) / BN;
    const long long head_bytes = 2ll * keys * 256;
    int T = 0;
    if (tid == 0) {  // producer
        for (int w = blockIdx.x; w < items; w += gridDim.x) {
            const unsigned char* k = kv + (long long)(w / qb) * head_bytes;
            const unsigned char* v = k + (long long)keys * 256;
            for (int t = 0; t < nt; t++, T++) {
                const int s = T % ST;
                if (T >= ST) mbar_wait(bars + 8 * (ST + s), (T / ST - 1) & 1);
                const unsigned full = bars + 8 * s;
                const int rows = min(BN, keys - t * BN);
                mbar_expect(full, 2 * rows * 256);
                bulk(base + 2 * s * tb, k + (long long)t * BN * 256, rows * 256, full);
                bulk(base + 2 * s * tb + tb, v + (long long)t * BN * 256, rows * 256, full);
            }
        }
    } else if (tid == 32) {  // consumer
        for (int w = blockIdx.x; w < items; w += gridDim.x)
            for (int t = 0; t < nt; t++, T++) {
                const int s = T % ST;
                mbar_wait(bars + 8 * s, (T / ST) & 1);
                mbar_arrive(bars + 8 * (ST + s));
            }
        cycles[blockIdx.x] = clock64() - t0;
    }
}
"""


def source(bn, st):
    return f"#define BN {bn}\n#define ST {st}\n" + SRC


def shared_bytes(bn, st):
    return 2 * st * bn * 256 + 16 * st + 1024


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "run"
    os.environ.setdefault("KS_CUBIN_DIR", os.path.join(cd.ROOT, ".l2-cubins"))
    opts = ["--gpu-architecture=sm_90a", "--std=c++17"]
    paths = {(bn, st): cd.cubin_for(source(bn, st), opts)[0] for _, bn, st, *_ in CASES}
    if mode == "prepare":
        print(f"prepare: {len(paths)} cubins in {os.environ['KS_CUBIN_DIR']}")
        return 0
    import cupy as cp

    dev = cp.cuda.Device(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    flash_ws_us = float(os.environ.get("FLASH_WS_US", "0"))  # its measured time at the anchor, if given
    print(f"{name}: {SMS} blocks, one producer and one consumer thread each; medians of 10 launches (CUDA events)")
    print(f"{'case':<24} {'GB':>6} {'us':>9} {'TB/s':>6}  {'cycles (block min-max)':>24}")
    for label, bn, st, heads, qb, keys in CASES:
        mod = cp.RawModule(path=paths[(bn, st)])
        f = mod.get_function("stream")
        smem = shared_bytes(bn, st)
        f.max_dynamic_shared_size_bytes = smem
        items = heads * qb if heads > 1 else qb
        kv = cp.zeros(max(heads, 1) * 2 * keys * HD, dtype=cp.float16)
        cyc = cp.zeros(SMS, dtype=cp.int64)
        args = (kv, cyc, cp.int32(items), cp.int32(qb), cp.int32(keys))
        gb = items * 2 * keys * 256 / 1e9  # each item copies its head's K and V whole
        times = []
        for i in range(12):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            f((SMS,), (64,), args, shared_mem=smem)
            b.record()
            b.synchronize()
            if i >= 2:
                times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
        dev.synchronize()
        us = statistics.median(times)
        c = sorted(int(x) for x in cyc.get())
        print(f"{label:<24} {gb:6.2f} {us:9.1f} {gb / us * 1e3:6.2f}  {c[0]:>11}-{c[-1]:<11}")
        if label.startswith("anchor BN 128 x 3") and flash_ws_us:
            print(f"{'':<24} flash_ws moves the same bytes in {flash_ws_us:.1f} us: {gb / flash_ws_us * 1e3:.2f} TB/s, "
                  f"{us / flash_ws_us:.0%} of its time is this copy floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
