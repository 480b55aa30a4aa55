"""Timing on the GPU's own clock, on MLX's CUDA stream (back-end ``mlx-cuda``).

MLX spends tens of microseconds of host time on every call it queues (building the call,
allocating its outputs, launching), and a decode-step kernel runs for a few. Timed by the host
clock, a batch of such calls measures MLX's host cost, not the kernel, and ranks candidates by
noise. A CUDA graph would hide the host cost but runs the independent calls of a batch
*concurrently* (MLX's graphs order nodes by data dependencies only), which flatters a small
kernel that leaves the GPU half idle. So the judge times a batch like this:

1. A **gate** kernel (one thread) is queued first. It spins until a flag in pinned host memory
   holds this sample's sequence number, then writes the GPU's ``%globaltimer`` (ns) and exits.
2. Optional **lead** work follows it: the judge's cache flush (a write of a buffer well past
   the L2). It keeps the GPU busy up to the first call, as the kernels before it in a model's
   stream do: on the H200 the first call straight after the gate (a GPU that sat idle while
   the host queued the sample) ran up to ~15% slower than the same call behind other work.
3. A **stamp** kernel writes ``%globaltimer``: the sample's start.
4. The batch's calls are queued behind it, each made to depend on the previous call's outputs
   (``mx.depends``), so that MLX encodes them in order; with ``MLX_USE_CUDA_GRAPHS=0`` (the
   worker sets it) every launch goes straight to MLX's one stream, which runs them one after
   the other.
5. A second stamp, depending on the last call's outputs, writes ``%globaltimer`` again.
6. Only when everything is queued does the host set the flag: the GPU then runs the lead and
   the calls back to back, with no host work between them.

A call's time is ``(second stamp - first stamp - empty bracket) / calls``, where the empty
bracket (the two stamps back to back: one launch gap; the least of 7) is measured when the
clock is made. The clock then checks itself: calls that each spin a known time on the GPU
clock must measure at least that each, else there is no clock (and the judge uses the host's).
It is each kernel's run plus one launch gap, as on a stream a model fills. The gate gives up
after ``GATE_LIMIT_NS`` (a host that never set its flag cannot hang the GPU) and the sample
then raises ``ClockError``; so does a time that is negative or longer than the host's own
wall time for the sample. The host clock still bounds the sample: nothing a kernel writes can
make its time longer than the wall time nor the judge wait longer than the limit.

Metal has no such clock within reach of MLX's custom kernels; ``mlx-metal`` keeps the host
clock (judge.py).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Optional

# The gate's flag is polled with this pause between reads (ns), and given up after this long.
GATE_POLL_NS = 200
GATE_LIMIT_NS = 2_000_000_000

GATE_NAME = "ks_clock_gate"
STAMP_NAME = "ks_clock_stamp"
# Inputs: `addr` (uint64[1], the flag's device address), `seq` (uint32[1], the value to wait
# for). Output `t` (uint64[2]): the release time and 1 where the gate gave up.
GATE_INPUTS = ("addr", "seq")
GATE_BODY = f"""
if (threadIdx.x == 0 && blockIdx.x == 0) {{
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  const unsigned long long start = now;
  volatile const unsigned int* flag = reinterpret_cast<volatile const unsigned int*>(addr[0]);
  unsigned long long gave_up = 0;
  while (*flag != seq[0]) {{
    __nanosleep({GATE_POLL_NS});
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > {GATE_LIMIT_NS}ull) {{
      gave_up = 1;
      break;
    }}
  }}
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  t[0] = now;
  t[1] = gave_up;
}}
"""
# Input `after` (any array: only its place in the graph matters); output `t` (uint64[2], more
# than MLX's 8-byte small blocks, which live in managed memory: a page of them that the host
# read last would migrate back between the gate and the stamp, tens of microseconds).
STAMP_INPUTS = ("after",)
STAMP_BODY = """
if (threadIdx.x == 0 && blockIdx.x == 0) {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  t[0] = now;
}
"""

# The self-check at creation: CHECK_CALLS calls that each spin CHECK_NS on the GPU clock must
# measure at least that long each (they ran one after the other, behind the gate).
CHECK_NS = 20_000
CHECK_CALLS = 4
CHECK_BODY = f"""
if (threadIdx.x == 0) {{
  unsigned long long t0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {{
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  }} while (now - t0 < {CHECK_NS}ull);
  y[0] = x[0] + 1.0f;
}}
"""

# cuMemHostAlloc flags: PORTABLE | DEVICEMAP
_HOST_ALLOC_FLAGS = 0x01 | 0x02


class ClockError(Exception):
    """A sample the GPU clock cannot vouch for (the gate gave up, or the stamps disagree with
    the host's wall time)."""


class PinnedFlag:
    """Four bytes of pinned, device-mapped host memory: the host writes, a kernel polls."""

    def __init__(self) -> None:
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._host = ctypes.c_void_p()
        rc = self._cuda.cuMemHostAlloc(ctypes.byref(self._host), ctypes.c_size_t(64), ctypes.c_uint(_HOST_ALLOC_FLAGS))
        if rc != 0 or not self._host.value:
            raise OSError(f"cuMemHostAlloc failed (CUresult {rc})")
        dev = ctypes.c_uint64()
        rc = self._cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), self._host, ctypes.c_uint(0))
        if rc != 0 or not dev.value:
            self.close()
            raise OSError(f"cuMemHostGetDevicePointer failed (CUresult {rc})")
        self.device_address = int(dev.value)
        self._word = ctypes.c_uint32.from_address(self._host.value)
        self._word.value = 0

    def set(self, value: int) -> None:
        self._word.value = value & 0xFFFFFFFF

    def close(self) -> None:
        if self._host.value:
            self._cuda.cuMemFreeHost(self._host)
            self._host = ctypes.c_void_p()


class GpuClock:
    """Times batches of MLX calls on the GPU clock (see the module's text)."""

    def __init__(self) -> None:
        import os

        import mlx.core as mx

        if os.environ.get("MLX_USE_CUDA_GRAPHS", "") != "0":
            # In a graph the calls would not wait for the gate (mx.depends adds no graph edge).
            raise ClockError("MLX's CUDA graphs are on (MLX_USE_CUDA_GRAPHS=0 must be set before MLX starts)")
        self.mx = mx
        self.flag = PinnedFlag()
        self._seq = 0
        self._addr = mx.array([self.flag.device_address], dtype=mx.uint64)
        self._dummy = mx.zeros((64,), dtype=mx.uint32)
        mx.eval(self._addr, self._dummy)
        self._gate_k = mx.fast.cuda_kernel(
            name=GATE_NAME, input_names=list(GATE_INPUTS), output_names=["t"], source=GATE_BODY
        )
        self._stamp_k = mx.fast.cuda_kernel(
            name=STAMP_NAME, input_names=list(STAMP_INPUTS), output_names=["t"], source=STAMP_BODY
        )
        # Both kernels compiled and loaded before any bracket, with the flag already set so the
        # gate passes at once: loading a module waits for the kernels running, a spinning gate
        # too (so a bracket must never meet a kernel's first call).
        self._seq = 1
        self.flag.set(self._seq)
        gate = self._gate(self._seq)
        mx.eval(gate, self._stamp([gate]))
        mx.synchronize()
        # The empty bracket: the two stamps back to back. Its least time is subtracted
        # from every sample, so a sample is never made shorter than its calls took.
        self.empty_ns = min(self._bracket([])[0] for _ in range(7))
        self._self_check()

    def _self_check(self) -> None:
        """Calls that spin a known time on the GPU clock measure at least that each: they ran
        behind the gate and one after the other (else ``ClockError``: no clock)."""
        mx = self.mx
        spin = mx.fast.cuda_kernel(name="ks_clock_check", input_names=["x"], output_names=["y"], source=CHECK_BODY)

        def call(v: dict) -> dict:
            (y,) = spin(inputs=[v["x"]], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)],
                        output_dtypes=[mx.float32])
            return {"y": y}

        xs = [{"x": mx.full((4,), float(i))} for i in range(CHECK_CALLS)]
        mx.eval([v["x"] for v in xs])
        mx.eval(call(xs[0])["y"])  # compiled and loaded outside any bracket
        per_call, results = self.time_calls([call] * CHECK_CALLS, xs)
        got = [float(r["y"][0].item()) for r in results]
        if got != [float(i) + 1 for i in range(CHECK_CALLS)]:
            raise ClockError(f"the self-check's calls returned {got}")
        if per_call * 1e9 < CHECK_NS:
            raise ClockError(
                f"{CHECK_CALLS} calls of {CHECK_NS / 1e3:.0f} us each measured {per_call * 1e6:.1f} us each: "
                "they did not run one after the other behind the gate"
            )
        self.check_us = per_call * 1e6

    @classmethod
    def create(cls) -> tuple[Optional["GpuClock"], str]:
        """(the clock, "") or (None, why not)."""
        try:
            return cls(), ""
        except Exception as e:  # no libcuda, no pinned memory, a kernel that did not build
            return None, f"{type(e).__name__}: {e}"

    def _gate(self, seq: int) -> Any:
        mx = self.mx
        (t,) = self._gate_k(
            inputs=[self._addr, mx.array([seq], dtype=mx.uint32)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(2,)],
            output_dtypes=[mx.uint64],
        )
        return t

    def _stamp(self, after: list) -> Any:
        mx = self.mx
        dep = mx.depends([self._dummy], after)[0] if after else self._dummy
        (t,) = self._stamp_k(
            inputs=[dep],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(2,)],
            output_dtypes=[mx.uint64],
        )
        return t

    def _bracket(self, calls: list[Callable[[list], list]], lead: Optional[Callable[[list], list]] = None) -> tuple[float, list]:
        """Run `lead` (if any) behind a gate, then `calls` between two stamps; (GPU ns from the
        first stamp to the second, what the calls returned). Each call takes the arrays the
        previous one must come after and returns (its result, the arrays the next must come
        after); `lead` takes the gate's and returns what the first stamp must come after."""
        mx = self.mx
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        seq = self._seq
        started = time.perf_counter()
        gate = self._gate(seq)
        prev = [gate]
        results = []
        queued = False
        try:
            if lead is not None:
                prev = lead(prev)
            first = self._stamp(prev)
            prev = [first]
            for c in calls:
                r, prev = c(prev)
                results.append(r)
            stamp = self._stamp(prev)
            mx.async_eval(gate, first, stamp)
            queued = True
        finally:
            # Release the gate even when queueing failed half-way (it may be spinning already).
            self.flag.set(seq)
            if not queued:
                try:
                    mx.synchronize()
                except Exception:
                    pass
        mx.eval(gate, first, stamp)
        mx.synchronize()
        wall_ns = (time.perf_counter() - started) * 1e9
        g = gate.tolist()
        s = int(stamp.tolist()[0])
        if int(g[1]) != 0:
            raise ClockError(f"the gate gave up after {GATE_LIMIT_NS / 1e9:.0f} s (queueing the calls took that long)")
        ns = s - int(first.tolist()[0])
        if ns < 0 or ns > wall_ns:
            raise ClockError(f"GPU clock span {ns} ns outside [0, {wall_ns:.0f}] ns of host wall time")
        return float(ns), results

    def time_calls(
        self, calls: list[Callable[[dict], Any]], views: list[dict], lead: Optional[Callable[[list], list]] = None
    ) -> tuple[float, list]:
        """Run ``calls[i](views[i])`` in order between two stamps behind a gate; (seconds per
        call on the GPU clock, the calls' results). A result is ``{name: array}`` or
        ``(outputs, tails)``; each call's inputs are made to depend on the previous call's
        arrays. ``lead``, when given, is GPU work queued between the gate and the first stamp
        (the judge's cache flush: it also keeps the GPU busy up to the first call, as a model's
        stream does; a first call straight after the gate, on a GPU idle while the host queued
        the sample, ran up to ~15% slower on the H200). Every kernel the calls launch must have
        run before (compiled and loaded): a module loaded behind the gate waits for it, and the
        gate gives up (``ClockError``)."""
        mx = self.mx

        def chained(call: Callable[[dict], Any], v: dict) -> Callable[[list], tuple[Any, list]]:
            def run(prev: list) -> tuple[Any, list]:
                names = list(v)
                after = mx.depends([v[n] for n in names], prev)
                r = call(dict(zip(names, after)))
                o, g = r if isinstance(r, tuple) else (r, {})
                return r, list(o.values()) + list(g.values())

            return run

        ns, results = self._bracket([chained(c, v) for c, v in zip(calls, views)], lead)
        per_call = max(0.0, ns - self.empty_ns) / max(1, len(calls))
        return per_call * 1e-9, results
