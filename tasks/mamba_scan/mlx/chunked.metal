// Chunked parallel selective scan, MLX Metal dialect, three launches (translated from
// tasks/mamba_scan/mlx/chunked.cu):
//   scan_local   per (batch, chunk of CHUNK steps, CPT channels per thread): scan the chunk from a
//                zero state with all N states in registers; write the chunk's sum of delta
//                (chunk_dsum) and its local end state (chunk_state).
//   scan_combine per (batch, state, channel): walk the chunks in order; the true start state of
//                chunk k+1 is exp2(a2 * dsum[k]) * start[k] + local_end[k]; write every start state
//                (chunk_start) and the final state (`state`).
//   scan_output  re-scan each chunk from its true start state and write y.
// Scratch is channel-last ([batch][chunk][state][channel]): consecutive threads touch
// consecutive floats. Bm/Cm rows of the chunk are staged in threadgroup memory as f32 (shared by
// every channel of the threadgroup): CHUNK * N * 4 bytes each, within Apple's 32 KB for CHUNK <= 128.
// exp(delta*A) = fast exp2(delta * A*log2(e)). Tunables: CHUNK, THREADS, CPT (1 or 2 channels per
// thread; 2 reads u/delta and writes y as half2).
// Helpers are templates (header code cannot see MLX's template parameters); threadgroup arrays
// live in the kernel bodies and are passed down.

template <bool OUT, int L, int D, int N, int CHUNK, int THREADS, int CPT>
inline void ks_chunk_scan(const device half* u, const device half* delta, const device float* A,
                          const device half* Bm, const device half* Cm, const device float* Dv,
                          const device float* hstart, device half* y, device float* dsum, device float* hend,
                          threadgroup float* sB, threadgroup float* sC, uint3 tg, uint tid) {
    constexpr int NCH = (L + CHUNK - 1) / CHUNK;
    const int b = int(tg.z), chunk = int(tg.y);
    const int t0 = chunk * CHUNK;
    const int tn = min(CHUNK, L - t0);
    const ulong bt = (ulong(b) * L + t0) * N;
    for (int i = int(tid); i < tn * N; i += THREADS) {
        sB[i] = float(Bm[bt + i]);
        if (OUT) sC[i] = float(Cm[bt + i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int d0 = (int(tg.x) * THREADS + int(tid)) * CPT;
    if (d0 >= D) return;  // no barrier below this point

    float a2[CPT][N], h[CPT][N], dv[CPT], sdt[CPT];
    const ulong cbase = (ulong(b) * NCH + chunk) * N * D;  // [b][chunk][.][.]
    for (int c = 0; c < CPT; c++) {
        for (int n = 0; n < N; n++) {
            a2[c][n] = A[(d0 + c) * N + n] * M_LOG2E_F;
            h[c][n] = OUT ? hstart[cbase + ulong(n) * D + d0 + c] : 0.0f;
        }
        dv[c] = OUT ? Dv[d0 + c] : 0.0f;
        sdt[c] = 0.0f;
    }
    const ulong base = (ulong(b) * L + t0) * D + d0;
    for (int t = 0; t < tn; t++) {
        const ulong x = base + ulong(t) * D;
        float dt[CPT], ut[CPT];
        if (CPT == 2) {
            const float2 pd = float2(*reinterpret_cast<const device half2*>(delta + x));
            const float2 pu = float2(*reinterpret_cast<const device half2*>(u + x));
            dt[0] = pd.x; dt[CPT - 1] = pd.y;
            ut[0] = pu.x; ut[CPT - 1] = pu.y;
        } else {
            for (int c = 0; c < CPT; c++) {
                dt[c] = float(delta[x + c]);
                ut[c] = float(u[x + c]);
            }
        }
        float yo[CPT];
        for (int c = 0; c < CPT; c++) {
            const float dtu = dt[c] * ut[c];
            if (!OUT) sdt[c] += dt[c];
            // four partial sums: the <Cm, h> reduction is a 4-deep, not an N-deep, FMA chain
            float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
            for (int n = 0; n < N; n += 4) {
                const float4 b4 = *reinterpret_cast<const threadgroup float4*>(sB + t * N + n);
                h[c][n] = fma(metal::fast::exp2(dt[c] * a2[c][n]), h[c][n], dtu * b4.x);
                h[c][n + 1] = fma(metal::fast::exp2(dt[c] * a2[c][n + 1]), h[c][n + 1], dtu * b4.y);
                h[c][n + 2] = fma(metal::fast::exp2(dt[c] * a2[c][n + 2]), h[c][n + 2], dtu * b4.z);
                h[c][n + 3] = fma(metal::fast::exp2(dt[c] * a2[c][n + 3]), h[c][n + 3], dtu * b4.w);
                if (OUT) {
                    const float4 c4 = *reinterpret_cast<const threadgroup float4*>(sC + t * N + n);
                    acc0 = fma(c4.x, h[c][n], acc0);
                    acc1 = fma(c4.y, h[c][n + 1], acc1);
                    acc2 = fma(c4.z, h[c][n + 2], acc2);
                    acc3 = fma(c4.w, h[c][n + 3], acc3);
                }
            }
            yo[c] = fma(dv[c], ut[c], (acc0 + acc1) + (acc2 + acc3));
        }
        if (OUT) {
            if (CPT == 2) {
                *reinterpret_cast<device half2*>(y + x) = half2(float2(yo[0], yo[CPT - 1]));
            } else {
                for (int c = 0; c < CPT; c++) y[x + c] = half(yo[c]);
            }
        }
    }
    if (!OUT) {
        for (int c = 0; c < CPT; c++) {
            dsum[(ulong(b) * NCH + chunk) * D + d0 + c] = sdt[c];
            for (int n = 0; n < N; n++) hend[cbase + ulong(n) * D + d0 + c] = h[c][n];
        }
    }
}

// @kernel scan_local
static_assert(N % 4 == 0, "N must be a multiple of 4 (float4 reads of the staged Bm rows)");
threadgroup float4 sB4[CHUNK * N / 4];  // float4: 16-byte aligned rows
threadgroup float* sB = reinterpret_cast<threadgroup float*>(sB4);
ks_chunk_scan<false, L, D, N, CHUNK, THREADS, CPT>(u, delta, A, Bm, Bm, nullptr, nullptr, nullptr, chunk_dsum,
                                                   chunk_state, sB, sB, threadgroup_position_in_grid,
                                                   thread_position_in_threadgroup.x);

// @kernel scan_combine
// One thread per (batch, state, channel), channel fastest; 8 chunks' aggregates loaded together.
constexpr int NCH = (L + CHUNK - 1) / CHUNK;
constexpr int CB = 8;
const uint i = thread_position_in_grid.x;
if (i >= uint(batch * N * D)) return;
const uint d = i % D, n = (i / D) % N, b = i / (N * D);
const float a2 = A[d * N + n] * M_LOG2E_F;
float hc = 0.0f;
for (int k0 = 0; k0 < NCH; k0 += CB) {
    float p[CB], hl[CB];
    for (int kk = 0; kk < CB; kk++) {
        const int kc = k0 + kk;
        const bool ok = kc < NCH;
        p[kk] = ok ? metal::fast::exp2(a2 * chunk_dsum[(ulong(b) * NCH + kc) * D + d]) : 1.0f;
        hl[kk] = ok ? chunk_state[((ulong(b) * NCH + kc) * N + n) * D + d] : 0.0f;
    }
    for (int kk = 0; kk < CB; kk++) {
        const int kc = k0 + kk;
        if (kc < NCH) chunk_start[((ulong(b) * NCH + kc) * N + n) * D + d] = hc;
        hc = fma(p[kk], hc, hl[kk]);
    }
}
state[(ulong(b) * D + d) * N + n] = hc;

// @kernel scan_output
threadgroup float4 sB4[CHUNK * N / 4];  // float4: 16-byte aligned rows
threadgroup float4 sC4[CHUNK * N / 4];
threadgroup float* sB = reinterpret_cast<threadgroup float*>(sB4);
threadgroup float* sC = reinterpret_cast<threadgroup float*>(sC4);
ks_chunk_scan<true, L, D, N, CHUNK, THREADS, CPT>(u, delta, A, Bm, Cm, Dv, chunk_start, y, nullptr, nullptr, sB, sC,
                                                  threadgroup_position_in_grid, thread_position_in_threadgroup.x);
