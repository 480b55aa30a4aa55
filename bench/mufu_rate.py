#!/usr/bin/env python3
"""MUFU's exp2 rate on the GPU at hand: ex2.approx.ftz.f32 against ex2.approx.f16x2 (two f16 results an
instruction in PTX; on sm_90 ptxas emits two MUFU.EX2.F16 for it), the question being whether the
half-precision form gives the softmax more exponentials a cycle. Each thread runs CHAINS independent chains
of N dependent exponentials (inputs kept in [-1, 0] so no value leaves the range), one block of 1024
threads per SM times BLOCKS_PER_SM; CUDA events, median of 9 launches after a warm-up; results summed into
an output so nothing is dropped. Prints exponentials a cycle per SM at the SM clock nvidia-smi reports.

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
    for name, per_instr in (("ex32", 1), ("ex16x2", 2)):
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
        print(f"{name:7s} {t * 1e6:9.1f} us  {results / t / 1e12:6.3f} T exp2/s  "
              f"{per_sm_cycle:5.2f} exp2 a cycle per SM at {mhz:.0f} MHz (the clock read after each launch; "
              f"checksum {float(out.sum()):.3e})")
    print(f"f16 results a second over f32 results a second: {rate['ex16x2'] / rate['ex32']:.2f}x")


if __name__ == "__main__":
    main()
