// FlashAttention-2 forward, MLX Metal dialect (re-tiled from tasks/attention/mlx/flash.cu for
// Apple's 32 KB of threadgroup memory). One threadgroup per (BQ = 8 * NSG query rows, batch*head);
// each SIMD-group owns 8 query rows and keeps Q (8 x D) and the output accumulator O (8 x D) in
// simdgroup_float8x8 registers. K/V tiles of BK keys are kept in threadgroup memory as f32 (KH = 0)
// or as the f16 they are loaded as (KH = 1: half the bytes, so BK 32 fits at D 128; the products
// then take half K and V matrices with f32 Q, P and accumulators, as Metal's mixed-precision
// simdgroup_multiply_accumulate allows); S = Q K^T and O += P V are 8x8x8
// simdgroup_multiply_accumulate products.
//
// The online softmax does not depend on the (unspecified) lane layout of simdgroup matrices: S is
// stored to a per-SIMD-group scratch, each row is handled by the 4 lanes of a quad (simd_shuffle_xor
// 1, 2 for the row max), P goes back through the scratch, and the per-row rescale of O by
// alpha = exp2(m_old - m_new) is a product with an 8x8 diagonal matrix, skipped when no row max of
// the SIMD-group moved (most tiles once the maxima settle). exp2 with Q pre-multiplied by
// log2(e) / sqrt(D). Causal (axis `causal` = 1): a threadgroup stops at the diagonal, a SIMD-group
// skips the tiles past its last row, and only tiles crossing the diagonal are masked.
// KT = 1 stores the K tile transposed (d-major) so that K^T blocks load without a transpose;
// KT = 0 stores it key-major and loads with simdgroup_load's transpose flag.
// Threadgroup memory: (4 - 2 KH) * (K tile + V tile) + 4 * (NSG * 8 * BK + NSG * 64) bytes; the
// f32 Q tile at the start and O tile at the end reuse the K/V space. Tunables: BK, NSG, KT, KH.
// Any L: ceil(L / BQ) threadgroups per head, rows and keys past L are zero in threadgroup memory,
// scores of keys past L are -inf, rows past L are not stored. Grouped-query heads: query head h
// reads key/value head h / (H / Hkv) (k, v: [B, Hkv, L, D]).

// The element type of the K/V tiles (KH is a template parameter of the body, so the header's
// helper takes it as an argument).
template <int KH_> struct ks_kv_t { typedef float type; };
template <> struct ks_kv_t<1> { typedef half type; };

// @kernel attention
constexpr int BQ = 8 * NSG;
constexpr int NT = 32 * NSG;
typedef typename ks_kv_t<KH>::type KVT;         // f32 or f16 K/V tiles
constexpr int VS = D + 4;                       // V tile row stride (elements)
constexpr int KS = KT ? BK + 4 : D + 4;         // K tile row stride: [d][key] or [key][d]
constexpr int KSZ = KT ? D * KS : BK * KS;
constexpr int VSZ = BK * VS;
constexpr int KVF = (KSZ + VSZ) * int(sizeof(KVT)) / 4;  // the K/V space in floats
constexpr int TOT = KVF + NSG * 8 * BK + NSG * 64;
static_assert(D % 8 == 0 && BK % 8 == 0 && H % Hkv == 0, "tile shape, head groups");
constexpr int NTK = (L + BK - 1) / BK;  // key tiles; the last one may be partial
constexpr int NQB = (L + BQ - 1) / BQ;  // query tiles
static_assert(BQ * D <= KVF, "the Q and O tiles reuse the K/V space");
threadgroup float tgm[TOT];
threadgroup KVT* Ks = reinterpret_cast<threadgroup KVT*>(tgm);
threadgroup KVT* Vs = Ks + KSZ;
threadgroup float* Qs = tgm;  // [BQ][D], before the first K/V tile and again (as O) after the last
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
threadgroup float* Ss = tgm + KVF + sg * 8 * BK;    // this SIMD-group's S/P scratch, [8][BK]
threadgroup float* Dg = tgm + KVF + NSG * 8 * BK + sg * 64;  // its 8x8 diagonal
const uint bh = threadgroup_position_in_grid.y;
const uint kvh = (bh / H) * Hkv + (bh % H) / (H / Hkv);  // the key/value head of this query head
const int mb = causal ? NQB - 1 - int(threadgroup_position_in_grid.x) : int(threadgroup_position_in_grid.x);
const int m0 = mb * BQ;                  // first query row of the threadgroup
const int r0 = m0 + int(sg) * 8;         // first query row of this SIMD-group
const int nt = causal ? min(NTK, (m0 + BQ + BK - 1) / BK) : NTK;
const ulong base = ulong(bh) * L * D;
const ulong kvbase = ulong(kvh) * L * D;
const float sc = M_LOG2E_F * metal::rsqrt(float(D));

// Q tile (scaled, f32) -> registers; rows past L are zero
for (int e = int(tid); e < BQ * D / 4; e += NT) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    const float4 w = m0 + r < L ? float4(*reinterpret_cast<const device half4*>(q + base + ulong(m0 + r) * D + c)) * sc : float4(0.0f);
    Qs[r * D + c] = w.x; Qs[r * D + c + 1] = w.y; Qs[r * D + c + 2] = w.z; Qs[r * D + c + 3] = w.w;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_float8x8 qm[D / 8];
simdgroup_float8x8 om[D / 8];
for (int i = 0; i < D / 8; i++) {
    simdgroup_load(qm[i], Qs + sg * 8 * D + i * 8, D);
    om[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
threadgroup_barrier(mem_flags::mem_threadgroup);  // Q space is reused by the first K/V tile

// softmax bookkeeping: row = lane / 4 of this SIMD-group's 8 rows, quarter = lane % 4 holds
// BK / 4 columns of it
const int row = int(lane / 4), quarter = int(lane % 4);
float mrow = -INFINITY, lpart = 0.0f;

for (int t = 0; t < nt; t++) {
    const int n0 = t * BK;
    // K/V tile of BK keys -> threadgroup memory (half4 device loads; keys past L are zero)
    for (int e = int(tid); e < BK * D / 4; e += NT) {
        const int r = e / (D / 4), c = (e % (D / 4)) * 4;
        const bool ok = n0 + r < L;
        const ulong g = kvbase + ulong(ok ? n0 + r : 0) * D + c;
        const vec<KVT, 4> kv = ok ? vec<KVT, 4>(*reinterpret_cast<const device half4*>(k + g)) : vec<KVT, 4>(KVT(0.0f));
        const vec<KVT, 4> vv = ok ? vec<KVT, 4>(*reinterpret_cast<const device half4*>(v + g)) : vec<KVT, 4>(KVT(0.0f));
        if (KT) {
            Ks[c * KS + r] = kv.x; Ks[(c + 1) * KS + r] = kv.y; Ks[(c + 2) * KS + r] = kv.z; Ks[(c + 3) * KS + r] = kv.w;
        } else {
            Ks[r * KS + c] = kv.x; Ks[r * KS + c + 1] = kv.y; Ks[r * KS + c + 2] = kv.z; Ks[r * KS + c + 3] = kv.w;
        }
        Vs[r * VS + c] = vv.x; Vs[r * VS + c + 1] = vv.y; Vs[r * VS + c + 2] = vv.z; Vs[r * VS + c + 3] = vv.w;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (r0 < L && !(causal && n0 > r0 + 7)) {  // uniform per SIMD-group
        // S = Q K^T, one 8x8 block per 8 keys
        for (int kb = 0; kb < BK / 8; kb++) {
            simdgroup_float8x8 sacc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int i = 0; i < D / 8; i++) {
                simdgroup_matrix<KVT, 8, 8> kt;
                if (KT) simdgroup_load(kt, Ks + (i * 8) * KS + kb * 8, KS);
                else simdgroup_load(kt, Ks + (kb * 8) * KS + i * 8, KS, ulong2(0, 0), true);
                simdgroup_multiply_accumulate(sacc, qm[i], kt, sacc);
            }
            simdgroup_store(sacc, Ss + kb * 8, BK);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        // online softmax on this lane's BK / 4 columns of its row
        constexpr int CPL = BK / 4;
        float sv[CPL];
        float tmax = -INFINITY;
        const bool diag = causal && (n0 + BK - 1 > r0);
        const bool tail = n0 + BK > L;
        for (int j = 0; j < CPL; j++) {
            const int col = quarter * CPL + j;
            float s = Ss[row * BK + col];
            if ((diag && n0 + col > r0 + row) || (tail && n0 + col >= L)) s = -INFINITY;
            sv[j] = s;
            tmax = max(tmax, s);
        }
        tmax = max(tmax, simd_shuffle_xor(tmax, ushort(1)));
        tmax = max(tmax, simd_shuffle_xor(tmax, ushort(2)));
        const float mnew = max(mrow, tmax);
        // mnew is finite from the first tile on (key 0 is never masked); the guard keeps a fully
        // masked start from producing NaN
        const float alpha = (mnew == -INFINITY) ? 1.0f : metal::fast::exp2(mrow - mnew);
        float psum = 0.0f;
        for (int j = 0; j < CPL; j++) {
            const float p = (mnew == -INFINITY) ? 0.0f : metal::fast::exp2(sv[j] - mnew);
            Ss[row * BK + quarter * CPL + j] = p;
            psum += p;
        }
        lpart = lpart * alpha + psum;
        mrow = mnew;
        const bool rescale = simd_any(alpha != 1.0f);
        if (rescale) {
            Dg[row * 8 + quarter * 2] = (quarter * 2 == row) ? alpha : 0.0f;
            Dg[row * 8 + quarter * 2 + 1] = (quarter * 2 + 1 == row) ? alpha : 0.0f;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        if (rescale) {
            simdgroup_float8x8 dm;
            simdgroup_load(dm, Dg, 8);
            for (int i = 0; i < D / 8; i++) {
                simdgroup_float8x8 tmp;
                simdgroup_multiply(tmp, dm, om[i]);
                om[i] = tmp;
            }
        }
        // O += P V
        for (int kb = 0; kb < BK / 8; kb++) {
            simdgroup_float8x8 pm;
            simdgroup_load(pm, Ss + kb * 8, BK);
            for (int i = 0; i < D / 8; i++) {
                simdgroup_matrix<KVT, 8, 8> vm;
                simdgroup_load(vm, Vs + (kb * 8) * VS + i * 8, VS);
                simdgroup_multiply_accumulate(om[i], pm, vm, om[i]);
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD-group is done with this K/V tile
}

// O / l -> device memory, through the (now free) K/V space as an [BQ][D] f32 tile
threadgroup float* Os = tgm + sg * 8 * D;
for (int i = 0; i < D / 8; i++) simdgroup_store(om[i], Os + i * 8, D);
simdgroup_barrier(mem_flags::mem_threadgroup);
float lrow = lpart + simd_shuffle_xor(lpart, ushort(1));
lrow += simd_shuffle_xor(lrow, ushort(2));
const float inv = 1.0f / lrow;
device half* orow = o + base + ulong(r0 + row) * D;
for (int c = quarter * 4; c < D && r0 + row < L; c += 16) {  // the 4 lanes of a row write 32 contiguous bytes
    const float4 w = float4(Os[row * D + c], Os[row * D + c + 1], Os[row * D + c + 2], Os[row * D + c + 3]) * inv;
    *reinterpret_cast<device half4*>(orow + c) = half4(w);
}
