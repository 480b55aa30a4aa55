"""Inputs from a seed, poison values, element-wise checks and timing summaries.

The check and the summary follow crates/core/src/data.rs (`check`) and protocol.rs
(`Timing::from_samples`), so MLX results read like those of the Rust back-ends.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .runtime import DTYPE_SIZES, eval_expr_float, mx_dtype, tensor_dtype, tensor_shape

# The lowest finite value of each dtype: no correct result of these tasks holds it, so an
# element still equal to it after a run was never written.
LOWEST = {
    "f16": -65504.0,
    "bf16": -3.3895313892515355e38,
    "f32": -3.4028234663852886e38,
    "f64": -1.7976931348623157e308,
    "i32": -2147483648.0,
}


def poison_value(dtypes: list[str]) -> float:
    """One `init_value` for a call whose outputs have `dtypes`.

    MLX takes a single float per kernel call and casts it to each output's dtype, so the
    value must stay finite in every one: the lowest finite value of the narrowest dtype (e.g.
    f16's -65504, still finite in f32).
    """
    return max(LOWEST[d] for d in dtypes) if dtypes else LOWEST["f32"]


def random_poison(rng: Any, dtypes: list[str]) -> float:
    """A fresh poison for one checked call whose outputs have `dtypes`: a finite value of
    large magnitude and random sign, different every call, so a kernel cannot recognise it.

    Not a NaN payload, as the Rust judge uses: MLX's `init_value` is one C++ float, cast to
    each output's dtype, and a NaN's payload does not survive the cast to f16/bf16 (nor can a
    NaN be told from a NaN the kernel wrote). Its magnitude is between a quarter and 99% of the
    largest finite value of the narrowest output dtype (f16: 16 376 to 64 849), which keeps it
    finite in every output and far from the values these tasks produce.
    """
    top = min([-LOWEST[d] for d in dtypes] or [-LOWEST["f32"]])
    top = min(top, -LOWEST["f32"])  # init_value is a float
    v = float(np.float32(top * rng.uniform(0.25, 0.99)))
    return v if rng.random() < 0.5 else -v


def poison_as(value: float, dtype: str) -> float:
    """`value` as it reads back from an array of `dtype` (what an unwritten element holds)."""
    if dtype == "f64":
        return float(value)
    return float(np.array(mx.array(value, dtype=mx.float32).astype(mx_dtype(dtype)).astype(mx.float32)))


def _draw(spec: dict, dtype: str, shape: tuple[int, ...], key: Any) -> Any:
    """Values for one tensor of `shape`: drawn in f32 from the spec's init and cast to `dtype`."""
    init = spec.get("init") or {"dist": "normal", "mean": 0.0, "std": 1.0}
    dist = init.get("dist", "normal")
    if dist == "normal":
        x = mx.random.normal(shape, dtype=mx.float32, loc=float(init.get("mean", 0.0)), scale=float(init.get("std", 1.0)), key=key)
    elif dist == "uniform":
        x = mx.random.uniform(float(init["lo"]), float(init["hi"]), shape, dtype=mx.float32, key=key)
    else:
        raise ValueError(f"input `{spec['name']}`: unknown init dist `{dist}`")
    if dtype == "i32":
        x = mx.round(x)
    return x.astype(mx_dtype(dtype))


def draw_inputs(task: dict, backend: str, axes: dict[str, int], seed: int) -> dict[str, Any]:
    """Fresh inputs for one workload: one sub-key of `seed` per tensor (by index), drawn in f32
    and cast to the tensor's dtype. The arrays are evaluated."""
    specs = task.get("inputs", [])
    keys = mx.random.split(mx.random.key(int(seed)), max(len(specs), 1))
    out = {}
    for i, spec in enumerate(specs):
        out[spec["name"]] = _draw(spec, tensor_dtype(task, backend, spec), tensor_shape(spec, axes), keys[i])
    mx.eval(list(out.values()))
    return out


def pool_extra(n: int) -> int:
    """Elements a pool holds beyond its input (the rule of crates/eval/src/judge.rs): enough
    distinct windows that calls almost never repeat one."""
    return max(n // 4, 4096)


def draw_pools(task: dict, backend: str, axes: dict[str, int], seed: int, set_index: int = 0) -> dict[str, Any]:
    """One pool per input for one workload: a flat array of `n + pool_extra(n)` values of the
    input's distribution and dtype, from one sub-key of `seed` per tensor. `set_index` > 0
    draws another, independent set from the same seed. The arrays are evaluated."""
    specs = task.get("inputs", [])
    key = mx.random.key(int(seed))
    if set_index:
        key = mx.random.split(mx.random.key(int(seed) ^ 0x504F4F4C), set_index + 1)[set_index]
    keys = mx.random.split(key, max(len(specs), 1))
    out = {}
    for i, spec in enumerate(specs):
        n = math.prod(tensor_shape(spec, axes))
        out[spec["name"]] = _draw(spec, tensor_dtype(task, backend, spec), (n + pool_extra(n),), keys[i])
    mx.eval(list(out.values()))
    return out


def as_f32(inputs: dict[str, Any]) -> dict[str, Any]:
    """The exact values the kernel sees, in f32, for the reference."""
    return {k: v.astype(mx.float32) for k, v in inputs.items()}


def to_numpy(a: Any) -> np.ndarray:
    """An MLX array as a flat float64 numpy array (bf16 has no numpy dtype: through f32);
    a numpy array (already read back) is flattened."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).astype(np.float64, copy=False)
    if a.dtype == mx.float64:
        return np.array(a).reshape(-1)
    return np.array(a.astype(mx.float32)).reshape(-1).astype(np.float64)


def fmt(v: float) -> str:
    # Rust prints these as NaN / inf / -inf; keep the same words in the messages.
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(float(v))


def empty_check() -> dict:
    return {
        "elements": 0,
        "mismatches": 0,
        "unwritten": 0,
        "nan": 0,
        "max_abs_err": 0.0,
        "max_rel_err": 0.0,
        "first_bad": None,
    }


def check_values(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float, poison: Optional[float]) -> dict:
    """Compare every element of `out` with `ref` (flat float64 arrays).

    Still equal to `poison` → unwritten; non-finite (unless it is the same infinity as the
    reference) → nan; otherwise outside ``atol + rtol·|ref|`` → mismatch. `first_bad` is
    the first offending element of any kind: (index, value, reference) as text.
    """
    out = np.asarray(out, dtype=np.float64).reshape(-1)
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    if out.shape != ref.shape:
        raise ValueError(f"output has {out.size} elements, the reference {ref.size}")
    c = empty_check()
    c["elements"] = int(ref.size)
    if ref.size == 0:
        return c
    unwritten = (out == poison) if poison is not None else np.zeros(out.shape, bool)
    finite = np.isfinite(out)
    same_inf = np.isinf(out) & (out == ref)
    nan = ~unwritten & ~finite & ~same_inf
    judged = ~unwritten & finite
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.where(judged, np.abs(out - ref), 0.0)
        bad = judged & ~(abs_err <= atol + rtol * np.abs(ref))
        rel_err = abs_err / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    rel_mask = judged & (np.abs(ref) > atol) & np.isfinite(rel_err)
    abs_ok = np.where(np.isfinite(abs_err), abs_err, 0.0)
    c["unwritten"] = int(unwritten.sum())
    c["nan"] = int(nan.sum())
    c["mismatches"] = int(bad.sum())
    c["max_abs_err"] = float(abs_ok.max()) if abs_ok.size else 0.0
    c["max_rel_err"] = float(rel_err[rel_mask].max()) if rel_mask.any() else 0.0
    offending = unwritten | nan | bad
    if offending.any():
        i = int(np.argmax(offending))
        value = "never written" if unwritten[i] else fmt(out[i])
        c["first_bad"] = [i, value, fmt(ref[i])]
    return c


def merge_checks(a: dict, b: dict) -> dict:
    m = dict(a)
    for k in ("elements", "mismatches", "unwritten", "nan"):
        m[k] = a[k] + b[k]
    m["max_abs_err"] = max(a["max_abs_err"], b["max_abs_err"])
    m["max_rel_err"] = max(a["max_rel_err"], b["max_rel_err"])
    m["first_bad"] = a["first_bad"] if a["first_bad"] is not None else b["first_bad"]
    return m


def passed(c: dict) -> bool:
    return c["mismatches"] == 0 and c["unwritten"] == 0 and c["nan"] == 0


def tolerance(task: dict, dtype: str) -> tuple[float, float]:
    t = (task.get("tolerance") or {}).get(dtype) or {"atol": 1e-5, "rtol": 1e-4}
    return float(t["atol"]), float(t["rtol"])


def check_outputs(
    task: dict,
    backend: str,
    outputs: dict[str, Any],
    refs: dict[str, Any],
    poison: Optional[float],
) -> tuple[dict, Optional[dict]]:
    """Check every task output; the merged check and the failure it implies (or None).

    The failure is the first output's that failed, classed unwritten, then nan, then wrong.
    """
    total = empty_check()
    failure = None
    for spec in task.get("outputs", []):
        name = spec["name"]
        dt = tensor_dtype(task, backend, spec)
        atol, rtol = tolerance(task, dt)
        if name not in outputs:
            raise ValueError(f"no output `{name}` was returned")
        p = poison_as(poison, dt) if poison is not None else None
        c = check_values(to_numpy(outputs[name]), to_numpy(refs[name]), atol, rtol, p)
        if failure is None and not passed(c):
            failure = failure_for(name, c, atol, rtol)
        total = merge_checks(total, c)
    return total, failure


def failure_for(name: str, c: dict, atol: float, rtol: float) -> dict:
    i, got, want = c["first_bad"] or [0, "?", "?"]
    if c["unwritten"]:
        return {
            "class": "unwritten",
            "message": f"output `{name}`: {c['unwritten']} of {c['elements']} elements never written (first at {i}, reference {want})",
        }
    if c["nan"]:
        return {
            "class": "nan",
            "message": f"output `{name}`: {c['nan']} NaN/inf elements (first at {i}: {got}, reference {want})",
        }
    return {
        "class": "wrong",
        "message": (
            f"output `{name}`: {c['mismatches']} of {c['elements']} elements outside tolerance "
            f"(atol {atol:g}, rtol {rtol:g}); first at {i}: got {got}, reference {want}; "
            f"max abs err {c['max_abs_err']:.3e}"
        ),
    }


def summarize(samples_us: list[float]) -> Optional[dict]:
    """Median, min and spread ((p90 - p10) / median) as `Timing::from_samples` computes them."""
    if not samples_us:
        return None
    us = sorted(samples_us)

    def q(f: float) -> float:
        # Rust's f64::round rounds halves away from zero; Python's round() would go to even.
        return us[int(math.floor((len(us) - 1) * f + 0.5))]

    median = q(0.5)
    return {
        "median_us": median,
        "min_us": us[0],
        "spread": (q(0.9) - q(0.1)) / median if median > 0 else 0.0,
        "reps": len(us),
    }


def min_bytes(task: dict, backend: str, axes: dict[str, int]) -> float:
    """Bytes every evaluation moves at least once: inputs read, outputs written."""
    total = 0
    for spec in task.get("inputs", []) + task.get("outputs", []):
        n = math.prod(tensor_shape(spec, axes))
        total += n * DTYPE_SIZES[tensor_dtype(task, backend, spec)]
    return float(total)


def task_flops(task: dict, axes: dict[str, int]) -> float:
    return _task_count(task, "flops", axes)


def task_transcendentals(task: dict, axes: dict[str, int]) -> float:
    """The task's `transcendentals` (exp, log… per call), 0 where it declares none."""
    return _task_count(task, "transcendentals", axes)


def _task_count(task: dict, field: str, axes: dict[str, int]) -> float:
    f = task.get(field)
    if not f:
        return 0.0
    try:
        return float(eval_expr_float(f, axes))
    except ValueError:
        return 0.0
