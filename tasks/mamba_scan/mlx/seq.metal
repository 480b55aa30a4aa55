// Single-launch selective scan, MLX Metal dialect (translated from tasks/mamba_scan/mlx/seq.cu):
// G = N / SPT lanes of a SIMD-group per channel, each lane owning SPT states of one channel, walk
// the whole sequence once (one exp per (step, channel, state), half the exps of the chunked scan,
// no scratch, one launch).
//
// Per step a lane updates its SPT states and forms v = sum_s Cm[t][n_s] * h[n_s]. A sub-tile of G
// steps is reduced at once by a transposing butterfly: round w (w = G/2 .. 1) swaps half of the
// values still held with the lane at xor distance w and adds, so after G-1 simd_shuffle_xor in
// total lane g holds the complete <Cm, h> of step g.
//
// Time is staged in tiles of TT = 16 steps through threadgroup memory as f32, double-buffered with
// the next tile's device loads issued before the current tile is computed (one barrier per tile):
// (delta, delta*u) pairs of the threadgroup's CPB channels (the product formed once per element,
// not once per lane), u alone, and (Bm, Cm) pairs (shared by every channel). y is staged the same
// way and written coalesced one tile later, when Dv*u is added.
// Threadgroup memory: 2 * TT * (CPB * 16 + N * 8) bytes, CPB = WARPS * 32 / (N / SPT) (<= 32 KB
// by constraint).
// Tunables: SPT (states per lane), WARPS (SIMD-groups per threadgroup).

// Transposing butterfly over the G lanes of a group (g = lane % G): on entry v[j] is this lane's
// part of step j; on return the sum over the group of step g. Round W keeps W values: the lane
// with bit W of g set keeps the upper half of the steps it still holds and sends the lower half to
// its partner at xor distance W, which does the opposite. Compile-time recursion, so that every
// round's trip count is a constant and v[] can stay in registers once unrolled.
template <int G, int W> struct ks_bfly {
    static inline void run(thread float* v, uint g) {
        const bool upper = (g & uint(W)) != 0;
        for (int k = 0; k < W; k++) {
            const float send = upper ? v[k] : v[k + W];
            const float keep = upper ? v[k + W] : v[k];
            v[k] = keep + simd_shuffle_xor(send, ushort(W));
        }
        ks_bfly<G, W / 2>::run(v, g);
    }
};
template <int G> struct ks_bfly<G, 0> {
    static inline void run(thread float*, uint) {}
};
template <int G> inline float ks_transpose_sum(thread float* v, uint g) {
    ks_bfly<G, G / 2>::run(v, g);
    return v[0];
}

// One tile's inputs from device memory into registers (zeros past L and past D: delta = 0 makes
// exp2(0) = 1, so padded steps leave the state unchanged).
template <int L, int D, int N, int TT, int CPB, int NT, int PDU, int PBC>
inline void ks_load_tile(const device half* u, const device half* delta, const device half* Bm,
                         const device half* Cm, int b, int dbase, int tile, uint tid, thread float* pdd,
                         thread float* pdu, thread float* pb, thread float* pc) {
    const int t0 = tile * TT;
    for (int r = 0; r < PDU; r++) {
        const int e = int(tid) + r * NT;
        const int t = t0 + e / CPB, dd = dbase + e % CPB;
        const bool ok = e < TT * CPB && t < L && dd < D;
        const ulong x = (ulong(b) * L + t) * D + dd;
        pdd[r] = ok ? float(delta[x]) : 0.0f;
        pdu[r] = ok ? float(u[x]) : 0.0f;
    }
    for (int r = 0; r < PBC; r++) {
        const int e = int(tid) + r * NT;
        const int t = t0 + e / N;
        const bool ok = e < TT * N && t < L;
        const ulong x = (ulong(b) * L + t) * N + e % N;
        pb[r] = ok ? float(Bm[x]) : 0.0f;
        pc[r] = ok ? float(Cm[x]) : 0.0f;
    }
}

template <int TT, int CPB, int N, int NT, int PDU, int PBC>
inline void ks_stash_tile(threadgroup float2* sDU, threadgroup float* sU, threadgroup float2* sBC, int buf, uint tid,
                          thread float* pdd, thread float* pdu, thread float* pb, thread float* pc) {
    for (int r = 0; r < PDU; r++) {
        const int e = int(tid) + r * NT;
        if (e < TT * CPB) {
            sDU[buf * TT * CPB + e] = float2(pdd[r], pdd[r] * pdu[r]);
            sU[buf * TT * CPB + e] = pdu[r];
        }
    }
    for (int r = 0; r < PBC; r++) {
        const int e = int(tid) + r * NT;
        if (e < TT * N) sBC[buf * TT * N + e] = float2(pb[r], pc[r]);
    }
}

// y of one tile = staged <Cm, h> + Dv * u, to device memory, coalesced along the channels.
template <int L, int D, int TT, int CPB, int NT>
inline void ks_flush_y(device half* y, const device float* Dv, const threadgroup float* sY, const threadgroup float* sU,
                       int b, int dbase, int tile, int buf, uint tid) {
    const int t0 = tile * TT;
    for (int e = int(tid); e < TT * CPB; e += NT) {
        const int t = t0 + e / CPB, dd = dbase + e % CPB;
        if (t < L && dd < D)
            y[(ulong(b) * L + t) * D + dd] = half(fma(Dv[dd], sU[buf * TT * CPB + e], sY[buf * TT * CPB + e]));
    }
}

// @kernel mamba_scan
constexpr int TT = 16;
constexpr int G = N / SPT;         // lanes per channel
constexpr int CPW = 32 / G;        // channels per SIMD-group
constexpr int CPB = WARPS * CPW;   // channels per threadgroup
constexpr int NT = WARPS * 32;
constexpr int NTILE = (L + TT - 1) / TT;
constexpr int PDU = (TT * CPB + NT - 1) / NT;
constexpr int PBC = (TT * N + NT - 1) / NT;
static_assert(N % SPT == 0 && 32 % G == 0 && TT % G == 0, "bad SPT for N");
threadgroup float2 sDU[2 * TT * CPB];  // (delta, delta * u)
threadgroup float2 sBC[2 * TT * N];    // (Bm, Cm)
threadgroup float sU[2 * TT * CPB];    // u, for Dv * u at the flush
threadgroup float sY[2 * TT * CPB];    // <Cm, h>

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint g = lane % G;
const int cidx = int(sg) * CPW + int(lane / G);  // channel within the threadgroup
const int b = int(threadgroup_position_in_grid.y);
const int dbase = int(threadgroup_position_in_grid.x) * CPB;
const int d = dbase + cidx;
const bool dok = d < D;
const int dc = dok ? d : D - 1;  // lanes past D compute on a valid channel (shuffles need them) and store nothing

float a2[SPT], h[SPT];
for (int s = 0; s < SPT; s++) {
    a2[s] = A[dc * N + int(g) * SPT + s] * M_LOG2E_F;
    h[s] = 0.0f;
}

float pdd[PDU], pdu[PDU], pb[PBC], pc[PBC];
ks_load_tile<L, D, N, TT, CPB, NT, PDU, PBC>(u, delta, Bm, Cm, b, dbase, 0, tid, pdd, pdu, pb, pc);
ks_stash_tile<TT, CPB, N, NT, PDU, PBC>(sDU, sU, sBC, 0, tid, pdd, pdu, pb, pc);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int tile = 0; tile < NTILE; tile++) {
    const int buf = tile & 1;
    if (tile + 1 < NTILE)  // in flight during the compute below
        ks_load_tile<L, D, N, TT, CPB, NT, PDU, PBC>(u, delta, Bm, Cm, b, dbase, tile + 1, tid, pdd, pdu, pb, pc);
    if (tile > 0) ks_flush_y<L, D, TT, CPB, NT>(y, Dv, sY, sU, b, dbase, tile - 1, buf ^ 1, tid);  // other buffer, refilled below
    const threadgroup float2* du = sDU + buf * TT * CPB;
    const threadgroup float2* bc = sBC + buf * TT * N;
    threadgroup float* ty = sY + buf * TT * CPB;
    for (int j0 = 0; j0 < TT; j0 += G) {
        float v[G];
        for (int j = 0; j < G; j++) {
            const int t = j0 + j;
            const float2 p = du[t * CPB + cidx];  // same address for the G lanes of a channel
            float acc = 0.0f;
            for (int s = 0; s < SPT; s++) {
                const float2 w = bc[t * N + int(g) * SPT + s];  // (Bm, Cm) of state n
                h[s] = fma(metal::fast::exp2(p.x * a2[s]), h[s], p.y * w.x);
                acc = fma(w.y, h[s], acc);
            }
            v[j] = acc;
        }
        const float yt = ks_transpose_sum<G>(v, g);
        ty[(j0 + int(g)) * CPB + cidx] = yt;
    }
    if (tile + 1 < NTILE) ks_stash_tile<TT, CPB, N, NT, PDU, PBC>(sDU, sU, sBC, buf ^ 1, tid, pdd, pdu, pb, pc);
    // one barrier per tile: the next tile's inputs are stashed, this tile's y is staged, and the
    // buffers read in this tile are free for tile + 2.
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
ks_flush_y<L, D, TT, CPB, NT>(y, Dv, sY, sU, b, dbase, NTILE - 1, (NTILE - 1) & 1, tid);
if (dok)
    for (int s = 0; s < SPT; s++) state[(ulong(b) * D + d) * N + int(g) * SPT + s] = h[s];
