// Seed (MLX Metal dialect): one threadgroup of 256 threads per row, sum of squares with a
// threadgroup-memory tree reduction, then scale. f32 arithmetic.
constexpr int NT = 256;
threadgroup float red[NT];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
if (row >= uint(rows)) return;  // uniform per threadgroup
const ulong r0 = ulong(row) * ulong(cols);
float ss = 0.0f;
for (uint c = tid; c < uint(cols); c += NT) {
    const float v = float(x[r0 + c]);
    ss += v * v;
}
red[tid] = ss;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = NT / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
const float inv = metal::rsqrt(red[0] / float(cols) + KS_EPS);
for (uint c = tid; c < uint(cols); c += NT) y[r0 + c] = float(x[r0 + c]) * inv * float(w[c]);
