// RMS norm (MLX Metal dialect, translated from tasks/rmsnorm/mlx/block_row.cu): one threadgroup of
// THREADS per row, VEC halves per access (half4 = 8-byte loads at VEC = 4), f32 sum of squares
// with simd_sum plus one threadgroup float per SIMD-group, the scale pass re-reads the row.
// Grid = rows * THREADS exactly: full threadgroups, every SIMD-group in the reduction.
// Tunables: THREADS, VEC (cols % VEC == 0 keeps every row aligned).
constexpr int NW = THREADS / 32;
constexpr int NV = cols / VEC;
threadgroup float part[32];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
if (row >= uint(rows)) return;  // uniform per threadgroup
const device half* xr = x + ulong(row) * ulong(cols);
device half* yr = y + ulong(row) * ulong(cols);
float ss = 0.0f;
for (uint i = tid; i < uint(NV); i += THREADS) {
    if (VEC == 4) {
        const float4 v = float4(*reinterpret_cast<const device half4*>(xr + i * VEC));
        ss += dot(v, v);
    } else if (VEC == 2) {
        const float2 v = float2(*reinterpret_cast<const device half2*>(xr + i * VEC));
        ss += dot(v, v);
    } else {
        const float v = float(xr[i]);
        ss = fma(v, v, ss);
    }
}
ss = simd_sum(ss);
if (lane == 0) part[sg] = ss;
threadgroup_barrier(mem_flags::mem_threadgroup);
ss = simd_sum(lane < uint(NW) ? part[lane] : 0.0f);
const float inv = metal::rsqrt(ss / float(cols) + KS_EPS);
for (uint i = tid; i < uint(NV); i += THREADS) {
    if (VEC == 4) {
        const float4 v = float4(*reinterpret_cast<const device half4*>(xr + i * VEC));
        const float4 g = float4(*reinterpret_cast<const device half4*>(w + i * VEC));
        *reinterpret_cast<device half4*>(yr + i * VEC) = half4(v * inv * g);
    } else if (VEC == 2) {
        const float2 v = float2(*reinterpret_cast<const device half2*>(xr + i * VEC));
        const float2 g = float2(*reinterpret_cast<const device half2*>(w + i * VEC));
        *reinterpret_cast<device half2*>(yr + i * VEC) = half2(v * inv * g);
    } else {
        yr[i] = half(float(xr[i]) * inv * float(w[i]));
    }
}
