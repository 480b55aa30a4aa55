// Bad kernel: does not compile (expect: compile, with the NVRTC log).
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    y[0] = undefined_name;
}
