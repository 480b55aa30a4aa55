// Bad kernel: never ends (expect: timeout from the supervisor's run time-out).
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    long long t = clock64();
    while (clock64() != t - 1) {
    }
    y[blockIdx.x] = x[0];
}
