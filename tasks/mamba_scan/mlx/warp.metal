// Selective scan parallel over time inside a SIMD-group, MLX Metal dialect (the design of
// tasks/mamba_scan/cuda/warp_scan.cu re-cut for Apple GPUs): one SIMD-group per channel, its 32
// lanes holding K consecutive steps each of a chunk of T = 32 K steps, every state's recurrence
// solved by a SIMD-group scan of the lanes' affine maps. One launch, one exp per (step, channel,
// state), no scratch.
//
// h_t = e_t h_{t-1} + x_t (e = exp2(delta * A * log2 e), x = delta * u * Bm) is an affine map per
// step; over a lane's K steps it composes to h -> P h + H. Per state, each lane runs its K steps
// from zero (keeping each step's e and x in registers), the lanes' maps are composed in lane order
// by an inclusive scan of five simd_shuffle_up rounds, shifted by one lane, so each lane learns
// the state entering its steps from the state entering the chunk; a second pass runs its steps
// again from there and adds Cm h to the step's y, which the lane keeps for all N states. The state
// leaving the chunk is lane 31's, broadcast with simd_shuffle: every lane keeps the N states
// entering the next chunk in registers. The only sequential chain from chunk to chunk is the
// scan's combine and one broadcast per state.
//
// Threadgroup memory (Apple GPUs: 32 KB), per chunk, rows of K steps a lane padded to K + 1 words
// (lanes' rows start 9 or 5 words apart: no two lanes of a read share a bank):
// (delta, u) as half2 per channel (f16 as loaded: exact), (Bm, Cm) as half2 per state, y as f32
// per channel, staged and written coalesced along the channels: 128 (K + 1) (2 CB + N) bytes.
// Loaded cooperatively, coalesced along channels (delta, u) and states (Bm, Cm); two barriers a
// chunk.
// Any L (steps past L are zeros: exp2(0) = 1 and x = 0 leave the state unchanged; y stored below L
// only), any D (SIMD-groups past D compute on zeros and store nothing; the test is uniform per
// SIMD-group, so every lane takes part in every shuffle). Tunables: K (steps per lane), CB
// (channels, i.e. SIMD-groups, per threadgroup).

// @kernel mamba_scan
constexpr int T = 32 * K;   // steps per chunk
constexpr int KP = K + 1;   // words per lane row
constexpr int RW = 32 * KP; // words per channel (or state) row
constexpr int NT = 32 * CB;
constexpr int NCH = (L + T - 1) / T;
threadgroup half2 sDU[CB * RW];  // (delta, u)
threadgroup half2 sBC[N * RW];   // (Bm, Cm)
threadgroup float sY[CB * RW];   // y of the chunk

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const int c = int(simdgroup_index_in_threadgroup);  // channel within the threadgroup
const int b = int(threadgroup_position_in_grid.y);
const int d0 = int(threadgroup_position_in_grid.x) * CB;
const int d = d0 + c;
const bool dok = d < D;  // uniform per SIMD-group
const int dc = dok ? d : 0;
const float dv = dok ? Dv[dc] : 0.0f;

float a2[N], hc[N];
for (int n = 0; n < N; n++) {
    a2[n] = dok ? A[dc * N + n] * M_LOG2E_F : 0.0f;
    hc[n] = 0.0f;
}

for (int k = 0; k < NCH; k++) {
    const int t0 = k * T;
    // this chunk's rows into threadgroup memory, in the lanes' layout
    for (int e = int(tid); e < T * CB; e += NT) {
        const int t = e / CB, cc = e % CB;
        const bool ok = t0 + t < L && d0 + cc < D;
        const ulong x = (ulong(b) * L + ulong(ok ? t0 + t : 0)) * D + ulong(ok ? d0 + cc : 0);
        sDU[cc * RW + (t / K) * KP + t % K] = ok ? half2(delta[x], u[x]) : half2(0.0h, 0.0h);
    }
    for (int e = int(tid); e < T * N; e += NT) {
        const int t = e / N, n = e % N;
        const bool ok = t0 + t < L;
        const ulong x = (ulong(b) * L + ulong(ok ? t0 + t : 0)) * N + ulong(n);
        sBC[n * RW + (t / K) * KP + t % K] = ok ? half2(Bm[x], Cm[x]) : half2(0.0h, 0.0h);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float dl[K], du[K], yk[K];
    for (int i = 0; i < K; i++) {
        const float2 w = float2(sDU[c * RW + int(lane) * KP + i]);
        dl[i] = w.x;
        du[i] = w.x * w.y;  // delta * u
        yk[i] = dv * w.y;   // the skip term Dv * u
    }
    for (int n = 0; n < N; n++) {
        // the lane's K steps from zero: each step's decay and input kept for the second pass
        float ev[K], xv[K], cv[K];
        float P = 1.0f, H = 0.0f;
        for (int i = 0; i < K; i++) {
            const float2 bc = float2(sBC[n * RW + int(lane) * KP + i]);
            ev[i] = metal::fast::exp2(dl[i] * a2[n]);
            xv[i] = du[i] * bc.x;
            cv[i] = bc.y;
            H = fma(ev[i], H, xv[i]);
            P *= ev[i];
        }
        // compose the maps of lanes 0..lane (inclusive scan), then shift by one lane
        for (ushort o = 1; o < 32; o *= 2) {
            const float Pp = simd_shuffle_up(P, o), Hp = simd_shuffle_up(H, o);
            if (lane >= o) {
                H = fma(P, Hp, H);
                P *= Pp;
            }
        }
        float Pb = simd_shuffle_up(P, ushort(1)), Hb = simd_shuffle_up(H, ushort(1));
        if (lane == 0) {
            Pb = 1.0f;
            Hb = 0.0f;
        }
        float h = fma(Pb, hc[n], Hb);  // the state entering this lane's steps
        for (int i = 0; i < K; i++) {
            h = fma(ev[i], h, xv[i]);
            yk[i] = fma(cv[i], h, yk[i]);
        }
        hc[n] = simd_shuffle(h, ushort(31));  // the state leaving the chunk
    }
    for (int i = 0; i < K; i++) sY[c * RW + int(lane) * KP + i] = yk[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // y of the chunk, coalesced along the channels. No barrier after it: the next chunk's loads
    // write only (delta, u) and (Bm, Cm), which nobody reads after the barrier above, and its y
    // rows are written only after the barrier at its top, which every thread reaches after this.
    for (int e = int(tid); e < T * CB; e += NT) {
        const int t = e / CB, cc = e % CB;
        if (t0 + t < L && d0 + cc < D)
            y[(ulong(b) * L + ulong(t0 + t)) * D + ulong(d0 + cc)] = half(sY[cc * RW + (t / K) * KP + t % K]);
    }
}
if (dok && lane == 0)
    for (int n = 0; n < N; n++) state[(ulong(b) * D + ulong(d)) * N + ulong(n)] = hc[n];
