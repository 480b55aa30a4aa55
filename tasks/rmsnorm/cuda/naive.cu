// Seed: one block of 256 threads per row: sum of squares with a shared-memory tree reduction,
// then scale. f16 as raw words (PTX cvt), f32 arithmetic.
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#ifndef KS_EPS
#define KS_EPS 1e-5
#endif
#define NT 256
extern "C" __global__ void rmsnorm(const unsigned short* x, const unsigned short* w, unsigned short* y,
                                   long long rows, long long cols) {
    __shared__ float red[NT];
    const unsigned short* xr = x + (long long)blockIdx.x * cols;
    unsigned short* yr = y + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (long long c = threadIdx.x; c < cols; c += NT) { float v = h2f(xr[c]); ss += v * v; }
    red[threadIdx.x] = ss;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    float inv = rsqrtf(red[0] / (float)cols + (float)KS_EPS);
    for (long long c = threadIdx.x; c < cols; c += NT) yr[c] = f2h(h2f(xr[c]) * inv * h2f(w[c]));
}
