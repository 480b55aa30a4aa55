"""The native MLX implementation of each task: what a searched kernel is compared with.

Each takes the task's inputs (MLX arrays in their task dtypes), the axes and the constants,
and returns lazy outputs in declared order (the caller casts them to the output dtypes and
evaluates them inside the timed region).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx


def softmax(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    return [mx.softmax(inputs["x"], axis=-1)]


def rmsnorm(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    return [mx.fast.rms_norm(inputs["x"], inputs["w"], float(constants.get("eps", 1e-5)))]


def attention(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """MLX's fused attention; k and v may have fewer heads than q (grouped-query attention is
    native to it: query head h reads key/value head h / (H / Hkv))."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    scale = 1.0 / math.sqrt(int(axes["D"]))
    mask = "causal" if int(axes.get("causal", 0)) else None
    return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)]


def ssm_step(x: Any, delta: Any, a: Any, b: Any, c: Any, d: Any, state: Any = None) -> tuple[Any, Any]:
    """One time step as mlx-lm 0.32.2's `MambaBlock.ssm_step` computes it, from the point where
    delta (already softplus'ed), B and C are known: x, delta [b, D]; B, C [b, N]."""
    new_state = mx.expand_dims(delta * x, -1) * mx.expand_dims(b, 1)
    if state is not None:
        new_state += state * mx.exp(mx.expand_dims(delta, -1) * a)
    y = (new_state @ mx.expand_dims(c, -1)).squeeze(2)
    y = y + d * x
    return y, new_state


def mamba_scan(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """mlx-lm's prefill path off Metal: a Python loop of `ssm_step` over time, one graph."""
    u, delta, a, bm, cm, dv = (inputs[n] for n in ("u", "delta", "A", "Bm", "Cm", "Dv"))
    state = None
    ys = []
    for t in range(u.shape[1]):
        y_t, state = ssm_step(u[:, t], delta[:, t], a, bm[:, t], cm[:, t], dv, state)
        ys.append(y_t)
    return [mx.stack(ys, axis=1), state]


def mamba_step(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """mlx-lm's decode step (`ssm_step` with the cached state)."""
    y, state = ssm_step(
        inputs["u"], inputs["delta"], inputs["A"], inputs["Bm"], inputs["Cm"], inputs["Dv"], inputs["state_in"]
    )
    return [y, state]


BASELINES: dict[str, Callable[[dict[str, Any], dict[str, int], dict[str, float]], list[Any]]] = {
    "softmax": softmax,
    "rmsnorm": rmsnorm,
    "attention": attention,
    "mamba_scan": mamba_scan,
    "mamba_step": mamba_step,
}


def describe(name: str) -> str:
    return {
        "softmax": "mx.softmax",
        "rmsnorm": "mx.fast.rms_norm",
        "attention": "mx.fast.scaled_dot_product_attention",
        "mamba_scan": "mlx-lm MambaBlock.ssm_step per time step",
        "mamba_step": "mlx-lm MambaBlock.ssm_step",
    }.get(name, name)
