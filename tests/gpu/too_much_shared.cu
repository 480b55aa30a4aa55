// Bad launch: asks for more dynamic shared memory than any block may have (expect: launch).
// Launch: shared = "1048576".
extern "C" __global__ void softmax(const float* x, float* y, long long rows, long long cols) {
    extern __shared__ float s[];
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    y[blockIdx.x * cols + threadIdx.x] = s[threadIdx.x];
}
