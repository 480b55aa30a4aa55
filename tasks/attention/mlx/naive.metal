// Seed (MLX Metal dialect): one threadgroup of 128 threads per query row. All scores of the row in
// threadgroup memory (L floats: L <= 7936 keeps it within 32 KB), threadgroup max and sum, exp,
// then each thread accumulates some output dimensions. f32 arithmetic. Grouped-query heads: query
// head h reads key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]).

// Threadgroup-wide max (is_max) or sum through red[NT]; every thread gets the result.
template <int NT> inline float ks_tg_reduce(float x, threadgroup float* red, uint tid, bool is_max) {
    red[tid] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = NT / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = is_max ? max(red[tid], red[tid + s]) : red[tid] + red[tid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const float r = red[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return r;
}

// @kernel attention
constexpr int NT = 128;
threadgroup float scores[L];
threadgroup float red[NT];
const uint rowi = threadgroup_position_in_grid.x;  // (b * H + h) * L + i
const uint tid = thread_position_in_threadgroup.x;
if (rowi >= uint(B * H * L)) return;  // uniform per threadgroup
const uint bh = rowi / L, i = rowi % L;
const uint kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);
const uint nk = causal ? i + 1 : uint(L);
const float scale = metal::rsqrt(float(D));
float mx = -INFINITY;
for (uint j = tid; j < nk; j += NT) {
    float s = 0.0f;
    for (int d = 0; d < D; d++) s += float(q[ulong(rowi) * D + d]) * float(k[(ulong(kvh) * L + j) * D + d]);
    s *= scale;
    scores[j] = s;
    mx = max(mx, s);
}
mx = ks_tg_reduce<NT>(mx, red, tid, true);
float sum = 0.0f;
for (uint j = tid; j < nk; j += NT) {
    const float p = metal::exp(scores[j] - mx);
    scores[j] = p;
    sum += p;
}
sum = ks_tg_reduce<NT>(sum, red, tid, false);
const float inv = 1.0f / sum;
for (uint d = tid; d < uint(D); d += NT) {
    float acc = 0.0f;
    for (uint j = 0; j < nk; j++) acc += scores[j] * float(v[(ulong(kvh) * L + j) * D + d]);
    o[ulong(rowi) * D + d] = acc * inv;
}
