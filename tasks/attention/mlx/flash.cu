// FlashAttention-2 forward, MLX CUDA dialect (translated from tasks/attention/cuda/flash.cu and
// flash_mt.cu). One block per (BM = 16 * WARPS * MT query rows, batch * head); each warp owns MT
// m-tiles of 16 query rows. K/V tiles of BLOCK_N keys are double-buffered in shared memory with
// cp.async 16-byte copies; S = Q K^T and O += P V run on the tensor cores through inline PTX
// mma.sync m16n8k16 (f16 in, f32 accumulate) fed by ldmatrix (MLX compiles with NVRTC: no
// <mma.h>); the online softmax keeps the running row max and sum in registers and P is reused
// straight from the S accumulators. exp2 with the 1/sqrt(D) scale pre-multiplied by log2(e).
// Causal (axis `causal` = 1): key tiles past a warp's last row are skipped and only the tiles
// crossing the diagonal are masked; blocks run heavy (late) query tiles first.
// MT = 1 keeps the Q fragments in registers; MT = 2 stages the Q tile in shared memory and reads
// its fragments with ldmatrix, so every K/V fragment feeds two MMAs (half the ldmatrix traffic
// per MMA, at the cost of registers: constraint BLOCK_N * D <= 4096 for MT = 2).
// Shared-memory rows are D + 8 halves: 16-byte aligned and conflict-free for ldmatrix.
// Any L: the grid covers ceil(L / BM) row blocks, rows and keys past L are zero-filled in shared
// memory (cp.async with src-size 0), scores of keys past L are -inf, rows past L are not stored.
// Grouped-query heads: query head h reads key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]).
// Tunables: BLOCK_N, WARPS, MT. D, L, H, Hkv, causal are compile-time (MLX template parameters).

#define KS_LOG2E 1.4426950408889634f
#define KS_INF __int_as_float(0x7f800000)  // INFINITY is not defined under NVRTC

__device__ __forceinline__ float ks_ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ unsigned ks_pack_h2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned ks_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ks_cp16(void* s, const void* gp) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ks_smem_addr(s)), "l"(gp));
}
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from gp then).
__device__ __forceinline__ void ks_cp16z(void* s, const void* gp, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ks_smem_addr(s)), "l"(gp), "r"(n));
}
__device__ __forceinline__ void ks_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int NW> __device__ __forceinline__ void ks_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(NW)); }
__device__ __forceinline__ void ks_ldsm4(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ks_ldsm4t(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
// c[16x8] += a[16x16] * b[16x8], f16 inputs, f32 accumulators
__device__ __forceinline__ void ks_mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// `rows` rows of HD halves (global row stride HD) into shared rows of KS halves, 16 bytes per
// cp.async; rows from `valid` on are zero-filled (nothing past them is read).
template <int HD, int KS, int NT>
__device__ __forceinline__ void ks_load_rows(unsigned short* dst, const unsigned short* src, int rows, int valid, int tid) {
    for (int c = tid; c < rows * (HD / 8); c += NT) {
        const int r = c / (HD / 8), cc = c % (HD / 8);
        const bool ok = r < valid;
        ks_cp16z(dst + r * KS + cc * 8, src + (ok ? (long long)r * HD + cc * 8 : 0), ok ? 16 : 0);
    }
}

template <int HD, int L, int H, int HKV, int BN, int WARPS, int MT, int CAUSAL>
__device__ __forceinline__ void ks_flash(const unsigned short* __restrict__ qp, const unsigned short* __restrict__ kp,
                                         const unsigned short* __restrict__ vp, unsigned short* __restrict__ op) {
    constexpr int NT = 32 * WARPS;
    constexpr int BM = 16 * WARPS * MT;
    constexpr int KS = HD + 8;
    constexpr int TILE = BN * KS;  // halves of one K or V tile
    static_assert(HD % 16 == 0 && BN % 16 == 0 && H % HKV == 0, "tile shape, head groups");
    constexpr int NTK = (L + BN - 1) / BN;  // key tiles; the last one may be partial
    extern __shared__ __align__(16) unsigned char ks_smem_raw[];
    unsigned short* sm = reinterpret_cast<unsigned short*>(ks_smem_raw);
    // K buffer i at sm + i * TILE, V buffer i at sm + (2 + i) * TILE (computed, not a pointer array:
    // a dynamically indexed array would live in local memory)
    unsigned short* sQ = sm + 4 * TILE;  // MT > 1 only: [BM][KS]

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, qd = lane & 3;
    const long long bh = blockIdx.y;
    const long long kvh = (bh / H) * HKV + (bh % H) / (H / HKV);  // the key/value head of this query head
    const int mb = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;  // heavy tiles first
    const int m0 = mb * BM;
    const int wfirst = m0 + warp * 16 * MT, wlast = wfirst + 16 * MT - 1;
    const bool wlive = wfirst < L;  // the warp has a row before L
    const int nt = CAUSAL ? min(NTK, (m0 + BM + BN - 1) / BN) : NTK;
    const unsigned short* Qg = qp + bh * L * HD;
    const unsigned short* Kg = kp + kvh * L * HD;
    const unsigned short* Vg = vp + kvh * L * HD;
    const float sc = KS_LOG2E * rsqrtf((float)HD);
    const int mi = lane >> 3, rr = lane & 7;  // ldmatrix: matrix index and row of this lane's address

    // Q fragments (A operand, row-major): registers for MT = 1, ldmatrix from shared for MT > 1.
    unsigned qa[MT == 1 ? HD / 16 : 1][4];
    if constexpr (MT == 1) {
        const bool q0 = wfirst + g < L, q1 = wfirst + g + 8 < L;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const unsigned short* p0 = Qg + (long long)(wfirst + g) * HD + kk * 16 + 2 * qd;
            qa[kk][0] = q0 ? __ldg(reinterpret_cast<const unsigned*>(p0)) : 0u;
            qa[kk][1] = q1 ? __ldg(reinterpret_cast<const unsigned*>(p0 + 8 * HD)) : 0u;
            qa[kk][2] = q0 ? __ldg(reinterpret_cast<const unsigned*>(p0 + 8)) : 0u;
            qa[kk][3] = q1 ? __ldg(reinterpret_cast<const unsigned*>(p0 + 8 * HD + 8)) : 0u;
        }
    } else {
        ks_load_rows<HD, KS, NT>(sQ, Qg + (long long)m0 * HD, BM, L - m0, tid);
    }
    const unsigned qoff = ks_smem_addr(sQ) + ((warp * 16 * MT + 8 * (mi & 1) + rr) * KS + 8 * (mi >> 1)) * 2;
    // K as the B operand of S = Q K^T: plain ldmatrix of [key][d] rows; V as the B operand of
    // O += P V: ldmatrix.trans of [key][d] rows.
    const unsigned koff = ((8 * (mi >> 1) + rr) * KS + 8 * (mi & 1)) * 2;
    const unsigned voff = ((8 * (mi & 1) + rr) * KS + 8 * (mi >> 1)) * 2;

    float mrow[MT][2], lrow[MT][2];
    float oacc[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        mrow[mt][0] = mrow[mt][1] = -KS_INF;
        lrow[mt][0] = lrow[mt][1] = 0.f;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) oacc[mt][j][0] = oacc[mt][j][1] = oacc[mt][j][2] = oacc[mt][j][3] = 0.f;
    }

    ks_load_rows<HD, KS, NT>(sm, Kg, BN, min(BN, L), tid);
    ks_load_rows<HD, KS, NT>(sm + 2 * TILE, Vg, BN, min(BN, L), tid);
    ks_cp_commit();
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {  // next tile in flight while this one is computed
            const int kv = min(BN, L - (t + 1) * BN);
            ks_load_rows<HD, KS, NT>(sm + ((t + 1) & 1) * TILE, Kg + (long long)(t + 1) * BN * HD, BN, kv, tid);
            ks_load_rows<HD, KS, NT>(sm + (2 + ((t + 1) & 1)) * TILE, Vg + (long long)(t + 1) * BN * HD, BN, kv, tid);
        }
        ks_cp_commit();
        ks_cp_wait<1>();  // tile t (and Q) landed for this thread ...
        __syncthreads();  // ... and for every thread
        const int n0 = t * BN;
        if (wlive && !(CAUSAL && n0 > wlast)) {
            float s[MT][BN / 8][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < BN / 8; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
            const unsigned kb = ks_smem_addr(sm + (t & 1) * TILE) + koff;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned qf[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if constexpr (MT == 1) {
                        qf[mt][0] = qa[kk][0]; qf[mt][1] = qa[kk][1]; qf[mt][2] = qa[kk][2]; qf[mt][3] = qa[kk][3];
                    } else {
                        ks_ldsm4(qoff + (mt * 16 * KS + kk * 16) * 2, qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3]);
                    }
                }
#pragma unroll
                for (int j = 0; j < BN / 8; j += 2) {
                    unsigned b0, b1, b2, b3;
                    ks_ldsm4(kb + (j * 8 * KS + kk * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        ks_mma16816(s[mt][j], qf[mt], b0, b1);
                        ks_mma16816(s[mt][j + 1], qf[mt], b2, b3);
                    }
                }
            }
            // scale (log2 units) and mask; accumulator element e of n-tile j is
            // (row g + 8 * (e >= 2), key n0 + 8 j + 2 qd + (e & 1)); keys past L are masked too.
            const bool tail = n0 + BN > L;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int r0 = wfirst + 16 * mt + g;
                const bool diag = CAUSAL && (n0 + BN - 1 > wfirst + 16 * mt);
                const bool edge = diag || tail;
                // keys from lim0 (row r0) and lim1 (row r0 + 8) on are masked: past the diagonal, past L
                const int lim0 = diag ? min(r0 + 1, L) : L, lim1 = diag ? min(r0 + 9, L) : L;
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float xv = s[mt][j][e] * sc;
                        const int key = n0 + 8 * j + 2 * qd + (e & 1);
                        s[mt][j][e] = (!edge || key < ((e < 2) ? lim0 : lim1)) ? xv : -KS_INF;
                    }
            }
            // online softmax: a row lives in the 4 lanes of a quad (xor 1, 2)
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float tx0 = -KS_INF, tx1 = -KS_INF;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    tx0 = fmaxf(tx0, fmaxf(s[mt][j][0], s[mt][j][1]));
                    tx1 = fmaxf(tx1, fmaxf(s[mt][j][2], s[mt][j][3]));
                }
                tx0 = fmaxf(tx0, __shfl_xor_sync(0xffffffffu, tx0, 1));
                tx0 = fmaxf(tx0, __shfl_xor_sync(0xffffffffu, tx0, 2));
                tx1 = fmaxf(tx1, __shfl_xor_sync(0xffffffffu, tx1, 1));
                tx1 = fmaxf(tx1, __shfl_xor_sync(0xffffffffu, tx1, 2));
                // tile 0 is never fully masked for any row, so the running max is finite from then on
                const float mn0 = fmaxf(mrow[mt][0], tx0), mn1 = fmaxf(mrow[mt][1], tx1);
                const float al0 = ks_ex2(mrow[mt][0] - mn0), al1 = ks_ex2(mrow[mt][1] - mn1);
                mrow[mt][0] = mn0;
                mrow[mt][1] = mn1;
                lrow[mt][0] *= al0;
                lrow[mt][1] *= al1;
#pragma unroll
                for (int j = 0; j < HD / 8; j++) {
                    oacc[mt][j][0] *= al0;
                    oacc[mt][j][1] *= al0;
                    oacc[mt][j][2] *= al1;
                    oacc[mt][j][3] *= al1;
                }
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    s[mt][j][0] = ks_ex2(s[mt][j][0] - mn0);
                    s[mt][j][1] = ks_ex2(s[mt][j][1] - mn0);
                    s[mt][j][2] = ks_ex2(s[mt][j][2] - mn1);
                    s[mt][j][3] = ks_ex2(s[mt][j][3] - mn1);
                    lrow[mt][0] += s[mt][j][0] + s[mt][j][1];
                    lrow[mt][1] += s[mt][j][2] + s[mt][j][3];
                }
            }
            // O += P V; the S accumulators of n-tiles (2 kk, 2 kk + 1) are the A fragment of key block kk
            const unsigned vb = ks_smem_addr(sm + (2 + (t & 1)) * TILE) + voff;
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                unsigned pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    pa[mt][0] = ks_pack_h2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pa[mt][1] = ks_pack_h2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pa[mt][2] = ks_pack_h2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pa[mt][3] = ks_pack_h2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int jd = 0; jd < HD / 8; jd += 2) {
                    unsigned b0, b1, b2, b3;
                    ks_ldsm4t(vb + (kk * 16 * KS + jd * 8) * 2, b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        ks_mma16816(oacc[mt][jd], pa[mt], b0, b1);
                        ks_mma16816(oacc[mt][jd + 1], pa[mt], b2, b3);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer t & 1 before iteration t + 1 refills it
    }
    ks_cp_wait<0>();
    unsigned short* Og = op + bh * L * HD;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float l0 = lrow[mt][0], l1 = lrow[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const float i0 = 1.f / l0, i1 = 1.f / l1;
        const long long row0 = wfirst + 16 * mt + g;
        const bool ok0 = row0 < L, ok1 = row0 + 8 < L;
#pragma unroll
        for (int jd = 0; jd < HD / 8; jd++) {
            if (ok0) *reinterpret_cast<unsigned*>(Og + row0 * HD + jd * 8 + 2 * qd) = ks_pack_h2(oacc[mt][jd][0] * i0, oacc[mt][jd][1] * i0);
            if (ok1) *reinterpret_cast<unsigned*>(Og + (row0 + 8) * HD + jd * 8 + 2 * qd) = ks_pack_h2(oacc[mt][jd][2] * i1, oacc[mt][jd][3] * i1);
        }
    }
}

// @kernel attention
ks_flash<D, L, H, Hkv, BLOCK_N, WARPS, MT, causal>(reinterpret_cast<const unsigned short*>(q), reinterpret_cast<const unsigned short*>(k),
                                          reinterpret_cast<const unsigned short*>(v), reinterpret_cast<unsigned short*>(o));
