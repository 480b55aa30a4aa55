// Seed: Mamba-1 decode step, one (batch, channel) at a time.
#include <cmath>
#include <cstdint>

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
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t c = 0; c < D; c++) {
            const int64_t i = b * D + c;
            float acc = 0.0f;
            for (int64_t s = 0; s < N; s++) {
                const int64_t j = i * N + s;
                s1[j] = std::exp(delta[i] * A[c * N + s]) * s0[j] + delta[i] * Bm[b * N + s] * u[i];
                acc += Cm[b * N + s] * s1[j];
            }
            y[i] = acc + Dv[c] * u[i];
        }
    }
}
