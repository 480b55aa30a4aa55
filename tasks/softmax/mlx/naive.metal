// Seed (MLX Metal dialect): one threadgroup of 256 threads per row, three passes over device
// memory (max, sum of exp, divide) with threadgroup-memory tree reductions.
constexpr int NT = 256;
threadgroup float red[NT];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
if (row >= uint(rows)) return;  // uniform per threadgroup
const ulong r0 = ulong(row) * ulong(cols);
float m = -INFINITY;
for (uint c = tid; c < uint(cols); c += NT) m = max(m, float(x[r0 + c]));
red[tid] = m;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = NT / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] = max(red[tid], red[tid + s]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
m = red[0];
threadgroup_barrier(mem_flags::mem_threadgroup);
float sum = 0.0f;
for (uint c = tid; c < uint(cols); c += NT) sum += metal::exp(float(x[r0 + c]) - m);
red[tid] = sum;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = NT / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
const float inv = 1.0f / red[0];
for (uint c = tid; c < uint(cols); c += NT) y[r0 + c] = metal::exp(float(x[r0 + c]) - m) * inv;
