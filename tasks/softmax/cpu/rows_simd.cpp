// Row softmax, vectorised with GCC vector extensions: VEC-lane max / sum accumulators,
// optional vectorised polynomial exp (exp2 range reduction), optional online variant
// (max and sum in one pass, rescaled per chunk), rows split over THREADS OpenMP threads.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef VEC
#define VEC 8          // lanes per vector (8 = 256-bit; 16 = 512-bit; 32 = two 512-bit)
#endif
#ifndef ONLINE
#define ONLINE 0       // 1: max and sum in one pass (chunk-wise rescaling), then one write pass
#endif
#ifndef FASTEXP
#define FASTEXP 0      // 1: polynomial exp on whole vectors; 0: std::exp lane by lane
#endif
#ifndef THREADS
#define THREADS 1
#endif

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef int32_t vi __attribute__((vector_size(VEC * 4)));

static inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return vf{} + x; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2 / 2, Cephes degree-6 polynomial
// (relative error ~1e-7). x is clamped to [-87.3, 88.3] (exp(-inf) gives ~1e-38, not 0).
static inline vf vexp(vf x) {
#if FASTEXP
    x = x < -87.3f ? vsplat(-87.3f) : x;
    x = x > 88.3f ? vsplat(88.3f) : x;
    const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const vf nf = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi e = (__builtin_convertvector(nf, vi) + 127) << 23;
    return p * (vf)e;
#else
    vf y;
    for (int k = 0; k < VEC; k++) y[k] = std::exp(x[k]);
    return y;
#endif
}
static inline float sexp(float x) {
#if FASTEXP
    return vexp(vsplat(x))[0];
#else
    return std::exp(x);
#endif
}

static inline float row_max(const float* x, int64_t n) {
    vf m = vsplat(-INFINITY);
    int64_t c = 0;
    for (; c + VEC <= n; c += VEC) m = vmax(m, vload(x + c));
    float r = -INFINITY;
    for (int k = 0; k < VEC; k++) r = m[k] > r ? m[k] : r;
    for (; c < n; c++) r = x[c] > r ? x[c] : r;
    return r;
}

// Sum of exp(x - m); if STORE, also writes the exponentials to y.
template <bool STORE>
static inline float exp_sum(const float* x, float* y, int64_t n, float m) {
    vf s = vf{};
    const vf mv = vsplat(m);
    int64_t c = 0;
    for (; c + VEC <= n; c += VEC) {
        const vf e = vexp(vload(x + c) - mv);
        s += e;
        if (STORE) vstore(y + c, e);
    }
    float r = 0.0f;
    for (int k = 0; k < VEC; k++) r += s[k];
    for (; c < n; c++) {
        const float e = sexp(x[c] - m);
        r += e;
        if (STORE) y[c] = e;
    }
    return r;
}

static void softmax_row(const float* x, float* y, int64_t n) {
#if ONLINE
    const int64_t CH = 1024;  // chunk re-read from L1
    float m = -INFINITY, s = 0.0f;
    for (int64_t c0 = 0; c0 < n; c0 += CH) {
        const int64_t len = n - c0 < CH ? n - c0 : CH;
        const float cm = row_max(x + c0, len);
        if (cm > m) {
            s = m == -INFINITY ? 0.0f : s * std::exp(m - cm);
            m = cm;
        }
        s += exp_sum<false>(x + c0, nullptr, len, m);
    }
    const float inv = 1.0f / s;
    const vf mv = vsplat(m);
    int64_t c = 0;
    for (; c + VEC <= n; c += VEC) vstore(y + c, vexp(vload(x + c) - mv) * inv);
    for (; c < n; c++) y[c] = sexp(x[c] - m) * inv;
#else
    const float m = row_max(x, n);
    const float inv = 1.0f / exp_sum<true>(x, y, n, m);
    int64_t c = 0;
    for (; c + VEC <= n; c += VEC) vstore(y + c, vload(y + c) * inv);
    for (; c < n; c++) y[c] *= inv;
#endif
}

extern "C" void softmax(void** bufs, const int64_t* dims) {
    const float* x = static_cast<const float*>(bufs[0]);
    float* y = static_cast<float*>(bufs[1]);
    const int64_t rows = dims[0], cols = dims[1];
#pragma omp parallel for num_threads(THREADS) if (THREADS > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) softmax_row(x + r * cols, y + r * cols, cols);
}
