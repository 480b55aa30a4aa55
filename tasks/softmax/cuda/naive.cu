// Seed: one block of 256 threads per row, three passes over global memory (max, sum of expf,
// divide) with shared-memory tree reductions.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define NT 256
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    __shared__ float red[NT];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* yr = y + (long long)blockIdx.x * cols;
    float m = -INFINITY;
    for (long long c = threadIdx.x; c < cols; c += NT) m = fmaxf(m, xr[c]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.f;
    for (long long c = threadIdx.x; c < cols; c += NT) sum += expf(xr[c] - m);
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    float inv = 1.f / red[0];
    for (long long c = threadIdx.x; c < cols; c += NT) yr[c] = expf(xr[c] - m) * inv;
}
