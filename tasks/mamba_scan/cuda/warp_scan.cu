// Selective scan parallel over time inside a warp: one warp per channel, its 32 lanes holding K
// consecutive steps each of a chunk of T = 32 K steps, every state's recurrence solved by a warp
// scan of the lanes' affine maps. One launch, every exp(delta * A) computed once, no scratch.
//
// The recurrence h_t = e_t h_{t-1} + x_t (e = exp2(delta * A * log2 e), x = delta * u * Bm) is
// an affine map per step; composed over a lane's K steps it is h -> P h + hl (P the product of
// the e's, hl the state from zero). Per state, each lane first runs its K steps from zero, keeping
// each step's (P_k, hl_k); the warp then composes the lanes' maps in order (an inclusive scan of
// five shuffle rounds, shifted by one lane), so each lane learns the state entering its steps,
// h_in = P_before * h_chunk + hl_before, where h_chunk is the state entering the chunk (the last
// lane's state at the end of the previous chunk, broadcast); a second pass forms each step's
// state h_k = P_k h_in + hl_k and adds Cm_k h_k to the step's y, which the lane keeps in registers
// for all NS states, so no partial sums cross lanes or shared memory. The only sequential chain
// from chunk to chunk is two FMAs and a shuffle per state.
//
// pipe_scan, the single pass with NS / SPT lanes per channel, gets at most 8 warps per SM at
// batch 1 (D = 2048: 2 channels per warp) and is bound by the latency of their dependent
// instructions (Nsight Compute, H200, 2026-12-04: 2 warps per scheduler, one instruction every 3.3
// cycles, stalls mostly on fixed-latency dependencies and shared-memory results) and by shared
// memory (per lane and step: (delta, delta u), (Bm, Cm), the partial sum stored and read back).
// Here a channel is one warp (16 per SM at D = 2048), a lane reads its steps' (Bm, Cm) as 16-byte
// vectors (one 32-bit word per step and state) and its delta and u once per chunk for all states,
// and SP states go side by side so that their chains (pass 1, the shuffle rounds, pass 2)
// interleave: with one state at a time the kernel stalled on shuffle, shared-memory and MUFU
// results and took 117 us at 1,4096,2048; with SP 4, 102 us (H200, 2026-12-04: 1.49x mamba_ssm's
// selective-scan forward, 1.11-1.31x on the other anchor shapes; bench/h200-2026-12-04-scan-warp.txt).
//
// Shared memory per block (CB warps = CB channels of one batch): the raw rows of the next chunk
// (16-, 8- or 4-byte cp.async: delta and u of the CB channels, Bm and Cm; issued before a chunk's
// compute, so they land meanwhile),
// converted once per chunk to what the lanes read: delta and u per channel with a lane's K steps
// contiguous, (Bm, Cm) as f16 pairs per state with a lane's K steps contiguous (rows padded so that
// 8 lanes' 16-byte reads fall in 8 distinct bank quads); y staged per chunk in the lanes' layout
// and stored row by row.
//
// Any L (steps past L are zeros: a zero step leaves the state unchanged, exp2(0) = 1 and
// delta u Bm = 0; y stored only below L), any D (warps past D compute zeros and store nothing;
// element loads where D % (row piece) != 0). Tunables: NS (== N), K (steps per lane: 4, 8, 16),
// CB (channels, i.e. warps, per block: 4, 6, 8, 12, 16; 6 and 12 spread d_inner 1536 evenly; K 16 with
// CB 6, two blocks of 6 warps per SM at 168 registers, converts (Bm, Cm) rounds of 24 steps, each
// step placing itself in its lane row),
// BF ((Bm, Cm) in shared memory as f16 pairs, one word per step and state widened in the loop, or as
// f32 pairs: twice the words, no conversions), SP (states processed side by side, their dependent
// chains interleaved: 1, 2, 4, 8), P2 (0: the second pass forms each step's state from the kept
// decay products, K independent FMAs; 1: it runs the recurrence again from the entering state, one
// dependent FMA per step, the lane's decay product from its summed delta: fewer instructions and
// registers, a longer chain), MW (warps per SM the register allocation must allow: 16 gives 128
// registers, 24 gives 80), RT (rotated instead of padded (Bm, Cm) rows), CQ (Cm folded into the first
// pass: y takes Cm . hl there and keeps q_k = Cm_k P_k for the second, y_k += q_k h_in, so a state in
// flight holds K registers instead of 2 K; the state entering a lane is the lane before's end state,
// one shuffle instead of two. One multiply more per step and state. In the machine code (NVRTC 13,
// bench/sass_census.py) K 16 / RT 1 fits 128 registers with SP 4 without spilling either way, but
// without CQ ptxas serialises it to get there: its one-warp schedule of a chunk's unrolled body is 7785
// cycles against 5883 with CQ (K 8 at the defaults: 3044 for half the steps); at 168 registers (CB 12),
// 5765 against 4429. Timed on an H100 (2026-12-05, bench/h100-2026-12-05-scan-cq-attention.txt), the
// shorter schedules bought almost nothing: 1-2% slower at the defaults on every anchor shape, K 16 / RT 1
// at 128 registers 1% faster with CQ and still slower than the defaults, d_inner 1536's K 16 / CB 12 /
// RT 1 50.9 against 51.4 us. So the one-warp schedule ranks poorly here too: the default stays 0).
// Measured on the H200 (2026-12-04, bench/h200-2026-12-04-scan-warp-2.txt): the defaults stay the
// best single configuration; MW 24 with P2 1 takes d_inner 3072 (1,024 x 3,072 channels, 1.45 waves
// at 16 warps per SM) into one wave, 42.0 us against 44.0; K 16, CB 12, RT 1 takes d_inner 1536 to
// 50.4 us against 53.1. The kernel is bound by each warp's dependent chains, not by its instruction
// count: P2 1 cuts 7% of the loop's instructions and runs 3% slower at MW 16, and splitting a
// channel's chunk over two warps (a named-barrier handoff of the first warp's map) ran 68.5 us at
// d_inner 1536 and was withdrawn. So was splitting a channel's states over 2 or 4 warps (each warp's
// partial y summed in shared memory; H200, 2026-12-05, bench/h200-2026-12-05-scan-ss.txt): twice the
// warps per SM (28.5 against 14.7) issued less (55% of issue slots against 61%), their waits on
// shuffle, shared-memory and MUFU results growing, and every configuration was at least 6% slower
// than the defaults on every anchor shape. Shuffles alone do not bind it either: scanning the lanes'
// maps through shared memory instead (each lane composing a segment of SP lanes' maps, a few shuffle
// rounds over the segments: 32 shuffles per chunk and warp instead of 192, a few more shared loads and
// stores, Cm read again for the second pass) was correct and 8-18% slower than the best configuration
// without it on every anchor shape (H200, 2026-12-05, bench/h200-2026-12-05-scan-xs.txt); withdrawn too.
// The same file is the MLX twin (form = "cuda", -DKS_AXIS=int).
#ifndef KS_AXIS
#define KS_AXIS long long
#endif
#ifndef NS
#define NS 16
#endif
#ifndef K
#define K 8
#endif
#ifndef CB
#define CB 8
#endif
#ifndef BF
#define BF 0
#endif
#ifndef SP
#define SP 4
#endif
#ifndef P2
#define P2 0
#endif
#ifndef MW
#define MW 16
#endif
#ifndef RT
#define RT 0
#endif
#ifndef CQ
#define CQ 0
#endif
#define T (32 * K)                     // steps per chunk
#define NTH (32 * CB)                  // threads per block
#define BW (BF ? 2 * K : K)            // 32-bit words of a lane's (Bm, Cm): f16 pairs, or f32 pairs (BF=1)
#define NQ (BW / 4)                    // 16-byte quads per lane row of (Bm, Cm)
// Words per lane row of (Bm, Cm). 8 lanes' 16-byte reads of quad q must fall in 8 distinct bank quads: rows
// padded by one quad where NQ is even (RT 0), or unpadded with lane l's quads rotated by
// (l / (8 / NQ)) % NQ (RT 1: 8 / NQ lanes per 8 bank quads, each group its own rotation; saves
// NS * 32 quads of shared memory, what lets K 16 run two blocks per SM).
#define KP (RT || NQ % 2 ? BW : BW + 4)
#define YA (K >= 16)                   // y staged in delta's rows (free once the lanes hold their delta): one barrier more per chunk
#if YA
#define YT dlt
#else
#define YT yt
#endif
#define KH (K > 8 ? K + 8 : K)         // halves per lane row of delta, u and y
#define CR (32 * KH + 8)               // halves per channel of delta, u and y (padded: a convert pass's stores spread)
#define SR (32 * KP + 4)               // words per state of (Bm, Cm) (padded likewise)
#define RB (2 * CB)                    // bytes per row of the CB channels' delta (or u)
#define PB (RB % 16 == 0 ? 16 : RB % 8 == 0 ? 8 : 4)  // bytes per cp.async piece of those rows
#define LOG2E 1.4426950408889634f
#if K != 4 && K != 8 && K != 16
#error "K must be 4, 8 or 16"
#endif
#if CB != 4 && CB != 6 && CB != 8 && CB != 12 && CB != 16
#error "CB must be 4, 6, 8, 12 or 16"
#endif
#if P2 != 0 && P2 != 1
#error "P2 must be 0 or 1"
#endif
#if MW != 16 && MW != 24 && MW != 32
#error "MW must be 16, 24 or 32"
#endif
#if RT != 0 && RT != 1
#error "RT must be 0 or 1"
#endif
#if CQ != 0 && CQ != 1
#error "CQ must be 0 or 1"
#endif
#if CQ && P2
#error "CQ folds Cm into the first pass of P2 0: not with P2 1"
#endif
#define MINB (MW / CB > 0 ? MW / CB : 1)  // blocks per SM the register allocation must allow
#if NS != 8 && NS != 16
#error "NS must be 8 or 16"
#endif
#if SP != 1 && SP != 2 && SP != 4 && SP != 8
#error "SP must be 1, 2, 4 or 8"
#endif
#if NS % SP != 0
#error "SP must divide NS"
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// PB bytes, or zeros when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp_piece(void* s, const void* g, int n) {
#if PB == 16
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#elif PB == 8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#endif
}
__device__ __forceinline__ void cp16(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float lo2f(unsigned w) { float f; asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w)); return f; }
__device__ __forceinline__ float hi2f(unsigned w) { float f; asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

struct __align__(16) Raw {
    unsigned short dl[T][CB];
    unsigned short uu[T][CB];
    unsigned short bm[T][NS];
    unsigned short cm[T][NS];
};
// The quad of lane l's row where its quad q lives (RT 1; 0 where rows are padded or one quad long).
__device__ __forceinline__ int rot(int l) { return (RT && NQ > 1) ? (l / (8 / NQ)) % NQ : 0; }

struct __align__(16) Smem {
    Raw raw;                   // the next chunk's rows, landing while this one is computed
    unsigned short dlt[CB][CR];  // delta: channel, then lane rows of the lane's K steps
    unsigned short ut[CB][CR];   // u
#if !YA
    unsigned short yt[CB][CR];   // y of the chunk, f16
#endif
    unsigned bc[NS][SR];         // (Bm, Cm) pairs: state, then lane rows of the lane's K steps
    float a2[CB][NS];            // A * log2(e) of the block's channels
    float hc[CB][NS];            // the state entering the chunk
};

// One chunk's raw rows (steps from nt on and channels from nc on are zeros).
__device__ __forceinline__ void load_chunk(Raw& r, const unsigned short* dl, const unsigned short* uu,
                                           const unsigned short* bm, const unsigned short* cm, long long D, int nt,
                                           int nc, bool al, int tid) {
    if (al) {
        constexpr int RP = RB / PB;  // pieces per row
        constexpr int HP = PB / 2;   // halves per piece
        for (int i = tid; i < T * RP; i += NTH) {
            const int t = i / RP, p = i % RP;
            const bool ok = t < nt && HP * p < nc;
            const long long x = ok ? (long long)t * D + HP * p : 0;
            cp_piece(&r.dl[t][HP * p], dl + x, ok ? PB : 0);
            cp_piece(&r.uu[t][HP * p], uu + x, ok ? PB : 0);
        }
    } else {
        for (int i = tid; i < T * CB; i += NTH) {
            const int t = i / CB, c = i % CB;
            const bool ok = t < nt && c < nc;
            const long long x = (long long)t * D + c;
            r.dl[t][c] = ok ? dl[x] : (unsigned short)0;
            r.uu[t][c] = ok ? uu[x] : (unsigned short)0;
        }
    }
    for (int i = tid; i < T * NS / 8; i += NTH) {
        const bool ok = 8 * i < nt * NS;
        cp16(&r.bm[0][0] + 8 * i, bm + (ok ? 8 * i : 0), ok ? 16 : 0);
        cp16(&r.cm[0][0] + 8 * i, cm + (ok ? 8 * i : 0), ok ? 16 : 0);
    }
}

// Raw rows to the lanes' layouts. Thread tid moves channel tid % CB of steps tid / CB + j NTH / CB
// (and the state pair 2 (tid % (NS / 2)) of steps tid / (NS / 2) + j 2 NTH / NS): fixed strides in
// both layouts, no index arithmetic per element (NTH / CB = 32 and 2 NTH / NS are multiples of K).
__device__ __forceinline__ void convert(Smem& sm, const Raw& r, int tid) {
    {
        constexpr int ST = NTH / CB;  // = 32 steps
        const int c = tid % CB, t0 = tid / CB;
        const unsigned short* sd = &r.dl[t0][c];
        const unsigned short* su = &r.uu[t0][c];
        unsigned short* dd = &sm.dlt[c][(t0 / K) * KH + t0 % K];
        unsigned short* du = &sm.ut[c][(t0 / K) * KH + t0 % K];
#pragma unroll
        for (int j = 0; j < T / ST; j++) {
            dd[j * (ST / K) * KH] = sd[j * ST * CB];
            du[j * (ST / K) * KH] = su[j * ST * CB];
        }
    }
    {
        constexpr int ST = 2 * NTH / NS;  // steps per round
        // Where a round is not a whole number of lane rows (K 16 with CB 6: 24 steps), each round's
        // step finds its lane row and place on its own (GW); else they move by a fixed stride.
        constexpr bool GW = ST % K != 0;
        constexpr int RD = (T + ST - 1) / ST;  // rounds; the last one partial where ST does not divide T (CB 6, 12)
        const int n = 2 * (tid % (NS / 2)), t0 = tid / (NS / 2);
        const unsigned* sb = (const unsigned*)&r.bm[t0][n];
        const unsigned* sc = (const unsigned*)&r.cm[t0][n];
        [[maybe_unused]] const int o = (t0 / K) * KP + (BF ? 2 : 1) * (t0 % K);
#pragma unroll
        for (int j = 0; j < RD; j++) {
            if (T % ST != 0 && j == RD - 1 && t0 + j * ST >= T) break;
            const unsigned wb = sb[j * ST * NS / 2], wc = sc[j * ST * NS / 2];
#if RT && NQ > 1
            const int lj = GW ? (t0 + j * ST) / K : t0 / K + j * (ST / K);  // the lane whose row takes this round's step
            const int w = (BF ? 2 : 1) * (GW ? (t0 + j * ST) % K : t0 % K);
            const int oj = lj * KP + 4 * ((w / 4 + rot(lj)) % NQ) + w % 4;
#else
            const int oj = GW ? ((t0 + j * ST) / K) * KP + (BF ? 2 : 1) * ((t0 + j * ST) % K) : o + j * (ST / K) * KP;
#endif
#if BF
            float b0, b1, c0, c1;
            asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %4;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n"
                " mov.b32 {l, h}, %5;\n cvt.f32.f16 %2, l;\n cvt.f32.f16 %3, h;}"
                : "=f"(b0), "=f"(b1), "=f"(c0), "=f"(c1) : "r"(wb), "r"(wc));
            *(float2*)&sm.bc[n][oj] = make_float2(b0, c0);
            *(float2*)&sm.bc[n + 1][oj] = make_float2(b1, c1);
#else
            sm.bc[n][oj] = __byte_perm(wb, wc, 0x5410);
            sm.bc[n + 1][oj] = __byte_perm(wb, wc, 0x7632);
#endif
        }
    }
}

// K halves of a lane row to f32.
__device__ __forceinline__ void row_f32(const unsigned short* s, float (&v)[K]) {
#pragma unroll
    for (int q = 0; q < K / 8 + (K < 8); q++) {
#if K >= 8
        const uint4 w = *(const uint4*)(s + 8 * q);
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            v[8 * q + 2 * j] = lo2f(ws[j]);
            v[8 * q + 2 * j + 1] = hi2f(ws[j]);
        }
#else
        const uint2 w = *(const uint2*)s;
        v[0] = lo2f(w.x);
        v[1] = hi2f(w.x);
        v[2] = lo2f(w.y);
        v[3] = hi2f(w.y);
#endif
    }
}

// y of a chunk from yt to global (rows below nt, channels below nc): a row's CB halves gathered from
// the channels' lane rows, stored as one piece where rows are aligned.
__device__ __forceinline__ void store_y(const Smem& sm, unsigned short* yg, long long D, int nt, int nc, bool al,
                                        int tid) {
    if (al && nc == CB) {
        constexpr int RP = RB / PB;
        constexpr int HP = PB / 2;
        for (int i = tid; i < nt * RP; i += NTH) {
            const int t = i / RP, p = i % RP;
            const int o = (t / K) * KH + t % K;
            unsigned w[HP / 2];
#pragma unroll
            for (int j = 0; j < HP / 2; j++)
                w[j] = (unsigned)sm.YT[HP * p + 2 * j][o] | ((unsigned)sm.YT[HP * p + 2 * j + 1][o] << 16);
            unsigned short* g = yg + (long long)t * D + HP * p;
#if PB == 16
            *(uint4*)g = make_uint4(w[0], w[1], w[2], w[3]);
#elif PB == 8
            *(uint2*)g = make_uint2(w[0], w[1]);
#else
            *(unsigned*)g = w[0];
#endif
        }
    } else {
        for (int i = tid; i < nt * CB; i += NTH) {
            const int t = i / CB, c = i % CB;
            if (c < nc) yg[(long long)t * D + c] = sm.YT[c][(t / K) * KH + t % K];
        }
    }
}

extern "C" __global__ void __launch_bounds__(NTH, MINB) mamba_scan(
    const unsigned short* __restrict__ u, const unsigned short* __restrict__ delta, const float* __restrict__ A,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, const float* __restrict__ Dv,
    unsigned short* __restrict__ y, float* __restrict__ state, KS_AXIS batch_, KS_AXIS L_, KS_AXIS D_, KS_AXIS N_) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const long long L = L_, D = D_;
    const int tid = threadIdx.x, lane = tid & 31, c = tid >> 5;
    const long long b = blockIdx.y;
    const long long d0 = (long long)blockIdx.x * CB;
    const long long d = d0 + c;
    const bool dok = d < D;
    const int nc = (int)min((long long)CB, D - d0);
    const bool al = (D * 2) % PB == 0;  // every block's rows start on a piece boundary
    const unsigned short* dlg = delta + b * L * D + d0;
    const unsigned short* ug = u + b * L * D + d0;
    const unsigned short* bg = Bm + b * L * NS;
    const unsigned short* cg = Cm + b * L * NS;
    unsigned short* yg = y + b * L * D + d0;

    if (lane < NS) {
        sm.a2[c][lane] = dok ? A[d * NS + lane] * LOG2E : 0.f;
        sm.hc[c][lane] = 0.f;
    }
    const float dv = dok ? Dv[d] : 0.f;

    const int Ln = (int)L;
    const int nch = (Ln + T - 1) / T;
#define STEPS(k) min(T, Ln - (k) * T)
    load_chunk(sm.raw, dlg, ug, bg, cg, D, STEPS(0), nc, al, tid);
    cp_commit();
    for (int k = 0; k < nch; k++) {
        cp_wait0();
        __syncthreads();  // chunk k landed; the compute of chunk k - 1 is done (yt, the lane layouts free)
        if (k > 0) store_y(sm, yg + (long long)(k - 1) * T * D, D, T, nc, al, tid);
#if YA
        __syncthreads();  // y read out of delta's rows
#endif
        convert(sm, sm.raw, tid);
        __syncthreads();  // converted; raw and yt free
        if (k + 1 < nch) {
            const long long t1 = (long long)(k + 1) * T;
            load_chunk(sm.raw, dlg + t1 * D, ug + t1 * D, bg + t1 * NS, cg + t1 * NS, D, STEPS(k + 1), nc, al, tid);
        }
        cp_commit();

        float dl[K], du[K], yk[K];
        row_f32(&sm.dlt[c][lane * KH], dl);
        row_f32(&sm.ut[c][lane * KH], du);
#pragma unroll
        for (int i = 0; i < K; i++) {
            yk[i] = dv * du[i];  // the skip term Dv * u
            du[i] *= dl[i];      // delta * u
        }
#if P2
        float sdl = 0.f;  // the lane's summed delta: its decay product is exp2(sdl A log2 e), one MUFU per state
#pragma unroll
        for (int i = 0; i < K; i++) sdl += dl[i];
#endif
#pragma unroll
        for (int n0 = 0; n0 < NS; n0 += SP) {
            // SP states side by side: their pass-1 chains, shuffle rounds and pass-2 chains
            // interleave in the instruction stream
#if P2
            float ev[SP][K], xv[SP][K];  // each step's decay and input, for the second pass's recurrence
#elif CQ
            float qv[SP][K];  // Cm times each step's decay product: y's share of the entering state
#else
            float hl[SP][K], pp[SP][K];  // each step's state from zero and decay product
#endif
            float bv[SP][K], cv[SP][K], P[SP], H[SP];
#pragma unroll
            for (int s = 0; s < SP; s++) {
                const int n = n0 + s;
                const float a2n = sm.a2[c][n];
#pragma unroll
                for (int q = 0; q < BW / 4; q++) {
                    const uint4 v = *(const uint4*)&sm.bc[n][lane * KP + 4 * ((q + rot(lane)) % NQ)];
#if BF
                    bv[s][2 * q] = __uint_as_float(v.x);
                    cv[s][2 * q] = __uint_as_float(v.y);
                    bv[s][2 * q + 1] = __uint_as_float(v.z);
                    cv[s][2 * q + 1] = __uint_as_float(v.w);
#else
                    const unsigned w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        bv[s][4 * q + j] = lo2f(w4[j]);
                        cv[s][4 * q + j] = hi2f(w4[j]);
                    }
#endif
                }
#if P2
                // the lane's K steps from zero, keeping each step's (e, x); the decay product from the
                // summed delta
#pragma unroll
                for (int i = 0; i < K; i++) {
                    ev[s][i] = ex2(dl[i] * a2n);
                    xv[s][i] = du[i] * bv[s][i];
                    H[s] = i == 0 ? xv[s][0] : fmaf(ev[s][i], H[s], xv[s][i]);
                }
                P[s] = ex2(sdl * a2n);
#elif CQ
                // the lane's K steps from zero; y takes Cm . hl now, and keeps Cm . P_i for the entering state:
                // h_i = P_i h_in + hl_i, so Cm_i h_i = Cm_i hl_i + (Cm_i P_i) h_in
                float hs = 0.f, ps = 1.f;
#pragma unroll
                for (int i = 0; i < K; i++) {
                    const float e = ex2(dl[i] * a2n);
                    const float x = du[i] * bv[s][i];
                    hs = i == 0 ? x : fmaf(e, hs, x);
                    ps = i == 0 ? e : ps * e;
                    yk[i] = fmaf(cv[s][i], hs, yk[i]);
                    qv[s][i] = cv[s][i] * ps;
                }
                P[s] = ps;
                H[s] = hs;
#else
                // the lane's K steps from zero: hl_i and the decay product P_i
#pragma unroll
                for (int i = 0; i < K; i++) {
                    const float e = ex2(dl[i] * a2n);
                    const float x = du[i] * bv[s][i];
                    hl[s][i] = i == 0 ? x : fmaf(e, hl[s][i - 1], x);
                    pp[s][i] = i == 0 ? e : pp[s][i - 1] * e;
                }
                P[s] = pp[s][K - 1];
                H[s] = hl[s][K - 1];
#endif
            }
            // compose the lanes' maps in lane order: (P, h) of lanes 0..lane
#pragma unroll
            for (int o = 1; o < 32; o *= 2) {
#pragma unroll
                for (int s = 0; s < SP; s++) {
                    // lanes below o keep theirs (predicated in place: no selects, no branches)
                    const float Ps = __shfl_up_sync(0xffffffffu, P[s], o);
                    const float Hs = __shfl_up_sync(0xffffffffu, H[s], o);
                    asm("{.reg .pred q;\n setp.ge.s32 q, %2, %3;\n @q fma.rn.f32 %0, %1, %4, %0;\n @q mul.f32 %1, %1, %5;}"
                        : "+f"(H[s]), "+f"(P[s]) : "r"(lane), "r"(o), "f"(Hs), "f"(Ps));
                }
            }
            float hout[SP];
#if CQ
#pragma unroll
            for (int s = 0; s < SP; s++) {
                // each lane's state at the end of its steps (lanes 0..lane's map applied to the state entering
                // the chunk), handed one lane up: the state entering the next lane's steps (one shuffle)
                const float hc = sm.hc[c][n0 + s];
                hout[s] = fmaf(P[s], hc, H[s]);
                float hin = __shfl_up_sync(0xffffffffu, hout[s], 1);
                if (lane == 0) hin = hc;
#pragma unroll
                for (int i = 0; i < K; i++) yk[i] = fmaf(qv[s][i], hin, yk[i]);
            }
#else
#pragma unroll
            for (int s = 0; s < SP; s++) {
                // the map of the lanes before this one, applied to the state entering the chunk
                float Pb = __shfl_up_sync(0xffffffffu, P[s], 1);
                float Hb = __shfl_up_sync(0xffffffffu, H[s], 1);
                if (lane == 0) {
                    Pb = 1.f;
                    Hb = 0.f;
                }
                const float hin = fmaf(Pb, sm.hc[c][n0 + s], Hb);
#if P2
                float h = hin;  // the recurrence again from the entering state: one FMA per step, no products kept
#pragma unroll
                for (int i = 0; i < K; i++) {
                    h = fmaf(ev[s][i], h, xv[s][i]);
                    yk[i] = fmaf(cv[s][i], h, yk[i]);
                }
#else
                float h = 0.f;
#pragma unroll
                for (int i = 0; i < K; i++) {
                    h = fmaf(pp[s][i], hin, hl[s][i]);
                    yk[i] = fmaf(cv[s][i], h, yk[i]);
                }
#endif
                hout[s] = h;
            }
#endif
            __syncwarp();  // every lane has read the entering states
            if (lane == 31) {
#pragma unroll
                for (int s = 0; s < SP; s++) sm.hc[c][n0 + s] = hout[s];  // the states leaving the chunk
            }
        }
#pragma unroll
        for (int q = 0; q < K / 4; q++)
            *(uint2*)&sm.YT[c][lane * KH + 4 * q] =
                make_uint2((unsigned)f2h(yk[4 * q]) | ((unsigned)f2h(yk[4 * q + 1]) << 16),
                           (unsigned)f2h(yk[4 * q + 2]) | ((unsigned)f2h(yk[4 * q + 3]) << 16));
    }
    __syncthreads();
    store_y(sm, yg + (long long)(nch - 1) * T * D, D, STEPS(nch - 1), nc, al, tid);
    if (dok && lane < NS) state[(b * D + d) * NS + lane] = sm.hc[c][lane];
}
