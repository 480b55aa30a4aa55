// Bad kernel: writes far outside any allocation (expect: crash, CUDA_ERROR_ILLEGAL_ADDRESS).
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    y[(1LL << 38) + blockIdx.x * 256 + threadIdx.x] = x[0];
}
