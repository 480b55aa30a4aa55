// Single-pass selective scan with the exponentials issued one group of steps ahead of the
// recurrence: one launch, every exp(delta * A) computed exactly once, no scratch.
//
// A block owns CB channels of one batch; each channel is served by GL = NS / SPT lanes, each lane
// holding SPT of the NS states in registers for the whole sequence. Time is walked in chunks of
// CHUNK steps whose rows of delta, u (CB channels) and Bm, Cm are copied into shared memory by
// 16-byte cp.async two chunks ahead (double-buffered) and converted once to f32 (delta, delta * u)
// per (step, channel) and (Bm, Cm) per (step, state).
//
// Inside a chunk the steps go in groups of U. Everything a step needs that does not depend on the
// state — e = exp2(delta * A * log2 e) on the MUFU pipe (or, for POLY of every 4 steps of state 0,
// a polynomial exp2 on the FMA pipe), x = delta * u * Bm and Cm — is computed for group g + 1
// while the dependent chain h = e * h + x, p = sum Cm * h of group g runs (a two-stage software
// pipeline over register sets A and B), so no exponential waits on the recurrence and ptxas can
// interleave both stages in one basic block. Each lane stores its partial sum p of every step in shared
// memory (no shuffles in the loop); after the chunk one pass adds the GL partials of each
// (step, channel pair), adds Dv * u and writes y as f16 pairs, while the next chunk is converted.
//
// Any L and any D: the last chunk's steps past L and the last block's channels past D are zeros in
// shared memory (cp.async with src-size 0, or element loads where D % 8 != 0 leaves rows
// unaligned); a zero step leaves the state unchanged (exp2(0) = 1, delta * u * Bm = 0), so the
// final state is exact; y and the state are stored only below L and D. A partial chunk runs only
// the groups that hold its steps.
//
// Shared memory returns 128 bytes per cycle and SM, one 32-bit register to every lane of a warp,
// however few distinct addresses the warp reads, so the loop can load few registers per state and
// step: with
// PACK=1 (Bm, Cm) per (step, state) stays an f16 pair in shared memory, one register widened in
// registers, instead of an f32 pair; PACK=2 also keeps (delta, u) per (step, channel) as an f16
// pair (delta * u then formed in the loop) instead of (delta, delta * u) in f32; with
// SWZ=1 lanes 2i and 2i + 1 of a warp serve the same states of two channels, so their (Bm, Cm)
// addresses agree pairwise and the hardware returns them packed, as it does for (delta, u), read
// alike by the lanes of one channel (lanes 2i and 2i + 1 with SWZ=0, 2i and 2i + 2 with SWZ=1).
//
// Tunables: NS (== N), SPT (states per lane: 1, 2 or 4), CB (channels per block), CHUNK (steps per
// shared-memory tile), U (steps per pipeline group), POLY (0-2: steps of every 4 whose state-0
// exponential is a polynomial on the FMA pipe), PACK (f16 pairs in shared memory), SWZ (lane order),
// IL (the two stages interleaved step by step in the source: see prep_run).
//
// The same file is the MLX twin: [backends.mlx-cuda] runs it as a whole CUDA unit (NVRTC with
// -DKS_AXIS=int, mx.fast.precompiled_cuda_kernel); on MLX's stream it takes 0.93-1.01x the CUDA
// back-end's time (H200, GPU clock, 2026-12-04). Splitting
// the sequence into segments for more chains at batch 1 (seg_scan.cu) measured slower on every
// anchor shape: the single pass here is bound by its per-SM work per step, not by too few chains.
#ifndef KS_AXIS
#define KS_AXIS long long  // MLX (form = "cuda") passes the axes as 32-bit ints: -DKS_AXIS=int
#endif
#ifndef NS
#define NS 16
#endif
#ifndef SPT
#define SPT 1
#endif
#ifndef CB
#define CB 16
#endif
#ifndef CHUNK
#define CHUNK 64
#endif
#ifndef U
#define U 8
#endif
#ifndef POLY
#define POLY 0
#endif
#ifndef PACK
#define PACK 1
#endif
#ifndef SWZ
#define SWZ 0
#endif
#ifndef IL
#define IL 0
#endif
#define GL (NS / SPT)       // lanes per channel
#define NTH (CB * GL)       // threads per block
#define NG (CHUNK / U)      // groups per full chunk
#define PW (CB + 32 / GL)   // floats per state group's row of partial sums (padded: no bank conflicts)
#define TS (GL * PW + 16)   // floats per step of partial sums
#define LOG2E 1.4426950408889634f
#if NS % SPT != 0 || (GL & (GL - 1)) != 0 || GL > 16 || GL < 2
#error "NS / SPT must be a power of two between 2 and 16"
#endif
#if CB % 8 != 0 || CHUNK % (2 * U) != 0 || NG < 2 || CHUNK % (2 * GL) != 0
#error "CB must be a multiple of 8, CHUNK a multiple of 2 * U and of 2 * NS / SPT"
#endif

__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
// 2^x on the FMA pipe: nearest integer j by the 1.5 * 2^23 trick, 2^(x - j) on [-0.5, 0.5] by a
// degree-6 Taylor polynomial (relative error ~1.2e-7, as MUFU's ex2.approx), j added to the exponent.
__device__ __forceinline__ float ex2_poly(float x) {
    x = fmaxf(x, -125.f);
    const float t = x + 12582912.f;
    const float f = x - (t - 12582912.f);
    float p = 1.5403530e-4f;
    p = fmaf(p, f, 1.3333558e-3f);
    p = fmaf(p, f, 9.6181291e-3f);
    p = fmaf(p, f, 5.5504109e-2f);
    p = fmaf(p, f, 2.4022651e-1f);
    p = fmaf(p, f, 6.9314718e-1f);
    p = fmaf(p, f, 1.0f);
    return __int_as_float(__float_as_int(p) + ((__float_as_int(t) - 0x4B400000) << 23));
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

struct __align__(16) Raw {
    unsigned short dl[CHUNK][CB];  // delta rows of the block's channels
    unsigned short uu[CHUNK][CB];  // u rows
    unsigned short bm[CHUNK][NS];
    unsigned short cm[CHUNK][NS];
};
struct __align__(16) Smem {
    Raw raw[2];
#if PACK >= 2
    unsigned f[CHUNK][CB];   // f16 (delta, u) per step and channel
#else
    float2 f[CHUNK][CB];     // (delta, delta * u) per step and channel
#endif
#if PACK >= 1
    unsigned bc[CHUNK][NS];  // f16 (Bm, Cm) per step and state
#else
    float2 bc[CHUNK][NS];    // (Bm, Cm) per step and state
#endif
    float part[CHUNK][TS];   // partial sums: [step][state group * PW + channel]
};
static_assert(sizeof(Smem) <= CHUNK * (16 * CB + 16 * NS + 4 * CB * NS / SPT + 192) - CHUNK * 4 * NS * (PACK > 0) -
                                  CHUNK * 4 * CB * (PACK / 2),
              "task.toml's shared bytes");

// One chunk's rows: delta and u of the CB channels (16-byte pieces; element loads when rows are
// not 16-byte aligned), Bm and Cm (contiguous over steps). Steps from `nt` on and channels from
// `nc` on are zeros.
__device__ __forceinline__ void load_chunk(Raw& r, const unsigned short* dl, const unsigned short* uu,
                                           const unsigned short* bm, const unsigned short* cm, long long D, int nt,
                                           int nc, bool al, int tid) {
    constexpr int RC = CB / 8;  // 16-byte pieces per row of CB halves
    if (al) {
        for (int i = tid; i < CHUNK * RC; i += NTH) {
            const int t = i / RC, p = i % RC;
            const bool ok = t < nt && 8 * p < nc;
            const long long x = ok ? (long long)t * D + 8 * p : 0;
            cp16z(&r.dl[t][8 * p], dl + x, ok ? 16 : 0);
            cp16z(&r.uu[t][8 * p], uu + x, ok ? 16 : 0);
        }
    } else {
        for (int i = tid; i < CHUNK * CB; i += NTH) {
            const int t = i / CB, c = i % CB;
            const bool ok = t < nt && c < nc;
            const long long x = (long long)t * D + c;
            r.dl[t][c] = ok ? dl[x] : (unsigned short)0;
            r.uu[t][c] = ok ? uu[x] : (unsigned short)0;
        }
    }
    for (int i = tid; i < CHUNK * NS / 8; i += NTH) {
        const bool ok = 8 * i < nt * NS;
        cp16z(&r.bm[0][0] + 8 * i, bm + (ok ? 8 * i : 0), ok ? 16 : 0);
        cp16z(&r.cm[0][0] + 8 * i, cm + (ok ? 8 * i : 0), ok ? 16 : 0);
    }
}

// Both halves of an f16 pair to f32.
__device__ __forceinline__ void h2x2(unsigned w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(lo), "=f"(hi) : "r"(w));
}

// Raw halves of one chunk to what the loop reads: (delta, u) as f16 pairs (PACK=2) or
// (delta, delta * u) in f32 per (step, channel); (Bm, Cm) as f16 pairs (PACK >= 1) or in f32 per
// (step, state).
__device__ __forceinline__ void convert(Smem& sm, const Raw& r, int tid) {
#pragma unroll 4
    for (int i = tid; i < CHUNK * CB / 2; i += NTH) {
        const int t = i / (CB / 2), c = 2 * (i % (CB / 2));
        const unsigned wd = *(const unsigned*)&r.dl[t][c], wu = *(const unsigned*)&r.uu[t][c];
#if PACK >= 2
        *(uint2*)&sm.f[t][c] = make_uint2(__byte_perm(wd, wu, 0x5410), __byte_perm(wd, wu, 0x7632));
#else
        float d0, d1, u0, u1;
        h2x2(wd, d0, d1);
        h2x2(wu, u0, u1);
        *(float4*)&sm.f[t][c] = make_float4(d0, d0 * u0, d1, d1 * u1);
#endif
    }
#pragma unroll 4
    for (int i = tid; i < CHUNK * NS / 2; i += NTH) {
        const int t = i / (NS / 2), n = 2 * (i % (NS / 2));
        const unsigned wb = *(const unsigned*)&r.bm[t][n], wc = *(const unsigned*)&r.cm[t][n];
#if PACK >= 1
        *(uint2*)&sm.bc[t][n] = make_uint2(__byte_perm(wb, wc, 0x5410), __byte_perm(wb, wc, 0x7632));
#else
        float b0, b1, c0, c1;
        h2x2(wb, b0, b1);
        h2x2(wc, c0, c1);
        *(float4*)&sm.bc[t][n] = make_float4(b0, c0, b1, c1);
#endif
    }
}

// Stage 1 of step t0 + i (slot i of a group's registers): what does not depend on the state.
__device__ __forceinline__ void prep_step(const Smem& sm, int t0, int i, int cl, int sg, const float (&a2)[SPT],
                                          float (&e)[U][SPT], float (&x)[U][SPT], float (&cv)[U][SPT]) {
    float bv[SPT];
#if PACK >= 2
    float2 f;
    h2x2(sm.f[t0 + i][cl], f.x, f.y);
    f.y *= f.x;
#else
    const float2 f = sm.f[t0 + i][cl];
#endif
#if PACK >= 1
    unsigned q[SPT];
#if SPT == 1
    q[0] = sm.bc[t0 + i][sg];
#elif SPT == 2
    const uint2 w2 = *(const uint2*)&sm.bc[t0 + i][2 * sg];
    q[0] = w2.x;
    q[1] = w2.y;
#else
    const uint4 w4 = *(const uint4*)&sm.bc[t0 + i][4 * sg];
    q[0] = w4.x;
    q[1] = w4.y;
    q[2] = w4.z;
    q[3] = w4.w;
#endif
#pragma unroll
    for (int j = 0; j < SPT; j++) h2x2(q[j], bv[j], cv[i][j]);
#else
#if SPT == 1
    const float2 w = sm.bc[t0 + i][sg];
    bv[0] = w.x;
    cv[i][0] = w.y;
#else
#pragma unroll
    for (int j = 0; j < SPT; j += 2) {
        const float4 w = *(const float4*)&sm.bc[t0 + i][sg * SPT + j];
        bv[j] = w.x;
        cv[i][j] = w.y;
        bv[j + 1] = w.z;
        cv[i][j + 1] = w.w;
    }
#endif
#endif
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        const float z = f.x * a2[j];
        e[i][j] = (POLY > 0 && j == 0 && (i & 3) < POLY) ? ex2_poly(z) : ex2(z);
        x[i][j] = f.y * bv[j];
    }
}

// Stage 2 of step t0 + i: the recurrence and the step's partial sum of Cm . h.
__device__ __forceinline__ void run_step(float* __restrict__ part, int t0, int i, float (&h)[SPT], const float (&e)[U][SPT],
                                         const float (&x)[U][SPT], const float (&cv)[U][SPT]) {
    float p = 0.f;
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        h[j] = fmaf(e[i][j], h[j], x[i][j]);
        p = fmaf(cv[i][j], h[j], p);
    }
    part[(t0 + i) * TS] = p;
}

// Stage 1 of a group of U steps from step t0.
__device__ __forceinline__ void prep(const Smem& sm, int t0, int cl, int sg, const float (&a2)[SPT],
                                     float (&e)[U][SPT], float (&x)[U][SPT], float (&cv)[U][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i++) prep_step(sm, t0, i, cl, sg, a2, e, x, cv);
}

// Stage 2 of a group of U steps from step t0.
__device__ __forceinline__ void run(float* __restrict__ part, int t0, float (&h)[SPT], const float (&e)[U][SPT],
                                    const float (&x)[U][SPT], const float (&cv)[U][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i++) run_step(part, t0, i, h, e, x, cv);
}

// Both stages at once, step by step (IL=1): step i of group t1's stage 1 into one register set,
// then step i of group t0's recurrence from the other, so each link of the recurrence's chain
// (h = e * h + x, four cycles) is a step's worth of independent instructions away from the next
// one in the instruction stream, not left to the scheduler to find.
__device__ __forceinline__ void prep_run(const Smem& sm, float* __restrict__ part, int t1, int t0, int cl, int sg,
                                         const float (&a2)[SPT], float (&h)[SPT], float (&eN)[U][SPT],
                                         float (&xN)[U][SPT], float (&cN)[U][SPT], const float (&e)[U][SPT],
                                         const float (&x)[U][SPT], const float (&cv)[U][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i++) {
        prep_step(sm, t1, i, cl, sg, a2, eN, xN, cN);
        run_step(part, t0, i, h, e, x, cv);
    }
}

extern "C" __global__ void __launch_bounds__(NTH) mamba_scan(
    const unsigned short* __restrict__ u, const unsigned short* __restrict__ delta, const float* __restrict__ A,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, const float* __restrict__ Dv,
    unsigned short* __restrict__ y, float* __restrict__ state, KS_AXIS batch_, KS_AXIS L_, KS_AXIS D_, KS_AXIS N_) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const long long L = L_, D = D_;
    const int tid = threadIdx.x;
#if SWZ
    // Lane bit 0 picks one of two channels, the next log2(GL) bits the state group.
    constexpr int LGL = GL == 2 ? 1 : GL == 4 ? 2 : GL == 8 ? 3 : 4;
    const int lane = tid & 31;
    const int cl = (tid >> 5) * (32 / GL) + (lane & 1) + 2 * (lane >> (LGL + 1));  // channel within the block
    const int sg = (lane >> 1) & (GL - 1);                                           // state group within it
#else
    const int cl = tid / GL, sg = tid % GL;  // channel within the block, state group within the channel
#endif
    const long long b = blockIdx.y;
    const long long d0 = (long long)blockIdx.x * CB;
    const long long d = d0 + cl;
    const bool dok = d < D;
    const int nc = (int)min((long long)CB, D - d0);  // channels of this block before D
    const bool al = D % 8 == 0;                       // delta / u rows are 16-byte aligned
    const unsigned short* dlg = delta + b * L * D + d0;
    const unsigned short* ug = u + b * L * D + d0;
    const unsigned short* bg = Bm + b * L * NS;
    const unsigned short* cg = Cm + b * L * NS;
    unsigned short* yg = y + b * L * D + d0;

    float a2[SPT], h[SPT];
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        a2[j] = dok ? A[d * NS + sg * SPT + j] * LOG2E : 0.f;
        h[j] = 0.f;
    }
    // The channel pair this thread sums in the output pass (NTH is a multiple of CB / 2).
    const int c2 = 2 * (tid % (CB / 2));
    const float dv0 = c2 < nc ? Dv[d0 + c2] : 0.f, dv1 = c2 + 1 < nc ? Dv[d0 + c2 + 1] : 0.f;
    const bool pair32 = D % 2 == 0 && c2 + 1 < nc;  // both channels stored as one 32-bit word
    float* part = &sm.part[0][sg * PW + cl];

    const int Ln = (int)L;
    const int nch = (Ln + CHUNK - 1) / CHUNK;  // the last chunk may be partial
#define STEPS(k) min(CHUNK, Ln - (k) * CHUNK)
    load_chunk(sm.raw[0], dlg, ug, bg, cg, D, STEPS(0), nc, al, tid);
    cp_commit();
    if (nch > 1)
        load_chunk(sm.raw[1], dlg + (long long)CHUNK * D, ug + (long long)CHUNK * D, bg + CHUNK * NS, cg + CHUNK * NS, D,
                   STEPS(1), nc, al, tid);
    cp_commit();
    cp_wait1();
    __syncthreads();
    convert(sm, sm.raw[0], tid);
    __syncthreads();
    for (int k = 0; k < nch; k++) {
        const int nt = STEPS(k);
        // Groups holding the chunk's steps, rounded up to a pair (the pipeline runs groups in pairs).
        const int ng = nt == CHUNK ? NG : max(2, 2 * ((nt + 2 * U - 1) / (2 * U)));
        {
            float eA[U][SPT], xA[U][SPT], cA[U][SPT], eB[U][SPT], xB[U][SPT], cB[U][SPT];
            prep(sm, 0, cl, sg, a2, eA, xA, cA);
#pragma unroll 1
            for (int g = 0; g < ng - 2; g += 2) {
#if IL
                prep_run(sm, part, (g + 1) * U, g * U, cl, sg, a2, h, eB, xB, cB, eA, xA, cA);
                prep_run(sm, part, (g + 2) * U, (g + 1) * U, cl, sg, a2, h, eA, xA, cA, eB, xB, cB);
#else
                prep(sm, (g + 1) * U, cl, sg, a2, eB, xB, cB);
                run(part, g * U, h, eA, xA, cA);
                prep(sm, (g + 2) * U, cl, sg, a2, eA, xA, cA);
                run(part, (g + 1) * U, h, eB, xB, cB);
#endif
            }
#if IL
            prep_run(sm, part, (ng - 1) * U, (ng - 2) * U, cl, sg, a2, h, eB, xB, cB, eA, xA, cA);
#else
            prep(sm, (ng - 1) * U, cl, sg, a2, eB, xB, cB);
            run(part, (ng - 2) * U, h, eA, xA, cA);
#endif
            run(part, (ng - 1) * U, h, eB, xB, cB);
        }
        cp_wait0();       // chunk k + 1 landed (this thread's copies)
        __syncthreads();  // ... everyone's; every partial sum of chunk k written; f and bc free
        {
            // y of chunk k: the GL partials of each (step, channel pair), plus Dv * u.
            const Raw& r = sm.raw[k & 1];
            const long long yt = (long long)k * CHUNK;
#pragma unroll 2
            for (int i = tid; i < CHUNK * CB / 2; i += NTH) {
                const int t = i / (CB / 2);
                if (t < nt) {
                    float s0 = 0.f, s1 = 0.f;
#pragma unroll
                    for (int q = 0; q < GL; q++) {
                        const float2 w = *(const float2*)&sm.part[t][q * PW + c2];
                        s0 += w.x;
                        s1 += w.y;
                    }
                    const unsigned wu = *(const unsigned*)&r.uu[t][c2];
                    const unsigned short y0 = f2h(fmaf(dv0, h2f((unsigned short)(wu & 0xffff)), s0));
                    const unsigned short y1 = f2h(fmaf(dv1, h2f((unsigned short)(wu >> 16)), s1));
                    unsigned short* yp = yg + (yt + t) * D + c2;
                    if (pair32)
                        *(unsigned*)yp = (unsigned)y0 | ((unsigned)y1 << 16);
                    else {
                        if (c2 < nc) yp[0] = y0;
                        if (c2 + 1 < nc) yp[1] = y1;
                    }
                }
            }
        }
        if (k + 1 < nch) convert(sm, sm.raw[(k + 1) & 1], tid);
        __syncthreads();  // chunk k + 1 converted; raw[k & 1] and the partial sums free
        if (k + 2 < nch) {
            const long long t2 = (long long)(k + 2) * CHUNK;
            load_chunk(sm.raw[k & 1], dlg + t2 * D, ug + t2 * D, bg + t2 * NS, cg + t2 * NS, D, STEPS(k + 2), nc, al, tid);
        }
        cp_commit();
    }
    if (dok) {
#pragma unroll
        for (int j = 0; j < SPT; j++) state[(b * D + d) * NS + sg * SPT + j] = h[j];
    }
}
