// Trusted device references for ksearch's CUDA back-end.
//
// Deliberately simple: every input arrives as double (the exact values the candidate sees,
// widened on the host), every output is written as double, and all arithmetic is in
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
