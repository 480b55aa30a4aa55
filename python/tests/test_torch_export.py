"""The body of modules written by `ksearch export <run> --torch` (ksearch_torch/export_module.py),
without torch, CuPy or a GPU:

* its expressions agree with the MLX runtime's (the Rust side's semantics) on every expression of
  every task file;
* the build chosen per shape is the search's (`KernelSpec::specialise`), launch sizes and limits;
* the drop-ins' dispatch, layout mapping and fall-back run against CPU STAND-INS: numpy arrays, a
  numpy "kernel" in the task's layout and a numpy "peer" — stand-ins for the CUDA launch and for
  torch's SDPA / mamba_ssm, so that what is checked is the module's logic, not a GPU result;
* every build of every CUDA kernel family of attention and mamba_scan compiles through the
  module's own NVRTC path (pip's nvidia-cuda-nvrtc; skipped without it unless
  KSEARCH_REQUIRE_NVRTC=1, as scripts/test.sh sets).

The SPECs here are made from the task files by `spec_from_task`, the same fields the Rust export
writes (crates/cli/tests/torch_export.rs checks a module the binary wrote).

    cd python && python -m pytest -q tests/test_torch_export.py
"""
import ast
import itertools
import math
import os
import pathlib
import random
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

from conftest import REPO, load_task

BODY = pathlib.Path(__file__).resolve().parent.parent / "ksearch_torch" / "export_module.py"
NVRTC = pathlib.Path(__file__).resolve().parent.parent / "ksearch_nvrtc.py"


def load(spec):
    """The module as `ksearch export --torch` assembles it: SPEC first, then the NVRTC helpers
    and the body."""
    m = types.ModuleType("exported_" + str(random.random())[2:])
    m.SPEC = spec
    for part in (NVRTC, BODY):
        exec(compile(part.read_text(), str(part), "exec"), m.__dict__)
    return m


def spec_from_task(task_name, kernel, defines=None, measured=None):
    """A SPEC for `kernel` of `task_name` (cuda section) at its default tunables (+ `defines`),
    with every build of its shape-tied tunables, as the Rust export makes it."""
    t = load_task(task_name)
    b = t["backends"]["cuda"]
    k = b["seed"] if kernel == "seed" else next(x for x in b["kernels"] if x["name"] == kernel)
    with open(os.path.join(REPO, "tasks", task_name, k["file"])) as f:
        source = f.read()
    free = {x["name"]: x.get("default", x["values"][0]) for x in k.get("tunables", [])}
    free.update(defines or {})
    shape_tied = [x for x in k.get("tunables", []) if x.get("pattern") == "specialisation"]
    launches = k.get("launches") or [{"entry": k["entry"]}]
    launches = [{"grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0", **l} for l in launches]
    over = b.get("dtypes", {})
    tensors = lambda ts: [{"name": x["name"], "shape": x["shape"], "dtype": over.get(x["name"], x["dtype"])} for x in ts]
    consts = [f"-DKS_{n.upper()}={float(v)!r}" for n, v in sorted((t.get("constants") or {}).items())]
    dispatch = {}
    for combo in itertools.product(*[x["values"] for x in shape_tied]) if shape_tied else [()]:
        d = dict(free)
        d.update({x["name"]: v for x, v in zip(shape_tied, combo)})
        cls = ",".join(f"{x['name']}={d[x['name']]}" for x in shape_tied) or "default"
        dispatch[cls] = {
            "defines": d,
            "launches": [{"entry": l["entry"], "grid": l["grid"], "block": l["block"], "shared": l["shared"]} for l in launches],
            "scratch": [{"name": s["name"], "bytes": s["bytes"]} for s in k.get("scratch", [])],
            "nvrtc_options": ["--gpu-architecture=@ARCH@", "--ptxas-options=-v", "--std=c++17", "-DKS_CUDA=1"]
            + consts + [f"-D{n}={v}" for n, v in sorted(d.items())],
            "measured": (measured or {}).get(cls, []),
        }
    return {
        "run": 1, "node": 1, "kernel": k.get("name", "seed"), "candidate_key": f"test_{task_name}_{kernel}",
        "task": {"name": t["name"], "description": t.get("description", ""), "axes": t["axes"],
                 "constants": t.get("constants", {}), "inputs": tensors(t["inputs"]), "outputs": tensors(t["outputs"])},
        "source": source,
        "arch": {"fixed": None, "specific": "wgmma" in source or "setmaxnreg" in source},
        "constraints": k.get("constraints", []),
        "defines": free,
        "specialise": [{"name": x["name"], "values": x["values"]} for x in shape_tied],
        "dispatch": dispatch,
        "peer": {"attention": "attention", "mamba_scan": "mamba_scan"}.get(task_name),
        "peer_name": "the stand-in peer",
    }


# ---- CPU stand-ins ---------------------------------------------------------------------------------

class StandInLauncher:
    """STAND-IN for the CUDA launch: records each plan and computes the task in numpy, in the
    task's layout (so a wrong layout mapping shows as a wrong result)."""

    def __init__(self, compute, limits=None):
        self.compute, self.plans, self._limits = compute, [], limits

    def check(self, arrays):
        return None

    def limits(self, arrays):
        return self._limits

    def launch(self, plan, arrays):
        self.plans.append(plan)
        return self.compute(arrays, plan.axis_values)  # the axes in the task's order


def np_attention(q, k, v, causal):
    """[B, H, L, D] attention in float64 (grouped-query heads), the result in q's dtype."""
    B, H, L, D = q.shape
    g = H // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = q.astype(np.float64) @ kk.swapaxes(-1, -2) / math.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ vv).astype(q.dtype)


def np_scan(u, delta, A, Bm, Cm, Dv):
    """The task's scan, channels last: u, delta [b, L, D], Bm, Cm [b, L, N] → y [b, L, D], state [b, D, N]."""
    b, L, D = u.shape
    h = np.zeros((b, D, A.shape[1]))
    y = np.zeros((b, L, D))
    for t in range(L):
        d = delta[:, t].astype(np.float64)[..., None]
        h = np.exp(d * A) * h + d * u[:, t].astype(np.float64)[..., None] * Bm[:, t, None, :].astype(np.float64)
        y[:, t] = (h * Cm[:, t, None, :]).sum(-1) + Dv * u[:, t]
    return y.astype(u.dtype), h.astype(np.float32)


def attention_kernel(arrays, axis_values):
    q, k, v = arrays
    return [np_attention(q, k, v, axis_values[-1])]


def scan_kernel(arrays, axis_values):
    return list(np_scan(*arrays))


def f16(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


# ---- the module on its own -------------------------------------------------------------------------

def test_the_body_imports_nothing_beyond_the_standard_library_at_load():
    tree = ast.parse(BODY.read_text())
    for node in tree.body:  # top level only: torch, numpy and CuPy are imported inside functions
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for n in names:
                assert n.split(".")[0] in sys.stdlib_module_names, n
    m = load(None)
    assert m.SPEC is None and m.eval_int("ceil_div(L, 3)", {"L": 10}) == 4
    assert "torch" not in m.__dict__ and "cupy" not in m.__dict__
    with pytest.raises(RuntimeError, match="template"):
        m.plan({})


def _task_expressions():
    """Every expression of every task file, with the names it may use and their candidate values."""
    out = []
    for name in sorted(os.listdir(os.path.join(REPO, "tasks"))):
        if not os.path.exists(os.path.join(REPO, "tasks", name, "task.toml")):
            continue
        t = load_task(name)
        for bname, b in t["backends"].items():
            for k in [b["seed"]] + b.get("kernels", []):
                values = {x["name"]: x["values"] for x in k.get("tunables", [])}
                exprs = list(k.get("constraints", []))
                for l in k.get("launches", []):
                    exprs += list(l.get("grid", [])) + list(l.get("block", [])) + [l.get("shared", "0")]
                exprs += [s["bytes"] for s in k.get("scratch", [])]
                for e in exprs:
                    out.append((f"{name}/{bname}/{k.get('name', 'seed')}", str(e), t["axes"], values, b["search"] + b.get("heldout", [])))
    return out


def test_expressions_agree_with_the_runtime_on_every_task_expression():
    runtime = pytest.importorskip("ksearch_mlx.runtime")
    m = load(None)
    rng = random.Random(7)
    n = 0
    for where, expr, axes, values, workloads in _task_expressions():
        for _ in range(6):
            env = dict(rng.choice(workloads))
            for a in axes:  # and ragged sizes the task files do not list
                if rng.random() < 0.3:
                    env[a] = rng.choice([0, 1, 3, 77, 1000, 4097])
            env.update({k: rng.choice(v) for k, v in values.items()})
            try:
                want = runtime.eval_expr(expr, env)
            except ValueError as e:
                with pytest.raises(m.ExprError):
                    m.eval_int(expr, env)
                continue
            assert m.eval_int(expr, env) == want, (where, expr, env)
            n += 1
    assert n > 300


@pytest.mark.parametrize(
    "expr, want",
    [("-7 / 2", -3), ("-L % 3", -1), ("!CHUNK == 0", 1), ("3 > 2 > 1", 0), ("0.5 * L", 2048), ("ceil_div(-5, 2)", -2)],
)
def test_expression_corners(expr, want):
    assert load(None).eval_int(expr, {"L": 4096, "CHUNK": 64}) == want


@pytest.mark.parametrize("expr, needle", [("L / X", "unknown name `X`"), ("L % 0", "division by zero"), ("min(1)", "takes 2"), ("1 2", "trailing")])
def test_expression_errors(expr, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        load(None).eval_int(expr, {"L": 1})


# ---- builds per shape --------------------------------------------------------------------------------

ATT = dict(B=1, H=32, Hkv=8, L=1000, causal=1)


@pytest.mark.parametrize("kernel", ["flash_wgmma", "flash", "flash_mt"])
def test_the_head_size_build_is_chosen_per_shape(kernel):
    m = load(spec_from_task("attention", kernel))
    for D in (64, 96, 128):
        cls, d = m.choose_build(dict(ATT, D=D))
        assert cls == f"HD={D}" and d["HD"] == D
        assert {k: v for k, v in d.items() if k != "HD"} == {k: v for k, v in m.SPEC["defines"].items() if k != "HD"}
    with pytest.raises(m.Unsupported, match="no build of kernel"):
        m.choose_build(dict(ATT, D=80))
    with pytest.raises(m.Unsupported, match=r"H % Hkv == 0"):
        m.choose_build(dict(ATT, Hkv=5, D=64))


def test_the_candidates_own_build_wins_where_it_is_admitted():
    # NS=8 admitted for N=8 as it is; NS is only changed where the constraints need it.
    m = load(spec_from_task("mamba_scan", "seq_scan", {"NS": 8}))
    assert m.choose_build(dict(batch=1, L=10, D=64, N=8))[0] == "NS=8"
    assert m.choose_build(dict(batch=1, L=10, D=64, N=16))[0] == "NS=16"


def test_plans_evaluate_every_launch_and_scratch_and_respect_limits():
    m = load(spec_from_task("mamba_scan", "chunked_scan"))
    p = m.plan(dict(batch=3, L=777, D=1536, N=16))
    d = m.SPEC["defines"]
    chunks = -(-777 // d["CHUNK"])
    assert [l[0] for l in p.launches] == ["scan_local", "scan_combine", "scan_output"]
    assert p.launches[0][1] == (-(-1536 // (d["THREADS"] * d["CPT"])), chunks, 3)
    assert p.scratch == [("chunk_decay", 3 * chunks * 1536 * 16 * 4), ("chunk_state", 3 * chunks * 1536 * 16 * 4)]
    assert p.outputs == [("y", (3, 777, 1536), "f16"), ("state", (3, 1536, 16), "f32")]
    assert p.axis_values == (3, 777, 1536, 16)
    a = load(spec_from_task("attention", "flash_wgmma"))
    small = dict(a.DEFAULT_LIMITS, shared=100 * 1024)
    with pytest.raises(a.Unsupported, match="dynamic shared memory"):
        a.plan(dict(ATT, D=128), small)
    with pytest.raises(a.Unsupported, match="exceeds the device"):
        a.plan(dict(B=4096, H=32, Hkv=32, L=64, D=64, causal=0))  # B * H = 131072 blocks in y
    with pytest.raises(a.Unsupported, match="below 1"):
        a.plan(dict(ATT, L=0, D=64))


# ---- the drop-ins against CPU stand-ins -----------------------------------------------------------

def test_sdpa_drop_in_runs_the_kernel_in_torchs_layout_and_falls_back_outside_it():
    m = load(spec_from_task("attention", "flash_wgmma"))
    launcher = StandInLauncher(attention_kernel)
    fell = []

    def peer(arrays, axes):  # STAND-IN for torch's SDPA in the task's layout
        fell.append(dict(axes))
        q, k, v = arrays
        return [np_attention(q, k, v, axes["causal"])]

    m.configure(launcher=launcher, peer=peer)
    rng = np.random.default_rng(1)
    # ragged lengths, grouped-query and multi-query heads, head sizes 64/128/96, one query row
    shapes = [(1, 8, 2, 100, 64, True), (3, 4, 4, 77, 128, False), (2, 4, 1, 33, 96, True), (1, 4, 4, 1, 64, True)]
    for B, H, Hkv, L, D, causal in shapes:
        q, k, v = f16(rng, B, H, L, D), f16(rng, B, Hkv, L, D), f16(rng, B, Hkv, L, D)
        o = m.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hkv != H)
        assert o.shape == (B, H, L, D) and o.dtype == np.float16
        np.testing.assert_allclose(o, np_attention(q, k, v, causal), atol=1e-3)
    assert [p.cls for p in launcher.plans] == ["HD=64", "HD=128", "HD=96", "HD=64"]
    assert m.STATS["kernel"] == 4 and not fell
    # outside the kernel: a head size without a build, float32 — the peer, warned once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = f16(rng, 1, 2, 5, 80)
        np.testing.assert_allclose(m.scaled_dot_product_attention(q, q, q), np_attention(q, q, q, False), atol=1e-3)
        q32 = rng.standard_normal((1, 2, 5, 64)).astype(np.float32)
        m.scaled_dot_product_attention(q32, q32, q32, is_causal=True)
    assert [a["D"] for a in fell] == [80, 64]
    assert len(caught) == 1 and "falling back to the stand-in peer" in str(caught[0].message)
    assert "no build of kernel `flash_wgmma`" in str(caught[0].message)
    assert m.STATS["fallback"] == 2 and any("is f32; the kernel takes f16" in r for r in m.STATS["reasons"])


class Shape:
    def __init__(self, *shape, dtype="float16"):
        self.shape, self.dtype = shape, dtype


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(attn_mask=object()), "attn_mask"),
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(scale=0.5), "scale 0.5 is not"),
        (dict(q=Shape(1, 8, 10, 64), k=Shape(1, 2, 10, 64), v=Shape(1, 2, 10, 64)), "enable_gqa is False"),
        (dict(q=Shape(1, 8, 10, 64), k=Shape(1, 8, 12, 64), v=Shape(1, 8, 12, 64)), "query length 10 differs"),
        (dict(q=Shape(8, 10, 64), k=Shape(8, 10, 64), v=Shape(8, 10, 64)), "not [B, H, L, D]"),
        (dict(v=Shape(1, 8, 10, 32)), "differ"),
    ],
)
def test_sdpa_arguments_the_kernel_does_not_take(kw, needle):
    m = load(spec_from_task("attention", "flash_wgmma"))
    args = dict(q=Shape(1, 8, 10, 64), k=Shape(1, 8, 10, 64), v=Shape(1, 8, 10, 64))
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    assert needle in m.sdpa_reason(args["q"], args["k"], args["v"], **kw)
    q = Shape(1, 8, 10, 64)
    assert m.sdpa_reason(q, q, q, scale=1 / 8) is None


def test_selective_scan_drop_in_maps_mamba_ssms_layout_onto_the_task():
    m = load(spec_from_task("mamba_scan", "seq_scan"))
    launcher = StandInLauncher(scan_kernel)
    m.configure(launcher=launcher, peer=lambda arrays, axes: pytest.fail("fell back"))
    rng = np.random.default_rng(2)
    b, D, L, N = 2, 16, 37, 16
    u = f16(rng, b, D, L)
    delta = (rng.uniform(-3, 0.5, (b, D, L))).astype(np.float16)
    A = -rng.uniform(1, 16, (D, N)).astype(np.float32)
    B, C = f16(rng, b, N, L), f16(rng, b, 1, N, L)  # C with mamba_ssm's group axis
    Dv = rng.uniform(0.5, 1.5, D).astype(np.float32)
    z = f16(rng, b, D, L)
    bias = rng.uniform(-1, 1, D).astype(np.float32)
    out, last = m.selective_scan(u, delta, A, B, C, Dv, z=z, delta_bias=bias, delta_softplus=True, return_last_state=True)
    # what mamba_ssm computes, written out here in its own layout
    d = np.logaddexp(0.0, delta.astype(np.float32) + bias[:, None]).astype(np.float16)
    y, h = np_scan(u.swapaxes(1, 2), d.swapaxes(1, 2), A, B.swapaxes(1, 2), C[:, 0].swapaxes(1, 2), Dv)
    zf = z.astype(np.float32)
    want = (y.swapaxes(1, 2).astype(np.float32) * zf / (1 + np.exp(-zf))).astype(np.float16)
    assert out.shape == (b, D, L) and last.shape == (b, D, N) and last.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(last, h, rtol=1e-5, atol=1e-6)
    assert launcher.plans[0].cls == "NS=16" and launcher.plans[0].axis_values == (b, L, D, N)
    # D omitted, no state asked for: out only
    out2 = m.selective_scan(u, d, A, B, C)
    y2, _ = np_scan(u.swapaxes(1, 2), d.swapaxes(1, 2), A, B.swapaxes(1, 2), C[:, 0].swapaxes(1, 2), np.zeros(D, np.float32))
    np.testing.assert_allclose(out2.astype(np.float32), y2.swapaxes(1, 2).astype(np.float32), atol=1e-2)


def test_selective_scan_outside_the_kernel_needs_mamba_ssm():
    m = load(spec_from_task("mamba_scan", "seq_scan"))
    m.configure(launcher=StandInLauncher(scan_kernel))
    m._MAMBA[:] = [None]  # as where mamba_ssm cannot be imported
    rng = np.random.default_rng(3)
    u = f16(rng, 1, 12, 5)  # D = 12: not a multiple of 8
    A = -np.ones((12, 16), np.float32)
    B = f16(rng, 1, 16, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"D % 8 == 0.*mamba_ssm, the fall-back, cannot be imported"):
            m.selective_scan(u, u, A, B, B)
        with pytest.raises(RuntimeError, match="2 groups"):
            m.selective_scan(u, u, A, f16(rng, 1, 2, 16, 5), f16(rng, 1, 2, 16, 5))
    assert m.scan_reason(u, u, A, A, A) .startswith("B is not")


def test_a_task_without_a_peer_raises_with_the_reason():
    m = load(spec_from_task("softmax", "block_row"))
    m.configure(launcher=StandInLauncher(lambda arrays, ax: [arrays[0]]))
    assert not hasattr(m, "scaled_dot_product_attention") and not hasattr(m, "selective_scan")
    x = np.ones((3, 8), np.float32)
    assert m.softmax(x) is x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"cols % VEC == 0.*no peer"):
            m.softmax(np.ones((3, 7), np.float32))
    with pytest.raises(ValueError, match="expected 2 dimensions"):
        m.softmax(np.ones(3, np.float32))


# ---- NVRTC -------------------------------------------------------------------------------------------

def _cu13():
    """pip's nvidia/cu13 folder, from this interpreter or `python3`."""
    cands = [os.path.join(p, "nvidia", "cu13") for p in sys.path]
    try:
        out = subprocess.run(["python3", "-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            cands.append(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return next((d for d in cands if os.path.exists(os.path.join(d, "lib", "libnvrtc.so.13"))), None)


@pytest.fixture(scope="module")
def nvrtc():
    d = _cu13()
    if d is None:
        if os.environ.get("KSEARCH_REQUIRE_NVRTC") == "1":
            pytest.fail("NVRTC 13 from pip not found and KSEARCH_REQUIRE_NVRTC=1 (scripts/nvrtc-check.sh installs it)")
        pytest.skip("NVRTC 13 from pip not found (scripts/nvrtc-check.sh installs it)")
    return d


@pytest.mark.parametrize(
    "task, kernel", [("attention", "flash_wgmma"), ("attention", "flash"), ("attention", "flash_mt"),
                     ("attention", "seed"), ("mamba_scan", "seq_scan"), ("mamba_scan", "chunked_scan")])
def test_every_build_compiles_with_nvrtc(nvrtc, monkeypatch, task, kernel):
    monkeypatch.setenv("KSEARCH_NVRTC", os.path.join(nvrtc, "lib", "libnvrtc.so.13"))
    monkeypatch.setenv("KSEARCH_CUDA_INCLUDE", os.path.join(nvrtc, "include"))
    m = load(spec_from_task(task, kernel))
    sizes = m.compile_all((9, 0))
    assert set(sizes) == set(m.SPEC["dispatch"]) and all(n > 1000 for n in sizes.values())
    if m.SPEC["arch"]["specific"]:
        assert m.arch_for((9, 0)) == "sm_90a"


def test_a_compile_failure_says_why_once(nvrtc, monkeypatch):
    monkeypatch.setenv("KSEARCH_NVRTC", os.path.join(nvrtc, "lib", "libnvrtc.so.13"))
    s = spec_from_task("softmax", "block_row")
    s["source"] = s["source"].replace("extern", "extrn", 1)
    m = load(s)
    with pytest.raises(m.CompileError, match="extrn"):
        m.compile_variant("default", (9, 0))
    with pytest.raises(m.CompileError):  # remembered, not compiled again
        m.compile_variant("default", (9, 0))
    assert len(m._CUBINS) == 1


# ---- the CUDA launcher's plumbing, against STAND-INS for torch and CuPy -------------------------------

class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class _Device:
    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __eq__(self, o):
        return (self.type, self.index) == (o.type, o.index)

    def __hash__(self):
        return hash((self.type, self.index))


class _Tensor:
    """STAND-IN for a torch CUDA tensor: shape, dtype, device and an address."""

    next_ptr = [0x7000_0000]

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.requires_grad = False
        self.ptr = _Tensor.next_ptr[0]
        _Tensor.next_ptr[0] += 0x100_0000

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return True

    def contiguous(self):
        return self


_Tensor.__module__ = "torch"


def _fake_gpu(launched, set_attrs):
    """STAND-INS for the parts of torch, CuPy and the CUDA driver the launcher calls; launchKernel
    reads the parameter block back from memory, as the driver would."""
    import contextlib
    import ctypes

    torch = types.ModuleType("torch")
    torch.Tensor = _Tensor
    torch.float16, torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.uint8 = (
        _Dtype(n) for n in ("float16", "float32", "bfloat16", "float64", "int32", "uint8"))
    torch.empty = lambda shape, dtype, device: _Tensor(shape if isinstance(shape, tuple) else (shape,), dtype, device)
    torch.is_grad_enabled = lambda: False
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False)
    torch.cuda = types.SimpleNamespace(
        current_stream=lambda dev: types.SimpleNamespace(cuda_stream=0x5757),
        get_device_capability=lambda idx: (9, 0), current_device=lambda: 0)
    attrs = {1: 1024, 5: 2**31 - 1, 6: 65535, 7: 65535, 97: 232448}
    runtime = types.SimpleNamespace(deviceGetAttribute=lambda a, idx: attrs[a], getDevice=lambda: 0, free=lambda p: None)

    class Module:
        def load(self, cubin):
            assert cubin == b"CUBIN"

        def get_function(self, name):
            return types.SimpleNamespace(ptr=hash(name) & 0xFFFF, name=name)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda idx: contextlib.nullcontext(),
                                      function=types.SimpleNamespace(Module=Module))

    def launch(fp, gx, gy, gz, bx, by, bz, shared, stream, pblock, extra):
        params = ctypes.cast(pblock, ctypes.POINTER(ctypes.c_void_p))
        n = 10  # q, k, v, o, then the six axes of attention
        values = [ctypes.c_uint64.from_address(params[i]).value for i in range(n)]
        launched.append(((gx, gy, gz), (bx, by, bz), shared, stream, values))

    driver = types.ModuleType("cupy_backends.cuda.api.driver")
    driver.funcGetAttribute = lambda attr, ptr: {0: 1024, 1: 0}[attr]
    driver.funcSetAttribute = lambda ptr, attr, v: set_attrs.append((attr, v))
    driver.launchKernel = launch
    api = types.ModuleType("cupy_backends.cuda.api")
    api.driver = driver
    return {"torch": torch, "cupy": cupy, "cupy_backends": types.ModuleType("cupy_backends"),
            "cupy_backends.cuda": types.ModuleType("cupy_backends.cuda"), "cupy_backends.cuda.api": api,
            "cupy_backends.cuda.api.driver": driver}


def test_the_cuda_launcher_fills_the_parameter_block_and_reuses_it(monkeypatch):
    m = load(spec_from_task("attention", "flash_wgmma"))
    launched, set_attrs = [], []
    for name, mod in _fake_gpu(launched, set_attrs).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(m, "compile_variant", lambda cls, cc: b"CUBIN")
    torch = sys.modules["torch"]
    dev = _Device("cuda", 0)
    q = _Tensor((1, 32, 1000, 64), torch.float16, dev)
    k, v = (_Tensor((1, 8, 1000, 64), torch.float16, dev) for _ in range(2))
    for _ in range(3):
        o = m.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert o.shape == (1, 32, 1000, 64) and str(o.dtype) == "torch.float16"
    # the task expression for head size 64 at its class tiling: NWG_D64=2, STAGES_D64=4, BLOCK_N_D64=64, MBAR=1
    shared = 128 * 2 * 64 + 4 * 4 * 64 * 64 + 1024 + 128
    assert len(launched) == 3 and m.STATS["kernel"] == 3
    grid, block, sh, stream, values = launched[-1]
    assert (grid, block, sh, stream) == ((8, 32, 1), (256, 1, 1), shared, 0x5757)
    assert values == [q.ptr, k.ptr, v.ptr, o.ptr, 1, 32, 8, 1000, 64, 1]
    assert set_attrs == [(8, shared)]  # the dynamic shared-memory limit raised once, above 48 KiB
    assert len(m._FAST) == 1  # calls after the first go straight to the prepared launch
    # a shape the constraints exclude never reaches the launcher
    m.configure(peer=lambda arrays, axes: ["peer"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = _Tensor((1, 4, 10, 80), torch.float16, dev)
        assert m.scaled_dot_product_attention(x, x, x) == "peer"
        y = _Tensor((1, 4, 10, 64), torch.float16, _Device("cpu", None))
        assert m.scaled_dot_product_attention(y, y, y) == "peer"
    assert len(launched) == 3 and "not a CUDA device" in m.STATS["last"]
