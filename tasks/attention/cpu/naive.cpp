// Seed: scaled dot-product attention, one query row at a time: scores row, max, exp, sum,
// weighted sum of values. q, o: [B, H, L, D]; k, v: [B, Hkv, L, D] (query head h reads
// key/value head h / (H / Hkv)); dims: B, H, Hkv, L, D, causal.
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void attention(void** bufs, const int64_t* dims) {
    const float* q = static_cast<const float*>(bufs[0]);
    const float* k = static_cast<const float*>(bufs[1]);
    const float* v = static_cast<const float*>(bufs[2]);
    float* o = static_cast<float*>(bufs[3]);
    const int64_t B = dims[0], H = dims[1], Hkv = dims[2], L = dims[3], D = dims[4];
    const bool causal = dims[5] != 0;
    const float scale = 1.0f / std::sqrt((float)D);
    std::vector<float> s(L);
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t base = bh * L * D;
        const int64_t kvbase = ((bh / H) * Hkv + (bh % H) / (H / Hkv)) * L * D;
        for (int64_t i = 0; i < L; i++) {
            const float* qi = q + base + i * D;
            const int64_t n = causal ? i + 1 : L;
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float* kj = k + kvbase + j * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qi[d] * kj[d];
                s[j] = dot * scale;
                m = std::fmax(m, s[j]);
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                s[j] = std::exp(s[j] - m);
                sum += s[j];
            }
            float* oi = o + base + i * D;
            for (int64_t d = 0; d < D; d++) oi[d] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float p = s[j] / sum;
                const float* vj = v + kvbase + j * D;
                for (int64_t d = 0; d < D; d++) oi[d] += p * vj[d];
            }
        }
    }
}
