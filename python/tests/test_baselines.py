"""The native implementations agree with the f32 references on small shapes (CPU)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import load_task

from ksearch_mlx import baselines, reference
from ksearch_mlx.data import as_f32, check_outputs, draw_inputs

CASES = [
    ("softmax", {"rows": 4, "cols": 33}),
    ("rmsnorm", {"rows": 3, "cols": 64}),
    ("attention", {"B": 1, "H": 2, "Hkv": 2, "L": 16, "D": 8, "causal": 0}),
    ("attention", {"B": 1, "H": 2, "Hkv": 2, "L": 16, "D": 8, "causal": 1}),
    ("attention", {"B": 3, "H": 8, "Hkv": 2, "L": 13, "D": 16, "causal": 1}),  # grouped-query heads, ragged L
    ("attention", {"B": 2, "H": 4, "Hkv": 1, "L": 7, "D": 8, "causal": 0}),  # multi-query
    ("mamba_scan", {"batch": 2, "L": 12, "D": 8, "N": 4}),
    ("mamba_step", {"batch": 2, "D": 8, "N": 4}),
]


@pytest.mark.parametrize("name, axes", CASES)
def test_baseline_matches_reference_within_task_tolerance(name, axes):
    task = load_task(name)
    if name.startswith("mamba"):
        # mlx-lm forms delta * x * B in the inputs' f16 before it meets the f32 state, so its
        # f32 state is only f16-accurate: judge every output with the f16 tolerance.
        task["tolerance"]["f32"] = task["tolerance"]["f16"]
    backend = "declared"  # no override: the task's own (mostly f16) dtypes
    inputs = draw_inputs(task, backend, axes, 1234)
    refs = reference.compute(task, as_f32(inputs), axes)
    outs = baselines.BASELINES[name](inputs, axes, task.get("constants") or {})
    named = {}
    for spec, o in zip(task["outputs"], outs):
        named[spec["name"]] = o.astype(mx.float16 if spec["dtype"] == "f16" else mx.float32)
    check, failure = check_outputs(task, backend, named, refs, None)
    assert failure is None, failure
    assert check["elements"] > 0


def test_mamba_scan_baseline_is_the_step_loop_in_f32():
    rng = np.random.default_rng(3)
    b, l, d, n = 1, 5, 3, 2
    ins = {
        "u": rng.normal(size=(b, l, d)),
        "delta": rng.uniform(0.01, 0.1, (b, l, d)),
        "A": rng.uniform(-4, -1, (d, n)),
        "Bm": rng.normal(size=(b, l, n)),
        "Cm": rng.normal(size=(b, l, n)),
        "Dv": rng.uniform(0.5, 1.5, d),
    }
    ins = {k: mx.array(v.astype(np.float32)) for k, v in ins.items()}
    axes = {"batch": b, "L": l, "D": d, "N": n}
    y, s = baselines.mamba_scan(ins, axes, {})
    y_ref, s_ref = reference.mamba_scan(ins, axes, {})
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), rtol=1e-5, atol=1e-6)
