// A Metal kernel that must be rejected: 40 KB of threadgroup memory (two 80x64 float tiles),
// above the 32 KB every Apple GPU allows. The tiles are sized like a CUDA kernel's 48 KB of
// shared memory; on Apple silicon they must be re-tiled (e.g. 32x64, or half precision).
#include <metal_stdlib>
using namespace metal;
#define TILE_ROWS 80
#define HEAD_DIM 64
[[kernel]] void tile_copy(device const float* k [[buffer(0)]],
                          device const float* v [[buffer(1)]],
                          device float* out [[buffer(2)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float k_tile[TILE_ROWS][HEAD_DIM];
  threadgroup float v_tile[TILE_ROWS][HEAD_DIM];
  for (uint i = tid; i < TILE_ROWS * HEAD_DIM; i += 256) {
    k_tile[i / HEAD_DIM][i % HEAD_DIM] = k[i];
    v_tile[i / HEAD_DIM][i % HEAD_DIM] = v[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = k_tile[tid % TILE_ROWS][0] + v_tile[0][tid % HEAD_DIM];
}
