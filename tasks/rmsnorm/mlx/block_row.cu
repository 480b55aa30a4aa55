// RMS norm (MLX CUDA dialect, translated from tasks/rmsnorm/cuda/block_row.cu): one block of
// THREADS per row, VEC elements per access (16-byte loads at VEC = 8 for f16), f32 sum of squares
// with warp shuffles + one shared float per warp, the scale pass re-reads the row (L2 hits).
// Tunables: THREADS, VEC (needs cols % VEC == 0 so every row starts aligned).
__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void ks_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
template <typename T, int V> struct alignas(sizeof(T) * V) ks_vec { T v[V]; };

template <int COLS, int THREADS, int VEC, typename T, typename TW, typename TY>
__device__ __forceinline__ void ks_rmsnorm_row(const T* __restrict__ x, const TW* __restrict__ w,
                                               TY* __restrict__ y, int row, float eps) {
    constexpr int NW = THREADS / 32;
    constexpr int NV = COLS / VEC;
    static_assert(COLS % VEC == 0 && THREADS % 32 == 0, "cols % VEC, THREADS % 32");
    __shared__ float sm[NW];
    const ks_vec<T, VEC>* xr = reinterpret_cast<const ks_vec<T, VEC>*>(x + (long long)row * COLS);
    const ks_vec<TW, VEC>* wr = reinterpret_cast<const ks_vec<TW, VEC>*>(w);
    ks_vec<TY, VEC>* yr = reinterpret_cast<ks_vec<TY, VEC>*>(y + (long long)row * COLS);
    float ss = 0.f;
    for (int i = threadIdx.x; i < NV; i += THREADS) {
        const ks_vec<T, VEC> v = xr[i];
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            const float f = ks_ld(v.v[e]);
            ss = fmaf(f, f, ss);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) ss += sm[i];
    const float inv = rsqrtf(ss / (float)COLS + eps);
    for (int i = threadIdx.x; i < NV; i += THREADS) {
        const ks_vec<T, VEC> v = xr[i];
        const ks_vec<TW, VEC> g = wr[i];
        ks_vec<TY, VEC> o;
#pragma unroll
        for (int e = 0; e < VEC; e++) ks_st(&o.v[e], ks_ld(v.v[e]) * inv * ks_ld(g.v[e]));
        yr[i] = o;
    }
}

// @kernel rmsnorm
if (blockIdx.x >= rows) return;  // uniform per block
ks_rmsnorm_row<cols, THREADS, VEC>(x, w, y, blockIdx.x, KS_EPS);
