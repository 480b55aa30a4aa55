// The selective scan split along time into segments, so that batch 1 has more blocks: two launches,
// every exp(delta * A) of the scan computed once, plus a correction that stops where it decays.
//
// Launch 1 (`mamba_scan`) is pipe_scan.cu's single-pass scan run on NSEG segments of the sequence
// at once (grid z), each from a zero state: a block owns CB channels of one batch and one
// segment; each channel is served by GL = NS / SPT lanes holding SPT states in registers; time is
// walked in chunks of CHUNK steps staged in shared memory by 16-byte cp.async two chunks ahead
// and converted once; inside a chunk the state-independent part of a group of U steps
// (exp2(delta * A * log2 e) on MUFU, delta * u * Bm, Cm) is issued while the FMA recurrence of the
// group before it runs; per-lane partial sums of Cm . h go to shared memory and are added per
// (step, channel pair) with Dv * u after each chunk. It writes y of its segment as if the segment
// had started from a zero state (y_loc), the segment's end state from zero, its delta sums per
// channel through every chunk (csum) and in all (segsum), and per block a flag (a negative delta in
// the segment) and the largest |Cm| of the segment.
//
// Launch 2 (`seg_fix`): one thread per channel holding all NS states; segment z's steps in FSL
// slices of whole chunks. The state entering segment z is folded from the earlier segments' end
// states and delta sums, h_z = exp2(A log2e S_(z-1)) * h_(z-1) + end_(z-1); slice 0 of the last
// segment writes the final state. Inside segment z >= 1 the true output is y_t = y_loc_t +
// sum_n Cm_t[n] * exp2(A[n] log2e S_t) * h_z[n], S_t the delta sum from the segment's start (at a
// slice's start: csum of the chunk before it): the slice walks its steps in groups of 4 (the
// group's loads issued first) and rewrites y. With A <= 0 and no negative delta in the segment
// (checked: A per thread, the flag of launch 1) exp2(A S_t) never grows, so once cmax * sum_n
// |h_z[n]| exp2(A[n] S_t) < 2^-25 for every channel of the warp (cmax: the segment's largest |Cm|)
// no later term can reach 2^-25, half the smallest f16 subnormal, and the warp stops (also
// before its first step); otherwise it walks the whole slice.
//
// NSEG = max(1, min(ceil_div(L, MINSEG), ceil_div(BLK, batch * ceil_div(D, CB)))): about BLK
// blocks in launch 1, segments of at least MINSEG steps; segment length ceil(L / NSEG) rounded up
// to CHUNK (trailing segments may be empty: they write zeros). Any L, any D; NS a multiple of 8.
//
// Measured (H200, 2026-12-04 10:26 UTC, bench/h200-2026-12-04-scan-seg.txt; 60 configurations x 5
// shapes and 104 held-out / ragged / stress runs, every element checked against float64: 0 failed):
// SLOWER than pipe_scan.cu on every anchor shape. Best per shape (us; pipe_scan's best of the
// configurations timed in the same process in brackets): 1,4096,2048: 152.4 (114.8); 1,512,2048:
// 37.4 (19.0); 1,2048,1536: 73.4 (59.5); 1,1024,3072: 68.9 (49.5); 4,1024,2048 (NSEG = 1):
// 109.2 (93.7). At L = 4096 (SPT 2, CHUNK 64) NSEG 2 / 4 / 8 (BLK 256 / 512 / 1024, slices of
// 512 / 256 / 128 steps) take 225.5 / 196.4 / 152.4 us: about 116 us plus 0.31 us per step of
// the longest slice walked. So (1) launch 1 takes about what pipe_scan takes on the whole sequence
// however many blocks the segments give it: pipe_scan at batch 1 is not short of parallel chains
// but of per-SM throughput in its loop; (2) the correction walk is latency-bound (a group's loads,
// then its exps, then the vote: about one memory round trip per 4 steps). With NSEG = 1 the extra
// launch and the bookkeeping cost about 15 us at batch 4.
//
// Tunables: NS (== N), SPT, CB, CHUNK, U, POLY, PACK, SWZ as in pipe_scan.cu; BLK (launch-1
// blocks aimed at), MINSEG (shortest segment), FSL (correction slices per segment).
#ifndef KS_AXIS
#define KS_AXIS long long
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
#ifndef FSL
#define FSL 4
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
#if NS % 8 != 0
#error "NS must be a multiple of 8"
#endif
typedef unsigned short u16;

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
    float4 acc[NTH];         // per thread: delta sums of its channel pair, a negative delta seen
};
static_assert(sizeof(Smem) <= CHUNK * (16 * CB + 16 * NS + 4 * CB * NS / SPT + 192) - CHUNK * 4 * NS * (PACK > 0) -
                                  CHUNK * 4 * CB * (PACK / 2) + 16 * NTH,
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
// Also adds this thread's (step, channel pair) deltas to its slot of acc (the segment's delta
// sums; kept in shared memory, not in registers across the scan) and notes a negative delta.
__device__ __forceinline__ void convert(Smem& sm, const Raw& r, int tid) {
    float s0 = 0.f, s1 = 0.f;
    bool neg = false;
#pragma unroll 4
    for (int i = tid; i < CHUNK * CB / 2; i += NTH) {
        const int t = i / (CB / 2), c = 2 * (i % (CB / 2));
        const unsigned wd = *(const unsigned*)&r.dl[t][c], wu = *(const unsigned*)&r.uu[t][c];
        float d0, d1;
        h2x2(wd, d0, d1);
        s0 += d0;
        s1 += d1;
        neg |= d0 < 0.f || d1 < 0.f;
#if PACK >= 2
        *(uint2*)&sm.f[t][c] = make_uint2(__byte_perm(wd, wu, 0x5410), __byte_perm(wd, wu, 0x7632));
#else
        float u0, u1;
        h2x2(wu, u0, u1);
        *(float4*)&sm.f[t][c] = make_float4(d0, d0 * u0, d1, d1 * u1);
#endif
    }
    float cmx = 0.f;
#pragma unroll 4
    for (int i = tid; i < CHUNK * NS / 2; i += NTH) {
        const int t = i / (NS / 2), n = 2 * (i % (NS / 2));
        const unsigned wb = *(const unsigned*)&r.bm[t][n], wc = *(const unsigned*)&r.cm[t][n];
        {
            float c0, c1;
            h2x2(wc, c0, c1);
            cmx = fmaxf(cmx, fmaxf(fabsf(c0), fabsf(c1)));  // NaN: y is NaN anyway; inf: no cut
            cmx = (c0 - c0 != 0.f || c1 - c1 != 0.f) ? __int_as_float(0x7f800000) : cmx;
        }
#if PACK >= 1
        *(uint2*)&sm.bc[t][n] = make_uint2(__byte_perm(wb, wc, 0x5410), __byte_perm(wb, wc, 0x7632));
#else
        float b0, b1, c0, c1;
        h2x2(wb, b0, b1);
        h2x2(wc, c0, c1);
        *(float4*)&sm.bc[t][n] = make_float4(b0, c0, b1, c1);
#endif
    }
    float4 ac = sm.acc[tid];
    ac.x += s0;
    ac.y += s1;
    ac.z = neg ? 1.f : ac.z;
    ac.w = fmaxf(ac.w, cmx);
    sm.acc[tid] = ac;
}

// Stage 1 of a group of U steps from step t0: what does not depend on the state.
__device__ __forceinline__ void prep(const Smem& sm, int t0, int cl, int sg, const float (&a2)[SPT],
                                     float (&e)[U][SPT], float (&x)[U][SPT], float (&cv)[U][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i++) {
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
}

// Stage 2: the recurrence of the group and each step's partial sum of Cm . h.
__device__ __forceinline__ void run(float* __restrict__ part, int t0, float (&h)[SPT], const float (&e)[U][SPT],
                                    const float (&x)[U][SPT], const float (&cv)[U][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i++) {
        float p = 0.f;
#pragma unroll
        for (int j = 0; j < SPT; j++) {
            h[j] = fmaf(e[i][j], h[j], x[i][j]);
            p = fmaf(cv[i][j], h[j], p);
        }
        part[(t0 + i) * TS] = p;
    }
}

// Segment z of nseg: steps [t0, t0 + len) (len <= 0: an empty segment); per, the steps of a full
// segment (a multiple of CHUNK).
__device__ __forceinline__ long long segment_of(long long L, int z, int nseg, long long& t0, long long& len) {
    const long long per = ((L + nseg - 1) / nseg + CHUNK - 1) / CHUNK * CHUNK;
    t0 = (long long)z * per;
    len = min(per, L - t0);
    return per;
}

// Sum of the delta-sum slots of channel c (the threads that convert its pair), in a fixed order.
__device__ __forceinline__ float delta_sum(const Smem& sm, int c) {
    float s = 0.f;
#pragma unroll 4
    for (int m = 0; m < NTH / (CB / 2); m++) {
        const float4 a = sm.acc[(c >> 1) + m * (CB / 2)];
        s += (c & 1) ? a.y : a.x;
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(NTH) mamba_scan(
    const u16* __restrict__ u, const u16* __restrict__ delta, const float* __restrict__ A, const u16* __restrict__ Bm,
    const u16* __restrict__ Cm, const float* __restrict__ Dv, u16* __restrict__ y, float* __restrict__ state,
    float* __restrict__ segend, float* __restrict__ segsum, float* __restrict__ csum, KS_AXIS batch_, KS_AXIS L_,
    KS_AXIS D_, KS_AXIS N_) {
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
    const int z = blockIdx.z, nseg = gridDim.z;
    const long long d0 = (long long)blockIdx.x * CB;
    const long long d = d0 + cl;
    const bool dok = d < D;
    const int nc = (int)min((long long)CB, D - d0);  // channels of this block before D
    const long long nblk = (D + CB - 1) / CB;
    float* send = segend + ((b * nseg + z) * D) * NS;
    float* ssum = segsum + (b * nseg + z) * (D + 2 * nblk);
    long long t0, len;
    const long long per = segment_of(L, z, nseg, t0, len);
    float* cs = csum + (b * nseg + z) * (per / CHUNK) * D + d0;  // [chunk][channel] of this segment
    if (len <= 0) {  // an empty trailing segment: end state 0, delta sum 0, no negative delta
        if (dok) {
#pragma unroll
            for (int j = 0; j < SPT; j++) send[d * NS + sg * SPT + j] = 0.f;
        }
        if (tid < nc) ssum[d0 + tid] = 0.f;
        if (tid == 0) {
            ssum[D + blockIdx.x] = 0.f;
            ssum[D + nblk + blockIdx.x] = 0.f;
        }
        return;
    }
    const bool al = D % 8 == 0;  // delta / u rows are 16-byte aligned
    const long long row0 = b * L + t0;
    const u16* dlg = delta + row0 * D + d0;
    const u16* ug = u + row0 * D + d0;
    const u16* bg = Bm + row0 * NS;
    const u16* cg = Cm + row0 * NS;
    u16* yg = y + row0 * D + d0;

    float a2[SPT], h[SPT];
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        a2[j] = dok ? A[d * NS + sg * SPT + j] * LOG2E : 0.f;
        h[j] = 0.f;
    }
    // The channel pair this thread converts and sums in the output pass (NTH is a multiple of CB / 2).
    const int c2 = 2 * (tid % (CB / 2));
    const float dv0 = c2 < nc ? Dv[d0 + c2] : 0.f, dv1 = c2 + 1 < nc ? Dv[d0 + c2 + 1] : 0.f;
    const bool pair32 = D % 2 == 0 && c2 + 1 < nc;  // both channels stored as one 32-bit word
    float* part = &sm.part[0][sg * PW + cl];
    sm.acc[tid] = make_float4(0.f, 0.f, 0.f, 0.f);  // this thread's slot only: no barrier needed

    const int Ln = (int)len;
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
                prep(sm, (g + 1) * U, cl, sg, a2, eB, xB, cB);
                run(part, g * U, h, eA, xA, cA);
                prep(sm, (g + 2) * U, cl, sg, a2, eA, xA, cA);
                run(part, (g + 1) * U, h, eB, xB, cB);
            }
            prep(sm, (ng - 1) * U, cl, sg, a2, eB, xB, cB);
            run(part, (ng - 2) * U, h, eA, xA, cA);
            run(part, (ng - 1) * U, h, eB, xB, cB);
        }
        // The delta sums of the segment through chunk k: acc holds them from the barrier after
        // chunk k's conversion until the barrier below (chunk k + 1 is converted after it).
        if (tid < nc) cs[(long long)k * D + tid] = delta_sum(sm, tid);
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
                    float q0 = 0.f, q1 = 0.f;
#pragma unroll
                    for (int q = 0; q < GL; q++) {
                        const float2 w = *(const float2*)&sm.part[t][q * PW + c2];
                        q0 += w.x;
                        q1 += w.y;
                    }
                    const unsigned wu = *(const unsigned*)&r.uu[t][c2];
                    const u16 y0 = f2h(fmaf(dv0, h2f((u16)(wu & 0xffff)), q0));
                    const u16 y1 = f2h(fmaf(dv1, h2f((u16)(wu >> 16)), q1));
                    u16* yp = yg + (yt + t) * D + c2;
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
#undef STEPS
    if (dok) {
#pragma unroll
        for (int j = 0; j < SPT; j++) send[d * NS + sg * SPT + j] = h[j];
    }
    // Delta sums per channel: the threads converting channel pair c2 are tid = c2 / 2 + m * CB / 2;
    // added in a fixed order (the same bits every call).
    const bool any_neg = __syncthreads_or(sm.acc[tid].z != 0.f);
    if (tid < nc) ssum[d0 + tid] = delta_sum(sm, tid);
    if (tid < 32) {  // the largest |Cm| of the segment (inf where any is not finite)
        float m = 0.f;
        for (int i = tid; i < NTH; i += 32) m = fmaxf(m, sm.acc[i].w);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (tid == 0) {
            ssum[D + blockIdx.x] = any_neg ? 1.f : 0.f;
            ssum[D + nblk + blockIdx.x] = m;
        }
    }
}


// The state entering each segment, the final state, and y corrected for the true start state:
// one thread per channel holding all NS states; segment z's steps in FSL slices of whole chunks.
extern "C" __global__ void __launch_bounds__(128) seg_fix(
    const u16* __restrict__ u, const u16* __restrict__ delta, const float* __restrict__ A, const u16* __restrict__ Bm,
    const u16* __restrict__ Cm, const float* __restrict__ Dv, u16* y, float* __restrict__ state,
    const float* __restrict__ segend, const float* __restrict__ segsum, const float* __restrict__ csum,
    KS_AXIS batch_, KS_AXIS L_, KS_AXIS D_, KS_AXIS N_) {
    const long long L = L_, D = D_;
    const u16* yl = y;  // y holds y_loc; corrected in place
    const int tid = threadIdx.x;
    const long long b = blockIdx.y;
    const int nseg = gridDim.z / FSL, z = blockIdx.z / FSL, k = blockIdx.z % FSL;
    const long long dbase = (long long)blockIdx.x * 128;
    const long long d = dbase + tid;
    const bool dok = d < D;
    const long long nblk = (D + CB - 1) / CB;
    long long t0, len;
    const long long per = segment_of(L, z, nseg, t0, len);
    const long long cps = (per / CHUNK + FSL - 1) / FSL;          // chunks per slice
    const long long s0 = min(len, k * cps * CHUNK), s1 = min(len, (k + 1) * cps * CHUNK);  // this slice's steps
    float a2[NS], hs[NS];
#pragma unroll
    for (int j = 0; j < NS; j++) {
        a2[j] = dok ? A[d * NS + j] * LOG2E : 0.f;
        hs[j] = 0.f;
    }
    const float* seg = segsum + b * nseg * (D + 2 * nblk);
    if (dok && (z > 0 || (k == 0 && z == nseg - 1))) {
        // Fold the segments before z; slice 0 of the last segment folds z too: the final state.
        const int last = (k == 0 && z == nseg - 1) ? z : z - 1;
        for (int p = 0; p <= last; p++) {
            const float sp = seg[p * (D + 2 * nblk) + d];
            const float4* e = (const float4*)&segend[((b * nseg + p) * D + d) * NS];
            float nh[NS];
#pragma unroll
            for (int j = 0; j < NS / 4; j++) {
                const float4 w = e[j];
                nh[4 * j] = fmaf(ex2(a2[4 * j] * sp), hs[4 * j], w.x);
                nh[4 * j + 1] = fmaf(ex2(a2[4 * j + 1] * sp), hs[4 * j + 1], w.y);
                nh[4 * j + 2] = fmaf(ex2(a2[4 * j + 2] * sp), hs[4 * j + 2], w.z);
                nh[4 * j + 3] = fmaf(ex2(a2[4 * j + 3] * sp), hs[4 * j + 3], w.w);
            }
            if (p == z) {
#pragma unroll
                for (int j = 0; j < NS / 4; j++)
                    *(float4*)&state[(b * D + d) * NS + 4 * j] = make_float4(nh[4 * j], nh[4 * j + 1], nh[4 * j + 2], nh[4 * j + 3]);
            } else {
#pragma unroll
                for (int j = 0; j < NS; j++) hs[j] = nh[j];
            }
        }
    }
    if (z == 0 || s1 <= s0) return;
    // Monotone decay in this segment (A <= 0 here, no negative delta in the segment) and the
    // largest |Cm| of the segment: once cmax * sum_n |hs_n| exp2(a2_n S) < 2^-25 nothing later counts.
    const float* sz = seg + z * (D + 2 * nblk);
    bool mono = dok && sz[D + d / CB] == 0.f;
#pragma unroll
    for (int j = 0; j < NS; j++) mono = mono && a2[j] <= 0.f;
    const float cmax = dok ? sz[D + nblk + d / CB] : 0.f;
    // S at the slice's start: the launch-1 delta sum through the chunk before it.
    float S = (k == 0 || !dok) ? 0.f : csum[((b * nseg + z) * (per / CHUNK) + k * cps - 1) * D + d];
    {
        float bound = 0.f;
#pragma unroll
        for (int j = 0; j < NS; j++) bound = fmaf(fabsf(hs[j]), ex2(a2[j] * S), bound);
        if (__all_sync(0xffffffffu, !dok || (mono && cmax * bound < 0x1p-25f))) return;
    }
    const int n = (int)(s1 - s0);
    const long long r0 = b * L + t0 + s0;
    for (int t = 0; t < n; t += 4) {
        u16 dl[4], yv[4];
        uint4 cq[4][NS / 8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool ok = dok && t + i < n;
            const long long r = r0 + t + i;
            dl[i] = ok ? delta[r * D + d] : (u16)0;
            yv[i] = ok ? yl[r * D + d] : (u16)0;
#pragma unroll
            for (int j = 0; j < NS / 8; j++) cq[i][j] = ok ? ((const uint4*)&Cm[r * NS])[j] : make_uint4(0u, 0u, 0u, 0u);
        }
        float g[NS];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            S += h2f(dl[i]);
            float cv[NS];
#pragma unroll
            for (int j = 0; j < NS / 8; j++) {
                h2x2(cq[i][j].x, cv[8 * j], cv[8 * j + 1]);
                h2x2(cq[i][j].y, cv[8 * j + 2], cv[8 * j + 3]);
                h2x2(cq[i][j].z, cv[8 * j + 4], cv[8 * j + 5]);
                h2x2(cq[i][j].w, cv[8 * j + 6], cv[8 * j + 7]);
            }
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                g[j] = ex2(a2[j] * S);
                s = fmaf(cv[j], hs[j] * g[j], s);
            }
            if (dok && t + i < n) y[(r0 + t + i) * D + d] = f2h(h2f(yv[i]) + s);
        }
        float bound = 0.f;
#pragma unroll
        for (int j = 0; j < NS; j++) bound = fmaf(fabsf(hs[j]), g[j], bound);
        if (__all_sync(0xffffffffu, !dok || (mono && cmax * bound < 0x1p-25f))) break;
    }
}
