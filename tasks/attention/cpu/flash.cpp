// Flash-style attention on the CPU: per (batch, key/value head), K is transposed and V padded
// once (grouped-query heads: query head h reads key/value head h / (H / Hkv));
// each block of BQ query rows walks the keys in blocks of BK with an online softmax
// (running max / sum, accumulator rescaled per block). The score tile S = Q K^T and the
// P V update are register-blocked with GCC vector extensions (16 lanes). Blocks above the
// causal diagonal are skipped. OpenMP (THREADS) over (batch, head, query block).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef BQ
#define BQ 2           // query rows per block
#endif
#ifndef BK
#define BK 16          // keys per block (multiple of 16)
#endif
#ifndef FASTEXP
#define FASTEXP 0      // 1: vectorised polynomial exp; 0: std::exp lane by lane
#endif
#ifndef THREADS
#define THREADS 1
#endif

#define W 16
#define NKV (BK / W)
static_assert(BK % W == 0, "BK must be a multiple of 16");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

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
    for (int k = 0; k < W; k++) y[k] = std::exp(x[k]);
    return y;
#endif
}

static std::vector<float> g_buf;

extern "C" void attention(void** bufs, const int64_t* dims) {
    const float* q = static_cast<const float*>(bufs[0]);
    const float* k = static_cast<const float*>(bufs[1]);
    const float* v = static_cast<const float*>(bufs[2]);
    float* o = static_cast<float*>(bufs[3]);
    const int64_t B = dims[0], H = dims[1], Hkv = dims[2], L = dims[3], D = dims[4];
    const bool causal = dims[5] != 0;
    const float scale = 1.0f / std::sqrt((float)D);
    const int64_t BHn = B * H, BKn = B * Hkv, G = H / Hkv;
    const int64_t Lk = (L + BK - 1) / BK * BK;   // keys padded to a multiple of BK
    const int64_t Lq = (L + BQ - 1) / BQ * BQ;   // queries padded to a multiple of BQ
    const int64_t Dp = (D + W - 1) / W * W;      // head dim padded to a multiple of 16
    const int64_t kvper = D * Lk + Lk * Dp;      // per key/value head: Kt [D][Lk], Vp [Lk][Dp]
    const int64_t qper = Lq * D;                 // per query head: Qs [Lq][D]
    if ((int64_t)g_buf.size() < BKn * kvper + BHn * qper) g_buf.resize(BKn * kvper + BHn * qper);
    float* kvbuf = g_buf.data();
    float* qbuf = kvbuf + BKn * kvper;

#pragma omp parallel num_threads(THREADS) if (THREADS > 1)
    {
#pragma omp for schedule(static)
        for (int64_t x = 0; x < BKn + BHn; x++) {
            if (x < BKn) {
                const float* kb = k + x * L * D;
                const float* vb = v + x * L * D;
                float* Kt = kvbuf + x * kvper;
                float* Vp = Kt + D * Lk;
                for (int64_t d = 0; d < D; d++) {
                    for (int64_t j = 0; j < L; j++) Kt[d * Lk + j] = kb[j * D + d];
                    for (int64_t j = L; j < Lk; j++) Kt[d * Lk + j] = 0.0f;
                }
                for (int64_t j = 0; j < Lk; j++)
                    for (int64_t d = 0; d < Dp; d++) Vp[j * Dp + d] = (j < L && d < D) ? vb[j * D + d] : 0.0f;
            } else {
                const int64_t bh = x - BKn;
                const float* qb = q + bh * L * D;
                float* Qs = qbuf + bh * qper;
                for (int64_t i = 0; i < Lq; i++)
                    for (int64_t d = 0; d < D; d++) Qs[i * D + d] = i < L ? qb[i * D + d] * scale : 0.0f;
            }
        }

        std::vector<float> oacc_v(BQ * Dp);
        float* oacc = oacc_v.data();
        vi lane;
        for (int t = 0; t < W; t++) lane[t] = t;
        const int64_t nqb = Lq / BQ;

#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < BHn * nqb; task++) {
            const int64_t bh = task / nqb, i0 = (task % nqb) * BQ;
            const float* Kt = kvbuf + ((bh / H) * Hkv + (bh % H) / G) * kvper;
            const float* Vp = Kt + D * Lk;
            const float* Qs = qbuf + bh * qper;
            float m[BQ], l[BQ];
            for (int r = 0; r < BQ; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
            for (int64_t x = 0; x < BQ * Dp; x++) oacc[x] = 0.0f;
            const int64_t jend = causal ? (i0 + BQ < L ? i0 + BQ : L) : L;

            for (int64_t j0 = 0; j0 < jend; j0 += BK) {
                // S = (Q * scale) K^T for BQ x BK, accumulated over d in registers.
                vf S[BQ][NKV];
                for (int r = 0; r < BQ; r++)
                    for (int c = 0; c < NKV; c++) S[r][c] = vf{};
                for (int64_t d = 0; d < D; d++) {
                    vf kv[NKV];
                    for (int c = 0; c < NKV; c++) kv[c] = vload(Kt + d * Lk + j0 + c * W);
                    for (int r = 0; r < BQ; r++) {
                        const float qv = Qs[(i0 + r) * D + d];
                        for (int c = 0; c < NKV; c++) S[r][c] += qv * kv[c];
                    }
                }
                const bool edge = j0 + BK > L || (causal && j0 + BK > i0 + 1);
                for (int r = 0; r < BQ; r++) {
                    const int64_t i = i0 + r;
                    // keys allowed for this row: j < lim
                    const int64_t lim = causal ? (i + 1 < L ? i + 1 : L) : L;
                    vi ok[NKV];
                    if (edge)
                        for (int c = 0; c < NKV; c++) {
                            ok[c] = (lane + (int32_t)(j0 + c * W)) < (int32_t)lim;
                            S[r][c] = ok[c] ? S[r][c] : vsplat(-INFINITY);
                        }
                    vf mx = S[r][0];
                    for (int c = 1; c < NKV; c++) mx = mx > S[r][c] ? mx : S[r][c];
                    float bm = m[r];
                    for (int t = 0; t < W; t++) bm = mx[t] > bm ? mx[t] : bm;
                    if (bm == -INFINITY) {  // row has no key in this block (padded row)
                        for (int c = 0; c < NKV; c++) S[r][c] = vf{};
                        continue;
                    }
                    const float alpha = std::exp(m[r] - bm);  // 0 on the first block
                    m[r] = bm;
                    vf ps = vf{};
                    for (int c = 0; c < NKV; c++) {
                        vf p = vexp(S[r][c] - bm);
                        if (edge) p = ok[c] ? p : vf{};
                        S[r][c] = p;
                        ps += p;
                    }
                    float s = 0.0f;
                    for (int t = 0; t < W; t++) s += ps[t];
                    l[r] = l[r] * alpha + s;
                    if (alpha != 1.0f)
                        for (int64_t d = 0; d < Dp; d += W)
                            vstore(oacc + r * Dp + d, vload(oacc + r * Dp + d) * alpha);
                }
                // oacc += P V, register-blocked over BQ rows x 16 columns of the head dim.
                const int64_t jn = (jend - j0) < BK ? (jend - j0) : BK;
                for (int64_t d = 0; d < Dp; d += W) {
                    vf acc[BQ];
                    for (int r = 0; r < BQ; r++) acc[r] = vload(oacc + r * Dp + d);
                    for (int64_t j = 0; j < jn; j++) {
                        const vf vv = vload(Vp + (j0 + j) * Dp + d);
                        for (int r = 0; r < BQ; r++) acc[r] += S[r][j / W][j % W] * vv;
                    }
                    for (int r = 0; r < BQ; r++) vstore(oacc + r * Dp + d, acc[r]);
                }
            }
            for (int r = 0; r < BQ; r++) {
                const int64_t i = i0 + r;
                if (i >= L) break;
                const float inv = 1.0f / l[r];
                float* oi = o + (bh * L + i) * D;
                for (int64_t d = 0; d < D; d++) oi[d] = oacc[r * Dp + d] * inv;
            }
        }
    }
}
