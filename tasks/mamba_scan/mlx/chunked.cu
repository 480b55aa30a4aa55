// Chunked parallel selective scan, MLX CUDA dialect, three launches (translated from
// tasks/mamba_scan/cuda/chunked_scan.cu):
//   scan_local   per (batch, chunk of CHUNK steps, CPT channels per thread): scan the chunk from a
//                zero state with all N states in registers; write the chunk's sum of delta
//                (chunk_dsum) and its local end state (chunk_state).
//   scan_combine per (batch, state, channel): walk the chunks in order. The true start state of
//                chunk k+1 is exp2(a2 * dsum[k]) * start[k] + local_end[k] (the product of the
//                chunk's decays is the exp of the sum of its exponents); write every start state
//                (chunk_start) and the final state (`state`).
//   scan_output  re-scan each chunk from its true start state and write y.
// MLX passes inputs as const pointers and outputs as fresh buffers, so the combine writes its start
// states into a third scratch buffer instead of updating chunk_state in place.
// Scratch layouts put the channel last ([batch][chunk][state][channel]) so that consecutive threads
// (consecutive channels) read and write consecutive floats in every launch.
// exp(delta*A) = exp2(delta * A*log2(e)): one MUFU ex2 per (step, channel, state); POLY of the N
// states go through a polynomial exp2 on the FMA pipe instead (balances the two pipes).
// Tunables: CHUNK, THREADS, CPT (1 or 2 channels per thread; 2 loads u/delta/y as 4-byte pairs), POLY.
// Axes L, D, N, batch and the tunables are compile-time constants (MLX template parameters); the
// helpers below are templates because header code cannot see them.

#define KS_LOG2E 1.4426950408889634f

__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void ks_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Two adjacent elements moved as one 2*sizeof(T)-byte access (CPT = 2).
template <typename T> struct alignas(2 * sizeof(T)) ks_pair { T a, b; };

__device__ __forceinline__ float ks_ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// 2^x on the FMA pipe: nearest integer j by the 1.5*2^23 trick, 2^(x-j) by a degree-6 polynomial on
// [-0.5, 0.5] (relative error ~1e-7), exponent added as an integer. x is clamped at -125 (the
// result is then ~0, as for MUFU with flush-to-zero).
__device__ __forceinline__ float ks_ex2_poly(float x) {
    x = fmaxf(x, -125.f);
    const float t = x + 12582912.f;
    const float j = t - 12582912.f;
    const float f = x - j;
    float p = 1.5403530e-4f;
    p = fmaf(p, f, 1.3333558e-3f);
    p = fmaf(p, f, 9.6181291e-3f);
    p = fmaf(p, f, 5.5504109e-2f);
    p = fmaf(p, f, 2.4022651e-1f);
    p = fmaf(p, f, 6.9314718e-1f);
    p = fmaf(p, f, 1.0f);
    const int e = (__float_as_int(t) - 0x4B400000) << 23;
    return __int_as_float(__float_as_int(p) + e);
}

// One chunk of CHUNK steps for CPT adjacent channels of one thread.
//   OUT = false: from a zero state; writes dsum[b][chunk][d] and hend[b][chunk][n][d].
//   OUT = true:  from hstart[b][chunk][n][d]; writes y.
template <bool OUT, int L, int D, int N, int CHUNK, int THREADS, int CPT, int POLY, typename TU, typename TB,
          typename TY>
__device__ __forceinline__ void ks_chunk_scan(const TU* __restrict__ u, const TU* __restrict__ delta,
                                              const float* __restrict__ A, const TB* __restrict__ Bm,
                                              const TB* __restrict__ Cm, const float* __restrict__ Dv,
                                              const float* __restrict__ hstart, TY* __restrict__ y,
                                              float* __restrict__ dsum, float* __restrict__ hend) {
    constexpr int NCH = (L + CHUNK - 1) / CHUNK;
    static_assert(N % 4 == 0, "N must be a multiple of 4 (float4 reads of the staged Bm/Cm rows)");
    extern __shared__ float4 ks_smem4[];  // float4 so the rows are 16-byte aligned
    float* sB = reinterpret_cast<float*>(ks_smem4);  // [CHUNK][N]
    float* sC = sB + CHUNK * N;                       // [CHUNK][N], OUT only
    const int tid = threadIdx.x;
    const int b = blockIdx.z, chunk = blockIdx.y;
    const int t0 = chunk * CHUNK;
    const int tn = min(CHUNK, L - t0);
    // Bm/Cm rows of this chunk, shared by every channel of the block, staged as f32.
    const long long bt = ((long long)b * L + t0) * N;
    for (int i = tid; i < tn * N; i += THREADS) {
        sB[i] = ks_ld(Bm[bt + i]);
        if (OUT) sC[i] = ks_ld(Cm[bt + i]);
    }
    __syncthreads();
    const int d0 = (blockIdx.x * THREADS + tid) * CPT;
    if (d0 >= D) return;  // no barrier below this point

    float a2[CPT][N], h[CPT][N], dv[CPT], sdt[CPT];
    const long long cbase = ((long long)b * NCH + chunk) * N * D;  // [b][chunk][.][.]
#pragma unroll
    for (int c = 0; c < CPT; c++) {
#pragma unroll
        for (int n = 0; n < N; n++) {
            a2[c][n] = A[(d0 + c) * N + n] * KS_LOG2E;
            h[c][n] = OUT ? hstart[cbase + (long long)n * D + d0 + c] : 0.f;
        }
        dv[c] = OUT ? Dv[d0 + c] : 0.f;
        sdt[c] = 0.f;
    }
    const long long base = ((long long)b * L + t0) * D + d0;
#pragma unroll 2
    for (int t = 0; t < tn; t++) {
        const long long x = base + (long long)t * D;
        float dt[CPT], ut[CPT];
        if constexpr (CPT == 2) {
            const ks_pair<TU> pd = *reinterpret_cast<const ks_pair<TU>*>(delta + x);
            const ks_pair<TU> pu = *reinterpret_cast<const ks_pair<TU>*>(u + x);
            dt[0] = ks_ld(pd.a);
            dt[CPT - 1] = ks_ld(pd.b);
            ut[0] = ks_ld(pu.a);
            ut[CPT - 1] = ks_ld(pu.b);
        } else {
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                dt[c] = ks_ld(delta[x + c]);
                ut[c] = ks_ld(u[x + c]);
            }
        }
        float bv[N], cv[N];
        const float4* b4 = reinterpret_cast<const float4*>(sB + t * N);
        const float4* c4 = reinterpret_cast<const float4*>(sC + t * N);
#pragma unroll
        for (int q4 = 0; q4 < N / 4; q4++) {
            const float4 w = b4[q4];
            bv[4 * q4] = w.x; bv[4 * q4 + 1] = w.y; bv[4 * q4 + 2] = w.z; bv[4 * q4 + 3] = w.w;
            if (OUT) {
                const float4 z = c4[q4];
                cv[4 * q4] = z.x; cv[4 * q4 + 1] = z.y; cv[4 * q4 + 2] = z.z; cv[4 * q4 + 3] = z.w;
            }
        }
        float yo[CPT];
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            const float dtu = dt[c] * ut[c];
            if (!OUT) sdt[c] += dt[c];
            // four partial sums: the <Cm, h> reduction is a 4-deep, not an N-deep, FMA chain
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int n = 0; n < N; n++) {
                const float e = dt[c] * a2[c][n];
                const float dA = (n < POLY) ? ks_ex2_poly(e) : ks_ex2(e);
                h[c][n] = fmaf(dA, h[c][n], dtu * bv[n]);
                if (OUT) acc[n & 3] = fmaf(cv[n], h[c][n], acc[n & 3]);
            }
            yo[c] = fmaf(dv[c], ut[c], (acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
        if (OUT) {
            if constexpr (CPT == 2) {
                ks_pair<TY> py;
                ks_st(&py.a, yo[0]);
                ks_st(&py.b, yo[CPT - 1]);
                *reinterpret_cast<ks_pair<TY>*>(y + x) = py;
            } else {
#pragma unroll
                for (int c = 0; c < CPT; c++) ks_st(y + x + c, yo[c]);
            }
        }
    }
    if (!OUT) {
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            dsum[((long long)b * NCH + chunk) * D + d0 + c] = sdt[c];
#pragma unroll
            for (int n = 0; n < N; n++) hend[cbase + (long long)n * D + d0 + c] = h[c][n];
        }
    }
}

// The combine: one thread per (batch, state, channel), channel fastest (coalesced scratch).
// CB chunks' aggregates are loaded together so that CB independent loads are in flight.
template <int L, int D, int N, int CHUNK, int CB>
__device__ __forceinline__ void ks_chunk_combine(const float* __restrict__ A, const float* __restrict__ dsum,
                                                 const float* __restrict__ hend, float* __restrict__ hstart,
                                                 float* __restrict__ state, int batch) {
    constexpr int NCH = (L + CHUNK - 1) / CHUNK;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)batch * N * D) return;
    const int d = (int)(i % D);
    const int n = (int)((i / D) % N);
    const int b = (int)(i / ((long long)N * D));
    const float a2 = A[d * N + n] * KS_LOG2E;
    float hc = 0.f;
    for (int k0 = 0; k0 < NCH; k0 += CB) {
        float p[CB], hl[CB];
#pragma unroll
        for (int kk = 0; kk < CB; kk++) {
            const int k = k0 + kk;
            const bool ok = k < NCH;
            p[kk] = ok ? ks_ex2(a2 * dsum[((long long)b * NCH + k) * D + d]) : 1.f;
            hl[kk] = ok ? hend[(((long long)b * NCH + k) * N + n) * D + d] : 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < CB; kk++) {
            const int k = k0 + kk;
            if (k < NCH) hstart[(((long long)b * NCH + k) * N + n) * D + d] = hc;
            hc = fmaf(p[kk], hc, hl[kk]);
        }
    }
    state[((long long)b * D + d) * N + n] = hc;
}

// @kernel scan_local
ks_chunk_scan<false, L, D, N, CHUNK, THREADS, CPT, POLY>(u, delta, A, Bm, Bm, (const float*)nullptr,
                                                          (const float*)nullptr, (__half*)nullptr,
                                                          chunk_dsum, chunk_state);

// @kernel scan_combine
ks_chunk_combine<L, D, N, CHUNK, 8>(A, chunk_dsum, chunk_state, chunk_start, state, batch);

// @kernel scan_output
ks_chunk_scan<true, L, D, N, CHUNK, THREADS, CPT, POLY>(u, delta, A, Bm, Cm, Dv, chunk_start, y,
                                                         (float*)nullptr, (float*)nullptr);
