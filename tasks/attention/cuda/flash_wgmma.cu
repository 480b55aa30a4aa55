// FlashAttention forward on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a): one block
// per (BLOCK_M = 64 * NWG query rows, batch*head); each warpgroup (4 warps, 128 threads) owns 64
// query rows. Q, K and V tiles live in shared memory in a layout wgmma reads through matrix
// descriptors (128-byte swizzle, or the no-swizzle core-matrix layout); they are copied
// with 16-byte cp.async, K/V through a ring of STAGES buffers (STAGES - 2 tiles prefetched ahead).
// S = Q K^T: wgmma m64nBLOCK_Nk16 with both operands in shared memory (K-major); O += P V: wgmma
// m64nHDk16 with P from registers (the S accumulators, converted to f16 in place: their layout is
// wgmma's A-fragment layout) and V in shared memory read transposed (MN-major, imm-trans-b = 1);
// f32 accumulation. Online softmax with exp2 (scale * log2 e folded into one FMA). The PV product
// of tile t-1 runs on the tensor cores while the softmax of tile t runs on the other pipes (P of
// the previous tile is kept in registers; O is rescaled once that product has landed). Causal
// blocks skip key tiles past the diagonal, heavy blocks first.
// Any L: the grid covers ceil(L / BLOCK_M) row blocks, rows and keys past L are zero-filled in
// shared memory (cp.async with src-size 0), scores of keys past L are -inf, rows past L are not
// stored. Grouped-query heads: query head h reads key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]).
// HD = 96 is laid out as 128 columns (HDP): S = Q K^T takes 6 k-steps over the loaded columns,
// O += P V runs at N = 128 over the padded V tile and the 32 padded output columns are dropped.
//
// MBAR=1: per-stage mbarriers instead of a __syncthreads per tile (every thread arrives on a stage's
// `full` barrier when its own copies land, every warp on its `empty` barrier when its last wgmma on
// it completed), so the warpgroups drift apart by up to a tile and one's softmax overlaps the
// other's matrix products.
//
// Tunables: HD (== D: 64, 96 or 128), BLOCK_N (keys per tile: 64 or 128), NWG (warpgroups per block: 1 or 2),
// STAGES (K/V buffers: 3 or 4), SWZ (1: 128-byte swizzled tiles; 0: the no-swizzle core-matrix
// layout), MBAR (1: per-stage barriers), and BLOCK_N_D64, NWG_D64, STAGES_D64: the tiling of the
// head-size-64 class (a candidate carries one tiling per class; the search tunes both). MBAR=1,
// measured on the H200 (2026-12-03, bench/cuda_dev.py KS_SUITES=mixed, same process, BLOCK_N=128
// NWG=2 STAGES=3): 2,16,3072,128 causal 229.5 -> 189.8 us, 4,32/8,2048,128 651 -> 537 us (511
// TFLOP/s), cuDNN SDPA 165 and 436 us. Measured on the H200 (2026-12-02, every admitted configuration, 4x32x2048x128 f16):
// SWZ=1 BLOCK_N=128 NWG=2 STAGES=3 0.617 ms (445 TFLOP/s), the best and the defaults; with SWZ=0
// no configuration beat 1.00 ms (wgmma reading the unswizzled tiles is bound on shared-memory
// bank conflicts). With any L and grouped-query heads (2026-12-03, same process, same shape and
// configuration): 0.655 ms against 0.621 ms for the kernel that required L % 128 == 0; the masks
// are select instructions (branches per element cost ~10%) and full tiles keep the plain copy.
// f16 data handled as raw 16-bit words; no headers needed.
#ifndef OV
#define OV 0
#endif
#ifndef HD
#define HD 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef NWG
#define NWG 2
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef SWZ
#define SWZ 1
#endif
#ifndef MBAR
#define MBAR 0
#endif
// Head size 64 is its own shape class with its own tile configuration (BLOCK_N_D64, NWG_D64,
// STAGES_D64): one candidate is a small dispatch table, each class tuned by the search, and
// a search over both head sizes does not have to pick one tiling for both.
#if HD == 64 && defined(BLOCK_N_D64)
#undef BLOCK_N
#define BLOCK_N BLOCK_N_D64
#endif
#if HD == 64 && defined(NWG_D64)
#undef NWG
#define NWG NWG_D64
#endif
#if HD == 64 && defined(STAGES_D64)
#undef STAGES
#define STAGES STAGES_D64
#endif
#define BLOCK_M (64 * NWG)
#define NT (128 * NWG)
#define HDP ((HD + 63) / 64 * 64)  // columns of the shared-memory tiles and of the PV product
#define TILE_BYTES (BLOCK_N * HDP * 2)
#define Q_BYTES (BLOCK_M * HDP * 2)
#if STAGES < 3
#error "STAGES must be at least 3 (the PV product of tile t-1 still reads its buffer in iteration t)"
#endif
#if (BLOCK_N != 64 && BLOCK_N != 128) || (HD != 64 && HD != 96 && HD != 128)
#error "BLOCK_N must be 64 or 128, HD 64, 96 or 128"
#endif

// The axes' type: `long long` for the CUDA back-end's ABI; MLX passes integer scalars as 32-bit
// `int`, so the mlx-cuda back-end compiles this file with -DKS_AXIS=int (docs/task-format.md).
#ifndef KS_AXIS
#define KS_AXIS long long
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(unsigned s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
}
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(unsigned s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes (cp.async) made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pin register values at this point of the instruction stream (accumulators of asynchronous wgmma).
template <int N> __device__ __forceinline__ void pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// OV: x[e] of quad lane l (qd) is word (l, e) of a 4 x 4 block; afterwards x[e] is word (e, l).
__device__ __forceinline__ void quad_transpose(unsigned* x, int qd) {
    const bool odd = qd & 1, hi = qd & 2;
    unsigned r0 = __shfl_xor_sync(0xffffffff, odd ? x[0] : x[1], 1);
    unsigned r1 = __shfl_xor_sync(0xffffffff, odd ? x[2] : x[3], 1);
    if (odd) {
        x[0] = r0;
        x[2] = r1;
    } else {
        x[1] = r0;
        x[3] = r1;
    }
    r0 = __shfl_xor_sync(0xffffffff, hi ? x[0] : x[2], 2);
    r1 = __shfl_xor_sync(0xffffffff, hi ? x[1] : x[3], 2);
    if (hi) {
        x[0] = r0;
        x[1] = r1;
    } else {
        x[2] = r0;
        x[3] = r1;
    }
}
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

// Shared-memory barriers (MBAR=1): `full` barriers say a stage's K/V tiles have landed (each thread
// arrives once its own cp.async copies complete), `empty` barriers say every warp is done reading a
// stage (its last wgmma on it has completed).
__device__ __forceinline__ void mbar_init(unsigned a, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
// Arrive once every cp.async this thread issued so far has completed (the arrival is counted in
// the barrier's expected count: .noinc).
__device__ __forceinline__ void mbar_arrive_cp(unsigned a) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ bool mbar_try(unsigned a, unsigned parity) {
    unsigned ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(a), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned a, unsigned parity) {
    while (!mbar_try(a, parity)) {
    }
}

// Shared-memory matrix descriptor: start address, leading-dimension byte offset, stride-dimension
// byte offset (all >> 4), layout type in bits 62-63 (0: no swizzle, 1: 128-byte swizzle).
__device__ __forceinline__ unsigned long long mdesc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | ((unsigned long long)SWZ << 62);
}

// Byte offset of the 16-byte chunk j (columns 8j..8j+7) of row r in a ROWS x HDP tile.
// SWZ=1, the 128-byte swizzle: the tile is HDP / 64 column blocks of ROWS rows of 128 bytes
// (1024-byte atoms of 8 rows), chunk j % 8 of row r stored at slot (j % 8) ^ (r % 8), so that the
// 8 rows of an atom spread every 16-byte column over all banks. SWZ=0, no swizzle: core matrix
// (r / 8, j) at ((r / 8) * (HDP / 8) + j) * 128, row r % 8 at +16 * (r % 8).
template <int ROWS> __device__ __forceinline__ unsigned chunk_off(int r, int j) {
#if SWZ
    return (j >> 3) * (ROWS * 128) + r * 128 + (((j & 7) ^ (r & 7)) << 4);
#else
    return ((r >> 3) * (HDP / 8) + j) * 128 + (r & 7) * 16;
#endif
}

// Copy a ROWS x HD tile (global row stride HD) into the layout above with 16-byte cp.async;
// rows from `valid` on are zero-filled (nothing past them is read). FULL: every row is valid
// (the plain copy, no per-chunk predicate: the common case stays as cheap as before).
// SWZ=1: consecutive threads take consecutive chunks of a row (coalesced, conflict-free writes);
// SWZ=0: a warp takes 4 chunks of 8 rows (64 contiguous bytes per row), writing 512 contiguous bytes.
template <int ROWS, bool FULL = false, int NTH = NT>
__device__ __forceinline__ void load_tile(unsigned dst, const unsigned short* src, int valid, int tid) {
    static_assert((ROWS * (HD / 8)) % NTH == 0, "tile chunks must divide evenly over the loading threads");
#pragma unroll
    for (int i = 0; i < ROWS * (HD / 8) / NTH; i++) {
        const int c = tid + i * NTH;
#if SWZ
        const int row = c / (HD / 8), j = c % (HD / 8);
#else
        const int row = (c / HD) * 8 + (c & 7), j = (c % HD) >> 3;
#endif
        if (FULL) {
            cp16(dst + chunk_off<ROWS>(row, j), src + (long long)row * HD + j * 8);
        } else {
            const bool ok = row < valid;
            cp16z(dst + chunk_off<ROWS>(row, j), src + (ok ? (long long)row * HD + j * 8 : 0), ok ? 16 : 0);
        }
    }
}
// K and V tiles of `kv` keys by NTH threads: the plain copy when the tile is full.
template <int NTH = NT>
__device__ __forceinline__ void load_kv(unsigned dst, const unsigned short* ks, const unsigned short* vs, int kv, int tid) {
    if (kv == BLOCK_N) {
        load_tile<BLOCK_N, true, NTH>(dst, ks, kv, tid);
        load_tile<BLOCK_N, true, NTH>(dst + TILE_BYTES, vs, kv, tid);
    } else {
        load_tile<BLOCK_N, false, NTH>(dst, ks, kv, tid);
        load_tile<BLOCK_N, false, NTH>(dst + TILE_BYTES, vs, kv, tid);
    }
}
// ---- generated wrappers: S = Q K^T (both operands K-major in shared memory), O += P V (P from
// registers, V MN-major in shared memory: imm-trans-b = 1). Accumulators f32, scale-d for S.
__device__ __forceinline__ void wgmma_ss_n64(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(sd));
}

__device__ __forceinline__ void wgmma_ss_n128(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(sd));
}

__device__ __forceinline__ void wgmma_rs_n64_tb(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_rs_n128_tb(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}


// Descriptors. SWZ=1: K-major Q and K (LBO unused, SBO 1024 between 8-row atoms; a k-step moves
// 32 bytes inside the 128-byte rows, a 64-column block moves ROWS * 128), MN-major V (LBO
// BLOCK_N * 128 between 64-column blocks of the head dimension, SBO 1024 between 8-key groups;
// a k-step of 16 keys moves 2048). SWZ=0: K-major LBO 128 (the two 8-column halves of a k-step),
// SBO HDP * 16 (8-row groups); MN-major LBO HDP * 16 (8-key groups), SBO 128 (8-column groups).
#if SWZ
#define KM_LBO 16
#define KM_SBO 1024
#define MN_LBO (BLOCK_N * 128)
#define MN_SBO 1024
#define Q_KSTEP(kk) (((kk) >> 2) * (BLOCK_M * 128) + ((kk) & 3) * 32)
#define K_KSTEP(kk) (((kk) >> 2) * (BLOCK_N * 128) + ((kk) & 3) * 32)
#define V_KSTEP(kk) ((kk) * 2048)
#define Q_WG(wg) ((wg) * 64 * 128)
#else
#define KM_LBO 128
#define KM_SBO (HDP * 16)
#define MN_LBO (HDP * 16)
#define MN_SBO 128
#define Q_KSTEP(kk) ((kk) * 256)
#define K_KSTEP(kk) ((kk) * 256)
#define V_KSTEP(kk) ((kk) * (HDP * 32))
#define Q_WG(wg) ((wg) * 64 * HDP * 2)
#endif

#if BLOCK_N == 128
#define WGMMA_S wgmma_ss_n128
#else
#define WGMMA_S wgmma_ss_n64
#endif
#if HDP == 128
#define WGMMA_O wgmma_rs_n128_tb
#else
#define WGMMA_O wgmma_rs_n64_tb
#endif

extern "C" __global__ void __launch_bounds__(NT, 1) attention(const unsigned short* __restrict__ q,
                                                              const unsigned short* __restrict__ k,
                                                              const unsigned short* __restrict__ v,
                                                              unsigned short* __restrict__ o, KS_AXIS B, KS_AXIS H,
                                                              KS_AXIS Hkv, KS_AXIS L, KS_AXIS D, KS_AXIS causal) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    const unsigned sKV = sQ + Q_BYTES;  // stage s: K at sKV + 2 * s * TILE_BYTES, V at + TILE_BYTES
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, qd = lane & 3;
    const long long bh = blockIdx.y;
    const long long kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);  // the key/value head of this query head
    const int Ln = (int)L;
    const int mb = causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int m0 = mb * BLOCK_M;
    const int wrow0 = m0 + 64 * wg;        // first query row of this warpgroup
    const int r0 = wrow0 + 16 * warp + g;  // this thread's rows: r0 and r0 + 8
    const unsigned short* Kg = k + kvh * L * HD;
    const unsigned short* Vg = v + kvh * L * HD;
    const int ntk = (Ln + BLOCK_N - 1) / BLOCK_N;  // key tiles; the last one may be partial
    const int nt = causal ? min(ntk, (m0 + BLOCK_M + BLOCK_N - 1) / BLOCK_N) : ntk;
    const float sl2 = 1.4426950408889634f / sqrtf((float)HD);

#if MBAR
    // Per-stage barriers after the K/V ring: full[s] at sBar + 8s (every thread arrives once its own
    // copies into the stage have landed), empty[s] at sBar + 8 (STAGES + s) (one arrival per warp
    // once its last wgmma on the stage has completed). No block-wide barrier in the loop: a
    // warpgroup waits only for the tiles it reads and, before refilling a stage, for every warp
    // to be done with it, so the warpgroups may drift apart by a tile.
    const unsigned sBar = sKV + 2 * STAGES * TILE_BYTES;
    if (tid == 0) {
        for (int st = 0; st < STAGES; st++) {
            mbar_init(sBar + 8 * st, NT);
            mbar_init(sBar + 8 * (STAGES + st), 4 * NWG);
        }
    }
    __syncthreads();
    // Q and tile 0 complete full[0]; tiles 1 .. STAGES - 3 their own stage.
    load_tile<BLOCK_M>(sQ, q + bh * L * HD + (long long)m0 * HD, Ln - m0, tid);
#pragma unroll
    for (int st = 0; st < STAGES - 2; st++) {
        if (st < nt) {
            load_kv(sKV + 2 * st * TILE_BYTES, Kg + (long long)st * BLOCK_N * HD, Vg + (long long)st * BLOCK_N * HD,
                    min(BLOCK_N, Ln - st * BLOCK_N), tid);
        }
        mbar_arrive_cp(sBar + 8 * st);
    }
#else
    // Q (joins the first group) and the first STAGES - 2 key/value tiles.
    load_tile<BLOCK_M>(sQ, q + bh * L * HD + (long long)m0 * HD, Ln - m0, tid);
#pragma unroll
    for (int st = 0; st < STAGES - 2; st++) {
        if (st < nt) {
            load_kv(sKV + 2 * st * TILE_BYTES, Kg + (long long)st * BLOCK_N * HD, Vg + (long long)st * BLOCK_N * HD,
                    min(BLOCK_N, Ln - st * BLOCK_N), tid);
        }
        cp_commit();
    }
#endif

    // This warpgroup's 64 rows of Q (descriptor strides above).
    const unsigned qbase = sQ + Q_WG(wg);
    float oacc[HDP / 2];
#pragma unroll
    for (int i = 0; i < HDP / 2; i++) oacc[i] = 0.f;
    float s[BLOCK_N / 2];
    unsigned pprev[BLOCK_N / 4];
#pragma unroll
    for (int i = 0; i < BLOCK_N / 4; i++) pprev[i] = 0u;
    float mrow0 = -INFINITY, mrow1 = -INFINITY, lrow0 = 0.f, lrow1 = 0.f;

    // Every wgmma sits on the block's uniform control flow (ptxas serialises wgmma issued in
    // branches): tile 0 is peeled (no PV product yet); key tiles past a causal diagonal are
    // still multiplied but fully masked (their P is zero), which only happens with BLOCK_N < 64 * NWG.
    auto wait_tile = [&](int t) {
#if MBAR
        mbar_wait(sBar + 8 * (t % STAGES), (t / STAGES) & 1);
        fence_proxy_async();
        const int tl = t + STAGES - 2;  // into the stage of tile t - 2, once every warp is done with it
        if (tl < nt) {
            if (tl >= STAGES) mbar_wait(sBar + 8 * (STAGES + tl % STAGES), (tl / STAGES - 1) & 1);
            load_kv(sKV + 2 * (tl % STAGES) * TILE_BYTES, Kg + (long long)tl * BLOCK_N * HD,
                    Vg + (long long)tl * BLOCK_N * HD, min(BLOCK_N, Ln - tl * BLOCK_N), tid);
            mbar_arrive_cp(sBar + 8 * (tl % STAGES));
        }
#else
        cp_wait<STAGES - 3>();
        fence_proxy_async();
        __syncthreads();  // tile t visible to all; every warpgroup done with iteration t - 1
        const int tl = t + STAGES - 2;  // its buffer was last read in iteration t - 1
        if (tl < nt) {
            load_kv(sKV + 2 * (tl % STAGES) * TILE_BYTES, Kg + (long long)tl * BLOCK_N * HD,
                    Vg + (long long)tl * BLOCK_N * HD, min(BLOCK_N, Ln - tl * BLOCK_N), tid);
        }
        cp_commit();
#endif
    };
    // This warp is done with the stage of tile t (MBAR=1: it may be refilled once every warp is).
    auto release = [&](int t) {
#if MBAR
        if (lane == 0) mbar_arrive(sBar + 8 * (STAGES + t % STAGES));
#endif
    };
    auto issue_s = [&](int t) {
        const unsigned kb = sKV + 2 * (t % STAGES) * TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++)
            WGMMA_S(s, mdesc(qbase + Q_KSTEP(kk), KM_LBO, KM_SBO), mdesc(kb + K_KSTEP(kk), KM_LBO, KM_SBO), kk);
        wg_commit();
    };
    auto issue_pv = [&](int buf) {
        const unsigned vb = sKV + 2 * buf * TILE_BYTES + TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++) WGMMA_O(oacc, pprev + 4 * kk, mdesc(vb + V_KSTEP(kk), MN_LBO, MN_SBO));
        wg_commit();
    };
    // Online softmax of tile t in place (s becomes exp2 of the scaled, shifted scores); returns the
    // rescale factors of the running output in al0, al1.
    float al0 = 1.f, al1 = 1.f;
    auto softmax = [&](int t) {
        const int n0 = t * BLOCK_N;
        // s[4c + e]: row r0 + 8 * (e >> 1), key n0 + 8c + 2qd + (e & 1).
        // Keys from lim0 (row r0) and lim1 (row r0 + 8) on are masked: past the diagonal, past L.
        const bool diag = causal && n0 + BLOCK_N - 1 > wrow0 + 16 * warp;
        if (diag || n0 + BLOCK_N > Ln) {
            const int lim0 = diag ? min(r0 + 1, Ln) : Ln, lim1 = diag ? min(r0 + 9, Ln) : Ln;
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[4 * c + e] = n0 + 8 * c + 2 * qd + (e & 1) < ((e >> 1) ? lim1 : lim0) ? s[4 * c + e] : -INFINITY;
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; c++) {
            mx0 = fmaxf(mx0, fmaxf(s[4 * c], s[4 * c + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * c + 2], s[4 * c + 3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
        // Tile 0 holds key 0, visible to every row: the running maxima are finite from then on.
        const float mn0 = fmaxf(mrow0, mx0 * sl2), mn1 = fmaxf(mrow1, mx1 * sl2);
        al0 = ex2(mrow0 - mn0);
        al1 = ex2(mrow1 - mn1);
        mrow0 = mn0;
        mrow1 = mn1;
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; c++) {
            s[4 * c] = ex2(fmaf(s[4 * c], sl2, -mn0));
            s[4 * c + 1] = ex2(fmaf(s[4 * c + 1], sl2, -mn0));
            s[4 * c + 2] = ex2(fmaf(s[4 * c + 2], sl2, -mn1));
            s[4 * c + 3] = ex2(fmaf(s[4 * c + 3], sl2, -mn1));
            ls0 += s[4 * c] + s[4 * c + 1];
            ls1 += s[4 * c + 2] + s[4 * c + 3];
        }
        lrow0 = lrow0 * al0 + ls0;
        lrow1 = lrow1 * al1 + ls1;
    };
    // P as wgmma A fragments: k-step kk covers keys 16kk..16kk+15 (n8 chunks 2kk, 2kk+1).
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++) {
            pprev[4 * kk] = pack2(s[8 * kk], s[8 * kk + 1]);
            pprev[4 * kk + 1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
            pprev[4 * kk + 2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
            pprev[4 * kk + 3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    wait_tile(0);
    wg_fence();
    issue_s(0);
    wg_wait<0>();
    pin<BLOCK_N / 2>(s);
    softmax(0);
    pack_p();
    for (int t = 1; t < nt; t++) {
        wait_tile(t);
        pin<HDP / 2>(oacc);
        pin<BLOCK_N / 4>(pprev);
        wg_fence();
        issue_s(t);                    // S of tile t ...
        issue_pv((t - 1) % STAGES);    // ... and the PV product of tile t - 1, both in flight
        wg_wait<1>();                  // S has landed
        pin<BLOCK_N / 2>(s);
        softmax(t);
        wg_wait<0>();                  // the PV product of tile t - 1 has landed in oacc
        pin<HDP / 2>(oacc);
        release(t - 1);
#pragma unroll
        for (int j = 0; j < HDP / 8; j++) {
            oacc[4 * j] *= al0;
            oacc[4 * j + 1] *= al0;
            oacc[4 * j + 2] *= al1;
            oacc[4 * j + 3] *= al1;
        }
        pack_p();
    }
    pin<HDP / 2>(oacc);
    pin<BLOCK_N / 4>(pprev);
    wg_fence();
    issue_pv((nt - 1) % STAGES);
    wg_wait<0>();
    pin<HDP / 2>(oacc);
    lrow0 += __shfl_xor_sync(0xffffffff, lrow0, 1);
    lrow0 += __shfl_xor_sync(0xffffffff, lrow0, 2);
    lrow1 += __shfl_xor_sync(0xffffffff, lrow1, 1);
    lrow1 += __shfl_xor_sync(0xffffffff, lrow1, 2);
    const float i0 = 1.f / lrow0, i1 = 1.f / lrow1;
    unsigned short* Og = o + bh * L * HD;
    const bool ok0 = r0 < Ln, ok1 = r0 + 8 < Ln;
#if OV
    // OV: a 4 x 4 transpose of words over each quad, then 16-byte stores: whole 32-byte sectors of o.
    #pragma unroll
    for (int jg = 0; jg < HD / 32; jg++) {
    #pragma unroll
        for (int h = 0; h < 2; h++) {
            const float ih = h ? i1 : i0;
            unsigned x[4];
    #pragma unroll
            for (int e = 0; e < 4; e++) x[e] = pack2(oacc[4 * (4 * jg + e) + 2 * h] * ih, oacc[4 * (4 * jg + e) + 2 * h + 1] * ih);
            quad_transpose(x, qd);
            if (h ? ok1 : ok0)
                asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(Og + ((long long)r0 + 8 * h) * HD + 32 * jg + 8 * qd),
                             "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
        }
    }
    #pragma unroll
    for (int j = HD / 32 * 4; j < HD / 8; j++) {  // HD % 32 != 0: the last chunks a word at a time
        if (ok0) *(unsigned*)(Og + (long long)r0 * HD + j * 8 + 2 * qd) = pack2(oacc[4 * j] * i0, oacc[4 * j + 1] * i0);
        if (ok1) *(unsigned*)(Og + (long long)(r0 + 8) * HD + j * 8 + 2 * qd) = pack2(oacc[4 * j + 2] * i1, oacc[4 * j + 3] * i1);
    }
#else
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        if (ok0) *(unsigned*)(Og + (long long)r0 * HD + j * 8 + 2 * qd) = pack2(oacc[4 * j] * i0, oacc[4 * j + 1] * i0);
        if (ok1) *(unsigned*)(Og + (long long)(r0 + 8) * HD + j * 8 + 2 * qd) = pack2(oacc[4 * j + 2] * i1, oacc[4 * j + 3] * i1);
    }
#endif
}
