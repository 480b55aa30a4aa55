// Bad kernel: skips the last row (expect: unwritten).
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    long long r = blockIdx.x;
    if (r == rows - 1 || threadIdx.x != 0) return;
    float m = -3.0e38f, s = 0.f;
    for (long long c = 0; c < cols; ++c) m = fmaxf(m, x[r * cols + c]);
    for (long long c = 0; c < cols; ++c) s += expf(x[r * cols + c] - m);
    for (long long c = 0; c < cols; ++c) y[r * cols + c] = expf(x[r * cols + c] - m) / s;
}
