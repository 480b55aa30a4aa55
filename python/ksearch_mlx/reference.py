"""MLX references, computed in f32: one function per task `reference` name.

Each takes the task's inputs (MLX arrays, already the exact values the kernel sees, in f32),
the workload's axes and the task's constants, and returns the outputs in declared order.
The math is that of the Rust f64 references in crates/core/src/reference.rs; these run on
the device, so they stay fast for the large search workloads.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx

F32 = mx.float32

# Elements of the largest temporary a reference builds at once (score blocks of attention,
# scan blocks of mamba_scan): 2^24 f32 values, 64 MiB.
BLOCK_ELEMENTS = 1 << 24


def softmax(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """y[r, :] = softmax(x[r, :])."""
    x = inputs["x"].astype(F32)
    m = mx.max(x, axis=-1, keepdims=True)
    e = mx.exp(x - m)
    return [e / mx.sum(e, axis=-1, keepdims=True)]


def rmsnorm(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """y = x / sqrt(mean(x^2) + eps) * w."""
    x = inputs["x"].astype(F32)
    w = inputs["w"].astype(F32)
    eps = float(constants.get("eps", 1e-5))
    inv = mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return [x * inv * w]


def attention(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """o = softmax(q k^T / sqrt(D), causal mask when causal = 1) v; q, o: [B, H, L, D];
    k, v: [B, Hkv, L, D] with query head h reading key/value head h / (H / Hkv) (grouped-query
    attention; without an `Hkv` axis, Hkv = H).

    Query rows are processed in blocks so that the score block stays under BLOCK_ELEMENTS.
    """
    q, k, v = (inputs[n].astype(F32) for n in ("q", "k", "v"))
    b, h, l, d = (int(axes[a]) for a in ("B", "H", "L", "D"))
    hkv = int(axes.get("Hkv", h) or h)
    if hkv <= 0 or h % hkv:
        raise ValueError(f"attention: H = {h} is not a multiple of Hkv = {hkv}")
    g = h // hkv
    causal = int(axes.get("causal", 0)) != 0
    scale = 1.0 / math.sqrt(d)
    rows = max(1, min(l, BLOCK_ELEMENTS // max(1, b * h * l)))
    # the query heads of one group share their key/value head: [B, Hkv, 1, L, D] broadcast over G
    kt = mx.expand_dims(mx.swapaxes(k, -1, -2), 2)
    vg = mx.expand_dims(v, 2)
    blocks = []
    for r0 in range(0, l, rows):
        r1 = min(l, r0 + rows)
        qb = q[:, :, r0:r1, :].reshape(b, hkv, g, r1 - r0, d)
        s = (qb @ kt) * scale  # [B, Hkv, G, rows, L]
        if causal:
            i = mx.arange(r0, r1).reshape(-1, 1)
            j = mx.arange(l).reshape(1, -1)
            s = mx.where(j <= i, s, -mx.inf)
        s = s - mx.max(s, axis=-1, keepdims=True)
        p = mx.exp(s)
        p = p / mx.sum(p, axis=-1, keepdims=True)
        o = (p @ vg).reshape(b, h, r1 - r0, d)
        mx.eval(o)
        blocks.append(o)
    return [mx.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]]


def _scan_block(decay: Any, drive: Any) -> tuple[Any, Any]:
    """Inclusive scan of h_t = decay_t * h_{t-1} + drive_t along axis 1, from a zero state.

    Hillis-Steele doubling on the pairs (decay, drive): log2(T) steps of element-wise ops.
    Returns the cumulative decay (product of decays up to t) and the scanned drive, so a
    block started from state h0 gives h_t = drive_t + decay_t * h0. Decays are in (0, 1],
    so products only shrink: no overflow, no log space needed.
    """
    t = decay.shape[1]
    off = 1
    while off < t:
        pad_shape = list(decay.shape)
        pad_shape[1] = off
        prev_decay = mx.concatenate([mx.ones(pad_shape, F32), decay[:, : t - off]], axis=1)
        prev_drive = mx.concatenate([mx.zeros(pad_shape, F32), drive[:, : t - off]], axis=1)
        drive = drive + decay * prev_drive
        decay = decay * prev_decay
        off *= 2
    return decay, drive


def mamba_scan(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """Mamba-1 selective scan (prefill), channels last, zero initial state.

    u, delta: [b, L, D]; A: [D, N]; Bm, Cm: [b, L, N]; Dv: [D] → y [b, L, D], state [b, D, N].
    h_t = exp(delta_t * A) * h_{t-1} + delta_t * Bm_t * u_t;  y_t = <Cm_t, h_t> + Dv * u_t.

    Time is cut into blocks of T steps (T * b * D * N <= BLOCK_ELEMENTS); each block is an
    associative scan, then shifted by the state carried in from the previous block.
    """
    u, delta, a, bm, cm, dv = (inputs[n].astype(F32) for n in ("u", "delta", "A", "Bm", "Cm", "Dv"))
    batch, l, d, n = (int(axes[x]) for x in ("batch", "L", "D", "N"))
    per_step = max(1, batch * d * n)
    block = 1 << max(0, int(math.log2(max(1, BLOCK_ELEMENTS // per_step))))
    block = max(1, min(block, l))
    h = mx.zeros((batch, d, n), F32)
    ys = []
    for t0 in range(0, l, block):
        t1 = min(l, t0 + block)
        dl = delta[:, t0:t1, :, None]  # [b, T, D, 1]
        decay = mx.exp(dl * a)  # [b, T, D, N]
        drive = (dl * u[:, t0:t1, :, None]) * bm[:, t0:t1, None, :]
        cum_decay, scanned = _scan_block(decay, drive)
        hs = scanned + cum_decay * h[:, None]  # [b, T, D, N]
        y = mx.sum(hs * cm[:, t0:t1, None, :], axis=-1) + dv * u[:, t0:t1]
        h = hs[:, -1]
        mx.eval(y, h)
        ys.append(y)
    y = mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0]
    return [y, h]


def mamba_step(inputs: dict[str, Any], axes: dict[str, int], constants: dict[str, float]) -> list[Any]:
    """Mamba-1 decode step. u, delta: [b, D]; A: [D, N]; Bm, Cm: [b, N]; Dv: [D];
    state_in: [b, D, N] → y [b, D], state_out [b, D, N]."""
    u, delta, a, bm, cm, dv, s0 = (
        inputs[x].astype(F32) for x in ("u", "delta", "A", "Bm", "Cm", "Dv", "state_in")
    )
    dl = delta[:, :, None]
    s1 = mx.exp(dl * a) * s0 + dl * bm[:, None, :] * u[:, :, None]
    y = mx.sum(s1 * cm[:, None, :], axis=-1) + dv * u
    return [y, s1]


REFERENCES: dict[str, Callable[[dict[str, Any], dict[str, int], dict[str, float]], list[Any]]] = {
    "softmax": softmax,
    "rmsnorm": rmsnorm,
    "attention": attention,
    "mamba_scan": mamba_scan,
    "mamba_step": mamba_step,
}


def compute(task: dict, inputs: dict[str, Any], axes: dict[str, int]) -> dict[str, Any]:
    """The task's reference outputs by name, evaluated, in f32."""
    name = task.get("reference", "")
    if isinstance(name, dict):
        raise ValueError(
            f"task `{task.get('name', '')}` brings its own reference ({name.get('file', '')}), "
            "which the MLX back-ends do not run: use --backend cpu or cuda"
        )
    if name not in REFERENCES:
        raise ValueError(f"no MLX reference `{name}` (known: {', '.join(REFERENCES)})")
    outs = REFERENCES[name](inputs, axes, task.get("constants") or {})
    names = [t["name"] for t in task.get("outputs", [])]
    if len(outs) != len(names):
        raise ValueError(f"reference `{name}` returned {len(outs)} outputs, the task declares {len(names)}")
    result = {n: o.astype(F32) for n, o in zip(names, outs)}
    mx.eval(list(result.values()))
    return result
