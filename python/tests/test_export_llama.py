"""Tests of ksearch_mlx/export_llama.py, the mlx-lm Llama attention patch of `ksearch export --mlx`
modules for the attention task.

They run on MLX's CPU back-end, where the searched CUDA kernel cannot run: the "kernel" is an
attention written in MLX ops (f32 arithmetic, grouped-query heads), patched into a tiny random
`mlx_lm.models.llama.Model` with GQA and compared with stock mlx-lm for prefill and for decode
with a KV cache; the path counts say which path ran.

    cd python && python -m pytest -q tests/test_export_llama.py
"""
import json
import math
import pathlib
import types

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from ksearch_mlx import export_llama  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
TAIL = HERE.parent / "ksearch_mlx" / "export_tail.py"
LLAMA = HERE.parent / "ksearch_mlx" / "export_llama.py"
STOCK = llama.Attention.__dict__["__call__"]
STOCK_BLOCK = llama.TransformerBlock.__dict__["__call__"]


@pytest.fixture(autouse=True)
def restore_stock():
    yield
    llama.Attention.__call__ = STOCK
    llama.TransformerBlock.__call__ = STOCK_BLOCK


def tiny_llama(dtype=mx.float32, head_dim=None, seed=0):
    """2 layers, hidden 128, 4 query heads on 2 key/value heads (GQA), random weights."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                           vocab_size=101, tie_word_embeddings=False)
    m = llama.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m


def standin(calls):
    """The kernel's contract in MLX ops: q [B, H, L, D], k/v [B, Hkv, L, D], 1/sqrt(D) scale,
    causal mask over the same L keys; f32 arithmetic, the result in q's dtype."""

    def attention(q, k, v, causal=0):
        calls.append({"q": q.shape, "k": k.shape, "causal": int(causal), "dtype": q.dtype})
        B, H, L, D = q.shape
        rep = H // k.shape[1]
        f = mx.float32
        qf = q.astype(f).reshape(B, k.shape[1], rep, L, D)
        kf, vf = k.astype(f)[:, :, None], v.astype(f)[:, :, None]
        s = (qf @ kf.swapaxes(-1, -2)) / math.sqrt(D)
        if causal:
            keep = mx.arange(L)[:, None] >= mx.arange(L)[None]
            s = mx.where(keep, s, -mx.inf)
        o = mx.softmax(s, axis=-1) @ vf
        return o.reshape(B, H, L, D).astype(q.dtype)

    return attention


def standin_lhd(calls):
    """The stand-in with q and o in [B, L, H, D] (the patch's `lhd`): q [B, L, H, D] in, o
    [B, L, H, D] out; records the shapes it was given."""
    inner = standin([])

    def lhd(q, k, v, causal=0):
        calls.append({"q": q.shape, "k": k.shape, "causal": int(causal), "dtype": q.dtype})
        return inner(q.transpose(0, 2, 1, 3), k, v, causal).transpose(0, 2, 1, 3)

    return lhd


def lhd_storage(inner):
    """A stand-in for the kernel built with QO_LHD=1, as KERNEL's compiled builds are called: q
    and o declared [B, H, L, D] but stored [B, L, H, D] (row-major order of the storage)."""

    def kernel(inputs, axes):
        B, H, L, D = inputs["q"].shape
        q = inputs["q"].reshape(B, L, H, D).transpose(0, 2, 1, 3)
        o = inner(q, inputs["k"], inputs["v"], axes["causal"])
        return {"o": o.transpose(0, 2, 1, 3).reshape(B, H, L, D)}

    return kernel


def prefill_and_decode(m, ids, steps, chunk=None):
    """Logits of the prompt (one call, or chunks of `chunk` tokens) and of `steps` greedy decode
    tokens, through a KV cache."""
    c = mlx_cache.make_prompt_cache(m)
    if chunk is None:
        out = [m(ids, cache=c)]
    else:
        out = [m(ids[:, i : i + chunk], cache=c) for i in range(0, ids.shape[1], chunk)]
    tok = mx.argmax(out[-1][:, -1:], axis=-1)
    for _ in range(steps):
        out.append(m(tok, cache=c))
        tok = mx.argmax(out[-1][:, -1:], axis=-1)
    mx.eval(out)
    return out


def assert_close(a, b, tol, what=""):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    diff = mx.abs(a - b)
    bad = (diff > tol + tol * mx.abs(b)).sum().item()
    assert a.shape == b.shape and bad == 0, f"{what}: {bad} elements differ, max {mx.max(diff).item():.3g}"


TOL = {mx.float32: 1e-4, mx.float16: 2e-2}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_prefill_runs_the_kernel_and_decode_stock_with_logits_as_stock(dtype):
    m = tiny_llama(dtype)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 3)
    calls = []
    unpatch = export_llama.patch_mlx_lm_llama(standin(calls), min_len=8, choose="always")
    assert llama.Attention.__call__ is not STOCK
    got = prefill_and_decode(m, ids, 3)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[dtype], what=f"call {i}")
    # prefill: both layers through the kernel, causal, GQA shapes; decode: stock, one-token queries
    assert unpatch.stats == {"kernel": 2, "stock": 6}, unpatch.stats
    assert unpatch.reasons == {"short": 6}
    assert [c["q"] for c in calls] == [(2, 4, 24, 32)] * 2 and [c["k"] for c in calls] == [(2, 2, 24, 32)] * 2
    assert all(c["causal"] == 1 and c["dtype"] == dtype for c in calls)
    unpatch()
    assert llama.Attention.__call__ is STOCK
    again = prefill_and_decode(m, ids, 0)
    assert_close(again[0], ref[0], 0.0, "after unpatch")
    assert len(calls) == 2 and unpatch.stats["kernel"] == 2


def test_without_a_cache_and_with_a_wrong_kernel_the_logits_differ():
    """The patched path is taken (a kernel that drops the causal mask changes the logits), so the
    comparisons above compare the kernel path, not stock with itself."""
    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 16))
    ref = m(ids)
    calls = []
    good = standin(calls)
    unpatch = export_llama.patch_mlx_lm_llama(good, min_len=2, choose="always")
    assert_close(m(ids), ref, 1e-4, "no cache")
    assert unpatch.stats == {"kernel": 2, "stock": 0}
    unpatch()
    unpatch = export_llama.patch_mlx_lm_llama(lambda q, k, v, causal: good(q, k, v, 0), min_len=2, choose="always")
    diff = mx.max(mx.abs(m(ids) - ref)).item()
    assert diff > 1e-2, diff
    unpatch()


def test_short_prompts_chunked_prefill_and_quantised_caches_keep_stock():
    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 20))
    ref_short = prefill_and_decode(m, ids[:, :6], 1)
    ref_chunked = prefill_and_decode(m, ids, 1, chunk=10)
    q_ref = m(ids, cache=[mlx_cache.QuantizedKVCache(group_size=32, bits=8) for _ in m.layers])
    calls = []
    unpatch = export_llama.patch_mlx_lm_llama(standin(calls), min_len=8, choose="always")
    for a, b in zip(prefill_and_decode(m, ids[:, :6], 1), ref_short):
        assert_close(a, b, 0.0, "short prompt")
    assert unpatch.stats == {"kernel": 0, "stock": 4} and not calls
    # the first chunk (empty cache) runs the kernel, the second (10 keys cached) stock
    for a, b in zip(prefill_and_decode(m, ids, 1, chunk=10), ref_chunked):
        assert_close(a, b, 1e-4, "chunked prefill")
    assert unpatch.stats == {"kernel": 2, "stock": 8}
    assert unpatch.reasons == {"short": 6, "cache_offset": 2}
    # a quantised KV cache: mlx-lm's quantised attention
    q_got = m(ids, cache=[mlx_cache.QuantizedKVCache(group_size=32, bits=8) for _ in m.layers])
    assert_close(q_got, q_ref, 0.0, "quantised cache")
    assert unpatch.reasons["quantized_cache"] == 2 and unpatch.stats["kernel"] == 2
    unpatch()


def test_an_array_mask_another_scale_or_dtype_keep_stock():
    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 12))
    calls = []
    unpatch = export_llama.patch_mlx_lm_llama(standin(calls), min_len=2, choose="always", dtypes=(mx.float16,))
    assert_close(m(ids), _stock_logits(m, ids), 0.0, "f32 model")
    assert unpatch.reasons == {"dtype": 2} and not calls
    attn = m.model.layers[0].self_attn
    h = mx.random.normal((1, 12, 128))
    mask = mx.tril(mx.ones((12, 12), dtype=mx.bool_))
    attn(h, mask=mask)
    assert unpatch.reasons["mask"] == 1
    attn.scale = 0.5
    attn(h, mask="causal")
    assert unpatch.reasons["scale"] == 1 and not calls
    unpatch()


def _stock_logits(m, ids):
    prev = llama.Attention.__dict__["__call__"]
    llama.Attention.__call__ = STOCK
    try:
        return m(ids)
    finally:
        llama.Attention.__call__ = prev


def test_arguments_are_checked_and_repatching_keeps_stock():
    with pytest.raises(ValueError, match="give attention="):
        export_llama.patch_mlx_lm_llama()  # imported on its own: no kernel of its own
    with pytest.raises(ValueError, match="min_len"):
        export_llama.patch_mlx_lm_llama(standin([]), min_len=1)
    first = export_llama.patch_mlx_lm_llama(standin([]))
    second = export_llama.patch_mlx_lm_llama(standin([]))
    assert llama.Attention.__call__._ksearch_stock is STOCK and first.min_len == export_llama.LLAMA_MIN_LEN
    second()
    first()
    assert llama.Attention.__call__ is STOCK


# ---- appended to an exported attention module -------------------------------------------------------
def load_exported_attention(candidate):
    """TASK, CANDIDATE, BACKEND as `ksearch export` writes them, then the tail and this file (the
    runtime's CompiledCandidate is not needed: KERNEL is replaced before any call)."""
    tomllib = pytest.importorskip("tomllib")
    t = tomllib.loads((HERE.parent.parent / "tasks" / "attention" / "task.toml").read_text())
    task = {"name": t["name"], "axes": t["axes"], "description": "",
            "inputs": [{k: i[k] for k in ("name", "shape", "dtype")} for i in t["inputs"]],
            "outputs": [{k: o[k] for k in ("name", "shape", "dtype")} for o in t["outputs"]],
            "backends": {"mlx-cuda": {"dtypes": {}}}}
    mod = types.ModuleType("exported_attention_llama")
    mod.json = json
    gen = (f"TASK = json.loads(r'''{json.dumps(task)}''')\n"
           f"CANDIDATE = json.loads(r'''{json.dumps(candidate)}''')\n"
           'BACKEND = "mlx-cuda"\n')
    text = gen + TAIL.read_text() + "\n" + LLAMA.read_text()
    exec(compile(text, "<exported attention>", "exec"), mod.__dict__)
    return mod


def test_exported_module_patches_with_its_own_kernel_where_its_builds_admit():
    cand = {"lang": "mlx_cuda", "source": "", "launches": [], "scratch": [], "options": {},
            "defines": {"HD": 128}, "builds": [{"HD": 64}, {"HD": 96}], "constraints": ["HD == D", "H % Hkv == 0"]}
    mod = load_exported_attention(cand)
    assert "patch_mlx_lm_llama" in mod.__all__ and "attention" in mod.__all__
    calls = []
    ref_attention = standin(calls)
    seen = []

    def kernel(inputs, axes):  # stands in for KERNEL (the compiled builds)
        seen.append((dict(axes), {n: a.dtype for n, a in inputs.items()}))
        return {"o": ref_attention(inputs["q"], inputs["k"], inputs["v"], axes["causal"])}

    mod.KERNEL = kernel
    m = tiny_llama(mx.float16, head_dim=64)
    ids = mx.random.randint(0, 101, (1, 16))
    ref = prefill_and_decode(m, ids, 2)
    unpatch = mod.patch_mlx_lm_llama(min_len=4, choose="always")
    for a, b in zip(prefill_and_decode(m, ids, 2), ref):
        assert_close(a, b, TOL[mx.float16], "exported kernel")
    assert unpatch.stats == {"kernel": 2, "stock": 4}
    assert seen[0][0] == {"B": 1, "H": 4, "Hkv": 2, "L": 16, "D": 64, "causal": 1}
    assert set(seen[0][1].values()) == {mx.float16}
    unpatch()
    # head size 32: no build admits it (HD == D); an f32 model: the kernel reads f16
    for model, reason in ((tiny_llama(mx.float16), "constraints"), (tiny_llama(mx.float32, head_dim=64), "dtype")):
        n = len(seen)
        unpatch = mod.patch_mlx_lm_llama(min_len=4, choose="always", fuse_mlp=False)
        out = model(ids)
        unpatch()
        assert_close(out, _stock_logits(model, ids), 0.0, reason)
        assert unpatch.reasons == {reason: 2} and len(seen) == n


def test_choice_timer_queues_every_call_and_bounds_the_batch(monkeypatch):
    """The measured choice's own timer: one warm-up call, then `reps` timings of a batch of calls,
    each call handed to the GPU on its own as soon as it is built (so the host builds the next while
    the GPU runs the last, as in a prefill), and no more calls in a batch than keep 256 MB of
    outputs in flight; the result is a time per call."""
    queued = []
    monkeypatch.setattr(export_llama.mx, "async_eval", lambda *a: queued.append(len(a)))
    built = []

    def small():
        built.append("small")
        return mx.zeros((4, 4))

    t = export_llama._llama_time("kernel", small, 3)
    assert t > 0
    n = export_llama.LLAMA_TIMING_BATCH
    assert built == ["small"] * (1 + 3 * n), len(built)
    assert queued == [1] * (3 * n), queued  # one call per async_eval, never a batch at once
    queued.clear()
    big = lambda: mx.zeros((100 << 20) // 4)  # noqa: E731  (100 MB of f32: two fit in 256 MB)
    export_llama._llama_time("stock", big, 2)
    assert len(queued) == 2 * 2, queued


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_measured_choice_keeps_the_faster_per_shape_class(monkeypatch, kernel_faster):
    """choose="measured" (the default) times the kernel against stock on the first call of a
    shape class, keeps the faster there, and does not time that class again; the logits are
    stock's either way. The clock is replaced so that the choice is known in advance."""
    timed = []

    def fake_time(label, fn, reps):
        timed.append(label)
        fn()  # the timed call must run
        fast, slow = 1e-3, 2e-3
        return (fast if kernel_faster else slow) if label == "kernel" else (slow if kernel_faster else fast)

    monkeypatch.setattr(export_llama, "_llama_time", fake_time)
    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 24))
    ref = m(ids)
    calls = []
    unpatch = export_llama.patch_mlx_lm_llama(standin(calls), min_len=8)
    first = m(ids)
    second = m(ids[:, :20])  # L 20 and 24 round up to the same class (32): no new timing
    unpatch()
    assert_close(first, ref, 1e-4, "measured choice")
    assert_close(second, m(ids[:, :20]), 1e-4, "measured choice, second call")
    # one timing per layer (each layer's shape class is the same, but layers time on their own
    # first call only while the class is new: the first layer decides for both)
    assert timed == ["kernel", "stock"] * export_llama.LLAMA_TIMING_ROUNDS, timed
    assert len(unpatch.choices) == 1
    ((t_kernel, t_stock, use_kernel),) = unpatch.choices.values()
    assert use_kernel == kernel_faster and (t_kernel < t_stock) == kernel_faster
    if kernel_faster:
        assert unpatch.stats == {"kernel": 4, "stock": 0}, unpatch.stats
    else:
        assert unpatch.stats == {"kernel": 0, "stock": 4} and unpatch.reasons == {"slower": 4}


def test_choose_is_checked():
    with pytest.raises(ValueError, match="choose"):
        export_llama.patch_mlx_lm_llama(standin([]), choose="sometimes")


def test_a_shapes_constraints_are_evaluated_once_not_per_layer_call():
    """`admits` evaluates the kernel's constraints and builds in Python; the patch asks it once
    per shape, and not at all for a shape class already timed slower, so that a prefill through
    many layers pays nothing per call for it."""
    asked = []

    def admits(axes):
        asked.append(dict(axes))
        return True

    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 24))
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, admits=admits, choose="always")
    for _ in range(3):
        mx.eval(m(ids))
    unpatch()
    assert unpatch.stats == {"kernel": 6, "stock": 0}
    assert len(asked) == 1 and asked[0]["L"] == 24, asked
    assert len(unpatch.admitted) == 1


def test_a_shape_class_timed_slower_skips_the_constraints(monkeypatch):
    asked = []

    def admits(axes):
        asked.append(axes["L"])
        return True

    monkeypatch.setattr(export_llama, "_llama_time", lambda label, fn, reps: (fn(), 2e-3 if label == "kernel" else 1e-3)[1])
    m = tiny_llama()
    ids = mx.random.randint(0, 101, (1, 24))
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, admits=admits)
    mx.eval(m(ids))
    mx.eval(m(ids[:, :20]))  # the same class (32), decided slower: admits is not asked
    unpatch()
    assert asked == [24], asked
    assert unpatch.reasons == {"slower": 4}


def test_a_kernel_only_marginally_faster_keeps_stock(monkeypatch):
    """The kernel is kept only where it times clearly faster than stock (LLAMA_MARGIN): within
    the margin the default stays stock."""
    ratio = (1 + export_llama.LLAMA_MARGIN) / 2  # faster, but not by the margin
    monkeypatch.setattr(export_llama, "_llama_time", lambda label, fn, reps: (fn(), ratio * 1e-3 if label == "kernel" else 1e-3)[1])
    m = tiny_llama()
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8)
    mx.eval(m(mx.random.randint(0, 101, (1, 24))))
    unpatch()
    assert unpatch.stats == {"kernel": 0, "stock": 2} and unpatch.reasons == {"slower": 2}


@pytest.mark.parametrize("via", ["argument", "attribute"])
def test_an_lhd_kernel_reads_q_and_writes_o_in_mlx_lms_order(via):
    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 2)
    calls, lhd_calls = [], []
    attention, lhd = standin(calls), standin_lhd(lhd_calls)
    if via == "argument":
        unpatch = export_llama.patch_mlx_lm_llama(attention, min_len=8, choose="always", lhd=lhd)
    else:
        attention.lhd = lhd
        unpatch = export_llama.patch_mlx_lm_llama(attention, min_len=8, choose="always")
    for i, (a, b) in enumerate(zip(prefill_and_decode(m, ids, 2), ref)):
        assert_close(a, b, TOL[mx.float16], what=f"call {i}")
    # Both layers' prefill through `lhd`, q in [B, L, H, D]; `attention` never called.
    assert unpatch.lhd and unpatch.stats == {"kernel": 2, "stock": 4}, unpatch.stats
    # (compiled: traced once for both layers)
    assert [c["q"] for c in lhd_calls] == [(2, 24, 4, 32)] and [c["k"] for c in lhd_calls] == [(2, 2, 24, 32)]
    assert calls == []
    with pytest.raises(TypeError):
        export_llama.patch_mlx_lm_llama(attention, lhd=3)


def test_exported_module_uses_its_qo_lhd_build_where_its_source_has_one():
    cand = {"lang": "mlx_cuda", "source": "#ifndef QO_LHD\n#define QO_LHD 0\n#endif", "launches": [], "scratch": [],
            "options": {}, "defines": {"HD": 64}, "builds": [], "constraints": ["HD == D", "H % Hkv == 0"]}
    mod = load_exported_attention(cand)
    built = []

    class Compiled:  # stands in for the runtime's CompiledCandidate of the QO_LHD build
        def __init__(self, candidate, task, backend):
            built.append(dict(candidate["defines"]))
            self.run = lhd_storage(standin([]))

        def __call__(self, inputs, axes):
            return self.run(inputs, axes)

    mod.CompiledCandidate = Compiled
    mod.KERNEL = lambda inputs, axes: pytest.fail("the [B, H, L, D] build ran")
    m = tiny_llama(mx.float16, head_dim=64)
    ids = mx.random.randint(0, 101, (1, 16))
    ref = prefill_and_decode(m, ids, 2)
    unpatch = mod.patch_mlx_lm_llama(min_len=4, choose="always")
    for a, b in zip(prefill_and_decode(m, ids, 2), ref):
        assert_close(a, b, TOL[mx.float16], "exported QO_LHD build")
    unpatch()
    assert unpatch.lhd and unpatch.stats == {"kernel": 2, "stock": 4}
    assert built == [{"HD": 64, "QO_LHD": 1}]  # one build for the shape class, with the switch


def rope_reference(q, k, v, rope, offset=0):
    """The fused RoPE kernel's arithmetic (export_llama._LLAMA_ROPE_BODY) in MLX ops: element d of
    a row turns with d + D / 2 by scale * l * 2^(-(d / (D / 2)) log2(base)); q stays in
    [B, L, H, D], k and v go to [B, Hkv, L, D] (v unchanged)."""
    if not export_llama._llama_rope_fits(rope, q, k, v):
        return None
    D, L = q.shape[-1], q.shape[1]
    d = mx.arange(D // 2, dtype=mx.float32)
    inv = mx.power(2.0, -(d / (D // 2)) * math.log2(float(rope.base)))
    ang = (float(rope.scale) * mx.arange(offset, offset + L, dtype=mx.float32))[:, None] * inv[None, :]  # [L, D/2]
    c, s = mx.cos(ang)[None, :, None, :], mx.sin(ang)[None, :, None, :]

    def turn(x):
        x1, x2 = x[..., : D // 2].astype(mx.float32), x[..., D // 2 :].astype(mx.float32)
        return mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)

    return turn(q), turn(k).transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def test_the_fused_ropes_arithmetic_is_mlx_lms_rope():
    """What the CUDA body computes (written out in rope_reference, f32 arithmetic) against nn.RoPE
    in f32 on the views mlx-lm rotates: a wrong pairing, frequency or scale is far outside f16's
    rounding of the result."""
    import mlx.nn as nn

    mx.random.seed(4)
    rope = nn.RoPE(32, base=500000.0, scale=0.5)
    q = mx.random.normal((2, 40, 4, 32)).astype(mx.float16)
    k = mx.random.normal((2, 40, 2, 32)).astype(mx.float16)
    v = mx.random.normal((2, 40, 2, 32)).astype(mx.float16)
    qo, ko, vo = rope_reference(q, k, v, rope)
    want_q = rope(q.astype(mx.float32).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    want_k = rope(k.astype(mx.float32).transpose(0, 2, 1, 3))
    assert ko.shape == (2, 2, 40, 32) and vo.shape == (2, 2, 40, 32)
    assert_close(qo.astype(mx.float32), want_q, 2e-3, "q")
    assert_close(ko.astype(mx.float32), want_k, 2e-3, "k")
    assert mx.array_equal(vo, v.transpose(0, 2, 1, 3)).item()
    # what the kernel does not compute, it declines
    assert rope_reference(q, k, v, nn.RoPE(32, traditional=True)) is None
    assert rope_reference(q, k, v, nn.RoPE(16)) is None
    assert rope_reference(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), rope) is None
    assert rope_reference(q, k, v.astype(mx.float32), rope) is None
    q12 = mx.zeros((1, 4, 2, 12), dtype=mx.float16)
    assert rope_reference(q12, q12, q12, nn.RoPE(12)) is None  # head size not a multiple of 8


def test_a_fused_rope_rotates_q_and_k_of_the_kernel_path_only():
    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 2)
    ref_cache = mlx_cache.make_prompt_cache(m)
    mx.eval(m(ids, cache=ref_cache))
    lhd_calls, rope_calls = [], []

    def rope(q, k, v, module):
        rope_calls.append((q.shape, k.shape, v.shape))
        return rope_reference(q, k, v, module)

    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd(lhd_calls),
                                              rope=rope)
    for i, (a, b) in enumerate(zip(prefill_and_decode(m, ids, 2), ref)):
        assert_close(a, b, TOL[mx.float16], what=f"call {i}")
    # the cache holds what stock's RoPE put there (decode attends to it)
    cache = mlx_cache.make_prompt_cache(m)
    mx.eval(m(ids, cache=cache))
    for c, r in zip(cache, ref_cache):
        assert_close(c.state[0], r.state[0], TOL[mx.float16], "cached keys")
        assert_close(c.state[1], r.state[1], TOL[mx.float16], "cached values")
    unpatch()
    # prefill of both layers (twice), decode stock with stock's RoPE
    assert unpatch.rope == {"fused": 4} and len(rope_calls) == 4, unpatch.rope
    assert rope_calls[0] == ((2, 24, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32))
    assert unpatch.stats == {"kernel": 4, "stock": 4}, unpatch.stats
    # without an lhd path too: the [B, H, L, D] attention is handed q's [B, L, H, D] storage as a
    # transposed view (as stock's SDPA is), with stock's logits
    calls = []
    unpatch = export_llama.patch_mlx_lm_llama(standin(calls), min_len=8, choose="always", lhd=None, rope=rope)
    for i, (a, b) in enumerate(zip(prefill_and_decode(m, ids, 2), ref)):
        assert_close(a, b, TOL[mx.float16], what=f"[B, H, L, D] kernel, call {i}")
    unpatch()
    assert unpatch.rope == {"fused": 2} and [c["q"] for c in calls] == [(2, 4, 24, 32)] * 2, (unpatch.rope, calls)
    with pytest.raises(ValueError):
        export_llama.patch_mlx_lm_llama(standin([]), rope="fast")
    with pytest.raises(TypeError):
        export_llama.patch_mlx_lm_llama(standin([]), rope=3)
    # "auto" on MLX's CPU back-end: stock's RoPE
    assert export_llama._llama_rope_default() is None or mx.default_device() == mx.gpu


def test_fused_qkv_projects_once_and_feeds_the_rope_kernel(monkeypatch):
    """fuse_qkv (default): one matmul over the stacked weights, its [B, L, H + 2 Hkv, D] output
    handed to the fused RoPE (here its arithmetic in MLX ops in place of the CUDA launch), logits
    and cache as stock's; the stacked weight is no parameter of the model, the projections'
    weights become its rows, and it follows a replaced weight."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 2)
    given = []

    def qkv_reference(qkv, H, Hkv, rope, offset=0):
        given.append(qkv.shape)
        module = nn.RoPE(qkv.shape[-1], base=rope.base, scale=rope.scale)
        return rope_reference(qkv[:, :, :H], qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :], module, offset)

    monkeypatch.setattr(export_llama, "_llama_rope_cuda_qkv", qkv_reference)
    monkeypatch.setattr(export_llama, "_llama_rope_qkv_dims", rope_dims_reference([]))  # decode (fuse_decode)
    n_params = len(tree_flatten(m.parameters()))
    m0_q = m.model.layers[0].self_attn.q_proj.weight
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                              rope=export_llama._llama_rope_cuda)
    for i, (a, b) in enumerate(zip(prefill_and_decode(m, ids, 2), ref)):
        assert_close(a, b, TOL[mx.float16], what=f"call {i}")
    assert unpatch.qkv == {"fused": 2} and unpatch.rope == {"fused": 2}, (unpatch.qkv, unpatch.rope)
    # compiled: traced once for both layers (the weights are inputs of the trace)
    assert given == [(2, 24, 4 + 2 * 2, 32)]
    mx.eval(m(ids, cache=mlx_cache.make_prompt_cache(m)))
    assert len(given) == 1 and unpatch.qkv == {"fused": 4}
    assert len(tree_flatten(m.parameters())) == n_params  # the stacked weight is not a parameter
    attn = m.model.layers[0].self_attn
    w0 = export_llama._llama_qkv_weight(attn)
    assert export_llama._llama_qkv_weight(attn) is w0  # kept
    # the projections' weights are its rows now, with their values
    assert all(mx.array_equal(a, b).item() for a, b in zip(
        (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), mx.split(w0, [128, 192], axis=0)))
    assert mx.array_equal(attn.q_proj.weight, m0_q).item()
    # a replaced weight (fine-tuning, loading) is stacked again, and the output follows it
    attn.q_proj.weight = attn.q_proj.weight * 2
    w1 = export_llama._llama_qkv_weight(attn)
    assert w1 is not w0 and mx.array_equal(w1[:128], m0_q * 2).item()
    unpatch()
    # a prompt in chunks (as mlx_lm.generate prefills a long one): the chunks after the first
    # rotate at their offset through the same path and attend with stock's SDPA to the whole cache
    ref_chunked = prefill_and_decode(m, ids, 2, chunk=8)
    unpatch_c = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                                rope=export_llama._llama_rope_cuda)
    got = prefill_and_decode(m, ids, 2, chunk=8)
    unpatch_c()
    for i, (a, b) in enumerate(zip(got, ref_chunked)):
        assert_close(a, b, TOL[mx.float16], what=f"chunked call {i}")
    assert unpatch_c.qkv == {"fused": 6} and unpatch_c.reasons == {"cache_offset": 4, "short": 4}, (
        unpatch_c.qkv, unpatch_c.reasons)
    assert unpatch_c.stats == {"kernel": 2, "stock": 8}
    # uncompiled: the Python runs per layer, with the same logits
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                              rope=export_llama._llama_rope_cuda, fuse_qkv=True, compile=False)
    attn.q_proj.weight = attn.q_proj.weight / 2
    for i, (a, b) in enumerate(zip(prefill_and_decode(m, ids, 2), ref)):
        assert_close(a, b, TOL[mx.float16], what=f"uncompiled call {i}")
    unpatch()
    assert len(given) == 1 + 3 + 2  # + a trace per chunk offset (0, 8, 16), + per layer uncompiled
    # a model the fused RoPE does not serve (f32) keeps its weights untouched
    f = tiny_llama(mx.float32)
    wq = f.model.layers[0].self_attn.q_proj.weight
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                              rope=export_llama._llama_rope_cuda)
    mx.eval(f(ids))
    unpatch()
    assert f.model.layers[0].self_attn.q_proj.weight is wq and unpatch.qkv == {"fused": 0}
    # projections it cannot stack keep stock's three: quantised, with a bias
    q = tiny_llama(mx.float16)
    nn.quantize(q, group_size=32, bits=4)
    assert export_llama._llama_qkv_weight(q.model.layers[0].self_attn) is None
    b = tiny_llama(mx.float16)
    b.model.layers[0].self_attn.k_proj = nn.Linear(128, 64, bias=True)
    assert export_llama._llama_qkv_weight(b.model.layers[0].self_attn) is None


def test_fuse_mlp_runs_the_blocks_rest_fused_for_prefill_only():
    """fuse_mlp (default): a prefill chunk's block runs o_proj with the residual in the matmul, the
    post-attention norm, gate and up as one matmul over stacked weights, swiglu and down_proj with
    the second residual; logits as stock's to f16 rounding; decode and a model it does not serve
    keep stock's block; unpatch restores it."""
    import mlx.nn as nn

    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 2)
    mlp = m.model.layers[1].mlp
    g0, u0 = mlp.gate_proj.weight, mlp.up_proj.weight
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]))
    assert llama.TransformerBlock.__call__ is not STOCK_BLOCK
    got = prefill_and_decode(m, ids, 2)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[mx.float16], what=f"call {i}")
    assert unpatch.mlp == {"fused": 2}, unpatch.mlp  # the prefill's two blocks; decode stock
    # the stacked weight's rows are the two projections' weights, with their values
    w = export_llama._llama_gate_up_weight(mlp)
    assert w.shape == (512, 128) and export_llama._llama_gate_up_weight(mlp) is w
    assert mx.array_equal(mlp.gate_proj.weight, g0).item() and mx.array_equal(mlp.up_proj.weight, u0).item()
    assert mx.array_equal(w[256:], u0).item()
    # a wrong MLP is caught: the fused path really computes the block (no silent stock fallback)
    mlp.up_proj.weight = mlp.up_proj.weight * 3
    bad = m(ids)
    mlp.up_proj.weight = u0
    assert unpatch.mlp == {"fused": 4}
    assert mx.max(mx.abs(bad.astype(mx.float32) - ref[0].astype(mx.float32))).item() > 1e-1
    # attention on stock's path (a mask array): the block still fuses, with stock's o_proj output
    h = mx.random.normal((1, 12, 128)).astype(mx.float16)
    blk = m.model.layers[0]
    mask = mx.tril(mx.ones((12, 12), dtype=mx.bool_))
    out = blk(h, mask=mask)
    unpatch()
    assert llama.TransformerBlock.__call__ is STOCK_BLOCK
    assert_close(out, blk(h, mask=mask), TOL[mx.float16], "stock attention, fused rest")
    assert unpatch.reasons.get("mask") == 1 and unpatch.mlp == {"fused": 5}
    # fuse_mlp=False: stock's block
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", fuse_mlp=False)
    mx.eval(m(ids))
    unpatch()
    assert unpatch.mlp == {"fused": 0} and unpatch.stats["kernel"] == 2
    # MLPs it cannot fuse keep stock's block: quantised, biased; and their weights untouched
    q = tiny_llama(mx.float16)
    nn.quantize(q, group_size=32, bits=4)
    b = tiny_llama(mx.float16)
    b.model.layers[0].mlp.down_proj = nn.Linear(256, 128, bias=True)
    b.model.layers[0].mlp.down_proj.set_dtype(mx.float16)
    g_b = b.model.layers[0].mlp.gate_proj.weight
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always")
    mx.eval(q(ids), b(ids))
    unpatch()
    assert unpatch.mlp == {"fused": 1}, unpatch.mlp  # b's second block only
    assert b.model.layers[0].mlp.gate_proj.weight is g_b
    assert export_llama._llama_gate_up_weight(q.model.layers[0].mlp) is None


def test_swiglu_in_ops_is_mlx_lms():
    from mlx_lm.models.activations import swiglu

    gu = mx.random.normal((5, 48)).astype(mx.float16)
    assert mx.array_equal(export_llama._llama_swiglu_ops(gu), swiglu(gu[:, :24], gu[:, 24:])).item()


def rope_dims_reference(seen, offset_shift=0):
    """export_llama._llama_rope_qkv_dims in MLX ops: the fused RoPE's arithmetic read from its dims
    (the offset dims[4]) and p (log2(base), scale) arrays, so it runs inside mx.compile with the
    offset an input; records the shapes it was traced for. `offset_shift` makes it wrong."""

    def qkv_dims(qkv, H, Hkv, dims, p):
        seen.append(qkv.shape)
        B, L, _, D = qkv.shape
        d = mx.arange(D // 2, dtype=mx.float32)
        inv = mx.power(2.0, -(d / (D // 2)) * p[0])
        pos = mx.arange(L, dtype=mx.float32) + dims[4].astype(mx.float32) + offset_shift
        ang = (p[1] * pos)[:, None] * inv[None, :]
        c, s = mx.cos(ang)[None, :, None, :], mx.sin(ang)[None, :, None, :]

        def turn(x):
            x1, x2 = x[..., : D // 2].astype(mx.float32), x[..., D // 2 :].astype(mx.float32)
            return mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)

        q, k, v = qkv[:, :, :H], qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :]
        return turn(q), turn(k).transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    return qkv_dims


def qkv_rope_reference(qkv, H, Hkv, rope, offset=0):
    """export_llama._llama_rope_cuda_qkv in MLX ops: rope_reference on the stacked projection's q, k and v."""
    import mlx.nn as nn

    module = nn.RoPE(qkv.shape[-1], base=rope.base, scale=rope.scale)
    return rope_reference(qkv[:, :, :H], qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :], module, offset)


def use_rope_references(monkeypatch, traced=None):
    """The fused RoPE's two entry points in MLX ops (MLX's CPU back-end has no CUDA kernel): a prompt
    chunk's (qkv_rope_reference) and a decode step's (rope_dims_reference, recording the shapes it is
    traced for in `traced`)."""
    monkeypatch.setattr(export_llama, "_llama_rope_cuda_qkv", qkv_rope_reference)
    monkeypatch.setattr(export_llama, "_llama_rope_qkv_dims", rope_dims_reference([] if traced is None else traced))


def test_fuse_decode_runs_decode_blocks_fused_with_the_offset_an_input(monkeypatch):
    """fuse_decode (default): a decode step's block runs the input norm, the stacked projection and
    the fused RoPE at the cache's offset (one trace for every position: the offset is an input of
    the launch), the cache update, stock's SDPA and the fused rest; logits as stock's at every step
    and for prompts prefilled in chunks shorter than min_len (the causal mask over the cache)."""

    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))
    ref = prefill_and_decode(m, ids, 3)
    ref_chunked = prefill_and_decode(m, ids, 2, chunk=4)

    traced = []
    use_rope_references(monkeypatch, traced)

    def patch(**kw):
        return export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                               rope=export_llama._llama_rope_cuda, **kw)

    unpatch = patch()
    got = prefill_and_decode(m, ids, 3)
    unpatch()
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[mx.float16], what=f"call {i}")
    assert unpatch.decode == {"fused": 6}, unpatch.decode  # 3 steps x 2 layers; the prefill is fuse_mlp's
    assert unpatch.stats == {"kernel": 2, "stock": 6} and unpatch.reasons == {"short": 6}
    assert traced == [(2, 1, 4 + 2 * 2, 32)]  # traced once: positions 24, 25 and 26 share it
    # chunks of 4 tokens (< min_len) attend to the cache with the causal mask, at offsets 0..20
    unpatch = patch()
    got = prefill_and_decode(m, ids, 2, chunk=4)
    unpatch()
    for i, (a, b) in enumerate(zip(got, ref_chunked)):
        assert_close(a, b, TOL[mx.float16], what=f"chunked call {i}")
    # a new patch traces again: once for the chunks of 4 (every offset), once for the decode steps
    assert unpatch.decode == {"fused": 16} and traced[1:] == [(2, 4, 8, 32), (2, 1, 8, 32)], (unpatch.decode, traced)
    # uncompiled: the same logits, the reference run per layer and step
    unpatch = patch(compile=False)
    got = prefill_and_decode(m, ids, 3)
    unpatch()
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[mx.float16], what=f"uncompiled call {i}")
    assert len(traced) == 3 + 6
    # the position really is read from the offset input: one step off and decode's logits differ
    monkeypatch.setattr(export_llama, "_llama_rope_qkv_dims", rope_dims_reference([], offset_shift=1))
    unpatch = patch()
    got = prefill_and_decode(m, ids, 3)
    unpatch()
    assert_close(got[0], ref[0], TOL[mx.float16], "prefill (not the decode path)")
    for i, (a, b) in enumerate(zip(got[1:], ref[1:])):
        with pytest.raises(AssertionError, match="elements differ"):
            assert_close(a, b, TOL[mx.float16], what=f"decode step {i} one position off")
    # fuse_decode=False, or a cache it does not serve (quantised): stock's block at decode
    monkeypatch.setattr(export_llama, "_llama_rope_qkv_dims", rope_dims_reference(traced))
    unpatch = patch(fuse_decode=False)
    got = prefill_and_decode(m, ids, 3)
    unpatch()
    assert unpatch.decode == {"fused": 0} and unpatch.mlp == {"fused": 2}
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[mx.float16], what=f"fuse_decode=False call {i}")
    unpatch = patch()
    c = mlx_cache.make_prompt_cache(m)
    mx.eval(m(ids, cache=c))
    qc = [kv.to_quantized(group_size=32, bits=8) for kv in c]
    mx.eval(m(ids[:, :1], cache=qc))
    unpatch()
    assert unpatch.decode == {"fused": 0}, unpatch.decode
    # mlx-lm's own generate_step (a prompt chunk of 23 tokens then one token at a time, its
    # evaluations queued asynchronously): the same greedy tokens, log-probabilities as stock's
    from mlx_lm.generate import generate_step

    one = ids[0]
    want = [(int(t), lp) for t, lp in generate_step(one, m, max_tokens=6, prefill_step_size=16)]
    unpatch = patch()
    got = [(int(t), lp) for t, lp in generate_step(one, m, max_tokens=6, prefill_step_size=16)]
    unpatch()
    assert [t for t, _ in got] == [t for t, _ in want]
    for i, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert_close(a, b, TOL[mx.float16], what=f"generate_step token {i}")
    assert unpatch.decode["fused"] >= 2 * 6, unpatch.decode


def test_one_row_products_are_a_matmul_and_an_add_not_addmm(monkeypatch):
    """The fused tail's o_proj and down_proj with their residuals: one mx.addmm each where a chunk
    has LLAMA_ADDMM_MIN_ROWS rows or more (prefill, a decode step of two sequences), a matmul and an
    add for one row (one sequence's decode step: MLX's CUDA back-end takes its gemv kernel for
    that, cuBLASLt for any addmm); the logits as stock's either way."""

    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))

    use_rope_references(monkeypatch)
    addmm_rows = []
    real_addmm = mx.addmm

    def counting_addmm(c, a, b, *args, **kw):
        addmm_rows.append(a.shape[0])
        return real_addmm(c, a, b, *args, **kw)

    monkeypatch.setattr(mx, "addmm", counting_addmm)

    def run(batch, min_rows):
        monkeypatch.setattr(export_llama, "LLAMA_ADDMM_MIN_ROWS", min_rows)
        x = ids[:batch]
        ref = prefill_and_decode(m, x, 2)
        unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                                  rope=export_llama._llama_rope_cuda, compile=False)
        addmm_rows.clear()
        got = prefill_and_decode(m, x, 2)
        unpatch()
        assert unpatch.decode == {"fused": 4}, unpatch.decode  # 2 steps x 2 layers
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_close(a, b, TOL[mx.float16], what=f"batch {batch}, min rows {min_rows}, call {i}")
        return list(addmm_rows)

    # one sequence: the prefill's 2 layers x 2 products through addmm (24 rows), the decode's none
    assert run(1, export_llama.LLAMA_ADDMM_MIN_ROWS) == [24] * 4
    # two sequences: every product through addmm, the decode's two-row ones too
    assert run(2, export_llama.LLAMA_ADDMM_MIN_ROWS) == [48] * 4 + [2] * 8
    # LLAMA_ADDMM_MIN_ROWS 1: addmm for one row too (the path as it was)
    assert run(1, 1) == [24] * 4 + [1] * 8


def test_a_blocks_decode_plan_is_kept_and_follows_replaced_weights_and_modules(monkeypatch):
    """fuse_decode checks a block once and keeps what it found (its plan) on the block: later steps
    reuse it; replacing a weight (o_proj's, down_proj's, a norm's: loading, fine-tuning) or a module
    (quantising a projection) makes it again, so decode computes with the model as it is now, the
    logits as stock's on the changed model at every step."""
    import mlx.nn as nn

    m = tiny_llama(mx.float16)
    ids = mx.random.randint(0, 101, (2, 24))

    use_rope_references(monkeypatch)
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                              rope=export_llama._llama_rope_cuda)
    try:
        prefill_and_decode(m, ids, 2)
        blocks = m.model.layers
        plans = [b.__dict__["_ks_decode_plan"] for b in blocks]
        prefill_and_decode(m, ids, 2)
        assert all(b.__dict__["_ks_decode_plan"] is p for b, p in zip(blocks, plans)), "a plan was made again"
        assert unpatch.decode == {"fused": 8}, unpatch.decode

        def replace_and_compare(what, change):
            change()
            unpatch_off = dict(unpatch.decode)
            got = prefill_and_decode(m, ids, 3)
            # stock on the changed model: the classes' own methods for the time of the reference
            from mlx_lm.models import llama

            patched = (llama.Attention.__dict__["__call__"], llama.TransformerBlock.__dict__["__call__"])
            llama.Attention.__call__ = patched[0]._ksearch_stock
            llama.TransformerBlock.__call__ = patched[1]._ksearch_stock
            try:
                ref = prefill_and_decode(m, ids, 3)
            finally:
                llama.Attention.__call__, llama.TransformerBlock.__call__ = patched
            for i, (a, b) in enumerate(zip(got, ref)):
                assert_close(a, b, TOL[mx.float16], what=f"{what}: call {i}")
            return unpatch.decode["fused"] - unpatch_off["fused"]

        def fresh(w, seed):
            return (mx.random.normal(w.shape, key=mx.random.key(seed)) * 0.05).astype(w.dtype)

        b0 = blocks[0]
        for what, change in (
            ("o_proj", lambda: setattr(b0.self_attn.o_proj, "weight", fresh(b0.self_attn.o_proj.weight, 1))),
            ("down_proj", lambda: setattr(b0.mlp.down_proj, "weight", fresh(b0.mlp.down_proj.weight, 2))),
            ("input norm", lambda: setattr(b0.input_layernorm, "weight", b0.input_layernorm.weight * 1.5)),
            ("q_proj", lambda: b0.self_attn.q_proj.update({"weight": fresh(b0.self_attn.q_proj.weight, 3)})),
        ):
            assert replace_and_compare(what, change) == 3 * len(blocks), what
            assert b0.__dict__["_ks_decode_plan"] is not plans[0], f"{what}: the old plan kept"
            plans[0] = b0.__dict__["_ks_decode_plan"]
        # a quantised projection: the path no longer serves the block (stock's block), nor do
        # its logits come from the old weights
        b0.mlp.down_proj = nn.QuantizedLinear.from_linear(b0.mlp.down_proj, group_size=32, bits=8)
        assert replace_and_compare("quantised down_proj", lambda: None) == 3 * (len(blocks) - 1)
    finally:
        unpatch()
    # LLAMA_DECODE_PLAN False: every step checks the block again and keeps nothing on it
    monkeypatch.setattr(export_llama, "LLAMA_DECODE_PLAN", False)
    m = tiny_llama(mx.float16)
    ref = prefill_and_decode(m, ids, 2)
    unpatch = export_llama.patch_mlx_lm_llama(standin([]), min_len=8, choose="always", lhd=standin_lhd([]),
                                              rope=export_llama._llama_rope_cuda)
    got = prefill_and_decode(m, ids, 2)
    unpatch()
    assert unpatch.decode == {"fused": 4}, unpatch.decode
    assert not any("_ks_decode_plan" in b.__dict__ for b in m.model.layers)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, TOL[mx.float16], what=f"without a plan: call {i}")
