// One block per row: VEC-wide (float4) coalesced loads, warp-shuffle + shared-memory reductions.
// ONLINE=1: one read pass keeps a running (max, sum) per thread, merged across the block;
// ONLINE=0: separate max and sum passes. The write pass re-reads the row (L1/L2 hits).
// Tunables: THREADS, VEC (needs cols % VEC == 0 for aligned rows), ONLINE.
#ifndef THREADS
#define THREADS 256
#endif
#ifndef VEC
#define VEC 4
#endif
#ifndef ONLINE
#define ONLINE 1
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define NW (THREADS / 32)
#define L2E 1.4426950408889634f
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

template <int V> struct vecf;
template <> struct vecf<1> { typedef float t; };
template <> struct vecf<2> { typedef float2 t; };
template <> struct vecf<4> { typedef float4 t; };

// merge (m, s) pairs: s scaled to the larger max
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;
    s = s * ex2((m - mn) * L2E) + s2 * ex2((m2 - mn) * L2E);
    m = mn;
}

__device__ __forceinline__ void block_ms(float& m, float& s, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        merge(m, s, m2, s2);
    }
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    if (l == 0) { sm[w] = m; sm[NW + w] = s; }
    __syncthreads();
    m = -INFINITY; s = 0.f;
    for (int i = 0; i < NW; i++) merge(m, s, sm[i], sm[NW + i]);
}

__device__ __forceinline__ float block_max(float m, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (threadIdx.x % 32 == 0) sm[threadIdx.x / 32] = m;
    __syncthreads();
    m = -INFINITY;
    for (int i = 0; i < NW; i++) m = fmaxf(m, sm[i]);
    __syncthreads();
    return m;
}
__device__ __forceinline__ float block_sum(float s, float* sm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (threadIdx.x % 32 == 0) sm[NW + threadIdx.x / 32] = s;
    __syncthreads();
    s = 0.f;
    for (int i = 0; i < NW; i++) s += sm[NW + i];
    return s;
}

extern "C" __global__ void __launch_bounds__(THREADS) softmax(const float* __restrict__ x, float* __restrict__ y,
                                                              long long rows, long long cols) {
    typedef typename vecf<VEC>::t VT;
    __shared__ float sm[2 * NW];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* yr = y + (long long)blockIdx.x * cols;
    const int nv = (int)(cols / VEC);
    float m = -INFINITY, s = 0.f;
#if ONLINE
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        float v[VEC];
        *(VT*)v = __ldg((const VT*)xr + i);
        float vm = v[0];
#pragma unroll
        for (int e = 1; e < VEC; e++) vm = fmaxf(vm, v[e]);
        float mn = fmaxf(m, vm);
        s *= ex2((m - mn) * L2E);
#pragma unroll
        for (int e = 0; e < VEC; e++) s += ex2((v[e] - mn) * L2E);
        m = mn;
    }
    block_ms(m, s, sm);
#else
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        float v[VEC];
        *(VT*)v = __ldg((const VT*)xr + i);
#pragma unroll
        for (int e = 0; e < VEC; e++) m = fmaxf(m, v[e]);
    }
    m = block_max(m, sm);
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        float v[VEC];
        *(VT*)v = __ldg((const VT*)xr + i);
#pragma unroll
        for (int e = 0; e < VEC; e++) s += ex2((v[e] - m) * L2E);
    }
    s = block_sum(s, sm);
#endif
    const float inv = 1.f / s;
    const float mb = m * L2E;
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        float v[VEC];
        *(VT*)v = __ldg((const VT*)xr + i);
#pragma unroll
        for (int e = 0; e < VEC; e++) v[e] = ex2(fmaf(v[e], L2E, -mb)) * inv;
        __stcs((VT*)yr + i, *(VT*)v);
    }
}
