// Decode step, memory-bound (MLX CUDA dialect, translated from tasks/mamba_step/cuda/vec_step.cu):
// each lane owns VEC consecutive states of one (batch, channel) (16-byte state loads and streaming
// stores at VEC = 4), N / VEC adjacent lanes share a channel and reduce y with butterfly shuffles,
// CPB channels per block. exp(delta*A) as exp2 with A*log2(e).
// Blocks are whole warps (constraint CPB * N / VEC >= 32) and lanes past the last channel stay in
// the shuffle with zero contributions, so the full-mask shuffles are always legal.
// Tunables: VEC (1, 2, 4), CPB (channels per block).
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
// VEC consecutive floats as one 4/8/16-byte access
template <int V> __device__ __forceinline__ void ks_load_f(float (&r)[V], const float* p) {
    if constexpr (V == 4) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(p));
        r[0] = w.x; r[1] = w.y; r[2] = w.z; r[3] = w.w;
    } else if constexpr (V == 2) {
        const float2 w = __ldg(reinterpret_cast<const float2*>(p));
        r[0] = w.x; r[1] = w.y;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) r[e] = __ldg(p + e);
    }
}
template <int V> __device__ __forceinline__ void ks_store_cs(float* p, const float (&r)[V]) {
    if constexpr (V == 4) {
        __stcs(reinterpret_cast<float4*>(p), make_float4(r[0], r[1], r[2], r[3]));
    } else if constexpr (V == 2) {
        __stcs(reinterpret_cast<float2*>(p), make_float2(r[0], r[1]));
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) __stcs(p + e, r[e]);
    }
}

template <int D, int N, int VEC, int CPB, typename TU, typename TB, typename TY>
__device__ __forceinline__ void ks_vec_step(const TU* __restrict__ u, const TU* __restrict__ delta,
                                            const float* __restrict__ A, const TB* __restrict__ Bm,
                                            const TB* __restrict__ Cm, const float* __restrict__ Dv,
                                            const float* __restrict__ s0, TY* __restrict__ y,
                                            float* __restrict__ s1, int batch) {
    constexpr int TPC = N / VEC;  // lanes per channel
    static_assert(N % VEC == 0 && 32 % TPC == 0, "N / VEC must divide 32");
    const long long ch = (long long)blockIdx.x * CPB + threadIdx.x / TPC;  // b * D + c
    const int part = threadIdx.x % TPC;
    const bool ok = ch < (long long)batch * D;
    const long long cc = ok ? ch : 0;
    const long long b = cc / D;
    const int c = (int)(cc % D);
    const int n0 = part * VEC;
    float acc = 0.f, ut = 0.f;
    if (ok) {
        const float dt = ks_ld(delta[cc]);
        ut = ks_ld(u[cc]);
        const float dtu = dt * ut;
        float sv[VEC], av[VEC], o[VEC];
        ks_load_f<VEC>(sv, s0 + cc * N + n0);
        ks_load_f<VEC>(av, A + (long long)c * N + n0);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            const float bb = ks_ld(Bm[b * N + n0 + e]), cv = ks_ld(Cm[b * N + n0 + e]);
            o[e] = fmaf(ks_ex2(dt * av[e] * 1.4426950408889634f), sv[e], dtu * bb);
            acc = fmaf(cv, o[e], acc);
        }
        ks_store_cs<VEC>(s1 + cc * N + n0, o);
    }
#pragma unroll
    for (int m = TPC / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (ok && part == 0) ks_st(y + cc, fmaf(Dv[c], ut, acc));
}

// @kernel mamba_step
ks_vec_step<D, N, VEC, CPB>(u, delta, A, Bm, Cm, Dv, state_in, y, state_out, batch);
