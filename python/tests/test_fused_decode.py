"""Tests of the fused Mamba decode of export_tail.py (one launch per token for the whole backbone):
- its CUDA unit compiled with NVRTC (no GPU) at several model shapes, for sm_90 and sm_80;
- on MLX's CPU back-end, with the launch played by a numpy model of the kernel that reads the
  packed weights with the kernel's own indexing (chunk-major x_proj / out_proj, stacked caches)
  and rounds where the kernel rounds: decode logits and states against stock mlx-lm, the cache
  plumbing (stacked caches reused, per-layer views), the fall-backs (other dtypes, back-ends,
  quantised layers, batch > 1), repacking after a weight changes, and the error flag.

    cd python && python -m pytest -q tests/test_fused_decode.py
"""
import pathlib
import re
import sys
import types

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
mamba = pytest.importorskip("mlx_lm.models.mamba")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
TAIL = HERE.parent / "ksearch_mlx" / "export_tail.py"
STOCK = mamba.MambaBlock.__dict__["_process_sequence"]
STOCK_BACKBONE = mamba.Mamba.__dict__["__call__"]


@pytest.fixture(autouse=True)
def restore_stock():
    yield
    mamba.MambaBlock._process_sequence = STOCK
    mamba.Mamba.__call__ = STOCK_BACKBONE


def load_tail():
    mod = types.ModuleType("export_tail_fused")
    mod.__file__ = str(TAIL)
    exec(compile(TAIL.read_text(), str(TAIL), "exec"), mod.__dict__)
    return mod


# ---- NVRTC compile checks -------------------------------------------------------------------------
SHAPES = [
    dict(DM=1024, DI=2048, NS=16, R=64, K=4, NL=48, NB=128),  # mamba-370m on an H200 (132 SMs)
    dict(DM=768, DI=1536, NS=16, R=48, K=4, NL=24, NB=96),    # mamba-130m
    dict(DM=2560, DI=5120, NS=16, R=160, K=4, NL=2, NB=132),  # mamba-2.8b sizes, several chunks a block
    dict(DM=256, DI=512, NS=8, R=12, K=2, NL=1, NB=3),        # small: 11 chunks on 3 blocks, odd J
]


@pytest.fixture(scope="module")
def nvrtc_build():
    import ksearch_nvrtc

    try:
        ksearch_nvrtc.nvrtc_library()
    except ksearch_nvrtc.CompileError as e:
        import os

        if os.environ.get("KSEARCH_REQUIRE_NVRTC") == "1":
            pytest.fail(f"NVRTC not found and KSEARCH_REQUIRE_NVRTC=1: {e}")
        pytest.skip(f"NVRTC not found: {e}")
    return ksearch_nvrtc.nvrtc_build


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"DM{s['DM']}-DI{s['DI']}-NB{s['NB']}")
def test_fused_unit_compiles(nvrtc_build, shape, arch):
    tail = load_tail()
    d = dict(shape, EPS="1e-05f", EPSF="1e-05f")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v"] + [f"-D{k}={v}" for k, v in d.items()]
    cubin, ptx, log = nvrtc_build(tail._FUSED_SRC, opts + ["-DKS_ENTRY=ks_mamba_decode_t"], "mamba_decode.cu")
    assert cubin and ".entry ks_mamba_decode_t(" in ptx
    assert "warning" not in log.lower(), log
    # the kernel keeps everything in registers: a spill would mean local-memory traffic per token
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 255
    # 20 parameters: the 16 inputs and 4 outputs the Python side passes, in that order
    params = re.search(r"\.entry ks_mamba_decode_t\((.*?)\)", ptx, re.S).group(1)
    assert params.count(".param") == 20
    if arch == "sm_90":
        assert "red.relaxed.gpu.global.add.v4.f32" in ptx and "cp.async.bulk.prefetch.L2" in ptx


def test_fused_unit_refuses_shapes_it_does_not_tile(nvrtc_build):
    tail = load_tail()
    import ksearch_nvrtc

    d = dict(SHAPES[3], DI=520, EPS="1e-05f", EPSF="1e-05f")  # not a multiple of 16
    opts = ["--gpu-architecture=sm_90", "--std=c++17"] + [f"-D{k}={v}" for k, v in d.items()]
    with pytest.raises(ksearch_nvrtc.CompileError, match="multiple of 16"):
        nvrtc_build(tail._FUSED_SRC, opts + ["-DKS_ENTRY=k"], "mamba_decode.cu")


# ---- a numpy model of the kernel -------------------------------------------------------------------
def f16(v):
    return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float32)


def emulate(shape, inputs):
    """What `_FUSED_SRC` computes, from the inputs the Python side passes it, indexed as the kernel
    indexes them; rounded to f16 where the kernel rounds."""
    (ids, emb, nw, win, cw, cb, wx, wdt, bdt, A, Dv, wout, nfw, conv_in, st_in, scratch) = [
        np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.array(a) for a in inputs]
    NL, DM, DI, N, R, K = (shape[k] for k in ("NL", "DM", "DI", "NS", "R", "K"))
    eps, epsf = float(shape["EPS"][:-1]), float(shape["EPSF"][:-1])
    nch, CH = DI // 16, 16
    h = emb[int(ids.reshape(-1)[0])].astype(np.float32)
    conv_out = np.zeros((NL, K - 1, DI), np.float32)
    st_out = np.zeros((NL, DI, N), np.float32)
    for layer in range(NL):
        r = 1.0 / np.sqrt(np.mean(h * h) + eps)
        xn = f16(nw[layer] * f16(h * r))
        xz = f16(win[layer] @ xn)
        x, z = xz[:DI], xz[DI:]
        a = cb[layer] + sum(cw[layer][:, k] * conv_in[layer][k] for k in range(K - 1)) + cw[layer][:, K - 1] * x
        cv = f16(a)
        xa = f16(cv / (1 + np.exp(-cv)))
        conv_out[layer, :K - 2] = conv_in[layer, 1:]
        conv_out[layer, K - 2] = x
        dbc = f16(np.einsum("kjc,kc->j", wx[layer], xa.reshape(nch, CH)))  # chunk-major x_proj
        pre = f16(wdt[layer] @ dbc[:R] + bdt[layer])
        dt = f16(np.maximum(pre, 0) + np.log1p(np.exp(-np.abs(pre))))
        Bv, Cv = dbc[R:R + N], dbc[R + N:]
        hn = np.exp(dt[:, None] * A[layer]) * st_in[layer] + (dt * xa)[:, None] * Bv[None, :]
        st_out[layer] = hn
        y = f16(hn @ Cv + Dv[layer] * xa)
        yg = f16(z / (1 + np.exp(-z)) * y)
        out = f16(np.einsum("krc,kc->r", wout[layer], yg.reshape(nch, CH)))  # chunk-major out_proj
        h = f16(h + out)
    r = 1.0 / np.sqrt(np.mean(h * h) + epsf)
    hidden = f16(nfw * f16(h * r))
    return [mx.array(hidden.reshape(1, 1, DM)).astype(mx.float16), mx.array(conv_out).astype(mx.float16),
            mx.array(st_out), mx.array(np.zeros((1,), np.uint32))]


SMALL = dict(model_type="mamba", vocab_size=300, hidden_size=256, intermediate_size=512, state_size=16,
             num_hidden_layers=3, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=16)


def small_model(dtype=mx.float16, seed=3, **over):
    mx.random.seed(seed)
    m = mamba.Model(mamba.ModelArgs(**dict(SMALL, **over)))
    m.set_dtype(dtype)
    # A_log and D away from their 1..N / ones defaults, so that a swapped index shows
    for layer in m.backbone.layers:
        mx_ = layer.mixer
        mx_.A_log = (mx_.A_log + 0.3 * mx.random.normal(mx_.A_log.shape)).astype(dtype)
        mx_.D = (1 + 0.5 * mx.random.normal(mx_.D.shape)).astype(dtype)
    mx.eval(m.parameters())
    return m


class Launches:
    def __init__(self, flag=0):
        self.calls, self.outs, self.flag = [], [], flag

    def __call__(self, unit, shape, inputs):
        self.calls.append(inputs)
        out = emulate(shape, inputs)
        out[3] = mx.array(np.full((1,), self.flag, np.uint32))
        self.outs.append(out)
        return out


def fused_tail(launch):
    tail = load_tail()
    tail.BACKEND = "mlx-cuda"
    tail._FUSED_SMS[:] = [132]
    tail._fused_unit = lambda defines, arch: ("ks_mamba_decode_fake", b"")
    tail._fused_arch = lambda: "sm_90"
    tail._fused_launch = launch
    return tail


def decode(m, prompt, toks):
    cache = m.make_cache()
    mx.eval(m(prompt, cache=cache))
    logits = []
    for t in toks:
        lg = m(mx.array([[t]]), cache=cache)
        mx.eval(lg)
        logits.append(lg[0, -1])
    return mx.stack(logits), cache


def rel(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


PROMPT = mx.array([[5, 17, 123, 9, 250, 77]])
TOKS = [3, 141, 59, 26, 299, 0, 88]


def test_fused_decode_matches_stock_f16_and_f32():
    m = small_model()
    lg_stock, cache_stock = decode(m, PROMPT, TOKS)
    launches = Launches()
    tail = fused_tail(launches)
    unpatch = tail.patch_mlx_lm()  # no scan, no step: the fused decode alone
    lg, cache = decode(m, PROMPT, TOKS)
    unpatch.fused_check()
    unpatch()
    assert unpatch.compiled["fused_calls"] == len(TOKS) and unpatch.compiled["fused"] == "on"
    assert len(launches.calls) == len(TOKS)
    assert rel(lg, lg_stock) < 2e-2  # bench/mlx_e2e.py's MODEL_REL
    assert (np.argmax(np.array(lg), -1) == np.argmax(np.array(lg_stock), -1)).mean() >= 0.8
    for c, s in zip(cache, cache_stock):
        assert c[0].shape == s[0].shape and c[0].dtype == mx.float16
        assert c[1].shape == s[1].shape and c[1].dtype == mx.float32
        assert rel(c[0], s[0]) < 1e-2  # the in_proj outputs of the last K-1 tokens
        assert rel(c[1], s[1]) < 2e-2
    # both against the same model in f32 (weights rounded to f16 first): the fused path is the closer
    m32 = small_model()
    m32.set_dtype(mx.float32)
    lg32, _ = decode(m32, PROMPT, TOKS)
    assert rel(lg, lg32) <= rel(lg_stock, lg32) * 1.5 + 1e-3


def test_fused_decode_reuses_its_stacked_caches():
    m = small_model()
    launches = Launches()
    tail = fused_tail(launches)
    tail.patch_mlx_lm()
    cache = m.make_cache()
    mx.eval(m(PROMPT, cache=cache))
    for t in TOKS[:3]:
        mx.eval(m(mx.array([[t]]), cache=cache))
    first, second, third = launches.calls
    # the stock prefill left f16 states: stacked (and cast) once, then the kernel's outputs pass on
    assert first[14].dtype == mx.float32 and first[14].shape == (3, 512, 16)
    assert all(a is b for a, b in zip(second[1:13], third[1:13]))  # the weights: packed once
    # call 3 gets exactly what call 2 returned (no concatenate): identity of the stacked arrays
    assert third[13] is launches.outs[1][1] and third[14] is launches.outs[1][2]
    assert third[15] is second[15]  # the scratch kept between launches
    assert cache[0][0].shape == (1, 3, 512) and cache[2][1].shape == (1, 512, 16)
    # a changed cache entry is noticed: the caches are stacked again
    cache[1][1] = cache[1][1] * 0
    mx.eval(m(mx.array([[7]]), cache=cache))
    assert float(mx.abs(launches.calls[-1][14][1]).max().item()) == 0.0


def test_fused_decode_from_empty_caches():
    m = small_model()
    lg_stock, _ = decode_from_one(m)
    tail = fused_tail(Launches())
    unpatch = tail.patch_mlx_lm()
    lg, _ = decode_from_one(m)
    assert unpatch.compiled["fused_calls"] == len(TOKS) + 1
    assert rel(lg, lg_stock) < 2e-2


def decode_from_one(m):
    cache = m.make_cache()
    logits = []
    for t in [11] + TOKS:
        lg = m(mx.array([[t]]), cache=cache)
        mx.eval(lg)
        logits.append(lg[0, -1])
    return mx.stack(logits), cache


def test_fused_decode_repacks_after_a_weight_changes():
    m = small_model()
    launches = Launches()
    tail = fused_tail(launches)
    unpatch = tail.patch_mlx_lm()
    decode(m, PROMPT, TOKS[:2])
    layer = m.backbone.layers[1].mixer
    layer.out_proj.weight = (layer.out_proj.weight * 2).astype(mx.float16)
    mx.eval(m.parameters())
    lg, _ = decode(m, PROMPT, TOKS)
    unpatch()
    lg_stock, _ = decode(m, PROMPT, TOKS)
    assert rel(lg, lg_stock) < 2e-2
    w = np.array(launches.calls[-1][11][1].astype(mx.float32))  # out_proj of layer 1, chunk-major
    assert np.array_equal(w, np.array(layer.out_proj.weight.reshape(256, 32, 16).transpose(1, 0, 2).astype(mx.float32)))


@pytest.mark.parametrize("case", ["f32", "metal", "quantized", "batch2", "bcdt_rms", "off"])
def test_fused_decode_stays_off_where_it_does_not_fit(case):
    m = small_model(dtype=mx.float32 if case == "f32" else mx.float16,
                    **({"use_bcdt_rms": True} if case == "bcdt_rms" else {}))
    if case == "quantized":
        nn.quantize(m.backbone.layers[0].mixer, group_size=64, bits=4,
                    class_predicate=lambda p, mod: isinstance(mod, nn.Linear) and mod.weight.shape[-1] % 64 == 0)
    launches = Launches()
    tail = fused_tail(launches)
    if case == "metal":
        tail.BACKEND = "mlx-metal"
    step = None
    if case == "off":  # something else to patch
        def step(u, delta, A, Bm, Cm, Dv, h):
            h = mx.exp(delta[..., None] * A) * h + (delta * u)[..., None] * Bm[:, None, :]
            return (h @ Cm[..., None])[..., 0] + Dv * u, h
    unpatch = tail.patch_mlx_lm(step=step, fused_decode=case != "off", decode_glue=False)
    prompt = mx.concatenate([PROMPT, PROMPT]) if case == "batch2" else PROMPT
    cache = m.make_cache()
    mx.eval(m(prompt, cache=cache))
    mx.eval(m(mx.array([[4]] * prompt.shape[0]), cache=cache))
    assert launches.calls == [] and unpatch.compiled["fused_calls"] == 0
    if case in ("f32", "quantized", "bcdt_rms"):
        assert unpatch.compiled["fused"] not in (None, "on")  # says why


def test_fused_shape_reasons():
    tail = fused_tail(Launches())
    assert isinstance(tail.fused_decode_shape(small_model().backbone), dict)
    s = tail.fused_decode_shape(small_model(intermediate_size=520).backbone)
    assert isinstance(s, str) and "tile" in s
    s = tail.fused_decode_shape(small_model(use_bias=True).backbone)
    assert isinstance(s, str) and "bias" in s
    d = tail.fused_decode_shape(small_model().backbone)
    assert d["NB"] == 32 and d["NL"] == 3 and d["EPS"] == "1e-05f"  # NB = min(SMs, DI / 16)
    tail._FUSED_SMS[:] = [None]
    assert "multiprocessor" in tail.fused_decode_shape(small_model().backbone)


def test_a_failed_launch_is_reported_and_turns_the_fused_path_off():
    m = small_model()
    launches = Launches(flag=2)
    tail = fused_tail(launches)
    unpatch = tail.patch_mlx_lm()
    cache = m.make_cache()
    mx.eval(m(PROMPT, cache=cache))
    lag = tail._FUSED_FLAG_LAG
    for t in TOKS[:lag]:  # the flag of call n is read at call n + lag
        mx.eval(m(mx.array([[t]]), cache=cache))
    with pytest.raises(tail.FusedDecodeError, match="did not finish"):
        m(mx.array([[1]]), cache=cache)
    assert "did not finish" in unpatch.compiled["fused"]
    n = len(launches.calls)
    cache = m.make_cache()
    mx.eval(m(PROMPT, cache=cache))
    mx.eval(m(mx.array([[1]]), cache=cache))  # off for this model now: the other paths
    assert len(launches.calls) == n
    launches2 = Launches(flag=1)
    tail2 = fused_tail(launches2)
    unpatch2 = tail2.patch_mlx_lm()
    mx.eval(small_model()(mx.array([[1]]), cache=small_model().make_cache()))
    with pytest.raises(tail2.FusedDecodeError):
        unpatch2.fused_check()
