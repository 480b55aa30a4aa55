// Seed (MLX CUDA dialect): one block of 128 threads per query row. All scores of the row in
// dynamic shared memory (L floats), block max and sum, expf, then each thread accumulates some
// output dimensions. f32 arithmetic. Grouped-query heads: query head h reads key/value head
// h / (H / Hkv) (k, v: [B, Hkv, L, D]).
#define KS_NEG_INF __int_as_float(0xff800000)  // -inf (INFINITY is not defined under NVRTC)
__device__ __forceinline__ float ks_ld(float x) { return x; }
__device__ __forceinline__ float ks_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ks_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void ks_st(float* p, float x) { *p = x; }
__device__ __forceinline__ void ks_st(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void ks_st(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Block-wide max (is_max) or sum through red[NT]; every thread gets the result.
template <int NT> __device__ float ks_block_reduce(float x, float* red, bool is_max) {
    red[threadIdx.x] = x;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float w = red[threadIdx.x + s];
            red[threadIdx.x] = is_max ? fmaxf(red[threadIdx.x], w) : red[threadIdx.x] + w;
        }
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

// @kernel attention
constexpr int NT = 128;
extern __shared__ float scores[];  // L floats
__shared__ float red[NT];
const long long row = blockIdx.x;  // (b * H + h) * L + i
if (row >= (long long)B * H * L) return;  // uniform per block
const long long bh = row / L, i = row % L;
const long long kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);
const long long nk = causal ? i + 1 : L;
const float scale = rsqrtf((float)D);
float mx = KS_NEG_INF;
for (long long j = threadIdx.x; j < nk; j += NT) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += ks_ld(q[row * D + d]) * ks_ld(k[(kvh * L + j) * D + d]);
    s *= scale;
    scores[j] = s;
    mx = fmaxf(mx, s);
}
mx = ks_block_reduce<NT>(mx, red, true);
float sum = 0.f;
for (long long j = threadIdx.x; j < nk; j += NT) {
    const float p = expf(scores[j] - mx);
    scores[j] = p;
    sum += p;
}
sum = ks_block_reduce<NT>(sum, red, false);
const float inv = 1.f / sum;
for (int d = threadIdx.x; d < D; d += NT) {
    float acc = 0.f;
    for (long long j = 0; j < nk; j++) acc += scores[j] * ks_ld(v[(kvh * L + j) * D + d]);
    ks_st(o + row * D + d, acc * inv);
}
