// Mamba-1 decode step, vectorised along the state axis: for each (batch, channel) the N
// contiguous state elements are updated with an `omp simd` loop (vectorised exp, fused
// <Cm, state> reduction); UNROLL channels are interleaved per iteration for independent
// reductions. OpenMP (THREADS) over (batch, channel) rows.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef UNROLL
#define UNROLL 1       // channels handled together (independent reductions)
#endif
#ifndef FASTEXP
#define FASTEXP 0      // 1: polynomial exp that vectorises; 0: std::exp
#endif
#ifndef THREADS
#define THREADS 1
#endif

static inline float bits_to_float(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }

// exp(x) = 2^n * exp(r), |r| <= ln2/2, Cephes degree-6 polynomial (rel. error ~1e-7).
#pragma omp declare simd notinbranch
static inline float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float magic = 12582912.0f;
    const float nf = (x * 1.44269504088896341f + magic) - magic;
    float r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * bits_to_float(((int32_t)nf + 127) << 23);
}

#if FASTEXP
#define EXP(x) fast_exp(x)
#else
#define EXP(x) std::exp(x)
#endif

extern "C" void mamba_step(void** bufs, const int64_t* dims) {
    const float* u = static_cast<const float*>(bufs[0]);
    const float* delta = static_cast<const float*>(bufs[1]);
    const float* A = static_cast<const float*>(bufs[2]);
    const float* Bm = static_cast<const float*>(bufs[3]);
    const float* Cm = static_cast<const float*>(bufs[4]);
    const float* Dv = static_cast<const float*>(bufs[5]);
    const float* s0 = static_cast<const float*>(bufs[6]);
    float* y = static_cast<float*>(bufs[7]);
    float* s1 = static_cast<float*>(bufs[8]);
    const int64_t batch = dims[0], D = dims[1], N = dims[2];
    const int64_t nblk = (D + UNROLL - 1) / UNROLL;

#pragma omp parallel for num_threads(THREADS) if (THREADS > 1) schedule(static)
    for (int64_t task = 0; task < batch * nblk; task++) {
        const int64_t b = task / nblk, c0 = (task % nblk) * UNROLL;
        const float* bb = Bm + b * N;
        const float* cc = Cm + b * N;
        if (c0 + UNROLL <= D) {
            float dt[UNROLL], du[UNROLL], acc[UNROLL];
            for (int k = 0; k < UNROLL; k++) {
                const int64_t i = b * D + c0 + k;
                dt[k] = delta[i];
                du[k] = delta[i] * u[i];
                acc[k] = 0.0f;
            }
            for (int k = 0; k < UNROLL; k++) {
                const float* a = A + (c0 + k) * N;
                const float* si = s0 + (b * D + c0 + k) * N;
                float* so = s1 + (b * D + c0 + k) * N;
                float sum = 0.0f;
                const float dk = dt[k], uk = du[k];
#pragma omp simd reduction(+ : sum)
                for (int64_t s = 0; s < N; s++) {
                    const float v = EXP(dk * a[s]) * si[s] + uk * bb[s];
                    so[s] = v;
                    sum += cc[s] * v;
                }
                acc[k] = sum;
            }
            for (int k = 0; k < UNROLL; k++) {
                const int64_t i = b * D + c0 + k;
                y[i] = acc[k] + Dv[c0 + k] * u[i];
            }
        } else {
            for (int64_t c = c0; c < D; c++) {
                const int64_t i = b * D + c;
                const float dk = delta[i], uk = delta[i] * u[i];
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t s = 0; s < N; s++) {
                    const float v = EXP(dk * A[c * N + s]) * s0[i * N + s] + uk * bb[s];
                    s1[i * N + s] = v;
                    sum += cc[s] * v;
                }
                y[i] = sum + Dv[c] * u[i];
            }
        }
    }
}
