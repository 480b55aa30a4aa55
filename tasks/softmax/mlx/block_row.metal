// Row softmax (MLX Metal dialect, translated from tasks/softmax/mlx/block_row.cu): one threadgroup
// of THREADS per row, VEC floats per access (float4 at VEC = 4), simd_max / simd_sum plus one
// threadgroup float per SIMD-group for the cross-SIMD-group step, exp2 with a log2(e) prescale
// (metal::fast::exp2). ONLINE = 1: one read pass with a running (max, sum) per thread, merged
// across the threadgroup; ONLINE = 0: separate max and sum passes. The write pass re-reads the row.
// Grid = rows * THREADS exactly, so every threadgroup is full (MLX dispatches non-uniform
// threadgroups otherwise) and every SIMD-group takes part in the reductions.
// Tunables: THREADS, VEC (cols % VEC == 0 keeps every row float4-aligned), ONLINE.

// (m, s) pairs: s scaled to the larger max
inline void ks_merge(thread float& m, thread float& s, float m2, float s2) {
    const float mn = max(m, m2);
    if (mn == -INFINITY) return;
    s = s * metal::fast::exp2((m - mn) * M_LOG2E_F) + s2 * metal::fast::exp2((m2 - mn) * M_LOG2E_F);
    m = mn;
}

// @kernel softmax
constexpr int NW = THREADS / 32;
constexpr int NV = cols / VEC;
threadgroup float pm[32];
threadgroup float ps[32];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
if (row >= uint(rows)) return;  // uniform per threadgroup
const device float* xr = x + ulong(row) * ulong(cols);
device float* yr = y + ulong(row) * ulong(cols);
float m = -INFINITY, s = 0.0f;
if (ONLINE) {
    for (uint i = tid; i < uint(NV); i += THREADS) {
        float v[VEC];
        if (VEC == 4) {
            const float4 w = *reinterpret_cast<const device float4*>(xr + i * VEC);
            v[0] = w.x; v[VEC > 1 ? 1 : 0] = w.y; v[VEC > 2 ? 2 : 0] = w.z; v[VEC > 3 ? 3 : 0] = w.w;
        } else {
            for (int e = 0; e < VEC; e++) v[e] = xr[i * VEC + e];
        }
        float vm = v[0];
        for (int e = 1; e < VEC; e++) vm = max(vm, v[e]);
        const float mn = max(m, vm);
        s *= metal::fast::exp2((m - mn) * M_LOG2E_F);
        for (int e = 0; e < VEC; e++) s += metal::fast::exp2((v[e] - mn) * M_LOG2E_F);
        m = mn;
    }
    // SIMD-group merge with shuffles, then one (m, s) per SIMD-group through threadgroup memory
    for (ushort o = 16; o > 0; o >>= 1) {
        const float m2 = simd_shuffle_xor(m, o), s2 = simd_shuffle_xor(s, o);
        ks_merge(m, s, m2, s2);
    }
    if (lane == 0) { pm[sg] = m; ps[sg] = s; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    m = -INFINITY;
    s = 0.0f;
    for (int i = 0; i < NW; i++) ks_merge(m, s, pm[i], ps[i]);
} else {
    for (uint i = tid; i < uint(NV); i += THREADS)
        for (int e = 0; e < VEC; e++) m = max(m, xr[i * VEC + e]);
    m = simd_max(m);
    if (lane == 0) pm[sg] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    m = simd_max(lane < uint(NW) ? pm[lane] : -INFINITY);
    for (uint i = tid; i < uint(NV); i += THREADS)
        for (int e = 0; e < VEC; e++) s += metal::fast::exp2((xr[i * VEC + e] - m) * M_LOG2E_F);
    s = simd_sum(s);
    if (lane == 0) ps[sg] = s;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    s = simd_sum(lane < uint(NW) ? ps[lane] : 0.0f);
}
const float inv = 1.0f / s;
const float mb = m * M_LOG2E_F;
for (uint i = tid; i < uint(NV); i += THREADS) {
    if (VEC == 4) {
        const float4 w = *reinterpret_cast<const device float4*>(xr + i * VEC);
        const float4 r = metal::fast::exp2(fma(w, float4(M_LOG2E_F), float4(-mb))) * inv;
        *reinterpret_cast<device float4*>(yr + i * VEC) = r;
    } else {
        for (int e = 0; e < VEC; e++) yr[i * VEC + e] = metal::fast::exp2(fma(xr[i * VEC + e], M_LOG2E_F, -mb)) * inv;
    }
}
