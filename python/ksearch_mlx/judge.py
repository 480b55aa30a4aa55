"""The MLX worker's judge: the rules of the Rust judge (crates/eval/src/judge.rs), in MLX.

A candidate is a callable ``call(inputs, init_value)`` that queues its work on MLX arrays and
returns its outputs, either ``{name: array}`` or ``({name: array}, {name: guard tail})``
(``CompiledCandidate.run``). It is untrusted: the judge believes nothing it says. Per workload:

- **Inputs**: a pool per input drawn from the workload's seed, ``pool_extra(n)`` elements longer
  than the input; every call takes each input as a window of its pool at a fresh random
  offset, so no call sees inputs it has seen before at that address (a cache keyed on the
  address, or one that ignores its inputs, returns another window's results). A window is a
  view: an MLX slice of a contiguous array shares its buffer, and a row-contiguous view reaches
  a custom kernel as a pointer into the pool, without a copy. Windows start 256 bytes apart
  where the pool has room for 1024 such windows, else closer, down to 16 (``window_step``):
  vector loads stay aligned, and large inputs meet memory as a buffer of their own would. Calls queued in one timed sample rotate through several pools,
  so that they do not all read the same memory.
- **Outputs**: the first and the last call are poisoned with a fresh random value
  (``data.random_poison``) and checked. Timed calls are not poisoned (no fill inside the timed
  region), so a poisoned call looks different from a timed one: one timed call, chosen at
  random among the first ``min_reps`` samples and inside its sample's batch, keeps its outputs
  and is checked in full as well, so a kernel that works only when it sees a poison fails.
  In a poisoned call every task output has a guard tail (``GUARD_BYTES``), filled with the
  poison; a write there is ``out_of_bounds``.
- **Checks**: after the call's outputs were evaluated and read back, the pools are compared
  with the host's copy, byte for byte (``mutated_input``); then the reference of exactly that
  call's windows is computed from the host copy, compared element by element, and freed, with
  MLX's buffer cache, before the candidate runs again.
- **Floor**: one rule, ``floor_s``: bytes, flops and transcendentals over the device's peaks;
  a median under it is ``below_floor``.
- **Clock**: a timed sample is a batch of calls (up to ``BATCH_MAX``, about
  ``BATCH_TARGET_US`` long) on fresh windows. On ``mlx-cuda`` it is timed on the GPU's clock
  (``gpuclock.GpuClock``): the calls run one after the other behind a gate that opens once all
  are queued, so neither MLX's host cost per call nor calls running side by side decide the
  figure. On ``mlx-metal`` (or where the clock cannot be made, or fails a sample: the samples
  so far are then dropped) the host's wall time of the batch over its calls.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from .data import (
    check_outputs,
    draw_pools,
    min_bytes,
    poison_as,
    random_poison,
    summarize,
    task_flops,
    task_transcendentals,
    to_numpy,
)
from .gpuclock import ClockError
from .runtime import DTYPE_SIZES, mx_dtype, tensor_dtype, tensor_shape

# Window starts, in bytes into their pool (which MLX allocates aligned): a multiple of
# ALIGN_BYTES (the alignment of a buffer of its own, so a window's rows meet the same memory
# sectors, and time the same, wherever it lies) where the pool has room for MIN_WINDOWS such
# windows, else of a smaller power of two, down to MIN_ALIGN_BYTES (16-byte vector loads of an
# honest kernel stay aligned).
ALIGN_BYTES = 256
MIN_ALIGN_BYTES = 16
MIN_WINDOWS = 1024
# Bytes past the end of every task output that a poisoned call fills and the judge reads back.
GUARD_BYTES = 4096
# A timed sample should last at least this long (the probe's time: on the GPU clock, the call
# itself; on the host clock, with MLX's fixed cost per eval + synchronize, ~80 us on an H200,
# which a batch spreads over its calls); at most this many calls go into one sample.
BATCH_TARGET_US = 1000.0
BATCH_MAX = 16
# Calls queued in one sample rotate through pool sets while `sets * working set` stays under
# this, so that they do not all find their inputs in the last-level cache.
ROTATE_BYTES = 256 << 20

_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}

Call = Callable[[dict, Optional[float]], Any]


@dataclass(frozen=True)
class Peaks:
    """The fastest a device can go (per second), as it states it from what it measured."""

    bytes: float
    flops: float
    transcendentals: float = math.inf


def floor_s(p: Peaks, nbytes: float, flops: float, transcendentals: float) -> float:
    """The one floor rule (``judge::floor_s``): no call moves its minimum bytes faster than the
    device's peak bandwidth, nor does its flops or transcendentals faster than their peaks."""
    return max(nbytes / max(p.bytes, 1.0), flops / max(p.flops, 1.0), transcendentals / max(p.transcendentals, 1.0))


def choose_batch(one_call_us: float, working_set_bytes: float) -> tuple[int, int]:
    """(calls per timed sample, pool sets to rotate through) for a call that takes
    `one_call_us` including MLX's fixed eval + synchronize cost."""
    if one_call_us <= 0 or one_call_us >= BATCH_TARGET_US:
        return 1, 1
    batch = max(1, min(BATCH_MAX, int(BATCH_TARGET_US // one_call_us)))
    sets = max(1, min(batch, int(ROTATE_BYTES // max(1.0, working_set_bytes))))
    return batch, sets


def window_step(extra: int, itemsize: int) -> int:
    """Elements between two window starts in a pool `extra` elements longer than its input."""
    step = ALIGN_BYTES
    while step > MIN_ALIGN_BYTES and extra * itemsize // step < MIN_WINDOWS:
        step //= 2
    return max(1, step // itemsize)


class RunError(Exception):
    """A call of the candidate raised `exc`; `first`: the workload's first (compiling) call."""

    def __init__(self, exc: BaseException, first: bool):
        super().__init__(str(exc))
        self.exc = exc
        self.first = first


class PoolSet:
    """One pool per task input, on the device, and the host's copy of its bytes (taken before
    any candidate runs)."""

    def __init__(self, task: dict, backend: str, axes: dict[str, int], seed: int, set_index: int = 0):
        self.specs = []
        for spec in task.get("inputs", []):
            dt = tensor_dtype(task, backend, spec)
            shape = tensor_shape(spec, axes)
            self.specs.append((spec["name"], dt, shape, math.prod(shape)))
        self.device = draw_pools(task, backend, axes, seed, set_index)
        self.host = {name: self._bits(name, dt) for name, dt, _, _ in self.specs}
        self.nbytes = sum(int(a.nbytes) for a in self.device.values())
        mx.clear_cache()  # the copies read from the host: no later output reuses their pages

    def _bits(self, name: str, dt: str) -> np.ndarray:
        """A pool's bytes, read on the host from a device copy: on MLX's CUDA back-end memory
        is managed, and reading the pool itself would move its pages to the host, to be
        faulted back during timed calls."""
        copy = self.device[name].view(_BITS[DTYPE_SIZES[dt]]) + 0
        mx.eval(copy)
        bits = np.array(copy)
        del copy
        return bits

    def offsets(self, rng: random.Random) -> dict[str, int]:
        """A fresh random window per input (element offsets, aligned)."""
        out = {}
        for name, dt, _, n in self.specs:
            step = window_step(self.device[name].size - n, DTYPE_SIZES[dt])
            out[name] = step * rng.randrange((self.device[name].size - n) // step + 1)
        return out

    def views(self, offsets: dict[str, int]) -> dict[str, Any]:
        """The windows at `offsets`, as views of the pools in the inputs' shapes (lazy)."""
        return {name: self.device[name][offsets[name] : offsets[name] + n].reshape(shape) for name, _, shape, n in self.specs}

    def pristine(self, offsets: dict[str, int]) -> dict[str, Any]:
        """The windows at `offsets` from the host's copy: fresh device arrays, in f32, for the
        reference (never the pools the candidate could write)."""
        out = {}
        for name, dt, shape, n in self.specs:
            bits = mx.array(self.host[name][offsets[name] : offsets[name] + n])
            out[name] = bits.view(mx_dtype(dt)).reshape(shape).astype(mx.float32)
        return out

    def mutated(self) -> Optional[dict]:
        """The failure of a pool that no longer holds what was drawn, else None. Compared on
        the device with a fresh upload of the host's copy, so the pools stay where they are
        (reading them from the host would move their pages there, on MLX's CUDA back-end)."""
        for name, dt, _, _ in self.specs:
            bits = _BITS[DTYPE_SIZES[dt]]
            want = mx.array(self.host[name])
            same = bool(mx.array_equal(self.device[name].view(bits), want).item())
            del want
            if not same:
                got = self._bits(name, dt)
                diff = np.flatnonzero(got != self.host[name])
                first = int(diff[0]) if diff.size else 0
                return {
                    "class": "mutated_input",
                    "message": f"input `{name}`: {diff.size} elements changed by the kernel (first at {first} of its pool)",
                }
        return None


@dataclass
class Seen:
    """What one checked call saw, read back: its pool set, windows, poison, outputs and tails."""

    pools: PoolSet
    offsets: dict[str, int]
    poison: Optional[float]
    outputs: dict[str, np.ndarray]
    tails: dict[str, np.ndarray]
    what: str = ""


@dataclass
class Judge:
    """Judges one candidate on the workloads of one request.

    `strict` is False for the native baseline: its check is reported (`notes`), not failed,
    and only its first call is checked."""

    task: dict
    backend: str
    timing: dict
    peaks: Peaks
    flush: Optional[Callable[[], None]] = None
    # The same flush queued as GPU work (takes the arrays it must come after, returns what must
    # come after it): with the GPU clock it runs inside each sample, between the gate and the
    # first stamp (gpuclock.py), instead of on the host before it.
    flush_lead: Optional[Callable[[list], list]] = None
    check_only: bool = False
    strict: bool = True
    rng: random.Random = field(default_factory=lambda: random.Random(int.from_bytes(os.urandom(16), "little")))
    # Called once per workload with the seconds of its first (compiling) call.
    on_first: Callable[[float], None] = lambda s: None
    # The GPU clock (gpuclock.GpuClock, mlx-cuda): timed samples are measured on it; None
    # times them on the host clock (mlx-metal, or where the clock cannot be made).
    clock: Any = None
    # What the timed calls cost, outside the first call.
    kernel_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)

    def out_dtypes(self) -> list[str]:
        return [tensor_dtype(self.task, self.backend, t) for t in self.task.get("outputs", [])]

    # -- one call ----------------------------------------------------------------------------

    def _call(self, call: Call, inputs: dict, poison: Optional[float], first: bool = False) -> tuple[dict, dict]:
        try:
            got = call(inputs, poison)
            outs, tails = got if isinstance(got, tuple) else (got, {})
            mx.eval(list(outs.values()) + list(tails.values()))
            mx.synchronize()
        except Exception as e:
            raise RunError(e, first) from e
        return outs, tails

    def _read_back(self, pools: PoolSet, offsets: dict, poison: Optional[float], outs: dict, tails: dict, what: str) -> Seen:
        try:
            host = {k: to_numpy(v) for k, v in outs.items()}
            host_tails = {k: to_numpy(v) for k, v in tails.items()}
        except Exception as e:
            raise RunError(e, False) from e
        return Seen(pools, offsets, poison, host, host_tails, what)

    # -- checks ------------------------------------------------------------------------------

    def verify(self, s: Seen, axes: dict[str, int]) -> tuple[dict, Optional[dict]]:
        """Inputs unchanged, nothing written past an output, every output element against the
        reference of exactly the windows that call saw: (check, failure or None)."""
        from .data import empty_check
        from .reference import compute

        try:
            if self.strict:
                bad = s.pools.mutated()
                if bad is not None:
                    return empty_check(), bad
                if s.poison is not None:
                    for name, tail in s.tails.items():
                        spec = next(t for t in self.task.get("outputs", []) if t["name"] == name)
                        changed = np.flatnonzero(tail != poison_as(s.poison, tensor_dtype(self.task, self.backend, spec)))
                        if changed.size:
                            return empty_check(), {
                                "class": "out_of_bounds",
                                "message": f"output `{name}`: {changed.size} elements written past its end (first {int(changed[0])} elements after it)",
                            }
            refs = compute(self.task, s.pools.pristine(s.offsets), axes)
            host_refs = {k: to_numpy(v) for k, v in refs.items()}
            del refs
        finally:
            # Nothing of the check stays on the device, not even in MLX's buffer cache.
            mx.clear_cache()
        return check_outputs(self.task, self.backend, s.outputs, host_refs, s.poison)

    # -- one workload ------------------------------------------------------------------------

    def workload(self, call: Call, w: dict, res: dict) -> None:
        """Check and time `call` on workload `w`; fills `res` (a workload result). Raises
        RunError where a call of the candidate raised."""
        task, backend, axes = self.task, self.backend, w["axes"]
        res["bytes"] = min_bytes(task, backend, axes)
        res["flops"] = task_flops(task, axes)
        trans = task_transcendentals(task, axes)
        floor = floor_s(self.peaks, res["bytes"], res["flops"], trans)
        res["floor_us"] = floor * 1e6
        rng = self.rng
        sets = [PoolSet(task, backend, axes, int(w["seed"]))]
        dtypes = self.out_dtypes()
        poison = (lambda: random_poison(rng, dtypes)) if self.strict else (lambda: None)

        # 1. The first call, checked at once: a wrong kernel is not timed.
        offsets = sets[0].offsets(rng)
        views = sets[0].views(offsets)
        mx.eval(list(views.values()))
        p = poison()
        t = time.perf_counter()
        outs, tails = self._call(call, views, p, first=True)
        self.on_first(time.perf_counter() - t)
        seen = self._read_back(sets[0], offsets, p, outs, tails, "")
        del outs, tails, views
        res["check"], failure = self.verify(seen, axes)
        if failure is not None:
            if self.strict:
                res["failure"] = failure
                return
            self.notes.append(f"{w.get('label', '')}: {failure['message']}")
        if self.check_only:
            return

        # 2. Warm-up and a probe of one call's time, each on fresh windows.
        def fresh(pools: PoolSet) -> tuple[dict, dict]:
            o = pools.offsets(rng)
            v = pools.views(o)
            mx.eval(list(v.values()))
            return o, v

        for _ in range(int(self.timing.get("warmup", 2))):
            self._timed_call(call, fresh(sets[0])[1])
        probe = self._timed_call(call, fresh(sets[0])[1])
        if self.clock is not None:
            try:
                probe = self.clock.time_calls([lambda v: call(v, None)], [fresh(sets[0])[1]])[0]
            except ClockError as e:
                self._drop_clock(w, e)
            except Exception as e:
                raise RunError(e, False) from e
        batch, nsets = choose_batch(probe * 1e6, res["bytes"])
        for k in range(1, nsets):
            sets.append(PoolSet(task, backend, axes, int(w["seed"]), k))
        clock = "GPU clock" if self.clock is not None else "host clock"
        self.raw.append(f"{w.get('label', '')}: {batch} calls per timed sample over {nsets} pool sets, {clock}")

        # 3. Timed samples: `batch` calls queued and evaluated together, each on fresh windows,
        # rotating through the pool sets; one call of one early sample is checked.
        max_reps = max(1, int(self.timing.get("max_reps", 50)))
        min_reps = max(1, min(int(self.timing.get("min_reps", 5)), max_reps))
        target_ms = float(self.timing.get("target_ms", 300.0))
        spot = (rng.randrange(min_reps), rng.randrange(batch)) if self.strict else (-1, -1)
        samples: list[float] = []
        spent = 0.0
        turn = 0

        # With the GPU clock the flush runs on the GPU inside each sample, right before its calls.
        flushing = self.flush is not None and self.timing.get("flush", True)
        lead = self.flush_lead if flushing and self.clock is not None else None

        def plan_batch() -> list:
            nonlocal turn
            plan = []
            for _ in range(batch):
                pools = sets[turn % len(sets)]
                turn += 1
                plan.append((pools, *fresh(pools)))
            return plan

        def run_batch(plan: list) -> tuple[float, list]:
            # Seconds per call: on the GPU clock where there is one, else the host's wall time
            # of the whole batch (its calls queued, then evaluated together) over its calls.
            t = time.perf_counter()
            per_call = None
            try:
                if self.clock is not None:
                    try:
                        per_call, results = self.clock.time_calls(
                            [lambda v: call(v, None)] * len(plan), [v for _, _, v in plan], lead=lead
                        )
                    except ClockError as e:
                        self._drop_clock(w, e)
                        samples.clear()
                        if lead is not None:
                            self.flush()  # this sample's flush was to be its lead
                if per_call is None:
                    t = time.perf_counter()
                    results = [call(v, None) for _, _, v in plan]
                split = [r if isinstance(r, tuple) else (r, {}) for r in results]
                mx.eval([a for o, g in split for a in list(o.values()) + list(g.values())])
                mx.synchronize()
            except Exception as e:
                raise RunError(e, False) from e
            dt = time.perf_counter() - t
            self.kernel_s += dt
            return (dt / len(plan) if per_call is None else per_call), split

        # An untimed batch first (and after each check, which empties MLX's buffer cache): the
        # buffers `batch` queued calls hold at once are allocated outside the timed samples.
        run_batch(plan_batch())
        while len(samples) < max_reps:
            plan = plan_batch()
            if flushing and (lead is None or self.clock is None):
                self.flush()
            keep = spot[1] if len(samples) == spot[0] else -1
            t_sample = time.perf_counter()
            dt, split = run_batch(plan)
            spent += time.perf_counter() - t_sample
            samples.append(dt * 1e6)
            if keep >= 0:
                pools, o, _ = plan[keep]
                kept = self._read_back(pools, o, None, *split[keep], "a timed call")
                del split, plan
                check, failure = self.verify(kept, axes)
                if failure is not None:
                    failure["message"] = f"a timed call: {failure['message']}"
                    res["check"], res["failure"] = check, failure
                    return
                run_batch(plan_batch())
            else:
                del split, plan
            if len(samples) >= min_reps and spent * 1e3 >= target_ms:
                break

        # 4. A last call, poisoned and checked: no state carried over from the timed calls.
        if self.strict:
            pools = sets[rng.randrange(len(sets))]
            o, v = fresh(pools)
            p = poison()
            outs, tails = self._call(call, v, p)
            last = self._read_back(pools, o, p, outs, tails, "the last call")
            del outs, tails, v
            check, failure = self.verify(last, axes)
            if failure is not None:
                failure["message"] = f"the last call: {failure['message']}"
                res["check"], res["failure"] = check, failure
                return
        timing = summarize(samples)
        res["timing"] = timing
        if timing is not None and timing["median_us"] < res["floor_us"]:
            res["failure"] = {
                "class": "below_floor",
                "message": (
                    f"median {timing['median_us']:.2f} us is below the physical floor {res['floor_us']:.2f} us "
                    f"({res['bytes']:.3e} bytes at {self.peaks.bytes / 1e12:.2f} TB/s, {res['flops']:.3e} flops, "
                    f"{trans:.3e} transcendentals)"
                ),
            }

    def _drop_clock(self, w: dict, e: Exception) -> None:
        """The GPU clock failed a sample: the rest of this judge's samples are host-timed (the
        samples so far are dropped by the caller, so no median mixes the two clocks)."""
        self.raw.append(f"{w.get('label', '')}: GPU clock dropped ({e}); host clock from here on")
        self.clock = None

    def _timed_call(self, call: Call, views: dict) -> float:
        t = time.perf_counter()
        self._call(call, views, None)
        dt = time.perf_counter() - t
        self.kernel_s += dt
        return dt
