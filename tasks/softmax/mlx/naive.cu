// Seed (MLX CUDA dialect): one block of 256 threads per row, three passes over global memory
// (max, sum of expf, divide) with shared-memory tree reductions.
#define KS_NEG_INF __int_as_float(0xff800000)  // -inf (INFINITY is not defined under NVRTC)
__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void ks_st(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// @kernel softmax
constexpr int NT = 256;
__shared__ float red[NT];
const int row = blockIdx.x;
if (row >= rows) return;  // uniform per block
const long long r0 = (long long)row * cols;
float m = KS_NEG_INF;
for (int c = threadIdx.x; c < cols; c += NT) m = fmaxf(m, ks_ld(x[r0 + c]));
red[threadIdx.x] = m;
__syncthreads();
for (int s = NT / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
}
m = red[0];
__syncthreads();
float sum = 0.f;
for (int c = threadIdx.x; c < cols; c += NT) sum += expf(ks_ld(x[r0 + c]) - m);
red[threadIdx.x] = sum;
__syncthreads();
for (int s = NT / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
}
const float inv = 1.f / red[0];
for (int c = threadIdx.x; c < cols; c += NT) ks_st(y + r0 + c, expf(ks_ld(x[r0 + c]) - m) * inv);
