#!/usr/bin/env python3
"""MUFU's exp2 rate on the GPU at hand: ex2.approx.ftz.f32 against ex2.approx.f16x2 (two f16 results an
instruction in PTX; on sm_90 ptxas emits two MUFU.EX2.F16 for it), the question being whether the
half-precision form gives the softmax more exponentials a cycle. Each thread runs CHAINS independent chains
of N dependent exponentials (inputs kept in [-1, 0] so no value leaves the range), one block of 1024
threads per SM times BLOCKS_PER_SM; CUDA events, median of 9 launches after a warm-up; results summed into
an output so nothing is dropped. Prints exponentials a cycle per SM at the SM clock nvidia-smi reports.

Then whether cvt.rn.f16x2.f32 (F2FP, the conversion that packs two probabilities into a PV product's A
fragment) takes MUFU's cycles: two dependent exponentials and one conversion of their results a step (the
softmax's mix) against two exponentials a step, and against the pair packed by integer operations instead (a
shift, a shift and a byte permute: the form an f32 whose exponent is lowered by 112 would allow). Printed as
steps a cycle per SM.

    python3 bench/mufu_rate.py            (the GPU machine; needs cupy)
"""
import statistics
import subprocess

import cupy as cp

SRC = r"""
extern "C" __global__ void ex32(float* out, int n) {
    float x[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; c++) x[c] = -0.001f * (threadIdx.x + c);
    for (int i = 0; i < n; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            float y;
            asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[c]));
            x[c] = y - 1.0f;   // 2^x - 1 stays in [-0.5, 0] for x in [-1, 0]
        }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) s += x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void ex16x2(float* out, int n) {
    unsigned x[CHAINS];
    const unsigned one = 0x3c003c00u;  // (1.0, 1.0) in f16
#pragma unroll
    for (int c = 0; c < CHAINS; c++) x[c] = 0xa000a000u + threadIdx.x + c;  // small negative halves
    for (int i = 0; i < n; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            unsigned y;
            asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x[c]));
            asm volatile("sub.f16x2 %0, %1, %2;" : "=r"(x[c]) : "r"(y), "r"(one));
        }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) s += __half2float(__ushort_as_half((unsigned short)(x[c] & 0xffff)));
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
// Two exponentials a step, their results (a) consumed as they are, (b) packed by cvt.rn.f16x2.f32, (c) packed
// by integer operations.
template <int MODE> __device__ void ex2_pairs(float* out, int n) {
    float x0[CHAINS], x1[CHAINS];
    unsigned acc[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; c++) { x0[c] = -0.001f * (threadIdx.x + c); x1[c] = -0.002f * (threadIdx.x + c); acc[c] = 0u; }
    for (int i = 0; i < n; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            float y0, y1;
            asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(x0[c]));
            asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y1) : "f"(x1[c]));
            unsigned p;
            if (MODE == 0) {
                p = __float_as_uint(y0) ^ __float_as_uint(y1);
            } else if (MODE == 1) {
                asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(y1), "f"(y0));
            } else {
                const unsigned lo = __float_as_uint(y0) >> 13, hi = __float_as_uint(y1) << 3;
                asm volatile("prmt.b32 %0, %1, %2, 0x7610;" : "=r"(p) : "r"(lo), "r"(hi));
            }
            acc[c] ^= p;
            x0[c] = y0 - 1.0f;
            x1[c] = y1 - 1.0f;
        }
    }
    unsigned s = 0u;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) s ^= acc[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = (float)s + x0[0] + x1[0];
}
extern "C" __global__ void ex2only(float* out, int n) { ex2_pairs<0>(out, n); }
extern "C" __global__ void ex2cvt(float* out, int n) { ex2_pairs<1>(out, n); }
extern "C" __global__ void ex2int(float* out, int n) { ex2_pairs<2>(out, n); }
"""


def sm_clock_mhz():
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return float(q.stdout.split()[0])
    except Exception:
        return float("nan")


def main():
    chains, n, bps = 8, 4096, 2
    mod = cp.RawModule(code="#include <cuda_fp16.h>\n#define CHAINS %d\n" % chains + SRC,
                       options=("--std=c++17",), backend="nvrtc")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    blocks, threads = sms * bps, 1024
    out = cp.zeros(blocks * threads, cp.float32)
    rate = {}
    for name, per_instr in (("ex32", 1), ("ex16x2", 2), ("ex2only", 1), ("ex2cvt", 1), ("ex2int", 1)):
        k = mod.get_function(name)
        k((blocks,), (threads,), (out, cp.int32(n)))
        times, clocks = [], []
        for _ in range(9):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            k((blocks,), (threads,), (out, cp.int32(n)))
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
            clocks.append(sm_clock_mhz())
        t = statistics.median(times)
        mhz = statistics.median(clocks)
        results = blocks * threads * chains * n * per_instr
        per_sm_cycle = results / (t * mhz * 1e6 * sms)
        rate[name] = results / t
        what = "exp2" if name.startswith("ex") and name[2] in "13" else "steps"
        print(f"{name:7s} {t * 1e6:9.1f} us  {results / t / 1e12:6.3f} T {what}/s  "
              f"{per_sm_cycle:5.2f} {what} a cycle per SM at {mhz:.0f} MHz (the clock read after each launch; "
              f"checksum {float(out.sum()):.3e})")
    print(f"f16 results a second over f32 results a second: {rate['ex16x2'] / rate['ex32']:.2f}x")
    print(f"steps a second, two exp2 and a cvt over two exp2: {rate['ex2cvt'] / rate['ex2only']:.2f}x; "
          f"two exp2 packed by integer operations over two exp2: {rate['ex2int'] / rate['ex2only']:.2f}x")


if __name__ == "__main__":
    main()
