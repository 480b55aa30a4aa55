// FlashAttention-2 style forward: one block per (BLOCK_M query rows, batch*head); each warp owns
// 16 query rows (BLOCK_M == 16 * WARPS). Any L: the grid covers ceil(L / BLOCK_M) row blocks,
// rows and keys past L are zero-filled in shared memory (cp.async with src-size 0), scores of
// keys past L are -inf and rows past L are not stored. Grouped-query heads: query head h reads
// key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]). K/V tiles of BLOCK_N keys are double-buffered in shared
// memory (cp.async 16-byte copies when VEC=1), S = Q K^T and O += P V run on the tensor cores with
// mma.sync m16n8k16 (f16 in, f32 accumulate) fed by ldmatrix; online softmax keeps the running row
// max and sum in registers. Causal blocks skip key tiles past the diagonal, heavy blocks first.
//
// Tunables: HD (== D, compile-time head dim, a multiple of 16), BLOCK_M, BLOCK_N, WARPS, KT (K stored transposed in
// shared memory, read with ldmatrix.trans), EXP2 (exp2 with log2(e)-prescaled scale, else expf),
// TC (1: mma.sync; 0: SIMT fallback, one thread per query row), VEC (16-byte cp.async vs 4-byte
// synchronous loads), ONLINE (1: online softmax; 0: a first pass computes the exact row max).
// f16 data handled as raw 16-bit words; no headers needed.
#ifndef OV
#define OV 0
#endif
#ifndef HD
#define HD 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef KT
#define KT 0
#endif
#ifndef EXP2
#define EXP2 1
#endif
#ifndef TC
#define TC 1
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef ONLINE
#define ONLINE 1
#endif

#define NT (32 * WARPS)
#define KS (HD + 8)          // row stride (halves) of [key][d] tiles
#define KTS (BLOCK_N + 8)    // row stride (halves) of the transposed [d][key] K tile
#define KBUF (KT ? HD * KTS : BLOCK_N * KS)
#define VBUF (BLOCK_N * KS)

#if TC && (BLOCK_M != 16 * WARPS)
#error "BLOCK_M must equal 16 * WARPS"
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
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
#if EXP2
#define EXPF(x) ex2(x)
#define SCALE_MUL 1.4426950408889634f
#else
#define EXPF(x) expf(x)
#define SCALE_MUL 1.0f
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(s)), "l"(g));
}
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm4(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(unsigned a, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copy `rows` rows of HD halves (global row stride HD) into shared rows of stride `ds` halves;
// rows from `valid` on are zero-filled (nothing past them is read).
__device__ __forceinline__ void load_rows(unsigned short* dst, int ds, const unsigned short* src, int rows, int valid,
                                          int tid) {
#if VEC
    for (int c = tid; c < rows * (HD / 8); c += NT) {
        int r = c / (HD / 8), cc = c % (HD / 8);
        const bool ok = r < valid;
        cp16z(dst + r * ds + cc * 8, src + (ok ? (long long)r * HD + cc * 8 : 0), ok ? 16 : 0);
    }
#else
    for (int c = tid; c < rows * (HD / 2); c += NT) {
        int r = c / (HD / 2), cc = c % (HD / 2);
        *(unsigned*)(dst + r * ds + cc * 2) = r < valid ? __ldg((const unsigned*)(src + (long long)r * HD + cc * 2)) : 0u;
    }
#endif
}

// K tile: [key][d] via load_rows, or transposed [d][key] through registers (KT=1); keys from
// `valid` on are zero.
__device__ __forceinline__ void load_k(unsigned short* dst, const unsigned short* src, int valid, int tid) {
#if KT
#if VEC
    for (int c = tid; c < BLOCK_N * (HD / 8); c += NT) {
        int r = c % BLOCK_N, cc = c / BLOCK_N;
        uint4 w = r < valid ? __ldg((const uint4*)(src + (long long)r * HD + cc * 8)) : make_uint4(0u, 0u, 0u, 0u);
        unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            dst[(cc * 8 + 2 * e) * KTS + r] = (unsigned short)(ws[e] & 0xffff);
            dst[(cc * 8 + 2 * e + 1) * KTS + r] = (unsigned short)(ws[e] >> 16);
        }
    }
#else
    for (int c = tid; c < BLOCK_N * (HD / 2); c += NT) {
        int r = c % BLOCK_N, cc = c / BLOCK_N;
        unsigned w = r < valid ? __ldg((const unsigned*)(src + (long long)r * HD + cc * 2)) : 0u;
        dst[(cc * 2) * KTS + r] = (unsigned short)(w & 0xffff);
        dst[(cc * 2 + 1) * KTS + r] = (unsigned short)(w >> 16);
    }
#endif
#else
    load_rows(dst, KS, src, BLOCK_N, valid, tid);
#endif
}

extern "C" __global__ void __launch_bounds__(NT) attention(const unsigned short* __restrict__ q,
                                                           const unsigned short* __restrict__ k,
                                                           const unsigned short* __restrict__ v,
                                                           unsigned short* __restrict__ o, long long B, long long H,
                                                           long long Hkv, long long L, long long D, long long causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned short* sm = (unsigned short*)smem_raw;
    unsigned short* sK[2] = {sm, sm + KBUF};
    unsigned short* sV[2] = {sm + 2 * KBUF, sm + 2 * KBUF + VBUF};
    const int tid = threadIdx.x;
    const long long bh = blockIdx.y;
    const long long kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);  // the key/value head of this query head
    const int mb = causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const unsigned short* Kg = k + kvh * L * HD;
    const unsigned short* Vg = v + kvh * L * HD;
    const float sc = SCALE_MUL / sqrtf((float)HD);
    const int Ln = (int)L;
    const int ntk = (Ln + BLOCK_N - 1) / BLOCK_N;  // key tiles; the last one may be partial
#define KVALID(t) min(BLOCK_N, Ln - (t) * BLOCK_N)

#if TC
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, qd = lane & 3;
    const int m0 = mb * BLOCK_M;
    const int row0 = m0 + warp * 16 + g, row1 = row0 + 8;
    const int wlast = m0 + warp * 16 + 15;  // last query row of this warp
    const bool wlive = m0 + warp * 16 < Ln;  // the warp has a row before L
    const int nt = causal ? min(ntk, (m0 + BLOCK_M + BLOCK_N - 1) / BLOCK_N) : ntk;
    const unsigned short* Qg = q + bh * L * HD;

    unsigned qa[HD / 16][4];
    const bool q0 = row0 < Ln, q1 = row1 < Ln;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const unsigned short* p0 = Qg + (long long)row0 * HD + kk * 16 + 2 * qd;
        qa[kk][0] = q0 ? __ldg((const unsigned*)p0) : 0u;
        qa[kk][1] = q1 ? __ldg((const unsigned*)(p0 + 8 * HD)) : 0u;
        qa[kk][2] = q0 ? __ldg((const unsigned*)(p0 + 8)) : 0u;
        qa[kk][3] = q1 ? __ldg((const unsigned*)(p0 + 8 * HD + 8)) : 0u;
    }
    // per-lane ldmatrix offsets
    const int mi = lane >> 3, rr = lane & 7;
#if KT
    const unsigned koff = ((16 * 0 + 8 * (mi & 1) + rr) * KTS + 8 * (mi >> 1)) * 2;  // + kk*16*KTS*2 + j*8*2
#else
    const unsigned koff = ((8 * (mi >> 1) + rr) * KS + 8 * (mi & 1)) * 2;            // + j*8*KS*2 + kk*16*2
#endif
    const unsigned voff = ((8 * (mi & 1) + rr) * KS + 8 * (mi >> 1)) * 2;            // + kk*16*KS*2 + jd*8*2

    float mrow0 = -INFINITY, mrow1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float oacc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.f;

    // S = Q K^T for one tile, scaled, masked.
#define COMPUTE_S(buf, n0)                                                                       \
    float s[BLOCK_N / 8][4];                                                                     \
    _Pragma("unroll") for (int j = 0; j < BLOCK_N / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f; \
    {                                                                                            \
        const unsigned kb = smem_addr(sK[buf]) + koff;                                           \
        _Pragma("unroll") for (int kk = 0; kk < HD / 16; kk++) {                                 \
            _Pragma("unroll") for (int j = 0; j < BLOCK_N / 8; j += 2) {                         \
                unsigned b0, b1, b2, b3;                                                         \
                if (KT) ldsm4t(kb + (kk * 16 * KTS + j * 8) * 2, b0, b1, b2, b3);                \
                else ldsm4(kb + (j * 8 * KS + kk * 16) * 2, b0, b1, b2, b3);                     \
                mma16816(s[j], qa[kk], b0, b1);                                                  \
                mma16816(s[j + 1], qa[kk], b2, b3);                                              \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    {                                                                                            \
        const bool diag = causal && (n0 + BLOCK_N - 1 > m0 + warp * 16);                         \
        const bool edge = diag || n0 + BLOCK_N > Ln;                                             \
        /* keys from lim0 (row0) and lim1 (row1) on are masked: past the diagonal, past L */     \
        const int lim0 = diag ? min(row0 + 1, Ln) : Ln, lim1 = diag ? min(row1 + 1, Ln) : Ln;    \
        _Pragma("unroll") for (int j = 0; j < BLOCK_N / 8; j++) {                                \
            _Pragma("unroll") for (int e = 0; e < 4; e++) {                                      \
                const float x = s[j][e] * sc;                                                    \
                const int key = n0 + 8 * j + 2 * qd + (e & 1);                                   \
                s[j][e] = (!edge || key < ((e < 2) ? lim0 : lim1)) ? x : -INFINITY;              \
            }                                                                                    \
        }                                                                                        \
    }

#if !ONLINE
    // Pass 1: exact row max over all keys.
    load_k(sK[0], Kg, KVALID(0), tid);
    cp_commit();
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) load_k(sK[(t + 1) & 1], Kg + (long long)(t + 1) * BLOCK_N * HD, KVALID(t + 1), tid);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const int n0 = t * BLOCK_N;
        if (wlive && !(causal && n0 > wlast)) {
            COMPUTE_S(t & 1, n0)
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; j++) {
                mrow0 = fmaxf(mrow0, fmaxf(s[j][0], s[j][1]));
                mrow1 = fmaxf(mrow1, fmaxf(s[j][2], s[j][3]));
            }
        }
        __syncthreads();
    }
    cp_wait<0>();
    mrow0 = fmaxf(mrow0, __shfl_xor_sync(0xffffffff, mrow0, 1));
    mrow0 = fmaxf(mrow0, __shfl_xor_sync(0xffffffff, mrow0, 2));
    mrow1 = fmaxf(mrow1, __shfl_xor_sync(0xffffffff, mrow1, 1));
    mrow1 = fmaxf(mrow1, __shfl_xor_sync(0xffffffff, mrow1, 2));
#endif

    load_k(sK[0], Kg, KVALID(0), tid);
    load_rows(sV[0], KS, Vg, BLOCK_N, KVALID(0), tid);
    cp_commit();
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {
            load_k(sK[(t + 1) & 1], Kg + (long long)(t + 1) * BLOCK_N * HD, KVALID(t + 1), tid);
            load_rows(sV[(t + 1) & 1], KS, Vg + (long long)(t + 1) * BLOCK_N * HD, BLOCK_N, KVALID(t + 1), tid);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const int n0 = t * BLOCK_N;
        if (wlive && !(causal && n0 > wlast)) {
            COMPUTE_S(t & 1, n0)
            float mn0 = mrow0, mn1 = mrow1;
#if ONLINE
            float tx0 = -INFINITY, tx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; j++) {
                tx0 = fmaxf(tx0, fmaxf(s[j][0], s[j][1]));
                tx1 = fmaxf(tx1, fmaxf(s[j][2], s[j][3]));
            }
            tx0 = fmaxf(tx0, __shfl_xor_sync(0xffffffff, tx0, 1));
            tx0 = fmaxf(tx0, __shfl_xor_sync(0xffffffff, tx0, 2));
            tx1 = fmaxf(tx1, __shfl_xor_sync(0xffffffff, tx1, 1));
            tx1 = fmaxf(tx1, __shfl_xor_sync(0xffffffff, tx1, 2));
            mn0 = fmaxf(mrow0, tx0);
            mn1 = fmaxf(mrow1, tx1);
            const float al0 = EXPF(mrow0 - mn0), al1 = EXPF(mrow1 - mn1);
            mrow0 = mn0;
            mrow1 = mn1;
            l0 *= al0;
            l1 *= al1;
#pragma unroll
            for (int j = 0; j < HD / 8; j++) {
                oacc[j][0] *= al0;
                oacc[j][1] *= al0;
                oacc[j][2] *= al1;
                oacc[j][3] *= al1;
            }
#endif
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; j++) {
                s[j][0] = EXPF(s[j][0] - mn0);
                s[j][1] = EXPF(s[j][1] - mn0);
                s[j][2] = EXPF(s[j][2] - mn1);
                s[j][3] = EXPF(s[j][3] - mn1);
                l0 += s[j][0] + s[j][1];
                l1 += s[j][2] + s[j][3];
            }
            const unsigned vb = smem_addr(sV[t & 1]) + voff;
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++) {
                unsigned pa[4];
                pa[0] = pack2(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = pack2(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int jd = 0; jd < HD / 8; jd += 2) {
                    unsigned b0, b1, b2, b3;
                    ldsm4t(vb + (kk * 16 * KS + jd * 8) * 2, b0, b1, b2, b3);
                    mma16816(oacc[jd], pa, b0, b1);
                    mma16816(oacc[jd + 1], pa, b2, b3);
                }
            }
        }
        __syncthreads();
    }
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    unsigned short* Og = o + bh * L * HD;
#if OV
    // OV: a 4 x 4 transpose of words over each quad, then 16-byte stores: whole 32-byte sectors of o.
    #pragma unroll
    for (int jg = 0; jg < HD / 32; jg++) {
    #pragma unroll
        for (int h = 0; h < 2; h++) {
            const float ih = h ? i1 : i0;
            unsigned x[4];
    #pragma unroll
            for (int e = 0; e < 4; e++) x[e] = pack2(oacc[4 * jg + e][2 * h] * ih, oacc[4 * jg + e][2 * h + 1] * ih);
            quad_transpose(x, qd);
            if (h ? q1 : q0)
                asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(Og + ((long long)row0 + 8 * h) * HD + 32 * jg + 8 * qd),
                             "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
        }
    }
    #pragma unroll
    for (int jd = HD / 32 * 4; jd < HD / 8; jd++) {  // HD % 32 != 0: the last chunks a word at a time
        if (q0) *(unsigned*)(Og + (long long)row0 * HD + jd * 8 + 2 * qd) = pack2(oacc[jd][0] * i0, oacc[jd][1] * i0);
        if (q1) *(unsigned*)(Og + (long long)row1 * HD + jd * 8 + 2 * qd) = pack2(oacc[jd][2] * i1, oacc[jd][3] * i1);
    }
#else
#pragma unroll
    for (int jd = 0; jd < HD / 8; jd++) {
        if (q0) *(unsigned*)(Og + (long long)row0 * HD + jd * 8 + 2 * qd) = pack2(oacc[jd][0] * i0, oacc[jd][1] * i0);
        if (q1) *(unsigned*)(Og + (long long)row1 * HD + jd * 8 + 2 * qd) = pack2(oacc[jd][2] * i1, oacc[jd][3] * i1);
    }
#endif
#else
    // SIMT fallback: one thread per query row, NT rows per block, K/V tiles shared by the block.
    const int m0 = mb * NT;
    const int row = m0 + tid;
    const bool rok = row < Ln;
    const int nt = causal ? min(ntk, (m0 + NT + BLOCK_N - 1) / BLOCK_N) : ntk;
    const unsigned* qrow = (const unsigned*)(q + bh * L * HD + (long long)(rok ? row : 0) * HD);
    float qf[HD];
#pragma unroll
    for (int d = 0; d < HD / 2; d++) {
        unsigned w = rok ? __ldg(qrow + d) : 0u;
        qf[2 * d] = h2f((unsigned short)(w & 0xffff)) * sc;
        qf[2 * d + 1] = h2f((unsigned short)(w >> 16)) * sc;
    }
    float acc[HD];
#pragma unroll
    for (int d = 0; d < HD; d++) acc[d] = 0.f;
    float m = -INFINITY, l = 0.f;
    load_rows(sK[0], KS, Kg, BLOCK_N, KVALID(0), tid);
    load_rows(sV[0], KS, Vg, BLOCK_N, KVALID(0), tid);
    cp_commit();
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {
            load_rows(sK[(t + 1) & 1], KS, Kg + (long long)(t + 1) * BLOCK_N * HD, BLOCK_N, KVALID(t + 1), tid);
            load_rows(sV[(t + 1) & 1], KS, Vg + (long long)(t + 1) * BLOCK_N * HD, BLOCK_N, KVALID(t + 1), tid);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const unsigned short* Ks = sK[t & 1];
        const unsigned short* Vs = sV[t & 1];
        for (int j0 = 0; j0 < BLOCK_N; j0 += 8) {
            float s[8];
            float tx = -INFINITY;
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const unsigned* kr = (const unsigned*)(Ks + (j0 + jj) * KS);
                float a = 0.f;
#pragma unroll
                for (int d = 0; d < HD / 2; d++) {
                    unsigned w = kr[d];
                    a = fmaf(qf[2 * d], h2f((unsigned short)(w & 0xffff)), a);
                    a = fmaf(qf[2 * d + 1], h2f((unsigned short)(w >> 16)), a);
                }
                int key = t * BLOCK_N + j0 + jj;
                if ((causal && key > row) || key >= Ln) a = -INFINITY;
                s[jj] = a;
                tx = fmaxf(tx, a);
            }
            float mn = fmaxf(m, tx);
            float al = EXPF(m - mn);
            m = mn;
            l *= al;
#pragma unroll
            for (int d = 0; d < HD; d++) acc[d] *= al;
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                float p = EXPF(s[jj] - mn);
                l += p;
                const unsigned* vr = (const unsigned*)(Vs + (j0 + jj) * KS);
#pragma unroll
                for (int d = 0; d < HD / 2; d++) {
                    unsigned w = vr[d];
                    acc[2 * d] = fmaf(p, h2f((unsigned short)(w & 0xffff)), acc[2 * d]);
                    acc[2 * d + 1] = fmaf(p, h2f((unsigned short)(w >> 16)), acc[2 * d + 1]);
                }
            }
        }
        __syncthreads();
    }
    const float il = 1.f / l;
    unsigned* orow = (unsigned*)(o + bh * L * HD + (long long)row * HD);
    if (rok) {
#pragma unroll
        for (int d = 0; d < HD / 2; d++) orow[d] = pack2(acc[2 * d] * il, acc[2 * d + 1] * il);
    }
#endif
}
