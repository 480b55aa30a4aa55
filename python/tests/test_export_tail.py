"""Tests of ksearch_mlx/export_tail.py, the tail of `ksearch export --mlx` modules.

They run on MLX's CPU back-end, where custom kernels cannot run: the "kernels" here are a plain
f32 reference scan and step written in MLX ops, patched into a tiny random mlx-lm Mamba model
and compared with stock mlx-lm; the axis derivation and dtype casts are tested against fake TASK
dicts and a fake KERNEL callable.

    cd python && python -m pytest -q tests/test_export_tail.py
"""
import inspect
import json
import pathlib
import sys
import types

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models import mamba  # noqa: E402

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

HERE = pathlib.Path(__file__).resolve().parent
TAIL = HERE.parent / "ksearch_mlx" / "export_tail.py"
RUNTIME = HERE.parent / "ksearch_mlx" / "runtime.py"
TASKS = HERE.parent.parent / "tasks"
STOCK = mamba.MambaBlock.__dict__["_process_sequence"]
STOCK_BACKBONE = mamba.Mamba.__dict__["__call__"]


# ---- reference kernels in plain MLX ops (f32) ----------------------------------------------------
def ref_step(u, delta, A, Bm, Cm, Dv, state_in):
    f = mx.float32
    u, delta, A, Bm, Cm, Dv, h = (a.astype(f) for a in (u, delta, A, Bm, Cm, Dv, state_in))
    h = mx.exp(delta[..., None] * A) * h + (delta * u)[..., None] * Bm[:, None, :]
    y = (h * Cm[:, None, :]).sum(-1) + Dv * u
    return y, h


def ref_scan(u, delta, A, Bm, Cm, Dv):
    b, L, D = u.shape
    h = mx.zeros((b, D, A.shape[1]), dtype=mx.float32)
    ys = []
    for t in range(L):
        y, h = ref_step(u[:, t], delta[:, t], A, Bm[:, t], Cm[:, t], Dv, h)
        ys.append(y)
    return mx.stack(ys, axis=1), h


def counting(fn, counts, key):
    def wrapped(*a):
        counts[key] = counts.get(key, 0) + 1
        return fn(*a)

    return wrapped


# ---- a tiny random mlx-lm Mamba --------------------------------------------------------------------
def tiny_model(bcdt=False, seed=0):
    mx.random.seed(seed)
    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=100, hidden_size=64, intermediate_size=128, state_size=16,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
        use_bcdt_rms=bcdt,
    )
    m = mamba.Model(args)
    # stock A_log = log(1..N) and D = 1 everywhere: randomise them so that a swapped or
    # mis-cast A / D would show
    for layer in m.layers:
        blk = layer.mixer
        blk.A_log = blk.A_log + 0.3 * mx.random.normal(blk.A_log.shape)
        blk.D = mx.random.uniform(0.5, 1.5, blk.D.shape)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def prefill_and_decode(m, ids, steps):
    """Logits of the prefill (all positions) and of `steps` teacher-forced decode tokens, and the
    final SSM states of every layer."""
    cache = m.make_cache()
    logits = [m(ids, cache=cache)]
    for t in steps:
        logits.append(m(mx.array([[t]] * ids.shape[0]), cache=cache))
    mx.eval(logits)
    return logits, [c[1] for c in cache]


def assert_close(a, b, atol=1e-4, rtol=1e-4, what=""):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    err = mx.abs(a - b)
    lim = atol + rtol * mx.abs(b)
    bad = int((err > lim).sum().item())
    assert bad == 0, f"{what}: {bad} elements off, max abs err {mx.max(err).item():.3g}, scale {mx.max(mx.abs(b)).item():.3g}"


@pytest.fixture(autouse=True)
def restore_stock():
    yield
    mamba.MambaBlock._process_sequence = STOCK
    mamba.Mamba.__call__ = STOCK_BACKBONE


# ---- loading the tail: standalone, or the way `ksearch export` concatenates it ---------------------
def load_tail_standalone():
    mod = types.ModuleType("export_tail_standalone")
    mod.__file__ = str(TAIL)
    exec(compile(TAIL.read_text(), str(TAIL), "exec"), mod.__dict__)
    return mod


class FakeCompiled:
    """Stands in for runtime.CompiledCandidate: runs the reference in MLX ops, casting its outputs
    to the task's kernel dtypes, and records what it was given."""

    instances = []

    def __init__(self, candidate, task, backend):
        self.candidate, self.task, self.backend = candidate, task, backend
        self.calls = []
        FakeCompiled.instances.append(self)

    def __call__(self, inputs, axes, init_value=None):
        self.calls.append(({k: v.dtype for k, v in inputs.items()}, dict(axes)))
        name = self.task["name"]
        order = [t["name"] for t in self.task["inputs"]]
        args = [inputs[n] for n in order]
        outs = {"mamba_scan": ref_scan, "mamba_step": ref_step}[name](*args)
        over = self.task["backends"].get(self.backend, {}).get("dtypes", {})
        res = {}
        for spec, arr in zip(self.task["outputs"], outs):
            dt = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[over.get(spec["name"], spec["dtype"])]
            res[spec["name"]] = arr.astype(dt)
        return res


def task_json(name, backend="mlx-cuda", dtypes=None):
    """TASK as the Rust export writes it (name, axes, inputs/outputs, constants, backends with
    their dtype overrides), from the real task.toml."""
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    path = TASKS / name / "task.toml"
    if not path.exists():
        pytest.skip(f"{path} not found")
    t = tomllib.loads(path.read_text())
    backends = {b: {"dtypes": dict(v.get("dtypes", {}))} for b, v in t["backends"].items()}
    if dtypes is not None:
        backends.setdefault(backend, {"dtypes": {}})["dtypes"] = dtypes
    return {
        "name": t["name"], "description": t.get("description", ""), "axes": t["axes"],
        "inputs": [{k: i[k] for k in ("name", "shape", "dtype")} for i in t["inputs"]],
        "outputs": [{k: o[k] for k in ("name", "shape", "dtype")} for o in t["outputs"]],
        "constants": t.get("constants", {}), "backends": backends,
    }


def load_exported(task, backend="mlx-cuda", candidate=None):
    """The tail executed after fake runtime globals and the three generated lines."""
    FakeCompiled.instances.clear()
    mod = types.ModuleType(f"exported_{task['name']}")
    mod.CompiledCandidate = FakeCompiled
    mod.json = json
    gen = (
        f"TASK = json.loads(r'''{json.dumps(task)}''')\n"
        f"CANDIDATE = json.loads(r'''{json.dumps(candidate or {'lang': 'cuda', 'source': '', 'launches': [], 'scratch': [], 'defines': {}, 'options': {}})}''')\n"
        f"BACKEND = {json.dumps(backend)}\n"
    )
    exec(compile(gen + TAIL.read_text(), f"<exported {task['name']}>", "exec"), mod.__dict__)
    return mod


# ---- the patch against stock mlx-lm -----------------------------------------------------------------
@pytest.mark.parametrize("bcdt", [False, True])
def test_patched_prefill_and_decode_match_stock(bcdt):
    m = tiny_model(bcdt=bcdt)
    ids = mx.random.randint(0, 100, (2, 23))
    steps = [5, 17, 99, 0, 42, 7]
    stock_logits, stock_states = prefill_and_decode(m, ids, steps)

    tail = load_tail_standalone()
    counts = {}
    unpatch = tail.patch_mlx_lm(
        scan=counting(ref_scan, counts, "scan"), step=counting(ref_step, counts, "step"), compile_decode=False
    )
    assert mamba.MambaBlock._process_sequence is not STOCK
    logits, states = prefill_and_decode(m, ids, steps)
    assert counts == {"scan": 2, "step": 2 * len(steps)}, counts
    assert unpatch.stats == {"scan": 2, "step": 2 * len(steps), "stock": 0}
    assert_close(logits[0], stock_logits[0], what="prefill logits")
    for i, (a, b) in enumerate(zip(logits[1:], stock_logits[1:])):
        assert_close(a, b, what=f"decode step {i} logits")
    for a, b in zip(states, stock_states):
        assert a.dtype == mx.float32
        assert_close(a, b, what="final SSM state")

    unpatch()
    assert mamba.MambaBlock.__dict__["_process_sequence"] is STOCK
    again, _ = prefill_and_decode(m, ids, steps)
    for a, b in zip(again, stock_logits):
        assert mx.array_equal(a, b).item(), "unpatched model differs from stock"
    unpatch()  # idempotent
    assert mamba.MambaBlock.__dict__["_process_sequence"] is STOCK


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_conv_step_equals_the_grouped_conv_on_its_window(bias, dtype):
    tail = load_tail_standalone()
    import mlx.nn as nn

    D, K = 128, 4
    conv = nn.Conv1d(D, D, kernel_size=K, groups=D, bias=bias)
    conv.set_dtype(getattr(mx, dtype))
    blk = types.SimpleNamespace(conv1d=conv)
    x_full = mx.random.normal((3, K, D)).astype(getattr(mx, dtype))
    got = tail._tail_conv_step(blk, x_full)
    want = conv(x_full)
    assert got.shape == want.shape == (3, 1, D) and got.dtype == want.dtype
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert_close(got, want, atol=tol, rtol=tol, what="conv step")
    # a wrong tap order would not pass
    flipped = tail._tail_conv_step(blk, x_full[:, ::-1])
    assert not mx.allclose(flipped.astype(mx.float32), want.astype(mx.float32), atol=1e-2).item()


@pytest.mark.parametrize("fast_conv", [True, False])
def test_decode_matches_stock_with_and_without_the_conv_step(fast_conv):
    m = tiny_model(bcdt=False)
    ids = mx.random.randint(0, 100, (1, 9))
    steps = [3, 1, 4, 1, 5]
    stock_logits, stock_states = prefill_and_decode(m, ids, steps)
    tail = load_tail_standalone()
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=ref_step, fast_conv=fast_conv)
    try:
        logits, states = prefill_and_decode(m, ids, steps)
    finally:
        unpatch()
    for i, (a, b) in enumerate(zip(logits, stock_logits)):
        assert_close(a, b, what=f"logits {i}")
    for a, b in zip(states, stock_states):
        assert_close(a, b, what="final SSM state")


@pytest.mark.parametrize("scope", ["model", "block"])
def test_compiled_decode_matches_stock_and_traces_the_step_once_per_block(scope):
    m = tiny_model(bcdt=False)
    ids = mx.random.randint(0, 100, (2, 23))
    steps = [5, 17, 99, 0, 42, 7]
    stock_logits, stock_states = prefill_and_decode(m, ids, steps)
    tail = load_tail_standalone()
    counts = {}
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=counting(ref_step, counts, "step"), compile_decode=scope)
    try:
        logits, states = prefill_and_decode(m, ids, steps)
    finally:
        unpatch()
    assert unpatch.compiled["error"] is None, unpatch.compiled
    assert unpatch.compiled["scope"] == scope
    # every decode step ran compiled: one call per token for the whole backbone, or one per
    # token and block; the Python step ran once per block (while tracing)
    assert unpatch.compiled["compiled_calls"] == (1 if scope == "model" else 2) * len(steps)
    assert unpatch.stats["step"] == 2 * len(steps)
    assert counts == {"step": 2}, counts
    assert mamba.Mamba.__dict__["__call__"] is STOCK_BACKBONE
    for i, (a, b) in enumerate(zip(logits, stock_logits)):
        assert_close(a, b, what=f"logits {i}")
    for a, b in zip(states, stock_states):
        assert_close(a, b, what="final SSM state")


@pytest.mark.parametrize("scope", ["model", "block"])
def test_a_step_mx_compile_cannot_trace_falls_back_and_leaves_the_model_intact(scope):
    m = tiny_model(bcdt=False)
    ids = mx.random.randint(0, 100, (2, 23))
    steps = [5, 17, 99]
    stock_logits, _ = prefill_and_decode(m, ids, steps)

    def untraceable_step(*args):
        y, h = ref_step(*args)
        mx.eval(y, h)  # not allowed while mx.compile traces
        return y, h

    tail = load_tail_standalone()
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=untraceable_step, compile_decode=scope)
    try:
        logits, _ = prefill_and_decode(m, ids, steps)
    finally:
        unpatch()
    assert unpatch.compiled["error"] and unpatch.compiled["compiled_calls"] == 0
    assert unpatch.stats["step"] == 2 * len(steps)
    for i, (a, b) in enumerate(zip(logits, stock_logits)):
        assert_close(a, b, what=f"logits {i}")
    again, _ = prefill_and_decode(m, ids, steps)  # the weights are the real arrays again
    for a, b in zip(again, stock_logits):
        assert mx.array_equal(a, b).item()


def test_a_bad_compile_scope_is_refused():
    tail = load_tail_standalone()
    with pytest.raises(ValueError, match="compile_decode"):
        tail.patch_mlx_lm(scan=ref_scan, step=ref_step, compile_decode="layer")
    assert mamba.MambaBlock.__dict__["_process_sequence"] is STOCK


def test_scan_only_and_step_only():
    m = tiny_model()
    ids = mx.random.randint(0, 100, (1, 12))
    steps = [3, 4, 5]
    stock_logits, _ = prefill_and_decode(m, ids, steps)
    tail = load_tail_standalone()

    unpatch = tail.patch_mlx_lm(scan=ref_scan)  # decode: stock step on the f32 state
    logits, states = prefill_and_decode(m, ids, steps)
    assert unpatch.stats == {"scan": 2, "step": 0, "stock": 2 * len(steps)}
    for a, b in zip(logits, stock_logits):
        assert_close(a, b, what="scan-only")
    unpatch()

    unpatch = tail.patch_mlx_lm(step=ref_step)  # prefill: stock loop
    logits, states = prefill_and_decode(m, ids, steps)
    assert unpatch.stats == {"scan": 0, "step": 2 * len(steps), "stock": 2}
    assert all(s.dtype == mx.float32 for s in states)
    for a, b in zip(logits, stock_logits):
        assert_close(a, b, what="step-only")
    unpatch()

    with pytest.raises(ValueError):  # nothing to patch (the fused decode alone needs no kernel module)
        tail.patch_mlx_lm(fused_decode=False)


def test_multi_token_with_state_continues_the_scan_from_that_state():
    m = tiny_model()
    ids = mx.random.randint(0, 100, (1, 10))
    more = mx.random.randint(0, 100, (1, 5))

    def two_chunks():
        cache = m.make_cache()
        a = m(ids, cache=cache)
        b = m(more, cache=cache)  # T > 1 with an incoming state: chunked prefill
        mx.eval(a, b)
        return a, b

    sa, sb = two_chunks()
    tail = load_tail_standalone()
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=ref_step)
    pa, pb = two_chunks()
    unpatch()
    assert unpatch.stats == {"scan": 4, "step": 0, "stock": 0}
    assert_close(pa, sa, what="first chunk")
    assert_close(pb, sb, what="second chunk (scan from zero + the incoming state's decay)")
    # without a scan the continuation is stock's
    unpatch = tail.patch_mlx_lm(step=ref_step)
    qa, qb = two_chunks()
    unpatch()
    assert unpatch.stats["stock"] == 4
    assert_close(qb, sb, what="stock continuation")


def test_one_token_prompt_uses_step_from_zero_state():
    m = tiny_model()
    ids = mx.array([[7]])
    stock_logits, _ = prefill_and_decode(m, ids, [8, 9])
    tail = load_tail_standalone()
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=ref_step)
    logits, _ = prefill_and_decode(m, ids, [8, 9])
    assert unpatch.stats == {"scan": 0, "step": 3 * 2, "stock": 0}  # 3 tokens x 2 layers
    for a, b in zip(logits, stock_logits):
        assert_close(a, b, what="one-token prompt")


def test_repatching_keeps_the_stock_fallback():
    tail = load_tail_standalone()
    u1 = tail.patch_mlx_lm(scan=ref_scan)
    first = mamba.MambaBlock.__dict__["_process_sequence"]
    u2 = tail.patch_mlx_lm(step=ref_step)
    assert mamba.MambaBlock.__dict__["_process_sequence"]._ksearch_stock is STOCK
    u2()
    assert mamba.MambaBlock.__dict__["_process_sequence"] is first
    u1()
    assert mamba.MambaBlock.__dict__["_process_sequence"] is STOCK


# ---- the exported module: defaults, casts, axes ------------------------------------------------------
def test_exported_scan_module_patches_with_its_own_function():
    all_f32 = {n: "f32" for n in ("u", "delta", "A", "Bm", "Cm", "Dv", "y", "state")}
    mod = load_exported(task_json("mamba_scan", dtypes=all_f32))
    assert list(inspect.signature(mod.mamba_scan).parameters) == ["u", "delta", "A", "Bm", "Cm", "Dv"]
    assert mod.KERNEL is None  # built on first use
    m = tiny_model()
    ids = mx.random.randint(0, 100, (2, 9))
    stock_logits, _ = prefill_and_decode(m, ids, [1, 2])
    unpatch = mod.patch_mlx_lm()
    logits, _ = prefill_and_decode(m, ids, [1, 2])
    assert unpatch.stats == {"scan": 2, "step": 0, "stock": 4}
    # two layers of one shape: the kernel traced once (mx.compile), the trace run twice
    assert isinstance(mod.KERNEL, FakeCompiled) and len(mod.KERNEL.calls) == 1
    dts, axes = mod.KERNEL.calls[0]
    assert axes == {"batch": 2, "L": 9, "D": 128, "N": 16}
    assert all(d == mx.float32 for d in dts.values())
    for a, b in zip(logits, stock_logits):
        assert_close(a, b, what="exported scan module")
    unpatch()


def test_exported_step_module_in_f16_dtypes():
    """Declared dtypes (u, delta, Bm, Cm f16; A, Dv, state f32): the function casts its arguments,
    the patch casts y back to the model's dtype and keeps the state in f32."""
    task = task_json("mamba_step")
    task["backends"].pop("mlx-cuda", None)
    mod = load_exported(task)
    assert not hasattr(mod, "mamba_scan")
    m = tiny_model()
    ids = mx.random.randint(0, 100, (1, 8))
    stock_logits, _ = prefill_and_decode(m, ids, [1, 2, 3])
    unpatch = mod.patch_mlx_lm(scan=ref_scan)
    logits, states = prefill_and_decode(m, ids, [1, 2, 3])
    assert unpatch.stats == {"scan": 2, "step": 6, "stock": 0}
    dts, axes = mod.KERNEL.calls[0]
    assert axes == {"batch": 1, "D": 128, "N": 16}
    assert dts == {"u": mx.float16, "delta": mx.float16, "A": mx.float32, "Bm": mx.float16,
                   "Cm": mx.float16, "Dv": mx.float32, "state_in": mx.float32}
    assert all(s.dtype == mx.float32 for s in states) and logits[-1].dtype == mx.float32
    for a, b in zip(logits, stock_logits):
        assert_close(a, b, atol=3e-2, rtol=3e-2, what="f16 step")
    unpatch()


def test_attention_axes_causal_keyword_and_no_patch():
    task = task_json("attention")
    mod = load_exported(task, candidate={"lang": "cuda", "source": "", "launches": [], "scratch": [],
                                         "defines": {"HD": 64}, "options": {},
                                         "constraints": ["HD == D", "L % 32 == 0"]})
    assert not hasattr(mod, "patch_mlx_lm")
    params = inspect.signature(mod.attention).parameters
    assert list(params) == ["q", "k", "v", "causal"] and params["causal"].default is False
    seen = []

    def fake(inputs, axes):
        seen.append((inputs, axes))
        return {"o": inputs["q"] * 2}

    mod.KERNEL = fake
    q = mx.ones((2, 3, 64, 64), dtype=mx.float32)
    o = mod.attention(q, q, q)
    assert isinstance(o, mx.array) and o.shape == q.shape  # one output: not a tuple
    inputs, axes = seen[-1]
    assert axes == {"B": 2, "H": 3, "Hkv": 3, "L": 64, "D": 64, "causal": 0}
    assert all(v.dtype == mx.float16 for v in inputs.values())  # declared f16 (cpu override not used)
    mod.attention(q, q, q, causal=True)
    assert seen[-1][1]["causal"] == 1
    out = mod.run(q=q, k=q, v=q, causal=1)
    assert set(out) == {"o"} and seen[-1][1]["causal"] == 1
    with pytest.raises(ValueError, match="axis `L`"):
        mod.attention(q, mx.ones((2, 3, 32, 64)), q)
    with pytest.raises(ValueError, match="4 dimensions"):
        mod.attention(q, q, mx.ones((3, 64, 64)))
    with pytest.raises(ValueError, match="HD == D"):
        q128 = mx.ones((1, 1, 64, 128))
        mod.attention(q128, q128, q128)
    with pytest.raises(ValueError, match="L % 32"):
        q48 = mx.ones((1, 1, 48, 64))
        mod.attention(q48, q48, q48)
    with pytest.raises(TypeError):
        mod.run(q=q, k=q)


FAKE = {
    "name": "fake",
    "axes": ["rows", "cols", "K", "flag"],
    "inputs": [
        {"name": "x", "shape": ["rows", "cols"], "dtype": "f16"},
        {"name": "w", "shape": ["cols", "4"], "dtype": "f32"},
        {"name": "z", "shape": ["rows * 2", "K"], "dtype": "f32"},
    ],
    "outputs": [{"name": "y", "shape": ["rows"], "dtype": "f32"}, {"name": "s", "shape": ["1"], "dtype": "f32"}],
    "constants": {"eps": 1e-5},
    "backends": {"mlx-cuda": {"dtypes": {"x": "bf16"}}, "cpu": {"dtypes": {"x": "f32"}}},
}


def test_axes_from_shapes_generic():
    tail = load_tail_standalone()
    arrays = {"x": mx.zeros((3, 5)), "w": mx.zeros((5, 4)), "z": mx.zeros((6, 7))}
    assert tail.axes_from_shapes(FAKE, arrays, {"flag": True}) == {"rows": 3, "cols": 5, "K": 7, "flag": 1}
    with pytest.raises(TypeError, match="flag"):
        tail.axes_from_shapes(FAKE, arrays)
    with pytest.raises(ValueError, match="expected 4"):
        tail.axes_from_shapes(FAKE, {**arrays, "w": mx.zeros((5, 3))}, {"flag": 0})
    with pytest.raises(ValueError, match="rows \\* 2"):
        tail.axes_from_shapes(FAKE, {**arrays, "z": mx.zeros((5, 7))}, {"flag": 0})
    with pytest.raises(ValueError, match="axis `cols`"):
        tail.axes_from_shapes(FAKE, {**arrays, "w": mx.zeros((6, 4))}, {"flag": 0})
    with pytest.raises(ValueError, match="axis `rows`"):  # an explicit axis must agree with the shapes
        tail.axes_from_shapes(FAKE, arrays, {"flag": 0, "rows": 4})
    with pytest.raises(TypeError, match="no axis"):
        tail.axes_from_shapes(FAKE, arrays, {"flag": 0, "bogus": 1})
    d = tail.expected_dtypes(FAKE, "mlx-cuda")
    assert d["x"] == mx.bfloat16 and d["w"] == mx.float32 and d["y"] == mx.float32
    assert tail.expected_dtypes(FAKE, "mlx-metal")["x"] == mx.float16


def test_make_entry_generic():
    tail = load_tail_standalone()
    seen = []

    def kernel(inputs, axes):
        seen.append(({k: v.dtype for k, v in inputs.items()}, axes))
        return {"y": mx.zeros((axes["rows"],)), "s": mx.zeros((1,))}

    fn, run = tail.make_entry(FAKE, "mlx-cuda", lambda: kernel)
    sig = inspect.signature(fn)
    assert fn.__name__ == "fake" and list(sig.parameters) == ["x", "w", "z", "flag"]
    assert sig.parameters["flag"].kind is inspect.Parameter.KEYWORD_ONLY
    y, s = fn([[1.0] * 5] * 3, mx.zeros((5, 4), dtype=mx.float16), mx.zeros((6, 2)), flag=1)
    assert y.shape == (3,) and s.shape == (1,)
    assert seen[-1] == ({"x": mx.bfloat16, "w": mx.float32, "z": mx.float32}, {"rows": 3, "cols": 5, "K": 2, "flag": 1})
    out = run(x=mx.zeros((2, 5)), w=mx.zeros((5, 4)), z=mx.zeros((4, 1)), flag=0)
    assert list(out) == ["y", "s"] and seen[-1][1]["rows"] == 2
    with pytest.raises(TypeError):
        fn(mx.zeros((3, 5)), mx.zeros((5, 4)), mx.zeros((6, 2)))  # flag missing
    with pytest.raises(TypeError, match="unexpected"):
        run(x=mx.zeros((2, 5)), w=mx.zeros((5, 4)), z=mx.zeros((4, 1)), flag=0, q=1)


def test_make_entry_compiles_each_call_shape_once():
    """The task function traces its kernel once per call shape (mx.compile) and reuses the trace;
    a kernel that cannot be traced, or COMPILE_CALLS = False, runs plainly on every call."""
    tail = load_tail_standalone()
    calls = []

    def kernel(inputs, axes):
        calls.append(axes["rows"])
        x = inputs["x"].astype(mx.float32)
        return {"y": x.sum(axis=1) * (2 if axes["flag"] else 1), "s": x.sum(keepdims=True)[0]}

    fn, _ = tail.make_entry(FAKE, "cpu", lambda: kernel)
    w, z = mx.zeros((5, 4)), mx.zeros((6, 2))
    for i in range(4):
        x = mx.full((3, 5), float(i))
        y, s = fn(x, w, z, flag=1)
        assert y.tolist() == [10.0 * i] * 3 and s.tolist() == [15.0 * i]  # fresh values every call
    assert calls == [3]  # one trace for four calls
    y, _ = fn(mx.ones((3, 5)), w, z, flag=0)  # an axis in no shape is part of the key
    assert y.tolist() == [5.0] * 3 and calls == [3, 3]

    def host_reading(inputs, axes):
        calls.append(float(inputs["x"][0, 0].item()))  # no value to read inside a trace
        return {"y": inputs["x"].sum(axis=1), "s": mx.zeros((1,))}

    fn, _ = tail.make_entry(FAKE, "cpu", lambda: host_reading)
    calls.clear()
    for i in range(3):
        y, _ = fn(mx.full((3, 5), float(i)), w, z, flag=0)
        assert y.tolist() == [5.0 * i] * 3
    assert calls == [0.0, 1.0, 2.0]

    tail.COMPILE_CALLS = False
    try:
        fn, _ = tail.make_entry(FAKE, "cpu", lambda: kernel)
        calls.clear()
        for _ in range(3):
            fn(mx.ones((3, 5)), w, z, flag=0)
        assert calls == [3, 3, 3]
    finally:
        tail.COMPILE_CALLS = True


def test_expressions():
    """Shape expressions and constraints go through the runtime's eval_expr (the Rust grammar)."""
    if not RUNTIME.exists():
        pytest.skip("python/ksearch_mlx/runtime.py not written yet")
    tail = load_tail_standalone()
    env = {"L": 100, "D": 64, "HD": 64, "C": 64}
    assert tail._tail_eval("ceil_div(L, C) * 2", env) == 4
    assert tail._tail_eval("L / C + L % C", env) == 1 + 36
    assert tail._tail_eval("HD == D && !(L % C == 0)", env) == 1
    assert tail._tail_eval("min(L, D) != 64 || max(1, 2) >= 2", env) == 1
    with pytest.raises(ValueError):
        tail._tail_eval("X + 1", env)
    assert tail._tail_defines({"defines": ["A=1", "B = 2"]}) == {"A": 1, "B": 2}
    assert tail._tail_defines({"defines": [["A", 3]]}) == {"A": 3}


def test_standalone_import_defines_no_entry():
    tail = load_tail_standalone()
    assert tail.KERNEL is None
    assert not hasattr(tail, "run") and hasattr(tail, "patch_mlx_lm")


@pytest.mark.skipif(not RUNTIME.exists(), reason="python/ksearch_mlx/runtime.py not written yet")
def test_concatenated_with_the_real_runtime():
    """runtime.py + the generated lines + the tail, as `ksearch export --mlx` writes them, must
    import (no kernel is built: that needs a GPU)."""
    task = task_json("mamba_scan")
    cand = {"lang": "cuda", "source": "", "launches": [], "scratch": [], "defines": {}, "options": {}}
    text = (
        RUNTIME.read_text()
        + "\nimport json\n"
        + f"TASK = json.loads(r'''{json.dumps(task)}''')\n"
        + f"CANDIDATE = json.loads(r'''{json.dumps(cand)}''')\n"
        + 'BACKEND = "mlx-cuda"\n'
        + TAIL.read_text()
    )
    # registered in sys.modules as an import would (the runtime's dataclasses look themselves up there)
    mod = types.ModuleType("exported_real_runtime")
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(text, "<exported>", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    assert callable(mod.CompiledCandidate) and callable(mod.eval_expr) and callable(mod.split_sections)
    assert list(inspect.signature(mod.mamba_scan).parameters) == ["u", "delta", "A", "Bm", "Cm", "Dv"]
    assert mod.KERNEL is None and callable(mod.patch_mlx_lm)


# ---- the fused decode glue's plumbing, with its kernels played by MLX ops ----------------------
def fake_glue_kernels(calls):
    """Stand-ins for the glue's CUDA kernels with the same inputs, outputs and rounding points,
    written in MLX ops: they test what _glue_decode feeds them and does with their outputs (the
    CUDA bodies themselves are compile-checked in test_glue_nvrtc.py and run on the GPU by
    bench/mlx_e2e.py, which compares the decoded logits with stock)."""
    f16, f32 = mx.float16, mx.float32

    def t(template, k):
        return dict(template)[k]

    def conv_xproj(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        xz, cache, cw, cb, wx = inputs
        D, K, J = t(template, "D"), t(template, "K"), t(template, "J")
        x = xz[:, :D]
        full = mx.concatenate([cache, x[:, None, :]], axis=1)
        conv = (mx.sum(full.astype(f32) * cw.astype(f32).T, axis=1) + cb.astype(f32)).astype(f16).astype(f32)
        xa = (conv * mx.sigmoid(conv)).astype(f16)
        dbc = (xa.astype(f32) @ wx.astype(f32).T).astype(f16)
        outs = [xa, full[:, 1:, :], dbc]
        assert [tuple(o.shape) for o in outs] == [tuple(s) for s in output_shapes]
        assert grid[1] == xz.shape[0] and grid[0] == ((J + 7) // 8) * 256
        return outs

    def dt_common(inputs, template):
        dbc, wdt, bdt = inputs[:3]
        R = t(template, "R")
        pre = (dbc[:, :R].astype(f32) @ wdt.astype(f32).T + bdt.astype(f32)).astype(f16).astype(f32)
        return (mx.maximum(pre, 0) + mx.log1p(mx.exp(-mx.abs(pre)))).astype(f16)

    def dt(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        R, N = t(template, "R"), t(template, "N")
        delta = dt_common(inputs, template)
        dbc = inputs[0]
        return [delta, dbc[:, R:R + N], dbc[:, R + N:R + 2 * N]]

    def dt_step(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        dbc, _, _, xa, A, Dv, s0, xz = inputs
        D, R, N = t(template, "D"), t(template, "R"), t(template, "N")
        delta = dt_common(inputs, template).astype(f32)
        u = xa.astype(f32)
        Bv, Cv = dbc[:, R:R + N].astype(f32), dbc[:, R + N:].astype(f32)
        h = mx.exp(delta[..., None] * A) * s0 + (delta * u)[..., None] * Bv[:, None, :]
        y = ((h * Cv[:, None, :]).sum(-1) + Dv * u).astype(f16).astype(f32)
        z = xz[:, D:].astype(f32)
        return [(z * mx.sigmoid(z) * y).astype(f16), h]

    fakes = {"ks_glue_conv_xproj": conv_xproj, "ks_glue_dt": dt, "ks_glue_dt_step": dt_step}

    def get(name):
        calls[name] = calls.get(name, 0) + 1
        return lambda **kw: fakes[name](**kw)

    return get


def glue_model():
    mx.random.seed(3)
    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=100, hidden_size=64, intermediate_size=256, state_size=8,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
    )
    m = mamba.Model(args)
    for layer in m.layers:
        blk = layer.mixer
        blk.A_log = blk.A_log + 0.3 * mx.random.normal(blk.A_log.shape)
        blk.D = blk.D + 0.5 * mx.random.normal(blk.D.shape)
    m.set_dtype(mx.float16)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("glue", [True, "step"])
@pytest.mark.parametrize("scope", ["block", False])
def test_decode_glue_plumbing_matches_stock(glue, scope):
    m = glue_model()
    ids = mx.random.randint(0, 100, (2, 11))
    steps = [4, 8, 15, 16, 23]
    stock_logits, stock_states = prefill_and_decode(m, ids, steps)
    tail = load_tail_standalone()
    tail.BACKEND = "mlx-cuda"  # as in a module exported for MLX's CUDA back-end
    calls = {}
    tail._glue_kernel = fake_glue_kernels(calls)
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=ref_step, compile_decode=scope, decode_glue=glue)
    try:
        logits, states = prefill_and_decode(m, ids, steps)
    finally:
        unpatch()
    assert unpatch.compiled["glue"] == ("step" if glue == "step" else "fused")
    assert unpatch.compiled["error"] is None, unpatch.compiled
    want = {"ks_glue_conv_xproj", "ks_glue_dt_step" if glue == "step" else "ks_glue_dt"}
    assert set(calls) == want, calls
    for i, (a, b) in enumerate(zip(logits, stock_logits)):
        assert_close(a, b, atol=3e-2, rtol=3e-2, what=f"logits {i}")
    for a, b in zip(states, stock_states):
        assert a.dtype == mx.float32
        assert_close(a, b, atol=3e-2, rtol=3e-2, what="final SSM state")


def test_decode_glue_stays_off_where_it_does_not_fit():
    m = tiny_model()  # f32 weights, intermediate 128: not what the glue was written for
    tail = load_tail_standalone()
    tail.BACKEND = "mlx-cuda"
    calls = {}
    tail._glue_kernel = fake_glue_kernels(calls)
    unpatch = tail.patch_mlx_lm(scan=ref_scan, step=ref_step)
    try:
        prefill_and_decode(m, mx.random.randint(0, 100, (1, 5)), [1, 2])
    finally:
        unpatch()
    assert calls == {} and "glue" not in unpatch.compiled
    with pytest.raises(ValueError, match="decode_glue"):
        tail.patch_mlx_lm(scan=ref_scan, step=ref_step, decode_glue="all")
