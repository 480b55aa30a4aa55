// Single-pass selective scan, parallel over (channel, state), sequential over time: one launch,
// every exp(delta * A) computed exactly once, no scratch and no chunk aggregates.
//
// A block owns CB channels of one batch; each channel is served by GL = NS / SPT lanes of one
// warp, each lane holding SPT of the NS states in registers for the whole sequence. Time is
// walked in chunks of CHUNK steps: the chunk's rows of delta, u (CB channels) and Bm, Cm are
// copied with 16-byte cp.async into shared memory one chunk ahead (double-buffered), converted
// once per chunk to f32 (delta, delta * u, Dv * u per channel and step; Bm, Cm per state), then
// every lane runs its recurrence h = exp2(delta * A * log2 e) * h + delta * u * Bm and its share
// of Cm . h. The GL partial sums of GL consecutive steps are combined by a reduce-scatter over
// the GL lanes (lane j ends with the full sum of step j), y goes to a shared tile and leaves as
// 16-byte rows at the next chunk (RED=0); or (RED=1) every lane stores its partial sum of each
// step in shared memory and a pass after the chunk adds the GL partials of each (step, channel),
// which keeps shuffles and their latency out of the recurrence loop. The final states are
// written from the registers.
//
// Any L and any D that is a multiple of 8 (16-byte rows): the last chunk's steps past L and the
// last block's channels past D are zero-filled in shared memory (cp.async with src-size 0). A
// zero step leaves the state unchanged (exp2(0 * A) = 1, delta * u * Bm = 0), so the final state
// is exact; y and the state are not stored past L and D.
//
// Tunables: NS (== N), SPT (states per lane: 1, 2 or 4), CB (channels per block), CHUNK (steps
// staged per shared-memory tile), RED (0: shuffle reduce-scatter, 1: shared-memory partial sums).
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
#ifndef RED
#define RED 0
#endif
#define GL (NS / SPT)           // lanes per channel
#define NTH (CB * GL)           // threads per block
#define LOG2E 1.4426950408889634f
#if NS % SPT != 0 || (GL & (GL - 1)) != 0 || GL > 32 || GL < 2
#error "NS / SPT must be a power of two between 2 and 32"
#endif
#if CHUNK % GL != 0 || CB % 8 != 0
#error "CHUNK must be a multiple of NS / SPT and CB a multiple of 8"
#endif

__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(s)), "l"(g) : "memory");
}
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

struct __align__(16) Raw {
    unsigned short dl[CHUNK][CB];  // delta rows of the block's channels
    unsigned short uu[CHUNK][CB];  // u rows
    unsigned short bm[CHUNK][NS];
    unsigned short cm[CHUNK][NS];
};
struct __align__(16) Smem {
    Raw raw[2];
    float4 f[CHUNK][CB];        // (delta, delta * u, Dv * u, unused) per step and channel
    float2 bc[CHUNK][NS];       // (Bm, Cm) per step and state
    unsigned short y[CHUNK][CB];
#if RED
    float part[CHUNK][CB][GL];  // per-lane partial sums of Cm . h
#endif
};

// 16-byte copies of one chunk's rows: CHUNK * CB * 2 / 16 per tensor for delta and u, CHUNK * NS * 2 / 16
// for Bm and Cm (contiguous over steps). Steps from `nt` on and channels from `nc` on are zeros.
__device__ __forceinline__ void load_chunk(Raw& r, const unsigned short* dl, const unsigned short* uu,
                                           const unsigned short* bm, const unsigned short* cm, long long D, int nt,
                                           int nc, int tid) {
    constexpr int RC = CB / 8;  // 16-byte pieces per row of CB halves
    for (int i = tid; i < CHUNK * RC; i += NTH) {
        const int t = i / RC, p = i % RC;
        const bool ok = t < nt && 8 * p < nc;
        const long long x = ok ? (long long)t * D + 8 * p : 0;
        cp16z(&r.dl[t][8 * p], dl + x, ok ? 16 : 0);
        cp16z(&r.uu[t][8 * p], uu + x, ok ? 16 : 0);
    }
    for (int i = tid; i < CHUNK * NS / 8; i += NTH) {
        const bool ok = 8 * i < nt * NS;
        cp16z(&r.bm[0][0] + 8 * i, bm + (ok ? 8 * i : 0), ok ? 16 : 0);
        cp16z(&r.cm[0][0] + 8 * i, cm + (ok ? 8 * i : 0), ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(NTH) mamba_scan(
    const unsigned short* __restrict__ u, const unsigned short* __restrict__ delta, const float* __restrict__ A,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, const float* __restrict__ Dv,
    unsigned short* __restrict__ y, float* __restrict__ state, long long batch, long long L, long long D, long long N) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const int tid = threadIdx.x;
    const int cl = tid / GL, sg = tid % GL;  // channel within the block, state group within the channel
    const long long b = blockIdx.y;
    const long long d0 = (long long)blockIdx.x * CB;
    const long long d = d0 + cl;
    const bool dok = d < D;
    const int nc = (int)min((long long)CB, D - d0);  // channels of this block before D
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
    // Dv of the channel this thread converts in the staging pass (channel index tid % CB).
    const float dv_conv = tid % CB < nc ? Dv[d0 + tid % CB] : 0.f;

    const int Ln = (int)L;
    const int nch = (Ln + CHUNK - 1) / CHUNK;  // the last chunk may be partial
#define STEPS(k) min(CHUNK, Ln - (k) * CHUNK)
    load_chunk(sm.raw[0], dlg, ug, bg, cg, D, STEPS(0), nc, tid);
    cp_commit();
    for (int k = 0; k < nch; k++) {
        cp_wait0();
        __syncthreads();  // raw chunk k landed for all; everyone done with chunk k - 1's f, bc and y
        if (k > 0) {
            // y of chunk k - 1: 16-byte pieces of CB halves per row.
            constexpr int RC = CB / 8;
            for (int i = tid; i < CHUNK * RC; i += NTH) {
                const int t = i / RC, p = i % RC;
                if (8 * p < nc)  // chunk k - 1 is a full one
                    *(uint4*)(yg + (long long)((k - 1) * CHUNK + t) * D + 8 * p) = *(const uint4*)&sm.y[t][8 * p];
            }
        }
        if (k + 1 < nch) {
            const long long t1 = (long long)(k + 1) * CHUNK;
            load_chunk(sm.raw[(k + 1) & 1], dlg + t1 * D, ug + t1 * D, bg + t1 * NS, cg + t1 * NS, D, STEPS(k + 1), nc,
                       tid);
        }
        cp_commit();
        const Raw& r = sm.raw[k & 1];
        for (int i = tid; i < CHUNK * CB; i += NTH) {  // i % CB == tid % CB: NTH is a multiple of CB
            const int t = i / CB, c = i % CB;
            const float dt = h2f(r.dl[t][c]), ut = h2f(r.uu[t][c]);
            sm.f[t][c] = make_float4(dt, dt * ut, dv_conv * ut, 0.f);
        }
        for (int i = tid; i < CHUNK * NS; i += NTH) {
            const int t = i / NS, n = i % NS;
            sm.bc[t][n] = make_float2(h2f(r.bm[t][n]), h2f(r.cm[t][n]));
        }
        __syncthreads();
#if RED
#pragma unroll 8
        for (int t = 0; t < CHUNK; t++) {
            const float4 f = sm.f[t][cl];
            float bv[SPT], cv[SPT];
#if SPT == 1
            const float2 w = sm.bc[t][sg];
            bv[0] = w.x;
            cv[0] = w.y;
#else
#pragma unroll
            for (int j = 0; j < SPT; j += 2) {
                const float4 w = *(const float4*)&sm.bc[t][sg * SPT + j];
                bv[j] = w.x;
                cv[j] = w.y;
                bv[j + 1] = w.z;
                cv[j + 1] = w.w;
            }
#endif
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < SPT; j++) {
                h[j] = fmaf(ex2(f.x * a2[j]), h[j], f.y * bv[j]);
                acc = fmaf(cv[j], h[j], acc);
            }
            sm.part[t][cl][sg] = acc;
        }
        __syncthreads();
        for (int i = tid; i < CHUNK * CB; i += NTH) {
            const int t = i / CB, c = i % CB;
            float acc = sm.f[t][c].z;
#pragma unroll
            for (int g4 = 0; g4 < GL; g4 += 2) {
                const float2 w = *(const float2*)&sm.part[t][c][g4];
                acc += w.x + w.y;
            }
            sm.y[t][c] = f2h(acc);
        }
#else
#pragma unroll 2
        for (int t0 = 0; t0 < CHUNK; t0 += GL) {
            float v[GL];
#pragma unroll
            for (int i = 0; i < GL; i++) {
                const float4 f = sm.f[t0 + i][cl];
                float bv[SPT], cv[SPT];
#if SPT == 1
                const float2 w = sm.bc[t0 + i][sg];
                bv[0] = w.x;
                cv[0] = w.y;
#else
#pragma unroll
                for (int j = 0; j < SPT; j += 2) {
                    const float4 w = *(const float4*)&sm.bc[t0 + i][sg * SPT + j];
                    bv[j] = w.x;
                    cv[j] = w.y;
                    bv[j + 1] = w.z;
                    cv[j + 1] = w.w;
                }
#endif
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < SPT; j++) {
                    h[j] = fmaf(ex2(f.x * a2[j]), h[j], f.y * bv[j]);
                    acc = fmaf(cv[j], h[j], acc);
                }
                v[i] = acc;
            }
            // Reduce-scatter over the GL lanes of the channel: after the round of width s, v[0..s)
            // holds sums over 2 * (GL / (2 s)) lanes of steps i + (bits of sg above s); at the end
            // lane sg holds the full sum of step t0 + sg.
#pragma unroll
            for (int s = GL / 2; s >= 1; s >>= 1) {
                const bool up = (sg & s) != 0;
#pragma unroll
                for (int i = 0; i < s; i++) {
                    const float send = up ? v[i] : v[i + s];
                    const float keep = up ? v[i + s] : v[i];
                    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
                }
            }
            sm.y[t0 + sg][cl] = f2h(v[0] + sm.f[t0 + sg][cl].z);
        }
#endif
    }
    __syncthreads();
    {
        constexpr int RC = CB / 8;
        const int nt = STEPS(nch - 1);
        for (int i = tid; i < CHUNK * RC; i += NTH) {
            const int t = i / RC, p = i % RC;
            if (t < nt && 8 * p < nc)
                *(uint4*)(yg + (long long)((nch - 1) * CHUNK + t) * D + 8 * p) = *(const uint4*)&sm.y[t][8 * p];
        }
    }
    if (dok) {
#pragma unroll
        for (int j = 0; j < SPT; j++) state[(b * D + d) * NS + sg * SPT + j] = h[j];
    }
}
