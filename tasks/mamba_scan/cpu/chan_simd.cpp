// Mamba-1 selective scan, vectorised across channels: a block of NB * VEC channels keeps its
// N x (NB * VEC) state in vectors (GCC vector extensions) and walks time once; exp(delta * A)
// is evaluated on whole vectors (optionally with a polynomial exp). A is transposed to
// [N][D] once so that channel-contiguous loads work. OpenMP (THREADS) over (batch, block).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef VEC
#define VEC 8          // lanes (channels) per vector
#endif
#ifndef NB
#define NB 1           // vectors per channel block (independent recurrences in flight)
#endif
#ifndef FASTEXP
#define FASTEXP 0      // 1: vectorised polynomial exp; 0: std::exp lane by lane
#endif
#ifndef THREADS
#define THREADS 1
#endif

#define CB (NB * VEC)  // channels per block

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef int32_t vi __attribute__((vector_size(VEC * 4)));

static inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return vf{} + x; }

// exp(x) = 2^n * exp(r), |r| <= ln2/2, Cephes degree-6 polynomial (rel. error ~1e-7).
static inline vf vexp(vf x) {
#if FASTEXP
    x = x < -87.3f ? vsplat(-87.3f) : x;
    x = x > 88.3f ? vsplat(88.3f) : x;
    const float magic = 12582912.0f;
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

extern "C" void mamba_scan(void** bufs, const int64_t* dims) {
    const float* u = static_cast<const float*>(bufs[0]);
    const float* delta = static_cast<const float*>(bufs[1]);
    const float* A = static_cast<const float*>(bufs[2]);
    const float* Bm = static_cast<const float*>(bufs[3]);
    const float* Cm = static_cast<const float*>(bufs[4]);
    const float* Dv = static_cast<const float*>(bufs[5]);
    float* y = static_cast<float*>(bufs[6]);
    float* state = static_cast<float*>(bufs[7]);
    const int64_t batch = dims[0], L = dims[1], D = dims[2], N = dims[3];
    const int64_t nblk = (D + CB - 1) / CB;
    const int64_t Dp = nblk * CB;

    // AT[s][c] = A[c][s], padded channels get A = -1 (their delta is 0, so they stay at 0).
    std::vector<float> AT(N * Dp), DvP(Dp);
    for (int64_t s = 0; s < N; s++)
        for (int64_t c = 0; c < Dp; c++) AT[s * Dp + c] = c < D ? A[c * N + s] : -1.0f;
    for (int64_t c = 0; c < Dp; c++) DvP[c] = c < D ? Dv[c] : 0.0f;

#pragma omp parallel num_threads(THREADS) if (THREADS > 1)
    {
        std::vector<vf> hv(N * NB);
        vf* h = hv.data();
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * nblk; task++) {
            const int64_t b = task / nblk, c0 = (task % nblk) * CB;
            const int64_t nc = D - c0 < CB ? D - c0 : CB;  // valid channels in this block
            for (int64_t x = 0; x < N * NB; x++) h[x] = vf{};
            vf dv[NB];
            for (int k = 0; k < NB; k++) dv[k] = vload(&DvP[c0 + k * VEC]);
            for (int64_t t = 0; t < L; t++) {
                const int64_t row = (b * L + t) * D + c0;
                vf dl[NB], uu[NB], du[NB], acc[NB];
                if (nc == CB) {
                    for (int k = 0; k < NB; k++) {
                        dl[k] = vload(delta + row + k * VEC);
                        uu[k] = vload(u + row + k * VEC);
                    }
                } else {
                    float tdl[CB], tu[CB];
                    for (int64_t c = 0; c < CB; c++) {
                        tdl[c] = c < nc ? delta[row + c] : 0.0f;
                        tu[c] = c < nc ? u[row + c] : 0.0f;
                    }
                    for (int k = 0; k < NB; k++) {
                        dl[k] = vload(tdl + k * VEC);
                        uu[k] = vload(tu + k * VEC);
                    }
                }
                for (int k = 0; k < NB; k++) { du[k] = dl[k] * uu[k]; acc[k] = vf{}; }
                const float* bt = Bm + (b * L + t) * N;
                const float* ct = Cm + (b * L + t) * N;
                for (int64_t s = 0; s < N; s++) {
                    const float bs = bt[s], cs = ct[s];
                    for (int k = 0; k < NB; k++) {
                        const vf dA = vexp(dl[k] * vload(&AT[s * Dp + c0 + k * VEC]));
                        const vf hn = dA * h[s * NB + k] + du[k] * bs;
                        h[s * NB + k] = hn;
                        acc[k] += cs * hn;
                    }
                }
                if (nc == CB) {
                    for (int k = 0; k < NB; k++) vstore(y + row + k * VEC, acc[k] + dv[k] * uu[k]);
                } else {
                    float ty[CB];
                    for (int k = 0; k < NB; k++) vstore(ty + k * VEC, acc[k] + dv[k] * uu[k]);
                    for (int64_t c = 0; c < nc; c++) y[row + c] = ty[c];
                }
            }
            for (int64_t c = 0; c < nc; c++)
                for (int64_t s = 0; s < N; s++)
                    state[(b * D + c0 + c) * N + s] = h[s * NB + c / VEC][c % VEC];
        }
    }
}
