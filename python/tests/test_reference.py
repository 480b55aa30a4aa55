"""The MLX f32 references against float64 numpy versions of crates/core/src/reference.rs."""

import math

import mlx.core as mx
import numpy as np
import pytest

from ksearch_mlx import reference

RNG = np.random.default_rng(7)


def mx32(a):
    return mx.array(np.asarray(a, dtype=np.float32))


def np64(a):
    return np.array(a).astype(np.float64)


def test_softmax_rows_sum_to_one_and_match_float64():
    x = RNG.normal(0, 3, (3, 17))
    x[2, 5] = 1000.0  # one dominant entry: stays finite, takes all the mass
    (y,) = reference.softmax({"x": mx32(x)}, {"rows": 3, "cols": 17}, {})
    y = np64(y)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, atol=1e-6)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), atol=1e-7, rtol=1e-5)
    assert y[2, 5] == pytest.approx(1.0)


def test_rmsnorm_matches_float64_with_the_task_eps():
    x = RNG.normal(size=(4, 32))
    w = RNG.uniform(0.5, 1.5, 32)
    (y,) = reference.rmsnorm({"x": mx32(x), "w": mx32(w)}, {"rows": 4, "cols": 32}, {"eps": 0.5})
    want = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 0.5) * w
    np.testing.assert_allclose(np64(y), want, rtol=1e-5, atol=1e-6)


def attention64(q, k, v, causal):
    d = q.shape[-1]
    g = q.shape[1] // k.shape[1]  # query heads per key/value head
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    if causal:
        l = q.shape[-2]
        s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_matches_float64(causal, monkeypatch):
    b, h, l, d = 2, 3, 9, 8
    q, k, v = (RNG.normal(size=(b, h, l, d)) for _ in range(3))
    axes = {"B": b, "H": h, "Hkv": h, "L": l, "D": d, "causal": causal}
    ins = {"q": mx32(q), "k": mx32(k), "v": mx32(v)}
    want = attention64(q, k, v, causal)
    (o,) = reference.attention(ins, axes, {})
    np.testing.assert_allclose(np64(o), want, rtol=1e-4, atol=1e-5)
    # Query blocks (here 2 rows at a time) give the same result.
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", b * h * l * 2)
    (o2,) = reference.attention(ins, axes, {})
    np.testing.assert_allclose(np64(o2), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("hkv", [1, 2, 6])
def test_grouped_query_attention_matches_float64(causal, hkv, monkeypatch):
    """k, v with Hkv heads: query head h reads key/value head h // (H // Hkv) (MQA at Hkv = 1)."""
    b, h, l, d = 2, 6, 11, 8
    q = RNG.normal(size=(b, h, l, d))
    k, v = (RNG.normal(size=(b, hkv, l, d)) for _ in range(2))
    axes = {"B": b, "H": h, "Hkv": hkv, "L": l, "D": d, "causal": causal}
    ins = {"q": mx32(q), "k": mx32(k), "v": mx32(v)}
    want = attention64(q, k, v, causal)
    (o,) = reference.attention(ins, axes, {})
    np.testing.assert_allclose(np64(o), want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", b * h * l * 3)  # blocks of 3 query rows
    (o3,) = reference.attention(ins, axes, {})
    np.testing.assert_allclose(np64(o3), want, rtol=1e-4, atol=1e-5)
    # Head h of the result only depends on its own kv head.
    k2 = k.copy()
    k2[:, -1] += 1.0
    (o4,) = reference.attention({"q": mx32(q), "k": mx32(k2), "v": mx32(v)}, axes, {})
    untouched = h - h // hkv
    np.testing.assert_allclose(np64(o4)[:, :untouched], np64(o)[:, :untouched], rtol=1e-6, atol=1e-7)


def test_attention_refuses_heads_that_do_not_group():
    x = mx32(np.zeros((1, 3, 2, 4)))
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        reference.attention({"q": x, "k": x[:, :2], "v": x[:, :2]}, {"B": 1, "H": 3, "Hkv": 2, "L": 2, "D": 4, "causal": 0}, {})


def test_causal_first_row_and_single_key_return_v():
    q, k, v = (RNG.normal(size=(1, 1, 4, 2)) for _ in range(3))
    (o,) = reference.attention({"q": mx32(q), "k": mx32(k), "v": mx32(v)}, {"B": 1, "H": 1, "L": 4, "D": 2, "causal": 1}, {})
    np.testing.assert_allclose(np64(o)[0, 0, 0], v[0, 0, 0], rtol=1e-6)
    one = {n: mx32(a[:, :, :1]) for n, a in (("q", q), ("k", k), ("v", v))}
    (o1,) = reference.attention(one, {"B": 1, "H": 1, "L": 1, "D": 2, "causal": 0}, {})
    np.testing.assert_allclose(np64(o1)[0, 0, 0], v[0, 0, 0], rtol=1e-6)


def mamba_inputs(batch, l, d, n):
    return {
        "u": RNG.normal(size=(batch, l, d)),
        "delta": RNG.uniform(0.001, 0.1, (batch, l, d)),
        "A": RNG.uniform(-16.0, -1.0, (d, n)),
        "Bm": RNG.normal(size=(batch, l, n)),
        "Cm": RNG.normal(size=(batch, l, n)),
        "Dv": RNG.uniform(0.5, 1.5, d),
    }


def mamba_scan64(x):
    u, dl, a, bm, cm, dv = (x[k] for k in ("u", "delta", "A", "Bm", "Cm", "Dv"))
    batch, l, d = u.shape
    h = np.zeros((batch, d, a.shape[1]))
    y = np.zeros_like(u)
    for t in range(l):
        h = np.exp(dl[:, t, :, None] * a) * h + dl[:, t, :, None] * bm[:, t, None, :] * u[:, t, :, None]
        y[:, t] = (h * cm[:, t, None, :]).sum(-1) + dv * u[:, t]
    return y, h


def test_mamba_scan_matches_float64_and_blocking_does_not_matter(monkeypatch):
    batch, l, d, n = 2, 13, 5, 4
    x = mamba_inputs(batch, l, d, n)
    axes = {"batch": batch, "L": l, "D": d, "N": n}
    ins = {k: mx32(v) for k, v in x.items()}
    y_want, s_want = mamba_scan64(x)
    y, s = reference.mamba_scan(ins, axes, {})
    np.testing.assert_allclose(np64(y), y_want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np64(s), s_want, rtol=1e-4, atol=1e-5)
    # Blocks of 4 time steps (13 = 4 + 4 + 4 + 1): the carried state joins them exactly.
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", batch * d * n * 4)
    y4, s4 = reference.mamba_scan(ins, axes, {})
    np.testing.assert_allclose(np64(y4), y_want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np64(s4), s_want, rtol=1e-4, atol=1e-5)


def test_mamba_scan_equals_repeated_steps():
    batch, l, d, n = 1, 6, 3, 2
    x = {k: mx32(v) for k, v in mamba_inputs(batch, l, d, n).items()}
    y, s = reference.mamba_scan(x, {"batch": batch, "L": l, "D": d, "N": n}, {})
    state = mx.zeros((batch, d, n))
    for t in range(l):
        step = {"u": x["u"][:, t], "delta": x["delta"][:, t], "A": x["A"], "Bm": x["Bm"][:, t], "Cm": x["Cm"][:, t], "Dv": x["Dv"], "state_in": state}
        y_t, state = reference.mamba_step(step, {"batch": batch, "D": d, "N": n}, {})
        np.testing.assert_allclose(np64(y_t), np64(y[:, t]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(state), np64(s), rtol=1e-5, atol=1e-6)


def test_mamba_step_matches_float64():
    batch, d, n = 2, 4, 3
    u, dl = RNG.normal(size=(batch, d)), RNG.uniform(0.001, 0.1, (batch, d))
    a, bm, cm = RNG.uniform(-16, -1, (d, n)), RNG.normal(size=(batch, n)), RNG.normal(size=(batch, n))
    dv, s0 = RNG.uniform(0.5, 1.5, d), RNG.normal(size=(batch, d, n))
    ins = {k: mx32(v) for k, v in dict(u=u, delta=dl, A=a, Bm=bm, Cm=cm, Dv=dv, state_in=s0).items()}
    y, s1 = reference.mamba_step(ins, {"batch": batch, "D": d, "N": n}, {})
    s_want = np.exp(dl[:, :, None] * a) * s0 + dl[:, :, None] * bm[:, None, :] * u[:, :, None]
    y_want = (s_want * cm[:, None, :]).sum(-1) + dv * u
    np.testing.assert_allclose(np64(s1), s_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(y), y_want, rtol=1e-5, atol=1e-6)


def test_compute_names_outputs_and_refuses_unknown_references():
    task = {"reference": "softmax", "outputs": [{"name": "y"}]}
    out = reference.compute(task, {"x": mx32(np.zeros((2, 3)))}, {"rows": 2, "cols": 3})
    assert list(out) == ["y"] and out["y"].dtype == mx.float32
    with pytest.raises(ValueError, match="no MLX reference `nope`"):
        reference.compute({"reference": "nope"}, {}, {})


def test_compute_refuses_a_reference_the_task_brings_in_one_line():
    task = {"name": "layernorm", "reference": {"file": "reference.cpp", "entry": "layernorm_ref"}}
    with pytest.raises(ValueError, match=r"brings its own reference \(reference.cpp\).*--backend cpu or cuda") as e:
        reference.compute(task, {}, {})
    assert "\n" not in str(e.value)
