// Decode step, memory-bound (MLX Metal dialect, translated from tasks/mamba_step/mlx/vec_step.cu):
// each thread owns VEC consecutive states of one (batch, channel) (float4 state loads and stores at
// VEC = 4), N / VEC adjacent lanes of a SIMD-group share a channel and reduce y with
// simd_shuffle_xor, CPB channels per threadgroup. exp(delta*A) as fast exp2 with A*log2(e).
// Threadgroups are whole SIMD-groups (constraint CPB * N / VEC >= 32) and the grid is a multiple of
// the threadgroup, so every lane exists for the shuffles; lanes past the last channel contribute 0.
// Tunables: VEC (1, 2, 4), CPB (channels per threadgroup).
constexpr int TPC = N / VEC;  // lanes per channel
const uint tid = thread_position_in_threadgroup.x;
const uint ch = threadgroup_position_in_grid.x * CPB + tid / TPC;  // b * D + c
const uint part = tid % TPC;
const bool ok = ch < uint(batch * D);
const uint cc = ok ? ch : 0;
const uint b = cc / D, c = cc % D;
const uint n0 = part * VEC;
float acc = 0.0f, ut = 0.0f;
if (ok) {
    const float dt = float(delta[cc]);
    ut = float(u[cc]);
    const float dtu = dt * ut;
    float sv[VEC], av[VEC], o[VEC];
    if (VEC == 4) {
        const float4 s4 = *reinterpret_cast<const device float4*>(state_in + cc * N + n0);
        const float4 a4 = *reinterpret_cast<const device float4*>(A + c * N + n0);
        sv[0] = s4.x; sv[VEC > 1 ? 1 : 0] = s4.y; sv[VEC > 2 ? 2 : 0] = s4.z; sv[VEC > 3 ? 3 : 0] = s4.w;
        av[0] = a4.x; av[VEC > 1 ? 1 : 0] = a4.y; av[VEC > 2 ? 2 : 0] = a4.z; av[VEC > 3 ? 3 : 0] = a4.w;
    } else {
        for (int e = 0; e < VEC; e++) {
            sv[e] = state_in[cc * N + n0 + e];
            av[e] = A[c * N + n0 + e];
        }
    }
    for (int e = 0; e < VEC; e++) {
        const float bb = float(Bm[b * N + n0 + e]), cv = float(Cm[b * N + n0 + e]);
        o[e] = fma(metal::fast::exp2(dt * av[e] * M_LOG2E_F), sv[e], dtu * bb);
        acc = fma(cv, o[e], acc);
    }
    if (VEC == 4) {
        *reinterpret_cast<device float4*>(state_out + cc * N + n0) =
            float4(o[0], o[VEC > 1 ? 1 : 0], o[VEC > 2 ? 2 : 0], o[VEC > 3 ? 3 : 0]);
    } else {
        for (int e = 0; e < VEC; e++) state_out[cc * N + n0 + e] = o[e];
    }
}
for (ushort m = TPC / 2; m > 0; m >>= 1) acc += simd_shuffle_xor(acc, m);
if (ok && part == 0) y[cc] = acc + Dv[c] * ut;
