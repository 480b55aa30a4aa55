// Single-launch selective scan, MLX CUDA dialect: G = N / SPT lanes per channel, each lane owning
// SPT states of one channel, walk the whole sequence once (one exp per (step, channel, state),
// half the exps of the chunked scan, no scratch, one launch).
//
// Per step a lane updates its SPT states and forms v = sum_s Cm[t][n_s] * h[n_s]. The G partial
// sums of one step live in G lanes; rather than reducing every step (log2(G) shuffles per step and
// lane), a sub-tile of G steps is reduced at once by a transposing butterfly: round w (w = G/2 .. 1)
// swaps half of the values still held with the lane at xor distance w and adds, so after G-1
// shuffles in total lane g holds the complete <Cm, h> of step g of the sub-tile.
//
// Time is staged in tiles of TT steps through shared memory as f32, double-buffered with the next
// tile's global loads issued before the current tile is computed (one barrier per tile):
// (delta, delta*u) pairs of the block's CPB channels (the product is formed once per element, not
// once per lane), u alone, and (Bm, Cm) pairs (shared by every channel of the block). y is staged
// the same way and written coalesced one tile later, when Dv*u is added.
// Tunables: SPT (states per lane), WARPS (warps per block). TT = 32 steps.
// Dynamic shared memory: 2 * TT * (CPB * 16 + N * 8) bytes, CPB = WARPS * 32 / (N / SPT).

#define KS_LOG2E 1.4426950408889634f

__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void ks_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float ks_ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Transposing butterfly over the G lanes of a group (g = lane % G): on entry v[j] is this lane's
// part of step j; on return the value is the sum over the group of step g. G - 1 shuffles.
// Round W keeps W values: the lane with bit W of g set keeps the upper half of the steps it still
// holds and sends the lower half to its partner at xor distance W, which does the opposite.
// Written as compile-time recursion so that every round's trip count is a constant: a runtime
// `w >>= 1` loop is not fully unrolled by NVVM, which then puts v[] in local memory.
template <int G, int W> struct ks_bfly {
    static __device__ __forceinline__ void run(float (&v)[G], int g) {
        const bool upper = (g & W) != 0;
#pragma unroll
        for (int k = 0; k < W; k++) {
            const float send = upper ? v[k] : v[k + W];
            const float keep = upper ? v[k + W] : v[k];
            v[k] = keep + __shfl_xor_sync(0xffffffffu, send, W);
        }
        ks_bfly<G, W / 2>::run(v, g);
    }
};
template <int G> struct ks_bfly<G, 0> {
    static __device__ __forceinline__ void run(float (&)[G], int) {}
};
template <int G> __device__ __forceinline__ float ks_transpose_sum(float (&v)[G], int g) {
    ks_bfly<G, G / 2>::run(v, g);
    return v[0];
}

template <int L, int D, int N, int SPT, int WARPS, int TT, typename TU, typename TB, typename TY>
__device__ __forceinline__ void ks_seq_scan(const TU* __restrict__ u, const TU* __restrict__ delta,
                                            const float* __restrict__ A, const TB* __restrict__ Bm,
                                            const TB* __restrict__ Cm, const float* __restrict__ Dv,
                                            TY* __restrict__ y, float* __restrict__ state) {
    constexpr int G = N / SPT;         // lanes per channel
    constexpr int CPW = 32 / G;        // channels per warp
    constexpr int CPB = WARPS * CPW;   // channels per block
    constexpr int NT = WARPS * 32;
    constexpr int NTILE = (L + TT - 1) / TT;
    constexpr int NDU = TT * CPB;      // delta (and u) elements of one tile
    constexpr int NBC = TT * N;        // Bm (and Cm) elements of one tile
    constexpr int PDU = (NDU + NT - 1) / NT;
    constexpr int PBC = (NBC + NT - 1) / NT;
    static_assert(N % SPT == 0 && 32 % G == 0 && TT % G == 0, "bad SPT for N");

    extern __shared__ float4 ks_smem4[];
    float2* sDU = reinterpret_cast<float2*>(ks_smem4);  // [2][TT][CPB] (delta, delta * u)
    float2* sBC = sDU + 2 * NDU;                        // [2][TT][N]   (Bm, Cm)
    float* sU = reinterpret_cast<float*>(sBC + 2 * NBC); // [2][TT][CPB] u, for Dv * u at the flush
    float* sY = sU + 2 * NDU;                            // [2][TT][CPB] <Cm, h>

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g = lane % G;
    const int cidx = warp * CPW + lane / G;       // channel within the block
    const int b = blockIdx.y;
    const int dbase = blockIdx.x * CPB;
    const int d = dbase + cidx;
    const bool dok = d < D;
    const int dc = dok ? d : D - 1;  // lanes past D compute on a valid channel (shuffles need them) and store nothing

    float a2[SPT], h[SPT];
#pragma unroll
    for (int s = 0; s < SPT; s++) {
        a2[s] = A[dc * N + g * SPT + s] * KS_LOG2E;
        h[s] = 0.f;
    }

    float pdd[PDU], pdu[PDU], pb[PBC], pc[PBC];
    auto load_tile = [&](int tile) {
        const int t0 = tile * TT;
#pragma unroll
        for (int r = 0; r < PDU; r++) {
            const int e = tid + r * NT;
            const int t = t0 + e / CPB, dd = dbase + e % CPB;
            const bool ok = e < NDU && t < L && dd < D;
            const long long x = ((long long)b * L + t) * D + dd;
            pdd[r] = ok ? ks_ld(delta[x]) : 0.f;  // delta = 0 past L: exp2(0) = 1 keeps h unchanged
            pdu[r] = ok ? ks_ld(u[x]) : 0.f;
        }
#pragma unroll
        for (int r = 0; r < PBC; r++) {
            const int e = tid + r * NT;
            const int t = t0 + e / N;
            const bool ok = e < NBC && t < L;
            const long long x = ((long long)b * L + t) * N + e % N;
            pb[r] = ok ? ks_ld(Bm[x]) : 0.f;
            pc[r] = ok ? ks_ld(Cm[x]) : 0.f;
        }
    };
    auto stash_tile = [&](int buf) {
#pragma unroll
        for (int r = 0; r < PDU; r++) {
            const int e = tid + r * NT;
            if (e < NDU) {
                sDU[buf * NDU + e] = make_float2(pdd[r], pdd[r] * pdu[r]);
                sU[buf * NDU + e] = pdu[r];
            }
        }
#pragma unroll
        for (int r = 0; r < PBC; r++) {
            const int e = tid + r * NT;
            if (e < NBC) sBC[buf * NBC + e] = make_float2(pb[r], pc[r]);
        }
    };
    // y of tile `tile` = staged <Cm, h> + Dv * u, coalesced along the channels.
    auto flush_y = [&](int tile, int buf) {
        const int t0 = tile * TT;
        for (int e = tid; e < NDU; e += NT) {
            const int t = t0 + e / CPB, dd = dbase + e % CPB;
            if (t < L && dd < D)
                ks_st(y + ((long long)b * L + t) * D + dd, fmaf(Dv[dd], sU[buf * NDU + e], sY[buf * NDU + e]));
        }
    };

    load_tile(0);
    stash_tile(0);
    __syncthreads();
    for (int tile = 0; tile < NTILE; tile++) {
        const int buf = tile & 1;
        if (tile + 1 < NTILE) load_tile(tile + 1);  // in flight during the compute below
        if (tile > 0) flush_y(tile - 1, buf ^ 1);   // reads sY/sU of the other buffer, refilled below
        const float2* du = sDU + buf * NDU;
        const float2* bc = sBC + buf * NBC;
        float* ty = sY + buf * NDU;
        // fully unrolled (TT / G sub-tiles): one sub-tile's butterfly latency overlaps the next one's work
#pragma unroll
        for (int j0 = 0; j0 < TT; j0 += G) {
            float v[G];
#pragma unroll
            for (int j = 0; j < G; j++) {
                const int t = j0 + j;
                const float2 p = du[t * CPB + cidx];  // same address for the G lanes of a channel
                float bb[SPT], cc[SPT];
                if constexpr (SPT % 2 == 0) {
#pragma unroll
                    for (int s = 0; s < SPT; s += 2) {
                        const float4 w = *reinterpret_cast<const float4*>(bc + t * N + g * SPT + s);
                        bb[s] = w.x; cc[s] = w.y; bb[s + 1] = w.z; cc[s + 1] = w.w;
                    }
                } else {
#pragma unroll
                    for (int s = 0; s < SPT; s++) {
                        const float2 w = bc[t * N + g * SPT + s];
                        bb[s] = w.x; cc[s] = w.y;
                    }
                }
                float acc = 0.f;
#pragma unroll
                for (int s = 0; s < SPT; s++) {
                    h[s] = fmaf(ks_ex2(p.x * a2[s]), h[s], p.y * bb[s]);
                    acc = fmaf(cc[s], h[s], acc);
                }
                v[j] = acc;
            }
            ty[(j0 + g) * CPB + cidx] = ks_transpose_sum<G>(v, g);
        }
        if (tile + 1 < NTILE) stash_tile(buf ^ 1);
        // one barrier per tile: the next tile's inputs are stashed, this tile's y is staged, and
        // the buffers read in this tile are free for tile + 2.
        __syncthreads();
    }
    flush_y(NTILE - 1, (NTILE - 1) & 1);
    if (dok) {
#pragma unroll
        for (int s = 0; s < SPT; s++) state[((long long)b * D + d) * N + g * SPT + s] = h[s];
    }
}

// @kernel mamba_scan
ks_seq_scan<L, D, N, SPT, WARPS, 32>(u, delta, A, Bm, Cm, Dv, y, state);
