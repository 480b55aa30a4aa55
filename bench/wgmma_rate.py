#!/usr/bin/env python3
"""The tensor pipe's own rate for the products an attention tile issues, on Hopper (sm_90a), without any
softmax, loads or barriers: what ceiling the products alone set for a FlashAttention-3-style kernel.

    python3 bench/wgmma_rate.py prepare      # here: NVRTC into KS_CUBIN_DIR (default .wgmma-cubins)
    python3 bench/wgmma_rate.py run          # the GPU machine (CuPy): a table of cycles per product

Each case is one launch of one block per SM (132 blocks) whose consumer warpgroups (NWG: 1 or 2) issue,
ITER times, the products of one key tile of an attention item with head size 128 and 64 query rows a
warpgroup, from shared memory laid out as flash_ws lays out Q, K and V (128-byte swizzle), committed as
flash_ws commits them, one group left in flight at each wait (the pipe never drains between tiles):
  S     S = Q K^T alone: HD / 16 = 8 wgmma m64nBNk16, both operands from shared memory (K-major);
  PV    O += P V alone: BN / 16 wgmma m64n128k16, P from registers, V MN-major in shared memory;
  S+PV  both, as a tile of flash_ws issues them (S of tile t and PV of tile t - 1 in flight together).
(PV and S+PV at BN 176 are left out: NVRTC 13's ptxas serialises their products for want of registers,
C7512, where flash_ws's consumers get 240 by setmaxnreg.) Per block the SM clock (clock64) brackets the loop after a block barrier; the table gives the median
block's cycles per tile of 64 query rows x BN keys a warpgroup, against the tensor pipe's ideal at
2048 dense f16 multiply-adds a cycle per SM (989.4 TFLOP/s at 1830 MHz over 132 SMs: the H100 SXM
data sheet's dense FP16 figure), and as a share of that ideal. The operands hold zeros (the values do
not change the pipe's rate); nothing is checked but that every block ran (a time, not a result).
Every case compiles with NVRTC 13 for sm_90a without spills or serialised products. H100, 2026-12-06
(bench/h100-2026-12-06-wgmma-blockn192.txt): every case at 99.9-100% of the ideal, S and PV of two
warpgroups together included (1024.2 cycles a warpgroup tile at BN 128).
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cuda_dev as cd  # noqa: E402

CASES = [  # (label, BN, what, NWG)
    ("S     BN 128", 128, "S", 2),
    ("PV    BN 128", 128, "PV", 2),
    ("S+PV  BN 128", 128, "SPV", 2),
    ("S+PV  BN 128, 1 WG", 128, "SPV", 1),
    ("S     BN 176", 176, "S", 2),
    ("S     BN 256", 256, "S", 2),
    ("S     BN 64", 64, "S", 2),
]
ITER = 2000
SMS = 132


def ss(n):
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    return (f"__device__ __forceinline__ void ss{n}(float* d, unsigned long long da, unsigned long long db) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n // 2 + 2}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, %{n // 2}, %{n // 2 + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
            f'                 : {outs} : "l"(da), "l"(db), "r"(1));\n}}\n')


def rs128():
    n = 128
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    a = n // 2
    return ("__device__ __forceinline__ void rs128(float* d, const unsigned* a, unsigned long long db) {\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{a + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {{{regs}}}, {{%{a}, %{a + 1}, %{a + 2}, %{a + 3}}}, %{a + 4}, p, 1, 1, 1;\\n}}\\n"\n'
            f'                 : {outs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));\n}}\n')


def source(bn, what, nwg):
    body = f"""
#define BN {bn}
#define NWG {nwg}
#define DO_S {1 if what in ("S", "SPV") else 0}
#define DO_PV {1 if what in ("PV", "SPV") else 0}
__device__ __forceinline__ unsigned long long mdesc(unsigned addr, unsigned lbo, unsigned sbo) {{
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}}
{ss(bn)}{rs128()}
// Shared memory: Q (64 rows a warpgroup x 128 columns: two 64-column blocks of 8 KB each), K (BN x 128:
// two blocks of BN * 128 bytes), V (BN keys x 128 columns, MN-major: two 64-column blocks of BN * 128).
extern "C" __global__ void __launch_bounds__(128 * NWG, 1) rate(long long* cycles, float* sink, int iters) {{
    extern __shared__ __align__(1024) unsigned char sm[];
    const int tid = threadIdx.x, wg = tid / 128;
    const int bytes = NWG * 16384 + 2 * BN * 256;
    for (int i = tid * 16; i < bytes; i += 128 * NWG * 16) *(uint4*)(sm + i) = make_uint4(0, 0, 0, 0);
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
    const unsigned base = (unsigned)__cvta_generic_to_shared(sm);
    const unsigned q = base + wg * 16384, k = base + NWG * 16384, v = k + BN * 256;
    float s[BN / 2], o[64];
    unsigned p[BN / 4];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 4; i++) p[i] = 0u;
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < iters; it++) {{
        asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#if DO_S
#pragma unroll
        for (int kk = 0; kk < 8; kk++)
            ss{bn}(s, mdesc(q + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024), mdesc(k + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024));
        asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
#endif
#if DO_PV
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) rs128(o, p + 4 * kk, mdesc(v + kk * 2048, BN * 128, 1024));
        asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
#endif
        asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");  // one group stays in flight
    }}
    asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
    __syncthreads();
    const long long t1 = clock64();
    if (tid == 0) cycles[blockIdx.x] = t1 - t0;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc += s[i];
#pragma unroll
    for (int i = 0; i < 64; i++) acc += o[i];
    if (acc != 0.f) sink[blockIdx.x * blockDim.x + tid] = acc;
}}
"""
    return body


def shared_bytes(bn, nwg):
    return nwg * 16384 + 2 * bn * 256 + 1024


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "run"
    os.environ.setdefault("KS_CUBIN_DIR", os.path.join(cd.ROOT, ".wgmma-cubins"))
    opts = ["--gpu-architecture=sm_90a", "--std=c++17"]
    paths = {}
    for label, bn, what, nwg in CASES:
        paths[label] = cd.cubin_for(source(bn, what, nwg), opts)[0]
    if mode == "prepare":
        print(f"prepare: {len(paths)} cubins in {os.environ['KS_CUBIN_DIR']}")
        return 0
    import cupy as cp

    dev = cp.cuda.Device(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}: {SMS} blocks, {ITER} tiles a warpgroup; ideal = 64 x BN x 128 multiply-adds per product set / 2048 a cycle")
    print(f"{'case':<22} {'cycles/tile/WG':>14} {'ideal':>7} {'share':>6}   (median block; min-max over blocks)")
    for label, bn, what, nwg in CASES:
        mod = cp.RawModule(path=paths[label])
        f = mod.get_function("rate")
        smem = shared_bytes(bn, nwg)
        f.max_dynamic_shared_size_bytes = smem
        cyc = cp.zeros(SMS, dtype=cp.int64)
        sink = cp.zeros(SMS * 128 * nwg, dtype=cp.float32)
        for _ in range(2):  # the first launch warms the clocks
            f((SMS,), (128 * nwg,), (cyc, sink, cp.int32(ITER)), shared_mem=smem)
        dev.synchronize()
        c = sorted(int(x) for x in cyc.get())
        per = statistics.median(c) / ITER / nwg  # cycles per warpgroup tile on the SM's tensor pipe
        # multiply-adds per warpgroup tile: S 64 x BN x 128, PV 64 x 128 x BN
        fma = (64 * bn * 128 if what in ("S", "SPV") else 0) + (64 * 128 * bn if what in ("PV", "SPV") else 0)
        ideal = fma / 2048
        print(f"{label:<22} {per:14.1f} {ideal:7.0f} {ideal / per:6.1%}   ({c[0] / ITER / nwg:.1f}-{c[-1] / ITER / nwg:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
