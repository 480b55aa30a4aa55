// Single-pass selective scan whose sums over the states, y_t = sum_n Cm_t[n] h_t[n], run on the
// tensor cores: one launch, every exp(delta * A) computed once, no scratch.
//
// Why it was written. pipe_scan.cu runs the same single pass; by count it spends more on delivering
// operands than on arithmetic: shared memory hands each lane of a warp one 32-bit register per
// cycle and SM, and a pipe_scan lane receives per (step, state) about five registers ((delta,
// delta * u), (Bm, Cm), then its partial sum of Cm . h stored and read back) against one
// exponential. Here the lanes of a channel never form partial sums: every two steps one warp
// instruction mma.m16n8k4/k8 (tf32 in, f32 out) takes the states of both steps straight from the
// registers that hold them and returns their dot products with Cm.
//
// What it measured (H200, 2026-12-04, bench/h200-2026-12-04-scan-mma.txt): 29% fewer instructions
// than pipe_scan (Nsight Compute, 1,4096,2048) but SLOWER at batch 1 with D <= 2048 (138.3 against
// 114.3 us at L = 4096; 21.8 / 19.0 at L = 512; 71.0 / 59.6 at 1,2048,1536), faster than pipe_scan's
// configuration timed beside it at 1,1024,3072 (48.7 / 52.8 us) and batch 4 (87.1 / 100.8 us). Both
// kernels are latency-bound, not delivery-bound: at batch 1 there are one or two warps per scheduler
// and each issues every 2.5 (this kernel, SPT 2) or 3.3 (pipe_scan) cycles, stalled mostly on
// fixed-latency dependencies; fewer instructions do not help while nothing else can issue. Issuing
// each pair's product later (the next pair stores it) and interleaving the preparation of the next
// group step by step with the recurrence were tried and were slower (142-150 us).
//
// Layout. A block owns CB channels of one batch; GL = NS / SPT lanes serve one channel, as QPC =
// GL / 4 quads (4 consecutive lanes) of KQ states each (KQ = 4 with SPT 1: mma.m16n8k4; KQ = 8
// otherwise: mma.m16n8k8). Lane t (0-3) of quad q holds the states KQ (q + r) + t + 4 i (i < KQ / 4,
// r < SPT / (KQ / 4)), which is where the instruction wants them: row g of the 16 x KQ A operand
// is quad g of the warp at step s, row g + 8 the same quad at step s + 1, its columns the quad's
// states. The KQ x 8 B operand holds Cm: its column CS (QPC p + q') (CS = 4 / QPC) is Cm of step
// s + p over the states of quad q', so the product's element (g, that column for q' = the quad's
// own q) is the quad's share of y at step s + p. The lane holding it stores it to shared memory
// (one pair later, so the store does not wait on the product) and the pass after the chunk adds the
// QPC shares of each (step, channel) with Dv * u; SPT 4 chains two instructions in the accumulator.
//
// Precision: the instruction reads the states as tf32 (11-bit significand; the low bits are
// dropped), so each term of y carries a relative error below 2^-10; measured, y is off by at most
// 0.19 of the f16 tolerance (pipe_scan: 0.04). The recurrence and the final state stay f32; Cm (f16)
// is exact in tf32.
//
// Time is walked in chunks of CHUNK steps whose rows of delta, u (CB channels) and Bm, Cm are
// copied into shared memory by 16-byte cp.async two chunks ahead (element loads when D % 8 != 0)
// and converted once: (delta, delta * u) per (step, channel) in f32 (PK 2: (delta, u) as an f16
// pair, delta * u then formed in the loop), Cm in f32 and Bm in f32 (PK 0) or f16 (PK >= 1) per
// (step, state) with each group of 8 states stored as the pairs (t, t + 4) a lane reads in one
// load. Inside a chunk the steps go in groups of U: the state-independent part of group g + 1
// (exp2(delta * A * log2 e) on MUFU, delta * u * Bm, Cm for the instruction) is loaded and issued
// while the recurrence h = e * h + x of group g and its instructions run, so no exponential waits
// on the state.
//
// Any L and any D: steps past L and channels past D are zeros in shared memory, and a zero step
// leaves the state unchanged (exp2(0) = 1, delta * u * Bm = 0), so the final state is exact; y
// and the state are stored only below L and D.
//
// Tunables: NS (== N), SPT (states per lane, 2 or 4; NS / SPT >= 4), CB (channels per block),
// CHUNK (steps per shared-memory tile), U (steps per pipeline group, even), PK (operand formats in
// shared memory, above; the task registers PK 0 and 1).
//
// The same file is the MLX twin ([backends.mlx-cuda], a whole CUDA unit with -DKS_AXIS=int).
#ifndef KS_AXIS
#define KS_AXIS long long
#endif
#ifndef NS
#define NS 16
#endif
#ifndef SPT
#define SPT 2
#endif
#ifndef CB
#define CB 16
#endif
#ifndef CHUNK
#define CHUNK 128
#endif
#ifndef U
#define U 8
#endif
#ifndef PK
#define PK 1
#endif
#define GL (NS / SPT)         // lanes per channel
#define QPC (GL / 4)          // quads per channel
#define KQ (SPT == 1 ? 4 : 8) // states per quad and instruction (m16n8k4 or m16n8k8)
#define VQ (KQ / 4)           // of them per lane
#define NI (SPT / VQ)         // instructions per pair of steps
#define CS (4 / QPC)          // B-operand column spacing
#define NTH (CB * GL)         // threads per block
#define NG (CHUNK / U)        // groups per full chunk
#define YS (QPC * CB + 8)     // floats per step of y shares (the +8 keeps a warp's stores on distinct banks)
#define LOG2E 1.4426950408889634f
#if !(SPT == 1 || SPT == 2 || (SPT == 4 && NS == 16)) || (NS != 8 && NS != 16)
#error "NS must be 8 or 16, SPT 1, 2 or (NS 16) 4"
#endif
#if CB % 8 != 0 || U % 2 != 0 || CHUNK % (2 * U) != 0 || NG < 2
#error "CB must be a multiple of 8, U even, CHUNK a multiple of 2 * U"
#endif

__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
// Both halves of an f16 pair to f32.
__device__ __forceinline__ void h2x2(unsigned w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(lo), "=f"(hi) : "r"(w));
}
// d = A B + c for one 16 x 8 x 8 tf32 product: a = (A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]),
// b = (B[t][g], B[t+4][g]), d = (D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]) for lane 4 g + t.
__device__ __forceinline__ void mma_tf32(float (&d)[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)), "r"(__float_as_uint(a3)),
          "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// The same with k = 4: a = (A[g][t], A[g+8][t]), b = B[t][g].
__device__ __forceinline__ void mma_tf32_k4(float (&d)[4], float a0, float a1, float b0) {
    asm("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(b0)));
}

struct __align__(16) Raw {
    unsigned short dl[CHUNK][CB];  // delta rows of the block's channels
    unsigned short uu[CHUNK][CB];  // u rows
    unsigned short bm[CHUNK][NS];
    unsigned short cm[CHUNK][NS];
};
struct __align__(16) Smem {
    Raw raw[2];
#if PK >= 2
    unsigned f[CHUNK][CB];   // f16 (delta, u) per step and channel
#else
    float2 f[CHUNK][CB];     // (delta, delta * u)
#endif
    float cf[CHUNK][NS];     // Cm, each group of 8 states stored as (0, 4), (1, 5), (2, 6), (3, 7)
#if PK >= 1
    unsigned short bh[CHUNK][NS];  // Bm in f16, same order
#else
    float bf[CHUNK][NS];           // Bm in f32, same order
#endif
    float yp[CHUNK + 2][YS]; // y shares: [2 + step][channel * QPC + quad] (rows 0-1: the store before a chunk's first pair)
};
static_assert(sizeof(Smem) <= (CHUNK + 2) * (CB * NS / SPT + 32) + CHUNK * (16 * CB + 16 * NS - 4 * CB * (PK / 2) - 2 * NS * (PK > 0)),
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

// Raw halves of one chunk to what the loop reads.
__device__ __forceinline__ void convert(Smem& sm, const Raw& r, int tid) {
#pragma unroll 4
    for (int i = tid; i < CHUNK * CB / 2; i += NTH) {
        const int t = i / (CB / 2), c = 2 * (i % (CB / 2));
        const unsigned wd = *(const unsigned*)&r.dl[t][c], wu = *(const unsigned*)&r.uu[t][c];
#if PK >= 2
        *(uint2*)&sm.f[t][c] = make_uint2(__byte_perm(wd, wu, 0x5410), __byte_perm(wd, wu, 0x7632));
#else
        float d0, d1, u0, u1;
        h2x2(wd, d0, d1);
        h2x2(wu, u0, u1);
        *(float4*)&sm.f[t][c] = make_float4(d0, d0 * u0, d1, d1 * u1);
#endif
    }
    // With two values per lane (k = 8), slot 2 k + i of a group of 8 holds state k + 4 i.
#pragma unroll 4
    for (int i = tid; i < CHUNK * NS / 2; i += NTH) {
        const int t = i / (NS / 2), q = i % (NS / 2);
        const int s0 = VQ == 2 ? 8 * (q / 4) + q % 4 : 2 * q, s1 = s0 + (VQ == 2 ? 4 : 1);
        const int o = VQ == 2 ? 8 * (q / 4) + 2 * (q % 4) : 2 * q;
        *(float2*)&sm.cf[t][o] = make_float2(h2f(r.cm[t][s0]), h2f(r.cm[t][s1]));
#if PK >= 1
        *(unsigned*)&sm.bh[t][o] = (unsigned)r.bm[t][s0] | ((unsigned)r.bm[t][s1] << 16);
#else
        *(float2*)&sm.bf[t][o] = make_float2(h2f(r.bm[t][s0]), h2f(r.bm[t][s1]));
#endif
    }
}

// What one step t needs that does not depend on the state: e = exp2(delta * A * log2 e) and
// x = delta * u * Bm for the lane's states (`bo`: the slot of its first state in a row of Bm).
__device__ __forceinline__ void prep1(const Smem& sm, int t, int cl, int bo, const float (&a2)[SPT], float (&e)[SPT],
                                      float (&x)[SPT]) {
    float dt, du;
#if PK >= 2
    h2x2(sm.f[t][cl], dt, du);
    du *= dt;
#else
    const float2 f = sm.f[t][cl];
    dt = f.x;
    du = f.y;
#endif
    float bv[SPT];
#pragma unroll
    for (int r = 0; r < NI; r++) {
#if VQ == 2
#if PK >= 1
        h2x2(*(const unsigned*)&sm.bh[t][bo + 8 * r], bv[2 * r], bv[2 * r + 1]);
#else
        const float2 w = *(const float2*)&sm.bf[t][bo + 8 * r];
        bv[2 * r] = w.x;
        bv[2 * r + 1] = w.y;
#endif
#else
#if PK >= 1
        bv[r] = h2f(sm.bh[t][bo]);
#else
        bv[r] = sm.bf[t][bo];
#endif
#endif
    }
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        e[j] = ex2(dt * a2[j]);
        x[j] = du * bv[j];
    }
}

// The B operand of the pair of steps from t: Cm of the lane's column (`cp`: its slot in row 0).
__device__ __forceinline__ void prepc(const float* cp, int t, float (&cb)[SPT]) {
#pragma unroll
    for (int r = 0; r < NI; r++) {
#if VQ == 2
        const float2 w = *(const float2*)(cp + t * NS + 8 * r);
        cb[2 * r] = w.x;
        cb[2 * r + 1] = w.y;
#else
        cb[r] = cp[t * NS];
#endif
    }
}

// The recurrence of the pair of steps from t, then the product that gives each quad its share of
// y at both steps; the lane that receives a share (element `sel` of its accumulator) stores the
// previous pair's (`v`: carried, so the store never waits on the product just issued; yp: the
// lane's slot in row 0 of sm.yp).
__device__ __forceinline__ void run2(float* __restrict__ yp, int t, int sel, bool yok, float& v, float (&h)[SPT],
                                     const float (&e0)[SPT], const float (&x0)[SPT], const float (&e1)[SPT],
                                     const float (&x1)[SPT], const float (&cb)[SPT]) {
    float h0[SPT], h1[SPT];
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        h[j] = fmaf(e0[j], h[j], x0[j]);
        h0[j] = h[j];
    }
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        h[j] = fmaf(e1[j], h[j], x1[j]);
        h1[j] = h[j];
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < NI; r++) {
#if VQ == 2
        mma_tf32(d, h0[2 * r], h1[2 * r], h0[2 * r + 1], h1[2 * r + 1], cb[2 * r], cb[2 * r + 1]);
#else
        mma_tf32_k4(d, h0[r], h1[r], cb[r]);
#endif
    }
    if (yok) yp[(t - 2) * YS] = v;
    const float lo = (sel & 1) ? d[1] : d[0], hi = (sel & 1) ? d[3] : d[2];
    v = (sel & 2) ? hi : lo;
}

// What a group of U steps from t needs that does not depend on the state, into one register set.
__device__ __forceinline__ void prepg(const Smem& sm, int t, int cl, int bo, const float* cp, const float (&a2)[SPT],
                                      float (&e)[U][SPT], float (&x)[U][SPT], float (&cb)[U / 2][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i += 2) {
        prep1(sm, t + i, cl, bo, a2, e[i], x[i]);
        prep1(sm, t + i + 1, cl, bo, a2, e[i + 1], x[i + 1]);
        prepc(cp, t + i, cb[i / 2]);
    }
}

// The recurrence and the products of a group of U steps from t, from one register set.
__device__ __forceinline__ void rung(float* __restrict__ yp, int t, int sel, bool yok, float& v, float (&h)[SPT],
                                     const float (&e)[U][SPT], const float (&x)[U][SPT], const float (&cb)[U / 2][SPT]) {
#pragma unroll
    for (int i = 0; i < U; i += 2) run2(yp, t + i, sel, yok, v, h, e[i], x[i], e[i + 1], x[i + 1], cb[i / 2]);
}

extern "C" __global__ void __launch_bounds__(NTH, NTH <= 128 ? 2 : 1) mamba_scan(
    const unsigned short* __restrict__ u, const unsigned short* __restrict__ delta, const float* __restrict__ A,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, const float* __restrict__ Dv,
    unsigned short* __restrict__ y, float* __restrict__ state, KS_AXIS batch_, KS_AXIS L_, KS_AXIS D_, KS_AXIS N_) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const long long L = L_, D = D_;
    const int tid = threadIdx.x;
    const int cl = tid / GL;           // channel within the block
    const int tq = tid & 3;            // lane within its quad
    const int hf = (tid % GL) / 4;     // quad within the channel
    const int g = (tid & 31) >> 2;     // quad within the warp: the B-operand column this lane loads
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

    // The lane's states: KQ (hf + j / VQ) + tq + 4 (j % VQ), from slot bo on in a row of Bm.
    const int bo = KQ * hf + VQ * tq;
    float a2[SPT], h[SPT];
#pragma unroll
    for (int j = 0; j < SPT; j++) {
        const int n = KQ * (hf + j / VQ) + tq + 4 * (j % VQ);
        a2[j] = dok ? A[d * NS + n] * LOG2E : 0.f;
        h[j] = 0.f;
    }
    // B-operand column g = CS (QPC p + h') carries Cm of step p of the pair over the states of the
    // channel's quad h'; other columns go unused (their loads are any in-bounds slot).
    const int gq = g / CS;
    const float* cp = &sm.cf[min(gq / QPC, 1)][KQ * (gq % QPC) + VQ * tq];
    // The lane that receives its quad's share of y at step p of a pair: the one holding column
    // CS (QPC p + hf), element (column % 2) of row half p.
    bool yok = false;
    int sel = 0;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int n = CS * (QPC * p + hf);
        if (n / 2 == tq) {
            yok = true;
            sel = 2 * p + (n & 1);
        }
    }
    float* yp = &sm.yp[2 + (sel >> 1)][cl * QPC + hf];
    // The channel pair this thread finishes in the output pass (NTH is a multiple of CB / 2).
    const int c2 = 2 * (tid % (CB / 2));
    const float dv0 = c2 < nc ? Dv[d0 + c2] : 0.f, dv1 = c2 + 1 < nc ? Dv[d0 + c2 + 1] : 0.f;
    const bool pair32 = D % 2 == 0 && c2 + 1 < nc;  // both channels stored as one 32-bit word

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
        // Groups holding the chunk's steps, rounded up to a pair (the sets alternate).
        const int ng = max(2, 2 * ((nt + 2 * U - 1) / (2 * U)));
        {
            // Two register sets: the group after the one running is prepared into the other set.
            float eA[U][SPT], xA[U][SPT], cA[U / 2][SPT], eB[U][SPT], xB[U][SPT], cB[U / 2][SPT], v = 0.f;
            prepg(sm, 0, cl, bo, cp, a2, eA, xA, cA);
#pragma unroll 1
            for (int gi = 0; gi < ng - 2; gi += 2) {
                prepg(sm, (gi + 1) * U, cl, bo, cp, a2, eB, xB, cB);
                rung(yp, gi * U, sel, yok, v, h, eA, xA, cA);
                prepg(sm, (gi + 2) * U, cl, bo, cp, a2, eA, xA, cA);
                rung(yp, (gi + 1) * U, sel, yok, v, h, eB, xB, cB);
            }
            prepg(sm, (ng - 1) * U, cl, bo, cp, a2, eB, xB, cB);
            rung(yp, (ng - 2) * U, sel, yok, v, h, eA, xA, cA);
            rung(yp, (ng - 1) * U, sel, yok, v, h, eB, xB, cB);
            if (yok) yp[(ng * U - 2) * YS] = v;
        }
        cp_wait0();       // chunk k + 1 landed (this thread's copies)
        __syncthreads();  // ... everyone's; every y half of chunk k stored; f, cf, bh free
        {
            // y of chunk k: the QPC halves of each (step, channel pair), plus Dv * u.
            const Raw& r = sm.raw[k & 1];
            const long long yt = (long long)k * CHUNK;
#pragma unroll 2
            for (int i = tid; i < CHUNK * CB / 2; i += NTH) {
                const int t = i / (CB / 2);
                if (t < nt) {
                    float s0, s1;
#if QPC == 4
                    const float4 w0 = *(const float4*)&sm.yp[2 + t][c2 * 4], w1 = *(const float4*)&sm.yp[2 + t][c2 * 4 + 4];
                    s0 = (w0.x + w0.y) + (w0.z + w0.w);
                    s1 = (w1.x + w1.y) + (w1.z + w1.w);
#elif QPC == 2
                    const float4 w = *(const float4*)&sm.yp[2 + t][c2 * 2];
                    s0 = w.x + w.y;
                    s1 = w.z + w.w;
#else
                    const float2 w = *(const float2*)&sm.yp[2 + t][c2];
                    s0 = w.x;
                    s1 = w.y;
#endif
                    const unsigned wu = *(const unsigned*)&r.uu[t][c2];
                    const unsigned short y0 = f2h(fmaf(dv0, h2f((unsigned short)(wu & 0xffff)), s0));
                    const unsigned short y1 = f2h(fmaf(dv1, h2f((unsigned short)(wu >> 16)), s1));
                    unsigned short* yq = yg + (yt + t) * D + c2;
                    if (pair32)
                        *(unsigned*)yq = (unsigned)y0 | ((unsigned)y1 << 16);
                    else {
                        if (c2 < nc) yq[0] = y0;
                        if (c2 + 1 < nc) yq[1] = y1;
                    }
                }
            }
        }
        if (k + 1 < nch) convert(sm, sm.raw[(k + 1) & 1], tid);
        __syncthreads();  // chunk k + 1 converted; raw[k & 1] and the y halves free
        if (k + 2 < nch) {
            const long long t2 = (long long)(k + 2) * CHUNK;
            load_chunk(sm.raw[k & 1], dlg + t2 * D, ug + t2 * D, bg + t2 * NS, cg + t2 * NS, D, STEPS(k + 2), nc, al, tid);
        }
        cp_commit();
    }
    if (dok) {
#pragma unroll
        for (int j = 0; j < SPT; j++) state[(b * D + d) * NS + KQ * (hf + j / VQ) + tq + 4 * (j % VQ)] = h[j];
    }
}
