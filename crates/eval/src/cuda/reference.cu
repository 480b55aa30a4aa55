// Trusted device references for ksearch's CUDA back-end.
//
// Deliberately simple: every input is read as double (the exact values the candidate sees,
// uploaded in their own encoding and widened by ksref_widen_*), every output is written as double, and all arithmetic is in
// KSREF_ACC (double unless the back-end says otherwise). They are checked against the host
// f64 references (ksearch-core::reference) on small workloads by the GPU tests.
//
// Layouts follow ksearch-core::reference exactly.

#ifndef KSREF_ACC
#define KSREF_ACC double
#endif
typedef KSREF_ACC acc_t;

#define KSREF_THREADS 256

// Sum (or max) over the block; every thread gets the result. blockDim.x == KSREF_THREADS.
__device__ acc_t ksref_block_sum(acc_t v, acc_t* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = KSREF_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    acc_t r = red[0];
    __syncthreads();
    return r;
}

__device__ acc_t ksref_block_max(acc_t v, acc_t* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = KSREF_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    acc_t r = red[0];
    __syncthreads();
    return r;
}

// softmax: x, y [rows, cols]. grid = rows, block = KSREF_THREADS.
extern "C" __global__ void ksref_softmax(const double* x, double* y, long long rows, long long cols) {
    __shared__ acc_t red[KSREF_THREADS];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const double* xr = x + r * cols;
    double* yr = y + r * cols;
    acc_t m = (acc_t)__longlong_as_double(0xfff0000000000000ULL);  // -inf
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) m = fmax(m, (acc_t)xr[c]);
    m = ksref_block_max(m, red);
    acc_t s = 0;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) s += exp((acc_t)xr[c] - m);
    s = ksref_block_sum(s, red);
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = exp((acc_t)xr[c] - m) / s;
}

// rmsnorm: x, y [rows, cols], w [cols]. grid = rows, block = KSREF_THREADS.
extern "C" __global__ void ksref_rmsnorm(const double* x, const double* w, double* y, long long rows, long long cols,
                                         double eps) {
    __shared__ acc_t red[KSREF_THREADS];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const double* xr = x + r * cols;
    double* yr = y + r * cols;
    acc_t s = 0;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) s += (acc_t)xr[c] * (acc_t)xr[c];
    s = ksref_block_sum(s, red);
    acc_t inv = (acc_t)1 / sqrt(s / (acc_t)cols + (acc_t)eps);
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = (acc_t)xr[c] * inv * (acc_t)w[c];
}

// attention: q, o [B, H, L, D]; k, v [B, Hkv, L, D] (query head h reads kv head h / (H / Hkv)).
// One warp per query row (b, h, i); 8 warps per block.
// grid = (ceil(L / 8), B * H), block = 256. Two passes over the keys: the row maximum first,
// then the exponentials, their sum and the weighted sum of v. D <= 32 * KSREF_MAXD_PER_LANE.
// (`ksref_attention_tiled` below is the one used for D <= 128; this one for wider heads.)
#define KSREF_MAXD_PER_LANE 8
extern "C" __global__ void ksref_attention(const double* q, const double* k, const double* v, double* o, long long L,
                                           long long D, long long causal, long long H, long long Hkv) {
    int lane = threadIdx.x & 31;
    long long i = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (i >= L) return;
    long long base = (long long)blockIdx.y * L * D;
    long long bq = blockIdx.y / H, hq = blockIdx.y % H;
    long long kvbase = (bq * Hkv + hq / (H / Hkv)) * L * D;
    const double* qi = q + base + i * D;
    acc_t qr[KSREF_MAXD_PER_LANE];
    acc_t acc[KSREF_MAXD_PER_LANE];
#pragma unroll
    for (int t = 0; t < KSREF_MAXD_PER_LANE; ++t) {
        long long d = lane + 32 * t;
        qr[t] = d < D ? (acc_t)qi[d] : (acc_t)0;
        acc[t] = 0;
    }
    acc_t scale = (acc_t)1 / sqrt((acc_t)D);
    long long n = causal ? i + 1 : L;
    acc_t m = (acc_t)__longlong_as_double(0xfff0000000000000ULL);  // -inf
    for (long long j = 0; j < n; ++j) {
        const double* kj = k + kvbase + j * D;
        acc_t s = 0;
#pragma unroll
        for (int t = 0; t < KSREF_MAXD_PER_LANE; ++t) {
            long long d = lane + 32 * t;
            if (d < D) s += qr[t] * (acc_t)kj[d];
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        m = fmax(m, s * scale);
    }
    acc_t sum = 0;
    for (long long j = 0; j < n; ++j) {
        const double* kj = k + kvbase + j * D;
        const double* vj = v + kvbase + j * D;
        acc_t s = 0;
#pragma unroll
        for (int t = 0; t < KSREF_MAXD_PER_LANE; ++t) {
            long long d = lane + 32 * t;
            if (d < D) s += qr[t] * (acc_t)kj[d];
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        acc_t p = exp(s * scale - m);
        sum += p;
#pragma unroll
        for (int t = 0; t < KSREF_MAXD_PER_LANE; ++t) {
            long long d = lane + 32 * t;
            if (d < D) acc[t] += p * (acc_t)vj[d];
        }
    }
    double* oi = o + base + i * D;
#pragma unroll
    for (int t = 0; t < KSREF_MAXD_PER_LANE; ++t) {
        long long d = lane + 32 * t;
        if (d < D) oi[d] = acc[t] / sum;
    }
}

// attention, D <= KSREF_TILE_D: the same result in one pass over the keys (online softmax in
// acc_t). A block of KSREF_WARPS warps takes KSREF_WARPS * KSREF_ROWS query rows of one (batch,
// head); each warp KSREF_ROWS consecutive rows, so that every key value read from shared memory
// serves KSREF_ROWS products. Per chunk of 32 keys: lane j takes key j and walks the head
// dimension for each of its warp's rows (Q and K padded with zeros to KSREF_TILE_D: the same
// sums, exactly); then, key by key, lane d takes output dims d, d + 32, ... of every row.
// K's chunk is stored with its columns rotated by the key's index, so the 32 lanes reading one
// column of 32 keys hit 32 different banks without padding (Q and K fill the 48 KB of static
// shared memory). grid = (ceil(L / (KSREF_WARPS * KSREF_ROWS)), B * H), block = 32 * KSREF_WARPS.
// On the H200 (2026-12-04, bench/h200-2026-12-04-attention-reference.txt) the judge's reference
// step for the 4,32/8,2048,128 search workload went from 0.54 s (one warp per row, runtime-D
// loops) to 0.40 s, uploads and the 268 MB f64 download included.
#define KSREF_TILE_D 128
#define KSREF_TILE_K 32
#define KSREF_ROWS 4
#define KSREF_WARPS 4
extern "C" __global__ void __launch_bounds__(32 * KSREF_WARPS)
    ksref_attention_tiled(const double* q, const double* k, const double* v, double* o, long long L, long long D,
                          long long causal, long long H, long long Hkv) {
    __shared__ double ks[KSREF_TILE_K * KSREF_TILE_D];
    __shared__ double qs[KSREF_WARPS * KSREF_ROWS * KSREF_TILE_D];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int Di = (int)D;
    const long long i0 = (long long)blockIdx.x * (KSREF_WARPS * KSREF_ROWS);
    const long long base = (long long)blockIdx.y * L * D;
    const long long bq = blockIdx.y / H, hq = blockIdx.y % H;
    const long long kvbase = (bq * Hkv + hq / (H / Hkv)) * L * D;
    for (int e = threadIdx.x; e < KSREF_WARPS * KSREF_ROWS * KSREF_TILE_D; e += blockDim.x) {
        int r = e / KSREF_TILE_D, d = e % KSREF_TILE_D;
        long long i = i0 + r;
        qs[e] = (i < L && d < Di) ? q[base + i * D + d] : 0.0;
    }
    const acc_t ninf = (acc_t)__longlong_as_double(0xfff0000000000000ULL);  // -inf
    const acc_t scale = (acc_t)1 / sqrt((acc_t)D);
    acc_t acc[KSREF_ROWS][KSREF_TILE_D / 32];
    acc_t m[KSREF_ROWS], sum[KSREF_ROWS];
    long long n[KSREF_ROWS];
    long long nwarp = 0;
#pragma unroll
    for (int r = 0; r < KSREF_ROWS; ++r) {
        long long i = i0 + wid * KSREF_ROWS + r;
        n[r] = i < L ? (causal ? i + 1 : L) : 0;
        nwarp = n[r] > nwarp ? n[r] : nwarp;
        m[r] = ninf;
        sum[r] = 0;
#pragma unroll
        for (int t = 0; t < KSREF_TILE_D / 32; ++t) acc[r][t] = 0;
    }
    // Keys the block needs: up to its last live row's.
    long long last = i0 + KSREF_WARPS * KSREF_ROWS - 1 < L ? i0 + KSREF_WARPS * KSREF_ROWS - 1 : L - 1;
    long long nblock = causal ? last + 1 : L;
    for (long long j0 = 0; j0 < nblock; j0 += KSREF_TILE_K) {
        __syncthreads();
        for (int e = threadIdx.x; e < KSREF_TILE_K * KSREF_TILE_D; e += blockDim.x) {
            int r = e / KSREF_TILE_D, d = e % KSREF_TILE_D;
            long long j = j0 + r;
            ks[r * KSREF_TILE_D + ((d + r) & (KSREF_TILE_D - 1))] = (j < L && d < Di) ? k[kvbase + j * D + d] : 0.0;
        }
        __syncthreads();
        if (j0 >= nwarp) continue;
        acc_t dot[KSREF_ROWS];
#pragma unroll
        for (int r = 0; r < KSREF_ROWS; ++r) dot[r] = 0;
        const double* qw = qs + wid * KSREF_ROWS * KSREF_TILE_D;
        const double* kl = ks + lane * KSREF_TILE_D;
#pragma unroll 16
        for (int d = 0; d < KSREF_TILE_D; ++d) {
            acc_t kd = (acc_t)kl[(d + lane) & (KSREF_TILE_D - 1)];
#pragma unroll
            for (int r = 0; r < KSREF_ROWS; ++r) dot[r] += (acc_t)qw[r * KSREF_TILE_D + d] * kd;
        }
        long long j = j0 + lane;
        acc_t p[KSREF_ROWS];
#pragma unroll
        for (int r = 0; r < KSREF_ROWS; ++r) {
            acc_t s = j < n[r] ? dot[r] * scale : ninf;
            acc_t cm = s;
            for (int off = 16; off > 0; off >>= 1) cm = fmax(cm, __shfl_xor_sync(0xffffffffu, cm, off));
            acc_t mnew = fmax(m[r], cm);
            // A row with no key in this chunk (a row past L) keeps its state.
            bool none = mnew == ninf;
            acc_t corr = none ? (acc_t)1 : exp(m[r] - mnew);
            p[r] = (j < n[r] && !none) ? exp(s - mnew) : (acc_t)0;
            acc_t ps = p[r];
            for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
            sum[r] = sum[r] * corr + ps;
#pragma unroll
            for (int t = 0; t < KSREF_TILE_D / 32; ++t) acc[r][t] *= corr;
            m[r] = mnew;
        }
        long long cnt = nwarp - j0 < KSREF_TILE_K ? nwarp - j0 : KSREF_TILE_K;
        for (int jj = 0; jj < (int)cnt; ++jj) {
            const double* vj = v + kvbase + (j0 + jj) * D;
            acc_t vd[KSREF_TILE_D / 32];
#pragma unroll
            for (int t = 0; t < KSREF_TILE_D / 32; ++t) {
                int d = lane + 32 * t;
                vd[t] = d < Di ? (acc_t)vj[d] : (acc_t)0;
            }
#pragma unroll
            for (int r = 0; r < KSREF_ROWS; ++r) {
                acc_t pj = __shfl_sync(0xffffffffu, p[r], jj);
#pragma unroll
                for (int t = 0; t < KSREF_TILE_D / 32; ++t) acc[r][t] += pj * vd[t];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < KSREF_ROWS; ++r) {
        long long i = i0 + wid * KSREF_ROWS + r;
        if (i >= L) continue;
        double* oi = o + base + i * D;
#pragma unroll
        for (int t = 0; t < KSREF_TILE_D / 32; ++t) {
            int d = lane + 32 * t;
            if (d < Di) oi[d] = acc[r][t] / sum[r];
        }
    }
}

// Inputs arrive in the candidate's own encoding and are widened here, exactly (every f16,
// bf16 and f32 value is a double): a quarter (f16, bf16) or half (f32) of the bytes a host
// widening would upload.
extern "C" __global__ void ksref_widen_f16(const unsigned short* x, double* y, long long n) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    unsigned h = x[e];
    unsigned sign = h >> 15, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    double mag;
    if (ex == 0) {
        mag = ldexp((double)man, -24);
    } else if (ex == 31) {
        mag = man ? __longlong_as_double(0x7ff8000000000000ULL) : __longlong_as_double(0x7ff0000000000000ULL);
    } else {
        mag = ldexp((double)(man | 0x400), (int)ex - 25);
    }
    y[e] = sign ? -mag : mag;
}
extern "C" __global__ void ksref_widen_bf16(const unsigned short* x, double* y, long long n) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    y[e] = (double)__uint_as_float((unsigned)x[e] << 16);
}
extern "C" __global__ void ksref_widen_f32(const float* x, double* y, long long n) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    y[e] = (double)x[e];
}

// mamba_scan: u, delta [batch, L, D]; A [D, N]; Bm, Cm [batch, L, N]; Dv [D];
// y [batch, L, D]; state [batch, D, N].
// One thread per (b, d, n), sequential over time; block = (N, G): G = max(1, 64 / N) channels of
// one batch.
// grid = (ceil(D / G), batch). y_t sums the N products in order n = 0..N-1 in one thread.
extern "C" __global__ void ksref_mamba_scan(const double* u, const double* delta, const double* A, const double* Bm,
                                            const double* Cm, const double* Dv, double* y, double* state,
                                            long long batch, long long L, long long D, long long N) {
    extern __shared__ unsigned char ksref_smem[];
    acc_t* part = (acc_t*)ksref_smem;  // [G][N]
    long long n = threadIdx.x;
    long long g = threadIdx.y;
    long long d = (long long)blockIdx.x * blockDim.y + g;
    long long b = blockIdx.y;
    bool live = d < D;
    acc_t a = live ? (acc_t)A[d * N + n] : (acc_t)0;
    acc_t h = 0;
    for (long long t = 0; t < L; ++t) {
        long long i = (b * L + t) * D + d;
        long long bc = (b * L + t) * N + n;
        acc_t dt = live ? (acc_t)delta[i] : (acc_t)0;
        acc_t ut = live ? (acc_t)u[i] : (acc_t)0;
        if (live) h = exp(dt * a) * h + dt * (acc_t)Bm[bc] * ut;
        part[g * N + n] = live ? (acc_t)Cm[bc] * h : (acc_t)0;
        __syncthreads();
        if (n == 0 && live) {
            acc_t s = 0;
            for (long long j = 0; j < N; ++j) s += part[g * N + j];
            y[i] = s + (acc_t)Dv[d] * ut;
        }
        __syncthreads();
    }
    if (live) state[(b * D + d) * N + n] = h;
}

// mamba_step: u, delta [batch, D]; A [D, N]; Bm, Cm [batch, N]; Dv [D]; state_in [batch, D, N];
// y [batch, D]; state_out [batch, D, N]. Same thread layout as ksref_mamba_scan.
extern "C" __global__ void ksref_mamba_step(const double* u, const double* delta, const double* A, const double* Bm,
                                            const double* Cm, const double* Dv, const double* s0, double* y,
                                            double* s1, long long batch, long long D, long long N) {
    extern __shared__ unsigned char ksref_smem[];
    acc_t* part = (acc_t*)ksref_smem;  // [G][N]
    long long n = threadIdx.x;
    long long g = threadIdx.y;
    long long d = (long long)blockIdx.x * blockDim.y + g;
    long long b = blockIdx.y;
    bool live = d < D;
    long long i = b * D + d;
    long long j = i * N + n;
    acc_t h = 0;
    if (live) {
        h = exp((acc_t)delta[i] * (acc_t)A[d * N + n]) * (acc_t)s0[j] +
            (acc_t)delta[i] * (acc_t)Bm[b * N + n] * (acc_t)u[i];
        s1[j] = h;
    }
    part[g * N + n] = live ? (acc_t)Cm[b * N + n] * h : (acc_t)0;
    __syncthreads();
    if (n == 0 && live) {
        acc_t s = 0;
        for (long long t = 0; t < N; ++t) s += part[g * N + t];
        y[i] = s + (acc_t)Dv[d] * (acc_t)u[i];
    }
}
