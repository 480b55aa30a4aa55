"""The judge's rules (ksearch_mlx/judge.py, those of crates/eval/src/judge.rs) on MLX's CPU
back-end: candidates are callables, here stand-ins written as plain MLX ops, honest or not."""

import math
import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import load_task, tiny_task

from ksearch_mlx import judge
from ksearch_mlx.data import poison_as, random_poison
from ksearch_mlx.worker import workload_result

TIMING = {"warmup": 1, "min_reps": 3, "max_reps": 6, "target_ms": 1.0, "flush": True}
W = {"label": "rows=4,cols=24", "axes": {"rows": 4, "cols": 24}, "seed": 91823}
PEAKS = judge.Peaks(bytes=1e12, flops=1e15, transcendentals=1e13)


def address(a) -> int:
    """Where an (evaluated, row-contiguous) MLX array's data starts."""
    if a.dtype in (mx.bfloat16,):  # no buffer format for bf16: the same bytes as uint16
        a = a.view(mx.uint16)
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def run(call, task=None, w=W, **kw):
    kw.setdefault("timing", TIMING)
    kw.setdefault("peaks", PEAKS)
    kw.setdefault("rng", random.Random(7))
    j = judge.Judge(task=task or load_task("softmax"), backend="mlx-cuda", **kw)
    res = workload_result(w)
    j.workload(call, w, res)
    return res, j


def softmax(x):
    return mx.softmax(x.astype(mx.float32), axis=-1)


class Recorder:
    """An honest softmax that records what each call saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, inputs, init):
        x = inputs["x"]
        self.calls.append({"init": init, "address": address(x), "x": np.array(x)})
        return {"y": softmax(x)}


def test_an_honest_candidate_passes_and_is_timed():
    rec = Recorder()
    res, j = run(rec)
    assert res["failure"] is None, res["failure"]
    assert res["check"]["elements"] == 96 and res["timing"]["reps"] >= 3
    assert res["bytes"] == 2 * 96 * 4 and res["flops"] == 5 * 96
    # first call, warm-up, probe, the timed calls, the last call
    assert len(rec.calls) >= 1 + 1 + 1 + 3 + 1
    assert j.kernel_s > 0


def test_every_call_sees_a_fresh_window():
    rec = Recorder()
    run(rec)
    addresses = [c["address"] for c in rec.calls]
    contents = {c["x"].tobytes() for c in rec.calls}
    assert len(set(addresses)) >= len(addresses) - 5  # 1025 aligned windows per pool
    assert len(contents) >= len(rec.calls) - 5


def test_windows_are_aligned_views_of_the_pool():
    task = tiny_task()  # u is bf16 here (a back-end override), A f32
    ps = judge.PoolSet(task, "mlx-cuda", {"batch": 3, "D": 64, "N": 16}, 5)
    assert ps.device["u"].size == 3 * 64 + 4096 and ps.device["A"].size == 64 * 16 + 4096
    rng = random.Random(1)
    for _ in range(20):
        off = ps.offsets(rng)
        assert off["u"] % 8 == 0 and off["A"] % 4 == 0
        assert 0 <= off["u"] <= 4096 and 0 <= off["A"] <= 4096
        v = ps.views(off)
        mx.eval(list(v.values()))
        assert v["u"].shape == (3, 64) and v["u"].dtype == mx.bfloat16 and v["A"].shape == (64, 16)
        # a view: the window's data is the pool's, at the offset (no copy)
        assert address(v["A"]) - address(ps.device["A"]) == 4 * off["A"]
        assert address(v["u"]) - address(ps.device["u"]) == 2 * off["u"]
        p = ps.pristine(off)
        assert np.array_equal(np.array(p["u"]), np.array(v["u"].astype(mx.float32)))
    assert ps.mutated() is None


def test_windows_are_256_bytes_apart_where_the_pool_has_room():
    # 2^20 f32 elements: a quarter more is 1 MiB of room, 4096 windows 256 bytes apart
    assert judge.window_step(1 << 18, 4) == 64
    # small inputs keep 1024 windows and at least 16-byte alignment
    assert judge.window_step(4096, 4) == 4 and judge.window_step(4096, 2) == 8
    assert judge.window_step(1 << 15, 4) == 32  # 128 KiB of room: 128-byte steps
    assert judge.window_step(10, 8) == 2


def test_a_candidate_that_ignores_its_inputs_is_wrong():
    saved = {}

    def replay(inputs, init):
        if "y" not in saved:
            saved["y"] = softmax(inputs["x"])
            mx.eval(saved["y"])
        return {"y": saved["y"]}

    res, _ = run(replay)
    assert res["failure"]["class"] == "wrong", res["failure"]
    assert res["failure"]["message"].startswith("a timed call: output `y`")
    assert res["timing"] is None


def test_a_cache_keyed_on_the_input_address_gains_nothing():
    cache, hits = {}, []

    def by_pointer(inputs, init):
        key = address(inputs["x"])
        if key in cache:
            hits.append(key)
            return {"y": cache[key]}
        y = softmax(inputs["x"])
        mx.eval(y)
        cache[key] = y
        return {"y": y}

    res, _ = run(by_pointer)
    # an address is only ever seen again with the same window (the pools never change), so
    # a hit is right, and hits are rare
    assert res["failure"] is None, res["failure"]
    assert len(hits) <= 5


def test_a_candidate_that_mutates_its_input_is_caught():
    def mutate(inputs, init):
        x = inputs["x"]
        y = softmax(x)
        mx.eval(y)
        np.asarray(memoryview(x))[0, 0] -= 1.0  # in place, in the pool
        return {"y": y}

    res, _ = run(mutate)
    assert res["failure"]["class"] == "mutated_input"
    assert res["failure"]["message"].startswith("input `x`: 1 elements changed by the kernel")


def test_a_candidate_that_mutates_only_timed_calls_is_caught():
    def mutate_unpoisoned(inputs, init):
        x = inputs["x"]
        y = softmax(x)
        mx.eval(y)
        if init is None:
            np.asarray(memoryview(x))[-1, -1] += 1.0
        return {"y": y}

    res, _ = run(mutate_unpoisoned)
    assert res["failure"]["class"] == "mutated_input"
    assert res["failure"]["message"].startswith("a timed call: input `x`")


def test_a_candidate_that_writes_nothing_is_unwritten():
    def nothing(inputs, init):
        return {"y": mx.full((4, 24), init if init is not None else 0.0)}

    res, _ = run(nothing)
    assert res["failure"]["class"] == "unwritten"
    assert res["check"]["unwritten"] == 96 and res["check"]["first_bad"][1] == "never written"


def test_a_candidate_that_works_only_under_poison_is_caught_on_a_timed_call():
    def poison_aware(inputs, init):
        y = softmax(inputs["x"])
        if init is None:  # no poison in the outputs: a timed call, skip half the rows
            y = mx.where(mx.arange(4)[:, None] < 2, y, 0.0)
        return {"y": y}

    res, _ = run(poison_aware)
    assert res["failure"]["class"] == "wrong"
    assert res["failure"]["message"].startswith("a timed call: output `y`: ")


def test_a_write_past_the_output_is_out_of_bounds():
    def past(inputs, init):
        y = softmax(inputs["x"])
        fill = init if init is not None else 0.0
        tail = mx.full((judge.GUARD_BYTES // 4,), fill)
        tail = mx.concatenate([mx.array([1.0]), tail[1:]])
        return {"y": y}, {"y": tail}

    res, _ = run(past)
    assert res["failure"]["class"] == "out_of_bounds"
    assert "1 elements written past its end (first 0 elements after it)" in res["failure"]["message"]


def test_a_time_under_the_floor_is_below_floor():
    res, _ = run(Recorder(), peaks=judge.Peaks(bytes=1.0, flops=1e15))
    assert res["failure"]["class"] == "below_floor" and res["timing"] is not None
    # each peak counts: here the transcendentals (softmax: rows * cols exp)
    res, _ = run(Recorder(), peaks=judge.Peaks(bytes=1e15, flops=1e15, transcendentals=1e-3))
    assert res["failure"]["class"] == "below_floor" and "9.600e+01 transcendentals" in res["failure"]["message"]


def test_the_floor_rule():
    p = judge.Peaks(bytes=2e12, flops=1e14, transcendentals=1e12)
    assert judge.floor_s(p, 4e6, 0.0, 0.0) == pytest.approx(2e-6)
    assert judge.floor_s(p, 4e6, 1e9, 0.0) == pytest.approx(1e-5)
    assert judge.floor_s(p, 4e6, 1e9, 1e8) == pytest.approx(1e-4)
    assert judge.floor_s(judge.Peaks(bytes=2e12, flops=1e14), 0.0, 0.0, 1e12) == 0.0


def test_poisons_are_fresh_finite_and_only_on_checked_calls():
    rec = Recorder()
    run(rec)
    inits = [c["init"] for c in rec.calls]
    poisoned = [v for v in inits if v is not None]
    assert inits[0] is not None and inits[-1] is not None and len(poisoned) == 2
    assert poisoned[0] != poisoned[1]
    assert all(abs(v) > 1e37 for v in poisoned)  # f32 outputs only
    rng = random.Random(3)
    values = [random_poison(rng, ["f32", "f16", "bf16"]) for _ in range(200)]
    assert len(set(values)) == 200 and {math.copysign(1, v) for v in values} == {-1.0, 1.0}
    for v in values:
        assert 16000 < abs(v) <= 65504
        for dt in ("f16", "bf16", "f32"):
            assert math.isfinite(poison_as(v, dt))


def test_references_come_after_the_call_and_are_freed(monkeypatch):
    events = []
    from ksearch_mlx import reference

    real_compute = reference.compute

    def compute(task, inputs, axes):
        events.append(("ref", np.array(inputs["x"]).tobytes()))
        return real_compute(task, inputs, axes)

    real_clear = mx.clear_cache
    monkeypatch.setattr(reference, "compute", compute)
    monkeypatch.setattr(mx, "clear_cache", lambda: (events.append(("clear", None)), real_clear()))

    def call(inputs, init):
        events.append(("call", np.array(inputs["x"]).tobytes()))
        return {"y": softmax(inputs["x"])}

    res, _ = run(call)
    assert res["failure"] is None
    assert next(e for e in events if e[0] != "clear")[0] == "call"
    refs = [i for i, e in enumerate(events) if e[0] == "ref"]
    assert len(refs) == 3  # the first call, one timed call, the last call
    for i in refs:
        # computed from exactly the inputs of a call that ran before it, then freed at once
        assert any(e == ("call", events[i][1]) for e in events[:i])
        assert events[i + 1] == ("clear", None)
    assert events[-1] == ("clear", None)


def test_check_only_runs_one_checked_call():
    rec = Recorder()
    res, _ = run(rec, check_only=True)
    assert res["failure"] is None and res["timing"] is None and len(rec.calls) == 1


def test_a_lenient_judge_reports_instead_of_failing():
    def wrong(inputs, init):
        return {"y": softmax(inputs["x"]) + 0.5}

    res, j = run(wrong, strict=False)
    assert res["failure"] is None and res["timing"] is not None
    assert res["check"]["mismatches"] == 96 and j.notes and "output `y`" in j.notes[0]


def test_a_raising_call_is_a_run_error():
    def boom(inputs, init):
        raise RuntimeError("launch refused")

    with pytest.raises(judge.RunError) as e:
        run(boom)
    assert e.value.first and "launch refused" in str(e.value.exc)


class StandInClock:
    """Runs the calls as the GPU clock does (in order, results back) and states `per_call`
    seconds for each sample; from sample `fail_at` on it raises the GPU clock's error."""

    def __init__(self, per_call, fail_at=None):
        self.per_call, self.fail_at, self.samples, self.leads = per_call, fail_at, 0, 0

    def time_calls(self, calls, views, lead=None):
        self.samples += 1
        if self.fail_at is not None and self.samples >= self.fail_at:
            raise judge.ClockError("the gate gave up")
        if lead is not None:
            self.leads += 1
            mx.eval(lead([]))
        results = [c(v) for c, v in zip(calls, views)]
        mx.eval([a for r in results for a in (r[0] if isinstance(r, tuple) else r).values()])
        return self.per_call, results


def test_samples_are_timed_on_the_clock_when_there_is_one():
    rec = Recorder()
    res, j = run(rec, clock=StandInClock(42e-6))
    assert res["failure"] is None, res["failure"]
    # Every sample is the clock's figure (not the host's time of the batch).
    assert res["timing"]["median_us"] == pytest.approx(42.0) and res["timing"]["min_us"] == pytest.approx(42.0)
    assert any("GPU clock" in r for r in j.raw), j.raw
    # The calls still ran, were checked (first, one timed, last) and saw fresh windows.
    assert len({c["address"] for c in rec.calls}) > 3


def test_a_failing_clock_falls_back_to_the_host_clock_without_mixing_samples():
    # The clock gives 1 s per call until it fails: had those samples stayed, the median of a
    # few-microsecond CPU call would be near a second.
    res, j = run(Recorder(), clock=StandInClock(1.0, fail_at=4))
    assert res["failure"] is None, res["failure"]
    assert res["timing"]["median_us"] < 1e5 and res["timing"]["reps"] >= 3
    assert any("GPU clock dropped (the gate gave up); host clock from here on" in r for r in j.raw), j.raw
    assert j.clock is None


def test_a_clock_that_fails_at_the_probe_leaves_the_host_clock():
    res, j = run(Recorder(), clock=StandInClock(1.0, fail_at=1))
    assert res["failure"] is None and res["timing"]["median_us"] < 1e5
    assert any("host clock" in r for r in j.raw) and j.clock is None


class Flushes:
    """Counts the host flushes and the flushes queued as a GPU-clock sample's lead."""

    def __init__(self):
        self.host = self.lead = 0

    def flush(self):
        self.host += 1

    def flush_lead(self, after):
        self.lead += 1
        return [mx.zeros((4,)) + 1.0]


def test_with_the_clock_the_flush_runs_inside_each_sample_not_on_the_host():
    f, clock = Flushes(), StandInClock(42e-6)
    res, j = run(Recorder(), clock=clock, flush=f.flush, flush_lead=f.flush_lead)
    assert res["failure"] is None, res["failure"]
    reps = res["timing"]["reps"]
    # One lead per timed sample (the probe has none), and no host flush between samples.
    assert f.lead >= reps and clock.leads == f.lead and f.host == 0, (f.lead, f.host, reps)


def test_without_the_clock_or_after_it_failed_the_host_flushes():
    f = Flushes()
    res, _ = run(Recorder(), flush=f.flush, flush_lead=f.flush_lead)
    assert f.lead == 0 and f.host >= res["timing"]["reps"], (f.lead, f.host)
    f = Flushes()
    res, j = run(Recorder(), clock=StandInClock(1.0, fail_at=4), flush=f.flush, flush_lead=f.flush_lead)
    assert j.clock is None and f.host >= res["timing"]["reps"] and res["timing"]["median_us"] < 1e5, (f.host, res["timing"])


def test_with_flush_off_there_is_no_lead():
    f, clock = Flushes(), StandInClock(42e-6)
    res, _ = run(Recorder(), clock=clock, flush=f.flush, flush_lead=f.flush_lead, timing={**TIMING, "flush": False})
    assert res["failure"] is None and f.lead == 0 and f.host == 0 and clock.leads == 0
