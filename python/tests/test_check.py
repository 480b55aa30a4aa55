import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import load_task, tiny_task

from ksearch_mlx.data import (
    LOWEST,
    check_outputs,
    check_values,
    draw_inputs,
    min_bytes,
    poison_as,
    poison_value,
    summarize,
    task_flops,
)

P = LOWEST["f32"]


def test_poison_nan_and_wrong_are_told_apart():
    ref = np.array([1.0, 2.0, 3.0, 4.0, math.inf, 5.0])
    out = np.array([1.0, P, math.nan, 4.5, math.inf, -math.inf])
    c = check_values(out, ref, 1e-3, 1e-3, P)
    assert (c["elements"], c["unwritten"], c["nan"], c["mismatches"]) == (6, 1, 2, 1)
    assert c["first_bad"] == [1, "never written", "2.0"]
    assert c["max_abs_err"] == pytest.approx(0.5)


def test_first_bad_is_the_first_offender_of_any_kind():
    ref = np.zeros(4)
    c = check_values(np.array([0.0, 0.0, 9.0, math.nan]), ref, 1e-3, 1e-3, P)
    assert c["first_bad"] == [2, "9.0", "0.0"]
    c = check_values(np.array([0.0, math.nan, 9.0, 0.0]), ref, 1e-3, 1e-3, P)
    assert c["first_bad"] == [1, "NaN", "0.0"]


def test_tolerance_is_atol_plus_rtol_and_rel_err_skips_tiny_refs():
    ref = np.array([100.0, 0.0])
    out = np.array([100.5, 0.0005])
    ok = check_values(out, ref, 1e-3, 1e-2, P)
    assert ok["mismatches"] == 0
    assert ok["max_rel_err"] == pytest.approx(0.005)  # the 0.0 reference does not count
    assert check_values(out, ref, 1e-3, 1e-3, P)["mismatches"] == 1


def test_without_poison_nothing_is_unwritten():
    c = check_values(np.array([P]), np.array([P]), 0.0, 0.0, None)
    assert c["unwritten"] == 0 and c["mismatches"] == 0


def test_poison_value_stays_finite_in_every_output_dtype():
    assert poison_value(["f32"]) == LOWEST["f32"]
    assert poison_value(["f16", "f32"]) == -65504.0
    v = poison_value(["f16", "bf16", "f32"])
    for dt in ("f16", "bf16", "f32"):
        assert math.isfinite(poison_as(v, dt))
    assert poison_as(-65504.0, "bf16") == -65536.0  # bf16 rounds it: the check uses the cast value
    assert poison_as(LOWEST["bf16"], "bf16") == LOWEST["bf16"]


def test_check_outputs_uses_each_dtype_and_names_the_output():
    task = tiny_task()
    poison = poison_value(["f16", "f32"])
    y_ref = mx.array([[1.0, 2.0]], dtype=mx.float32)
    s_ref = mx.ones((1, 2, 1), dtype=mx.float32)
    refs = {"y": y_ref, "state": s_ref}
    good = {"y": y_ref.astype(mx.float16), "state": s_ref}
    check, failure = check_outputs(task, "mlx-cuda", good, refs, poison)
    assert failure is None and check["elements"] == 4
    # y is fine, state has an unwritten element (MLX filled -65504 into the f32 output).
    bad_state = mx.array([[[1.0], [poison]]], dtype=mx.float32)
    check, failure = check_outputs(task, "mlx-cuda", {"y": good["y"], "state": bad_state}, refs, poison)
    assert failure["class"] == "unwritten" and "`state`" in failure["message"]
    assert check["unwritten"] == 1
    # f16 tolerance on y: 1e-2 + 1e-2 * 2 allows 0.02 but not 0.1; the message says so.
    off = {"y": mx.array([[1.0, 2.1]], dtype=mx.float16), "state": s_ref}
    check, failure = check_outputs(task, "mlx-cuda", off, refs, poison)
    assert failure["class"] == "wrong"
    assert "output `y`: 1 of 2 elements outside tolerance (atol 0.01, rtol 0.01); first at 1" in failure["message"]
    nan = {"y": mx.array([[math.nan, 2.1]], dtype=mx.float16), "state": s_ref}
    assert check_outputs(task, "mlx-cuda", nan, refs, poison)[1]["class"] == "nan"


def test_timing_summary_matches_rust():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t["median_us"], t["min_us"], t["reps"]) == (3.0, 1.0, 5)
    assert t["spread"] == pytest.approx(4.0 / 3.0)
    # Four samples: index round(1.5) = 2 (halves away from zero, like f64::round).
    assert summarize([1.0, 2.0, 3.0, 4.0])["median_us"] == 3.0
    assert summarize([]) is None


def test_bytes_and_flops_floors():
    task = load_task("attention")
    axes = {"B": 1, "H": 2, "Hkv": 2, "L": 8, "D": 4, "causal": 1}
    # q, k, v, o: 4 tensors of 1*2*8*4 f16 values.
    assert min_bytes(task, "no-such-backend", axes) == 4 * 64 * 2  # declared dtypes
    assert min_bytes(task, "cpu", axes) == 4 * 64 * 4  # the cpu back-end overrides them to f32
    # Grouped-query heads: k and v have Hkv = 1 head, q and o have H = 2.
    assert min_bytes(task, "cpu", dict(axes, Hkv=1)) == (2 * 64 + 2 * 32) * 4
    # 4 * B * H * D * (L*L - L*(L-1)/2) in floating point.
    assert task_flops(task, axes) == 4 * 2 * 4 * (64 - 28)
    overrides = load_task("mamba_scan")
    small = {"batch": 1, "L": 2, "D": 3, "N": 4}
    assert min_bytes(overrides, "cpu", small) == 4 * (6 + 6 + 12 + 8 + 8 + 3 + 6 + 12)


def test_inputs_are_seeded_rounded_and_distributed():
    task = tiny_task()
    axes = {"batch": 2, "D": 512, "N": 16}
    a = draw_inputs(task, "mlx-cuda", axes, 91823)
    b = draw_inputs(task, "mlx-cuda", axes, 91823)
    c = draw_inputs(task, "mlx-cuda", axes, 91824)
    assert a["u"].dtype == mx.bfloat16 and a["A"].dtype == mx.float32  # back-end override
    assert mx.array_equal(a["u"], b["u"]).item() and not mx.array_equal(a["u"], c["u"]).item()
    assert not mx.array_equal(a["u"].astype(mx.float32)[0, :16], a["A"][0]).item()
    big_a = np.array(a["A"])
    assert big_a.min() >= -2.0 and big_a.max() < -1.0
    u = np.array(a["u"].astype(mx.float32))
    assert abs(u.mean()) < 0.1 and abs(u.std() - 1.0) < 0.1
    # Seeds are u64 in the protocol.
    draw_inputs(task, "mlx-cuda", {"batch": 1, "D": 2, "N": 1}, 2**64 - 1)
