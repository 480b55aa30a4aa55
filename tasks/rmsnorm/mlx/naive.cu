// Seed (MLX CUDA dialect): one block of 256 threads per row, sum of squares with a shared-memory
// tree reduction, then scale. f32 arithmetic.
__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void ks_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// @kernel rmsnorm
constexpr int NT = 256;
__shared__ float red[NT];
const int row = blockIdx.x;
if (row >= rows) return;  // uniform per block
const long long r0 = (long long)row * cols;
float ss = 0.f;
for (int c = threadIdx.x; c < cols; c += NT) {
    const float v = ks_ld(x[r0 + c]);
    ss += v * v;
}
red[threadIdx.x] = ss;
__syncthreads();
for (int s = NT / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
}
const float inv = rsqrtf(red[0] / (float)cols + KS_EPS);
for (int c = threadIdx.x; c < cols; c += NT) ks_st(y + r0 + c, ks_ld(x[r0 + c]) * inv * ks_ld(w[c]));
