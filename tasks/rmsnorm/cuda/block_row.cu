// One block per row, VEC halves per access (VEC=8: 16-byte loads), sum of squares in f32 with
// warp shuffles + shared memory, the row re-read for the scale pass (L1/L2 hits).
// Tunables: THREADS, VEC (needs cols % VEC == 0).
#ifndef THREADS
#define THREADS 128
#endif
#ifndef VEC
#define VEC 8
#endif
#ifndef KS_EPS
#define KS_EPS 1e-5
#endif
#define NW (THREADS / 32)
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

template <int V> struct vech;
template <> struct vech<1> { typedef unsigned short t; };
template <> struct vech<2> { typedef unsigned t; };
template <> struct vech<4> { typedef uint2 t; };
template <> struct vech<8> { typedef uint4 t; };

extern "C" __global__ void __launch_bounds__(THREADS) rmsnorm(const unsigned short* __restrict__ x,
                                                              const unsigned short* __restrict__ w,
                                                              unsigned short* __restrict__ y, long long rows,
                                                              long long cols) {
    typedef typename vech<VEC>::t VT;
    __shared__ float sm[NW];
    const VT* xr = (const VT*)(x + (long long)blockIdx.x * cols);
    VT* yr = (VT*)(y + (long long)blockIdx.x * cols);
    const VT* wr = (const VT*)w;
    const int nv = (int)(cols / VEC);
    float ss = 0.f;
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        unsigned short v[VEC];
        *(VT*)v = __ldg(xr + i);
#pragma unroll
        for (int e = 0; e < VEC; e++) { float f = h2f(v[e]); ss = fmaf(f, f, ss); }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (threadIdx.x % 32 == 0) sm[threadIdx.x / 32] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) ss += sm[i];
    const float inv = rsqrtf(ss / (float)cols + (float)KS_EPS);
    for (int i = threadIdx.x; i < nv; i += THREADS) {
        unsigned short v[VEC], g[VEC];
        *(VT*)v = __ldg(xr + i);
        *(VT*)g = __ldg(wr + i);
#pragma unroll
        for (int e = 0; e < VEC; e++) v[e] = f2h(h2f(v[e]) * inv * h2f(g[e]));
        yr[i] = *(VT*)v;
    }
}
