// A correct (simple) softmax for the GPU tests: one block of 256 threads per row, f32.
// Launch: grid = [rows, 1, 1], block = [256, 1, 1].
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    __shared__ float red[256];
    long long r = blockIdx.x;
    const float* xr = x + r * cols;
    float m = -3.0e38f;
    for (long long c = threadIdx.x; c < cols; c += 256) m = fmaxf(m, xr[c]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.f;
    for (long long c = threadIdx.x; c < cols; c += 256) sum += expf(xr[c] - m);
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    sum = red[0];
    for (long long c = threadIdx.x; c < cols; c += 256) y[r * cols + c] = expf(xr[c] - m) / sum;
}
