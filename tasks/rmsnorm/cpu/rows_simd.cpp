// RMS norm, vectorised with GCC vector extensions: the sum of squares uses ACC independent
// VEC-lane accumulators (breaks the add dependency chain), the scale pass multiplies whole
// vectors; rows split over THREADS OpenMP threads.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef KS_EPS
#define KS_EPS 1e-5
#endif
#ifndef VEC
#define VEC 8       // lanes per vector
#endif
#ifndef ACC
#define ACC 1       // independent vector accumulators in the sum of squares
#endif
#ifndef THREADS
#define THREADS 1
#endif

typedef float vf __attribute__((vector_size(VEC * 4)));

static inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

static void rms_row(const float* x, const float* w, float* y, int64_t n) {
    vf acc[ACC];
    for (int a = 0; a < ACC; a++) acc[a] = vf{};
    int64_t c = 0;
    for (; c + ACC * VEC <= n; c += ACC * VEC)
        for (int a = 0; a < ACC; a++) {
            const vf v = vload(x + c + a * VEC);
            acc[a] += v * v;
        }
    for (; c + VEC <= n; c += VEC) {
        const vf v = vload(x + c);
        acc[0] += v * v;
    }
    for (int a = 1; a < ACC; a++) acc[0] += acc[a];
    float ss = 0.0f;
    for (int k = 0; k < VEC; k++) ss += acc[0][k];
    for (; c < n; c++) ss += x[c] * x[c];
    const float inv = 1.0f / std::sqrt(ss / (float)n + (float)KS_EPS);
    c = 0;
    for (; c + VEC <= n; c += VEC) vstore(y + c, vload(x + c) * inv * vload(w + c));
    for (; c < n; c++) y[c] = x[c] * inv * w[c];
}

extern "C" void rmsnorm(void** bufs, const int64_t* dims) {
    const float* x = static_cast<const float*>(bufs[0]);
    const float* w = static_cast<const float*>(bufs[1]);
    float* y = static_cast<float*>(bufs[2]);
    const int64_t rows = dims[0], cols = dims[1];
#pragma omp parallel for num_threads(THREADS) if (THREADS > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * cols, w, y + r * cols, cols);
}
