// A valid Metal kernel: row softmax, one threadgroup per row, 256 threads.
// Shows: threadgroup memory within 32 KB, SIMD-group reductions, exp2 with log2(e) folded in.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint THREADS = 256;

[[kernel, max_total_threads_per_threadgroup(THREADS)]]
void softmax_rows(device const float* x [[buffer(0)]],
                  device float* y [[buffer(1)]],
                  constant uint& cols [[buffer(2)]],
                  uint row [[threadgroup_position_in_grid]],
                  uint tid [[thread_index_in_threadgroup]],
                  uint lane [[thread_index_in_simdgroup]],
                  uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float partial[THREADS / 32];
  device const float* xr = x + row * cols;
  device float* yr = y + row * cols;

  float m = -INFINITY;
  for (uint c = tid; c < cols; c += THREADS) m = max(m, xr[c]);
  m = simd_max(m);
  if (lane == 0) partial[sg] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m = partial[lane < THREADS / 32 ? lane : 0];
  m = simd_max(m);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float ml = m * M_LOG2E_F;
  float s = 0.0f;
  for (uint c = tid; c < cols; c += THREADS) s += exp2(fma(xr[c], M_LOG2E_F, -ml));
  s = simd_sum(s);
  if (lane == 0) partial[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  s = lane < THREADS / 32 ? partial[lane] : 0.0f;
  s = simd_sum(s);

  const float inv = 1.0f / s;
  for (uint c = tid; c < cols; c += THREADS) yr[c] = exp2(fma(xr[c], M_LOG2E_F, -ml)) * inv;
}
