// Seed: row softmax in three passes (max, sum of exp, normalise), single-threaded.
#include <cmath>
#include <cstdint>

extern "C" void softmax(void** bufs, const int64_t* dims) {
    const float* x = static_cast<const float*>(bufs[0]);
    float* y = static_cast<float*>(bufs[1]);
    const int64_t rows = dims[0], cols = dims[1];
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        float m = -INFINITY;
        for (int64_t c = 0; c < cols; c++) m = std::fmax(m, xr[c]);
        float s = 0.0f;
        for (int64_t c = 0; c < cols; c++) {
            yr[c] = std::exp(xr[c] - m);
            s += yr[c];
        }
        for (int64_t c = 0; c < cols; c++) yr[c] /= s;
    }
}
