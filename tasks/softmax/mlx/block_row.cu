// Row softmax (MLX CUDA dialect, translated from tasks/softmax/cuda/block_row.cu): one block of
// THREADS per row, VEC elements per access (one 16-byte load at VEC = 4 for f32), warp-shuffle +
// shared-memory reductions, exp2 with a log2(e) prescale.
// ONLINE = 1: one read pass keeps a running (max, sum) per thread, merged across the block;
// ONLINE = 0: separate max and sum passes. The write pass re-reads the row (L2 hits).
// Tunables: THREADS, VEC (needs cols % VEC == 0 so every row starts aligned), ONLINE.
#define KS_L2E 1.4426950408889634f
#define KS_NEG_INF __int_as_float(0xff800000)  // -inf (INFINITY is not defined under NVRTC)
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
template <typename T, int V> struct alignas(sizeof(T) * V) ks_vec { T v[V]; };

// merge running (m, s) pairs, s scaled to the larger max
__device__ __forceinline__ void ks_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == KS_NEG_INF) return;
    s = s * ks_ex2((m - mn) * KS_L2E) + s2 * ks_ex2((m2 - mn) * KS_L2E);
    m = mn;
}
// Block-wide reductions through one shared float per warp (sm holds 2 * NW floats).
template <int NW> __device__ __forceinline__ void ks_block_ms(float& m, float& s, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ks_merge(m, s, m2, s2);
    }
    if ((threadIdx.x & 31) == 0) { sm[threadIdx.x >> 5] = m; sm[NW + (threadIdx.x >> 5)] = s; }
    __syncthreads();
    m = KS_NEG_INF;
    s = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) ks_merge(m, s, sm[i], sm[NW + i]);
}
template <int NW> __device__ __forceinline__ float ks_block_max(float m, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = m;
    __syncthreads();
    m = KS_NEG_INF;
#pragma unroll
    for (int i = 0; i < NW; i++) m = fmaxf(m, sm[i]);
    return m;
}
template <int NW> __device__ __forceinline__ float ks_block_sum(float s, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) sm[NW + (threadIdx.x >> 5)] = s;  // other half than the max
    __syncthreads();
    s = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) s += sm[NW + i];
    return s;
}

template <int COLS, int THREADS, int VEC, int ONLINE, typename T, typename TY>
__device__ __forceinline__ void ks_softmax_row(const T* __restrict__ x, TY* __restrict__ y, int row) {
    constexpr int NW = THREADS / 32;
    constexpr int NV = COLS / VEC;
    static_assert(COLS % VEC == 0 && THREADS % 32 == 0, "cols % VEC, THREADS % 32");
    __shared__ float sm[2 * NW];
    const ks_vec<T, VEC>* xr = reinterpret_cast<const ks_vec<T, VEC>*>(x + (long long)row * COLS);
    ks_vec<TY, VEC>* yr = reinterpret_cast<ks_vec<TY, VEC>*>(y + (long long)row * COLS);
    float m = KS_NEG_INF, s = 0.f;
    if constexpr (ONLINE) {
        for (int i = threadIdx.x; i < NV; i += THREADS) {
            const ks_vec<T, VEC> w = xr[i];
            float vm = ks_ld(w.v[0]);
#pragma unroll
            for (int e = 1; e < VEC; e++) vm = fmaxf(vm, ks_ld(w.v[e]));
            const float mn = fmaxf(m, vm);
            s *= ks_ex2((m - mn) * KS_L2E);
#pragma unroll
            for (int e = 0; e < VEC; e++) s += ks_ex2((ks_ld(w.v[e]) - mn) * KS_L2E);
            m = mn;
        }
        ks_block_ms<NW>(m, s, sm);
    } else {
        for (int i = threadIdx.x; i < NV; i += THREADS) {
            const ks_vec<T, VEC> w = xr[i];
#pragma unroll
            for (int e = 0; e < VEC; e++) m = fmaxf(m, ks_ld(w.v[e]));
        }
        m = ks_block_max<NW>(m, sm);
        for (int i = threadIdx.x; i < NV; i += THREADS) {
            const ks_vec<T, VEC> w = xr[i];
#pragma unroll
            for (int e = 0; e < VEC; e++) s += ks_ex2((ks_ld(w.v[e]) - m) * KS_L2E);
        }
        s = ks_block_sum<NW>(s, sm);
    }
    const float inv = 1.f / s;
    const float mb = m * KS_L2E;
    for (int i = threadIdx.x; i < NV; i += THREADS) {
        const ks_vec<T, VEC> w = xr[i];
        ks_vec<TY, VEC> o;
#pragma unroll
        for (int e = 0; e < VEC; e++) ks_st(&o.v[e], ks_ex2(fmaf(ks_ld(w.v[e]), KS_L2E, -mb)) * inv);
        yr[i] = o;
    }
}

// @kernel softmax
if (blockIdx.x >= rows) return;  // uniform per block
ks_softmax_row<cols, THREADS, VEC, ONLINE>(x, y, blockIdx.x);
