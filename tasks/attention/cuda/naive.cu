// Seed: one block per query row. Scores for the whole row in shared memory (L floats),
// block-wide max and sum, then each thread accumulates some output dimensions.
// f16 in/out (raw 16-bit words, converted with PTX cvt), f32 arithmetic. No headers.
// Grouped-query heads: query head h reads key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]).
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

#define NT 128

__device__ float block_reduce(float v, float* red, bool is_max) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float o = red[threadIdx.x + s];
            red[threadIdx.x] = is_max ? fmaxf(red[threadIdx.x], o) : red[threadIdx.x] + o;
        }
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

extern "C" __global__ void attention(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                     unsigned short* o, long long B, long long H, long long Hkv, long long L,
                                     long long D, long long causal) {
    extern __shared__ float sc[];  // L scores
    __shared__ float red[NT];
    long long row = blockIdx.x;    // (b*H + h)*L + i
    long long bh = row / L, i = row % L;
    long long kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);
    const unsigned short* qi = q + row * D;
    const unsigned short* K = k + kvh * L * D;
    const unsigned short* V = v + kvh * L * D;
    long long n = causal ? i + 1 : L;
    float scale = 1.0f / sqrtf((float)D);
    float mx = -INFINITY;
    for (long long j = threadIdx.x; j < n; j += NT) {
        float s = 0.f;
        for (long long d = 0; d < D; d++) s += h2f(qi[d]) * h2f(K[j * D + d]);
        s *= scale;
        sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_reduce(mx, red, true);
    float sum = 0.f;
    for (long long j = threadIdx.x; j < n; j += NT) {
        float p = expf(sc[j] - mx);
        sc[j] = p;
        sum += p;
    }
    sum = block_reduce(sum, red, false);
    float inv = 1.0f / sum;
    for (long long d = threadIdx.x; d < D; d += NT) {
        float acc = 0.f;
        for (long long j = 0; j < n; j++) acc += sc[j] * h2f(V[j * D + d]);
        o[row * D + d] = f2h(acc * inv);
    }
}
