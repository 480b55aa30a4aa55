# ---- ksearch export --torch: the body of the exported module -------------------------------------
#
# `ksearch export <run> --torch -o FILE` writes a docstring, one generated line that defines SPEC
# (the task, the kernel's source, constraints and launches, the dispatch table of the run's best
# candidate and what the run measured), then python/ksearch_nvrtc.py and this file verbatim. With SPEC present it defines:
#
#   <task name>(*inputs, **axes)        the task's inputs in order (the task's layout), its outputs
#                                       back (a tuple when there are several); axes found in no
#                                       input shape (attention's `causal`) by keyword
#   scaled_dot_product_attention(...)   attention: a drop-in for torch.nn.functional's
#   selective_scan(...), selective_scan_fn   mamba_scan: a drop-in for mamba_ssm's selective_scan_fn
#   decide(arrays, axes)                which build runs a call (pure Python, no torch needed)
#   compile_variant(cls, cc), compile_all(cc)   NVRTC builds of the dispatch table (no GPU needed)
#   STATS                               calls that ran the kernel / fell back, by reason
#   configure(launcher=, peer=)         replace how kernels run and what they fall back on
#
# Nothing outside the standard library is imported until a kernel runs: torch (tensors, streams,
# torch.library.custom_op for torch.compile) and CuPy (loading the CUBIN, launching on PyTorch's
# current stream) are imported then. The CUBIN itself is built here through NVRTC (ctypes, the
# same options the search compiled with), which is also what lets the dispatch table be
# compile-checked on a machine without a GPU.
#
# Imported on its own (no SPEC), it only defines the helpers; the tests load it with SPECs of
# their own. Names not meant for callers start with `_`.

import ctypes
import math
import os
import re
import sys
import threading
import warnings

# The generated line before this text defines SPEC; without it (the template on its own) it is None.
SPEC = globals().get("SPEC")

# ---------------------------------------------------------------------------------------------------
# Expressions: the task language of crates/core/src/expr.rs (integers, + - * / %, comparisons,
# && || !, ceil_div / min / max), evaluated the way the Rust side evaluates them: in f64, `/` and
# `%` on the truncated operands, `/` rounding toward zero, comparisons giving 1 or 0.
# ---------------------------------------------------------------------------------------------------

_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_ARITY = {"ceil_div": 2, "min": 2, "max": 2, "sqrt": 1, "log2": 1}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op><=|>=|==|!=|&&|\|\||[-+*/%<>!(),]))"
)


class ExprError(ValueError):
    """An expression that does not parse or cannot be evaluated (names it and the problem)."""


def _tokens(src):
    out, pos = [], 0
    while pos < len(src):
        if not src[pos:].strip():
            break
        m = _TOKEN.match(src, pos)
        if m is None or m.end() == pos:
            raise ExprError(f"expression `{src}`: unexpected character `{src[pos:].lstrip()[:1]}`")
        out.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, src):
        self.src, self.toks, self.pos = src, _tokens(src), 0

    def fail(self, why):
        return ExprError(f"expression `{self.src}`: {why}")

    def peek(self):
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def take(self):
        t = self.peek()
        self.pos += 1
        return t

    def parse(self):
        if not self.toks:
            raise self.fail("empty expression")
        e = self.expr(1)
        if self.pos < len(self.toks):
            raise self.fail(f"trailing input at token {self.pos + 1}")
        return e

    def expr(self, lowest):
        lhs = self.unary()
        while True:
            t = self.peek()
            if t is None or t[0] != "op" or _PREC.get(t[1], 0) < lowest:
                return lhs
            self.take()
            lhs = ("bin", t[1], lhs, self.expr(_PREC[t[1]] + 1))

    def unary(self):
        t = self.take()
        if t is None:
            raise self.fail("unexpected end")
        kind, text = t
        if t == ("op", "-"):
            return ("neg", self.unary())
        if t == ("op", "!"):
            return ("not", self.unary())
        if kind == "num":
            return ("num", float(text))
        if t == ("op", "("):
            e = self.expr(1)
            if self.take() != ("op", ")"):
                raise self.fail("missing `)`")
            return e
        if kind == "name":
            if self.peek() != ("op", "("):
                return ("var", text)
            self.take()
            args = []
            if self.peek() == ("op", ")"):
                self.take()
            else:
                while True:
                    args.append(self.expr(1))
                    sep = self.take()
                    if sep == ("op", ","):
                        continue
                    if sep == ("op", ")"):
                        break
                    raise self.fail(f"bad argument list for `{text}`")
            if text not in _ARITY:
                raise self.fail(f"unknown function `{text}`")
            if len(args) != _ARITY[text]:
                raise self.fail(f"`{text}` takes {_ARITY[text]} arguments")
            return ("call", text, args)
        raise self.fail(f"unexpected token `{text}`")


def _trunc(x):
    return float(int(x))  # Rust's `as i64`: toward zero


def _ev(node, env, src):
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        if node[1] not in env:
            raise ExprError(f"expression `{src}`: unknown name `{node[1]}`")
        return float(env[node[1]])
    if kind == "neg":
        return -_ev(node[1], env, src)
    if kind == "not":
        return 1.0 if _ev(node[1], env, src) == 0.0 else 0.0
    if kind == "call":
        a = _ev(node[2][0], env, src)
        if node[1] == "sqrt":
            return math.sqrt(a)
        if node[1] == "log2":
            return math.log2(a)
        c = _ev(node[2][1], env, src)
        if node[1] == "min":
            return min(a, c)
        if node[1] == "max":
            return max(a, c)
        if c == 0.0:
            raise ExprError(f"expression `{src}`: division by zero")
        n, d = int(a) + int(c) - 1, int(c)
        q = n // d
        if n - q * d < 0:  # Rust's div_euclid: the remainder is never negative
            q += 1
        return float(q)
    op, a, c = node[1], _ev(node[2], env, src), _ev(node[3], env, src)
    if op in ("/", "%"):
        if c == 0.0:
            raise ExprError(f"expression `{src}`: division by zero")
        x, y = int(a), int(c)
        q = abs(x) // abs(y)
        q = q if (x < 0) == (y < 0) else -q
        return float(q) if op == "/" else float(x - q * y)
    if op == "+":
        return a + c
    if op == "-":
        return a - c
    if op == "*":
        return a * c
    if op == "&&":
        return 1.0 if (a != 0.0 and c != 0.0) else 0.0
    if op == "||":
        return 1.0 if (a != 0.0 or c != 0.0) else 0.0
    return 1.0 if {"<": a < c, "<=": a <= c, ">": a > c, ">=": a >= c, "==": a == c, "!=": a != c}[op] else 0.0


_PARSED = {}


def eval_int(expr, env):
    """Evaluate a task expression as the Rust side's `eval_i64` does (raises ExprError)."""
    src = str(expr)
    node = _PARSED.get(src)
    if node is None:
        node = _PARSED[src] = _Parser(src).parse()
    v = _ev(node, env, src)
    if not math.isfinite(v):
        raise ExprError(f"expression `{src}`: not a finite value")
    return int(v)


# ---------------------------------------------------------------------------------------------------
# The search's result (from SPEC)
# ---------------------------------------------------------------------------------------------------

DTYPE_SIZES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4}
# Axes found in no input shape take these values when the caller leaves them out.
AXIS_DEFAULTS = {"causal": 0}
# Where a launcher gives no limits of its own (the stand-in of the tests): an H200's.
DEFAULT_LIMITS = {"threads": 1024, "grid": (2**31 - 1, 65535, 65535), "shared": 232448}


class Unsupported(Exception):
    """A call the exported kernel does not take (the reason says why); it falls back to the peer."""


def _spec():
    if SPEC is None:
        raise RuntimeError("this module has no SPEC: it is the template `ksearch export --torch` fills in")
    return SPEC


def _task():
    return _spec()["task"]


def class_of(defines):
    """The dispatch-table key of a build: its shape-tied tunables, e.g. `HD=128` (`default` when
    the kernel has none)."""
    names = [t["name"] for t in _spec().get("specialise", [])]
    if not names:
        return "default"
    return ",".join(f"{n}={int(defines[n])}" for n in names if n in defines) or "default"


def admits(defines, axes):
    """Do the kernel's constraints hold for this build and these axes?"""
    env = dict(axes)
    env.update(defines)
    return all(eval_int(c, env) != 0 for c in _spec().get("constraints", []))


def choose_build(axes):
    """The build for these axes, as the search chose one per workload (`KernelSpec::specialise`):
    the candidate's own tunables where its constraints admit the shape, else the same tunables
    with the shape-tied ones (pattern `specialisation`) set to the first admitted values, the first
    tunable varying fastest. Returns (class, defines) or raises Unsupported."""
    s = _spec()
    free = {k: int(v) for k, v in s["defines"].items()}
    try:
        if admits(free, axes):
            return class_of(free), free
        spec = s.get("specialise", [])
        if spec:
            idx = [0] * len(spec)
            while True:
                c = dict(free)
                for t, i in zip(spec, idx):
                    c[t["name"]] = int(t["values"][i])
                if admits(c, axes):
                    return class_of(c), c
                j = 0
                while True:
                    if j == len(idx):
                        break
                    idx[j] += 1
                    if idx[j] < len(spec[j]["values"]):
                        break
                    idx[j] = 0
                    j += 1
                if j == len(idx):
                    break
    except ExprError as e:
        raise Unsupported(f"the kernel's constraints cannot be evaluated: {e}") from None
    shown = ", ".join(f"{k}={v}" for k, v in axes.items())
    raise Unsupported(
        f"no build of kernel `{s['kernel']}` admits {shown} (constraints: {'; '.join(s.get('constraints', []))})"
    )


class Plan:
    """One call resolved: the build, every launch's sizes, scratch bytes, output shapes, axes."""

    __slots__ = ("cls", "defines", "launches", "scratch", "outputs", "axis_values")

    def __init__(self, cls, defines, launches, scratch, outputs, axis_values):
        self.cls, self.defines, self.launches = cls, defines, launches
        self.scratch, self.outputs, self.axis_values = scratch, outputs, axis_values

    def __repr__(self):
        return f"Plan({self.cls}, launches={self.launches}, scratch={self.scratch})"


def shape_of(spec, axes):
    out = []
    for d in spec["shape"]:
        d = str(d).strip()
        out.append(axes[d] if d in axes else eval_int(d, axes))
    return tuple(out)


def plan(axes, limits=None):
    """Resolve a call for `axes` (every axis of the task): choose the build, evaluate its launch
    sizes and scratch bytes, check them against `limits` (threads per block, grid, dynamic shared
    bytes). Raises Unsupported with the reason."""
    limits = limits or DEFAULT_LIMITS
    cls, defines = choose_build(axes)
    entry = _spec()["dispatch"].get(cls)
    if entry is None:
        raise Unsupported(f"build {cls} is not in the exported dispatch table")
    env = dict(axes)
    env.update(defines)
    launches = []
    try:
        for i, l in enumerate(entry["launches"]):
            at = f"launch {i + 1} `{l['entry']}`"
            grid = tuple(eval_int(e, env) for e in l["grid"])
            block = tuple(eval_int(e, env) for e in l["block"])
            shared = eval_int(l.get("shared", "0"), env)
            if min(grid + block) < 1:
                raise Unsupported(f"{at}: grid {grid} / block {block} has a size below 1")
            if any(g > m for g, m in zip(grid, limits["grid"])):
                raise Unsupported(f"{at}: grid {grid} exceeds the device's {tuple(limits['grid'])}")
            if block[0] * block[1] * block[2] > limits["threads"] or block[2] > 64:
                raise Unsupported(f"{at}: block {block} exceeds {limits['threads']} threads")
            if shared < 0 or shared > limits["shared"]:
                raise Unsupported(f"{at}: {shared} bytes of dynamic shared memory (the device allows {limits['shared']})")
            launches.append((l["entry"], grid, block, shared))
        scratch = []
        for s in entry.get("scratch", []):
            n = eval_int(s["bytes"], env)
            if n < 0:
                raise Unsupported(f"scratch `{s['name']}`: negative size {n}")
            scratch.append((s["name"], n))
        outputs = [(o["name"], shape_of(o, axes), o["dtype"]) for o in _task()["outputs"]]
    except ExprError as e:
        raise Unsupported(str(e)) from None
    values = tuple(int(axes[a]) for a in _task()["axes"])
    return Plan(cls, defines, launches, scratch, outputs, values)


# ---------------------------------------------------------------------------------------------------
# Calls: axes from shapes, the decision, the fall-back
# ---------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {"float16": "f16", "half": "f16", "float32": "f32", "float": "f32", "bfloat16": "bf16",
                "float64": "f64", "double": "f64", "int32": "i32", "int": "i32"}


def dtype_name(x):
    """`f16`, `f32`, … of a torch tensor or numpy array (None when unknown)."""
    s = str(getattr(x, "dtype", "")).replace("torch.", "")
    return _DTYPE_NAMES.get(s)


def bind_axes(arrays, given=None):
    """Every axis of the task, from the shapes of `arrays` (the task's inputs in order) and the
    keyword values `given`; raises ValueError on a rank or size mismatch, TypeError on a missing
    axis."""
    t = _task()
    if len(arrays) != len(t["inputs"]):
        raise TypeError(f"{t['name']}() takes {len(t['inputs'])} inputs, got {len(arrays)}")
    axes = {}
    for k, v in (given or {}).items():
        if k not in t["axes"]:
            raise TypeError(f"`{k}` is no axis of task `{t['name']}` (axes: {t['axes']})")
        axes[k] = int(v)
    later = []
    for spec, a in zip(t["inputs"], arrays):
        shape = tuple(int(d) for d in a.shape)
        want = [str(d).strip() for d in spec["shape"]]
        if len(shape) != len(want):
            raise ValueError(f"input `{spec['name']}`: expected {len(want)} dimensions [{', '.join(want)}], got shape {shape}")
        for i, (w, d) in enumerate(zip(want, shape)):
            if w.isdigit():
                if int(w) != d:
                    raise ValueError(f"input `{spec['name']}` dimension {i}: expected {w}, got {d}")
            elif w.isidentifier():
                if w in axes and axes[w] != d:
                    raise ValueError(f"input `{spec['name']}` dimension {i}: axis `{w}` is {axes[w]} elsewhere, {d} here")
                axes[w] = d
            else:
                later.append((spec["name"], i, w, d))
    for a in t["axes"]:
        if a not in axes:
            if a in AXIS_DEFAULTS:
                axes[a] = AXIS_DEFAULTS[a]
            else:
                raise TypeError(f"axis `{a}` appears in no input shape: pass it by keyword")
    for name, i, w, d in later:
        if eval_int(w, axes) != d:
            raise ValueError(f"input `{name}` dimension {i}: expected `{w}` = {eval_int(w, axes)}, got {d}")
    return {a: axes[a] for a in t["axes"]}


_PLANS = {}


def decide(arrays, axes, limits=None):
    """The plan that runs these inputs (the task's, in order, already bound to `axes`), or raises
    Unsupported: a dtype other than the kernel's, or a shape outside its constraints or the
    device's limits. Pure Python: no torch, no GPU."""
    t = _task()
    for spec, a in zip(t["inputs"], arrays):
        got = dtype_name(a)
        if got != spec["dtype"]:
            raise Unsupported(f"input `{spec['name']}` is {got or getattr(a, 'dtype', '?')}; the kernel takes {spec['dtype']}")
    limits = limits or DEFAULT_LIMITS
    key = (tuple(axes.items()), limits["shared"], limits["threads"], tuple(limits["grid"]))
    p = _PLANS.get(key)
    if p is None:
        try:
            p = plan(axes, limits)
        except Unsupported as e:
            p = e
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = p
    if isinstance(p, Unsupported):
        raise p
    return p


STATS = {"kernel": 0, "fallback": 0, "reasons": {}, "last": None}
_WARNED = []
_LOCK = threading.Lock()


def _note_fallback(reason, warn=True):
    STATS["fallback"] += 1
    STATS["reasons"][reason] = STATS["reasons"].get(reason, 0) + 1
    STATS["last"] = reason
    if warn and not _WARNED:
        _WARNED.append(reason)
        peer = _spec().get("peer_name") or "the peer"
        warnings.warn(
            f"ksearch export of {_task()['name']} (run {_spec().get('run')}): falling back to {peer}: {reason}. "
            "Warned once; every fall-back is counted in STATS.",
            RuntimeWarning,
            stacklevel=4,
        )


_HOOKS = {"launcher": None, "peer": None}


def configure(launcher=None, peer=None):
    """Replace how a plan runs (`launcher`: an object with `limits(arrays)`, `check(arrays)` →
    reason or None, and `launch(plan, arrays)` → outputs) and what a call falls back on
    (`peer(arrays, axes)` → outputs). None restores the default (CUDA through CuPy; the task's
    peer). The tests run the dispatch against CPU stand-ins this way."""
    _HOOKS["launcher"], _HOOKS["peer"] = launcher, peer
    _PLANS.clear()
    _FAST.clear()


def run(arrays, axes):
    """Run the task's inputs (in order, already bound to `axes`): the searched kernel where it
    takes them, else the peer (warned once). Returns the outputs as a list."""
    return _run(arrays, axes)[0]


def _run(arrays, axes):
    """run(), also returning the prepared launch of the kernel path (None when it fell back)."""
    launcher = _HOOKS["launcher"] or _cuda_launcher()
    try:
        reason = launcher.check(arrays)
        if reason:
            raise Unsupported(reason)
        p = decide(arrays, axes, launcher.limits(arrays))
        if hasattr(launcher, "prepare"):
            go = launcher.prepare(p, arrays)
            outs = go(arrays)
        else:
            go, outs = None, launcher.launch(p, arrays)
        STATS["kernel"] += 1
        return outs, go
    except Unsupported as e:
        _note_fallback(str(e))
        return _peer()(arrays, axes), None


# ---------------------------------------------------------------------------------------------------
# NVRTC (ctypes): the CUBIN of a build, compiled with the search's options; needs no GPU
# ---------------------------------------------------------------------------------------------------

# CompileError, nvrtc_library(), cuda_include_dir() and nvrtc_compile() are python/ksearch_nvrtc.py,
# whose text the export writes before this one (the tests load it the same way).


def arch_for(cc):
    """The architecture a build is compiled for on a device of compute capability `cc`, as the
    search chose it: the candidate's fixed `arch` option, else sm_XY, with the `a` suffix where
    the source uses arch-specific instructions (wgmma, setmaxnreg)."""
    a = _spec()["arch"]
    if a.get("fixed"):
        return a["fixed"]
    return f"sm_{cc[0]}{cc[1]}" + ("a" if a.get("specific") and cc[0] >= 9 else "")


def nvrtc_options(cls, arch):
    """The NVRTC options of build `cls` for `arch`: the search's own (architecture, C++17,
    KS_CUDA, the task's constants as KS_<NAME>, the tunables as -D), plus the CUDA headers."""
    opts = [o.replace("@ARCH@", arch) for o in _spec()["dispatch"][cls]["nvrtc_options"]]
    inc = cuda_include_dir()
    if inc:
        opts.insert(4, f"--include-path={inc}")
    return opts


_CUBINS = {}


def compile_variant(cls, cc):
    """The CUBIN of build `cls` for a device of compute capability `cc` (e.g. (9, 0)), compiled
    once per process; a failure is remembered too (raises CompileError again)."""
    arch = arch_for(cc)
    key = (cls, arch)
    with _LOCK:
        got = _CUBINS.get(key)
        if got is None:
            try:
                got = nvrtc_compile(_spec()["source"], nvrtc_options(cls, arch), f"{_task()['name']}_{cls}.cu")[0]
            except CompileError as e:
                got = e
            _CUBINS[key] = got
    if isinstance(got, CompileError):
        raise got
    return got


def compile_all(cc=(9, 0)):
    """Compile every build of the dispatch table for `cc`: {class: CUBIN size in bytes}."""
    return {cls: len(compile_variant(cls, cc)) for cls in _spec()["dispatch"]}


# ---------------------------------------------------------------------------------------------------
# Running on the GPU: torch tensors, CuPy for loading the CUBIN and launching on torch's stream
# ---------------------------------------------------------------------------------------------------

# CUfunction_attribute and cudaDeviceAttr values (the CUDA API's, stable across versions).
_ATTR_MAX_THREADS, _ATTR_STATIC_SHARED, _ATTR_MAX_DYNAMIC_SHARED = 0, 1, 8
_DEV_MAX_THREADS, _DEV_MAX_GRID, _DEV_SHARED_OPTIN = 1, (5, 6, 7), 97


class CudaLauncher:
    """Runs plans on torch CUDA tensors: outputs and scratch from PyTorch's allocator, the CUBIN
    loaded by CuPy, every launch through the driver (CuPy's `launchKernel`) on PyTorch's current
    stream, pointers by `data_ptr()` in a parameter block prepared once per shape."""

    def __init__(self):
        import torch

        try:
            import cupy
            from cupy_backends.cuda.api import driver
        except ImportError as e:
            raise Unsupported(f"CuPy cannot be imported ({e}); pip install cupy-cuda13x") from None
        self.torch, self.cupy, self.driver = torch, cupy, driver
        self.dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
                       "f64": torch.float64, "i32": torch.int32}
        self._limits, self._funcs, self._prepared = {}, {}, {}
        self._ready = threading.local()

    def check(self, arrays):
        t = self.torch
        dev = None
        for spec, a in zip(_task()["inputs"], arrays):
            if not isinstance(a, t.Tensor):
                return f"input `{spec['name']}` is no torch tensor"
            if a.device.type != "cuda":
                return f"input `{spec['name']}` is on {a.device}, not a CUDA device"
            if dev is None:
                dev = a.device
            elif a.device != dev:
                return f"inputs on two devices ({dev}, {a.device})"
            if not a.is_contiguous():
                return f"input `{spec['name']}` is not contiguous"
        return None

    def limits(self, arrays):
        idx = arrays[0].device.index
        lim = self._limits.get(idx)
        if lim is None:
            at = lambda a: self.cupy.cuda.runtime.deviceGetAttribute(a, idx)  # noqa: E731
            lim = self._limits[idx] = {
                "threads": at(_DEV_MAX_THREADS),
                "grid": tuple(at(a) for a in _DEV_MAX_GRID),
                "shared": at(_DEV_SHARED_OPTIN),
                "cc": tuple(self.torch.cuda.get_device_capability(idx)),
            }
        return lim

    def functions(self, p, idx, cc, optin):
        """The build's kernels on device `idx`, loaded once; checks the compiled kernels' own
        limits (threads per block, static + dynamic shared memory) and raises the dynamic
        shared-memory limit where a launch needs more than 48 KiB."""
        key = (p.cls, idx)
        fs = self._funcs.get(key)
        if fs is None:
            try:
                cubin = compile_variant(p.cls, cc)
            except CompileError as e:
                raise Unsupported(f"build {p.cls} does not compile for {arch_for(cc)}: {str(e).splitlines()[0][:300]}") from None
            d = self.driver
            with self.cupy.cuda.Device(idx):
                mod = self.cupy.cuda.function.Module()
                mod.load(cubin)
                fs = []
                for entry, _, _, _ in p.launches:
                    f = mod.get_function(entry)
                    fs.append((f, d.funcGetAttribute(_ATTR_MAX_THREADS, f.ptr), d.funcGetAttribute(_ATTR_STATIC_SHARED, f.ptr), [0]))
            self._funcs[key] = fs
        for (f, max_threads, static, allowed), (entry, grid, block, shared) in zip(fs, p.launches):
            threads = block[0] * block[1] * block[2]
            if threads > max_threads:
                raise Unsupported(f"launch `{entry}`: block of {threads} threads, the compiled kernel takes at most {max_threads}")
            if static + shared > optin:
                raise Unsupported(f"launch `{entry}`: {shared} + {static} static bytes of shared memory exceed {optin}")
            if shared > allowed[0] and shared > 48 * 1024 - static:
                with self.cupy.cuda.Device(idx):
                    self.driver.funcSetAttribute(f.ptr, _ATTR_MAX_DYNAMIC_SHARED, shared)
                allowed[0] = shared
        return fs

    def prepare(self, p, arrays):
        """A function arrays -> outputs that runs plan `p` on the device of `arrays`: made once per
        plan and device (raises Unsupported where the compiled kernels cannot take the plan)."""
        dev = arrays[0].device
        idx = dev.index if dev.index is not None else self.torch.cuda.current_device()
        key = (p.cls, p.axis_values, idx)
        go = self._prepared.get(key)
        if go is not None:
            return go
        lim = self.limits(arrays)
        fs = self.functions(p, idx, lim["cc"], lim["shared"])
        t, cupy, launch = self.torch, self.cupy, self.driver.launchKernel
        outs_spec = [(shape, self.dtypes[dt]) for _, shape, dt in p.outputs]
        scratch_spec = [max(n, 1) for _, n in p.scratch]
        n_ptr = len(arrays) + len(outs_spec) + len(scratch_spec)
        values = (ctypes.c_uint64 * (n_ptr + len(p.axis_values)))()
        for i, v in enumerate(p.axis_values):  # `long long` axes, two's complement
            values[n_ptr + i] = v & 0xFFFFFFFFFFFFFFFF
        base = ctypes.addressof(values)
        params = (ctypes.c_void_p * len(values))(*[base + 8 * i for i in range(len(values))])
        pblock = ctypes.addressof(params)
        launches = [(f.ptr, grid, block, shared) for (f, _, _, _), (_, grid, block, shared) in zip(fs, p.launches)]
        lock = threading.Lock()
        ready = self._ready

        def go(arrays):
            outs = [t.empty(shape, dtype=dt, device=dev) for shape, dt in outs_spec]
            scratch = [t.empty(n, dtype=t.uint8, device=dev) for n in scratch_spec]
            stream = t.cuda.current_stream(dev).cuda_stream
            seen = getattr(ready, "devices", None)
            if seen is None or idx not in seen:  # this thread has the device's context current
                with cupy.cuda.Device(idx):  # (what CuPy does before a launch: a runtime call)
                    cupy.cuda.runtime.free(0)
                ready.devices = (seen or set()) | {idx}
            switch = cupy.cuda.runtime.getDevice() != idx
            with lock:  # one parameter block per plan: filled and launched under the lock
                i = 0
                for a in arrays:
                    values[i] = a.data_ptr()
                    i += 1
                for a in outs:
                    values[i] = a.data_ptr()
                    i += 1
                for a in scratch:
                    values[i] = a.data_ptr()
                    i += 1
                if switch:
                    with cupy.cuda.Device(idx):
                        for fp, g, b, sh in launches:
                            launch(fp, g[0], g[1], g[2], b[0], b[1], b[2], sh, stream, pblock, 0)
                else:
                    for fp, g, b, sh in launches:
                        launch(fp, g[0], g[1], g[2], b[0], b[1], b[2], sh, stream, pblock, 0)
            return outs

        go.block = (values, params)  # `pblock` points into `params`: both live as long as `go`
        if len(self._prepared) > 4096:
            self._prepared.clear()
        self._prepared[key] = go
        return go

    def launch(self, p, arrays):
        return self.prepare(p, arrays)(arrays)


_LAUNCHER = []


class _Unavailable:
    """Stands in for the CUDA launcher where it cannot start (no CuPy): every call falls back."""

    def __init__(self, why):
        self.why = why

    def check(self, arrays):
        return self.why


def _cuda_launcher():
    if not _LAUNCHER:
        try:
            _LAUNCHER.append(CudaLauncher())
        except Unsupported as e:
            _LAUNCHER.append(_Unavailable(str(e)))
    return _LAUNCHER[0]


# ---------------------------------------------------------------------------------------------------
# Peers, in the task's layout
# ---------------------------------------------------------------------------------------------------

def _peer():
    if _HOOKS["peer"] is not None:
        return _HOOKS["peer"]
    return {"attention": _peer_attention, "mamba_scan": _peer_scan}.get(_spec().get("peer"), _no_peer)


def _last_reason():
    return STATS["last"] or "?"


def _no_peer(arrays, axes):
    raise RuntimeError(
        f"{_task()['name']}: the exported kernel does not take this call ({_last_reason()}) "
        "and this task has no peer to fall back on"
    )


def _peer_attention(arrays, axes):
    import torch

    q, k, v = arrays
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=bool(axes.get("causal", 0)), enable_gqa=k.shape[1] != q.shape[1]
    )
    return [o.contiguous()]


_MAMBA = []


def mamba_ssm_scan():
    """mamba_ssm's selective_scan_fn, or None when mamba_ssm cannot be imported."""
    if not _MAMBA:
        try:
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

            _MAMBA.append(selective_scan_fn)
        except Exception:  # noqa: BLE001 - any failure to import means no peer
            _MAMBA.append(None)
    return _MAMBA[0]


def _peer_scan(arrays, axes):
    fn = mamba_ssm_scan()
    if fn is None:
        raise RuntimeError(
            f"selective_scan: the exported kernel does not take this call ({_last_reason()}) and "
            "mamba_ssm, the fall-back, cannot be imported (pip install mamba-ssm)"
        )
    u, delta, A, Bm, Cm, Dv = arrays
    out, state = fn(u.transpose(1, 2), delta.transpose(1, 2), A, Bm.transpose(1, 2), Cm.transpose(1, 2), Dv,
                    return_last_state=True)
    return [out.transpose(1, 2).contiguous(), state.contiguous()]


# ---------------------------------------------------------------------------------------------------
# The task function, and a torch.library custom op for torch.compile
# ---------------------------------------------------------------------------------------------------

def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _compiling():
    import torch

    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(f and f())


_OP = []


def torch_op():
    """The custom op `ksearch_<candidate>::<task>(inputs, axes) -> outputs` that torch.compile
    traces a call as (an opaque call; its fake implementation gives the outputs' shapes from the
    axes). Registered when this module is imported after torch, else on the first call; call it
    yourself before compiling if neither happened."""
    if _OP:
        return _OP[0]
    import torch

    ns = "ksearch_" + re.sub(r"[^0-9A-Za-z_]", "_", str(_spec().get("candidate_key", "x")))[:24]
    name = _task()["name"]
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64, "i32": torch.int32}

    def impl(inputs: list[torch.Tensor], axes: list[int]) -> list[torch.Tensor]:
        given = {a: v for a, v in zip(_task()["axes"], axes) if a in _EXTRA_AXES}
        return _torch_call(tuple(inputs), given)

    try:
        op = torch.library.custom_op(f"{ns}::{name}", impl, mutates_args=())
    except RuntimeError:  # this module was loaded twice in one process: the same kernel, reuse it
        _OP.append(getattr(getattr(torch.ops, ns), name))
        return _OP[0]

    @op.register_fake
    def _(inputs, axes):
        env = dict(zip(_task()["axes"], axes))
        return [inputs[0].new_empty(shape_of(o, env), dtype=dtypes[o["dtype"]]) for o in _task()["outputs"]]

    _OP.append(op)
    return op


# Where each axis is read from (input, dimension) for a traced call; axes in no input shape
# (attention's `causal`) come by keyword. Filled in by _install().
_AXIS_SOURCES = []
_EXTRA_AXES = set()


def _traced_axes(arrays, given):
    return [given[a] if a in given else (arrays[src[0]].shape[src[1]] if src else AXIS_DEFAULTS.get(a, 0))
            for a, src in _AXIS_SOURCES]


def call(*arrays, **given):
    """The task's inputs (in order, in the task's layout) and keyword axes → the list of outputs.
    Torch tensors that are not contiguous are copied first."""
    if arrays and _HOOKS["launcher"] is None and _is_torch(arrays[0]):
        if _compiling():
            return list(torch_op()(list(arrays), _traced_axes(arrays, given)))
        return _torch_call(arrays, given)
    return run(arrays, bind_axes(arrays, given))


# (given axes, then shape, dtype and device of every input) -> the prepared kernel launch: a call
# seen before goes straight to it (the constraints, limits and plan were checked the first time).
_FAST = {}


def _torch_call(arrays, given):
    arrays = tuple(a.contiguous() for a in arrays)
    key = (tuple(given.items()),) + tuple((a.shape, a.dtype, a.device) for a in arrays)
    go = _FAST.get(key)
    if go is not None:
        STATS["kernel"] += 1
        return go(arrays)
    outs, go = _run(arrays, bind_axes(arrays, given))
    if go is not None:
        if len(_FAST) > 4096:
            _FAST.clear()
        _FAST[key] = go
    return outs


def task_function(*arrays, **axes):
    outs = call(*arrays, **axes)
    return outs[0] if len(outs) == 1 else tuple(outs)


# ---------------------------------------------------------------------------------------------------
# Drop-ins
# ---------------------------------------------------------------------------------------------------

def _needs_grad(*xs):
    for x in xs:
        if getattr(x, "requires_grad", False):
            import torch

            return torch.is_grad_enabled()
    return False


def sdpa_reason(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, enable_gqa=False):
    """Why a scaled_dot_product_attention call cannot go to the kernel (None: it can). Pure."""
    if attn_mask is not None:
        return "attn_mask is given (the kernel has only the causal mask)"
    if dropout_p:
        return "dropout_p > 0"
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        return "q, k, v are not [B, H, L, D]"
    if tuple(k.shape) != tuple(v.shape):
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head size"
    if q.shape[2] != k.shape[2]:
        return f"query length {q.shape[2]} differs from key length {k.shape[2]}"
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return "k and v have fewer heads than q but enable_gqa is False"
    if scale is not None and q.shape[3] > 0 and abs(float(scale) * math.sqrt(q.shape[3]) - 1.0) > 1e-6:
        return f"scale {scale} is not 1/sqrt({q.shape[3]})"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention through the searched kernel where it takes
    the call: q [B, H, L, D], k and v [B, Hkv, L, D] (H a multiple of Hkv; enable_gqa=True when
    they differ, as torch requires), float16, CUDA, no mask but the causal one, no dropout, the
    default scale, no autograd. Other calls go to torch's own (warned once). The output is
    contiguous [B, H, L, D]; non-contiguous inputs are copied first."""
    reason = sdpa_reason(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if reason is None and _needs_grad(query, key, value):
        reason = "inputs require grad (the kernel is forward-only)"
    if reason is not None:
        _note_fallback(reason, warn=not (_is_torch(query) and _compiling()))
        import torch

        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    return call(query, key, value, causal=int(bool(is_causal)))[0]


def _swap12(x):
    return x.transpose(1, 2) if _is_torch(x) else x.swapaxes(1, 2)


def scan_reason(u, delta, A, B, C, D=None, z=None):
    """Why a selective_scan call cannot be mapped onto the task (None: it can). Pure."""
    if len(u.shape) != 3 or tuple(delta.shape) != tuple(u.shape):
        return "u and delta are not both (batch, dim, L)"
    if len(A.shape) != 2 or A.shape[0] != u.shape[1]:
        return "A is not (dim, dstate)"
    if "complex" in str(getattr(A, "dtype", "")):
        return "A is complex"
    for name, m in (("B", B), ("C", C)):
        if len(m.shape) == 4 and m.shape[1] != 1:
            return f"{name} has {m.shape[1]} groups (the kernel shares one B and C over the channels)"
        if len(m.shape) not in (3, 4):
            return f"{name} is not (batch, dstate, L): the kernel takes an input-dependent {name} only"
    if D is not None and tuple(D.shape) != (u.shape[1],):
        return "D is not (dim,)"
    if z is not None and tuple(z.shape) != tuple(u.shape):
        return "z is not (batch, dim, L)"
    return None


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """mamba_ssm's selective_scan_fn through the searched kernel: u, delta (batch, dim, L); A
    (dim, dstate) float32; B, C (batch, dstate, L) or (batch, 1, dstate, L); D (dim,) float32;
    u, delta, B, C float16, CUDA. Returns out (batch, dim, L) (a transposed view of the kernel's
    channels-last output), and the last state (batch, dim, dstate) float32 with
    return_last_state=True. The kernel computes the scan of the task; delta_bias and
    delta_softplus are applied to delta in PyTorch before it (in float32, rounded back to delta's
    dtype) and the z gate out * silu(z) after it. Inputs that are not channels-last in memory are
    copied. Calls outside the kernel (dtype, device, groups, shapes, autograd) go to mamba_ssm
    when it can be imported, else raise."""
    reason = scan_reason(u, delta, A, B, C, D, z)
    if reason is None and _needs_grad(u, delta, A, B, C, D, z, delta_bias):
        reason = "inputs require grad (the kernel is forward-only)"
    if reason is not None:
        _note_fallback(reason, warn=not (_is_torch(u) and _compiling()))
        fn = mamba_ssm_scan()
        if fn is None:
            raise RuntimeError(
                f"selective_scan: the exported kernel does not take this call ({reason}) and mamba_ssm, "
                "the fall-back, cannot be imported (pip install mamba-ssm)")
        return fn(u, delta, A, B, C, D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                  return_last_state=return_last_state)
    torch_in = _is_torch(u)
    if delta_bias is not None or delta_softplus:
        d = delta.float() if torch_in else delta.astype("float32")
        if delta_bias is not None:
            d = d + delta_bias.reshape(-1, 1)
        if delta_softplus:
            if torch_in:
                import torch

                d = torch.nn.functional.softplus(d)
            else:
                import numpy as np

                d = np.logaddexp(0.0, d)
        delta = d.to(delta.dtype) if torch_in else d.astype(delta.dtype)
    B = B[:, 0] if len(B.shape) == 4 else B
    C = C[:, 0] if len(C.shape) == 4 else C
    if D is None:
        if torch_in:
            import torch

            D = torch.zeros(u.shape[1], dtype=torch.float32, device=u.device)
        else:
            import numpy as np

            D = np.zeros(u.shape[1], dtype=np.float32)
    y, state = call(_swap12(u), _swap12(delta), A, _swap12(B), _swap12(C), D)
    out = _swap12(y)
    if z is not None:
        if torch_in:
            import torch

            out = (out.float() * torch.nn.functional.silu(z.float())).to(y.dtype)
        else:
            zf = z.astype("float32")
            out = (out.astype("float32") * zf / (1.0 + _np_exp(-zf))).astype(y.dtype)
    return (out, state) if return_last_state else out


def _np_exp(x):
    import numpy as np

    return np.exp(x)


selective_scan_fn = selective_scan


def _install():
    """Name the task function after the task (e.g. `softmax(x)`), with the inputs as parameters."""
    t = _task()
    names = [i["name"] for i in t["inputs"]]

    def f(*arrays, **axes):
        return task_function(*arrays, **axes)

    f.__name__ = f.__qualname__ = t["name"]
    shown = ", ".join("%s[%s]" % (i["name"], ", ".join(map(str, i["shape"]))) for i in t["inputs"])
    f.__doc__ = (f"{t.get('description', t['name'])}\n\nInputs in order: {shown} ({', '.join(i['dtype'] for i in t['inputs'])}); "
                 f"outputs: {', '.join(o['name'] for o in t['outputs'])}. Axes come from the shapes; "
                 f"others ({', '.join(a for a in t['axes'] if not any(a in map(str, i['shape']) for i in t['inputs'])) or 'none'}) by keyword.")
    f.inputs = names
    g = globals()
    if t["name"] not in g:
        g[t["name"]] = f
    # Only the drop-in of this task's peer stays.
    peer = _spec().get("peer")
    if peer != "attention":
        for n in ("scaled_dot_product_attention", "sdpa_reason"):
            g.pop(n, None)
    if peer != "mamba_scan":
        for n in ("selective_scan", "selective_scan_fn", "scan_reason"):
            g.pop(n, None)
    _AXIS_SOURCES.clear()
    for a in t["axes"]:
        src = next(((i, j) for i, spec in enumerate(t["inputs"]) for j, d in enumerate(spec["shape"])
                    if str(d).strip() == a), None)
        _AXIS_SOURCES.append((a, src))
        if src is None:
            _EXTRA_AXES.add(a)
    if "torch" in sys.modules:  # so that torch.compile finds the op registered before it traces
        torch_op()


if SPEC is not None:
    _install()
