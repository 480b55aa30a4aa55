// Seed: RMS norm per row, y = x / sqrt(mean(x^2) + eps) * w, single-threaded.
#include <cmath>
#include <cstdint>

#ifndef KS_EPS
#define KS_EPS 1e-5
#endif

extern "C" void rmsnorm(void** bufs, const int64_t* dims) {
    const float* x = static_cast<const float*>(bufs[0]);
    const float* w = static_cast<const float*>(bufs[1]);
    float* y = static_cast<float*>(bufs[2]);
    const int64_t rows = dims[0], cols = dims[1];
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        float ss = 0.0f;
        for (int64_t c = 0; c < cols; c++) ss += xr[c] * xr[c];
        const float inv = 1.0f / std::sqrt(ss / (float)cols + (float)KS_EPS);
        for (int64_t c = 0; c < cols; c++) yr[c] = xr[c] * inv * w[c];
    }
}
