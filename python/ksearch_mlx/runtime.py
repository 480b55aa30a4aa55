"""Run a ksearch MLX candidate: kernel file sections, launch expressions, MLX custom kernels.

This module is self-contained on purpose (standard library and ``mlx.core`` only, nothing
from the package): ``ksearch export --mlx`` pastes its source verbatim into the module it
writes, so that the exported kernel runs without ksearch installed.

The format it implements is ``docs/mlx.md``:

* a kernel file is an optional header, then one body per launch under ``// @kernel NAME``
  lines (a file with none is the single launch's body, with no header);
* each launch is one ``mx.fast.cuda_kernel`` (``mlx-cuda``) or ``mx.fast.metal_kernel``
  (``mlx-metal``) call; ``grid`` counts threads, ``block`` is the threadgroup;
* every axis and every define is an ``int`` template parameter, the task's constants are
  prepended to the header as ``KS_<NAME>``;
* launches read task inputs and whatever an earlier launch wrote, and write task outputs or
  1-D scratch buffers; every task output is written by exactly one launch;
* on ``mlx-cuda`` a kernel whose ``options`` say ``form = "cuda"`` is a whole CUDA translation
  unit instead: compiled here with NVRTC for the device's architecture (``ksearch_nvrtc``'s text
  comes before this one in an exported module), run with ``mx.fast.precompiled_cuda_kernel``;
  its entries take the launch's inputs and outputs, then every axis as an ``int``
  (``-DKS_AXIS=int``), and the tunables and constants arrive as ``-D``.
"""

# No `from __future__` import: it must open a file, and this text is pasted into another.
import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

try:  # an exported module: ksearch_nvrtc.py's text comes before this one
    nvrtc_build  # noqa: B018
except NameError:  # the worker: python/ is on the path
    from ksearch_nvrtc import CompileError, cuda_include_dir, nvrtc_build, nvrtc_version  # noqa: F401

# ---------------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------------
# A small recursive-descent parser rather than Python's `ast`: the task language differs from
# Python where it matters (`!x == 0` is `(!x) == 0`, `a < b < c` does not chain, `==` binds
# looser than `<`, `/` and `%` truncate toward zero), and this mirrors crates/core/src/expr.rs
# exactly, so the worker and the Rust side always agree on a launch size.

_BINARY_PRECEDENCE = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "%": 6,
}
_FUNCTIONS = {"ceil_div": 2, "min": 2, "max": 2, "sqrt": 1, "log2": 1}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op><=|>=|==|!=|&&|\|\||[-+*/%<>!(),]))"
)


def _tokenize(src: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(src):
        if src[pos:].strip() == "":
            break
        m = _TOKEN.match(src, pos)
        if m is None or m.end() == pos:
            bad = src[pos:].lstrip()[:1]
            raise ValueError(f"expression `{src}`: unexpected character `{bad}`")
        kind = m.lastgroup or "op"
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


class _Parser:
    """Parses into nested tuples: ("num", v) ("var", n) ("neg", e) ("not", e) ("bin", op, a, b)
    ("call", f, [args])."""

    def __init__(self, src: str):
        self.src = src
        self.tokens = _tokenize(src)
        self.pos = 0

    def fail(self, reason: str) -> ValueError:
        return ValueError(f"expression `{self.src}`: {reason}")

    def peek(self) -> Optional[tuple[str, str]]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def next(self) -> Optional[tuple[str, str]]:
        t = self.peek()
        self.pos += 1
        return t

    def parse(self) -> tuple:
        if not self.tokens:
            raise self.fail("empty expression")
        e = self.expr(1)
        if self.pos < len(self.tokens):
            raise self.fail(f"trailing input at token {self.pos + 1}")
        return e

    def expr(self, min_prec: int) -> tuple:
        lhs = self.unary()
        while True:
            t = self.peek()
            if t is None or t[0] != "op" or _BINARY_PRECEDENCE.get(t[1], 0) < min_prec:
                break
            op = t[1]
            self.next()
            rhs = self.expr(_BINARY_PRECEDENCE[op] + 1)
            lhs = ("bin", op, lhs, rhs)
        return lhs

    def unary(self) -> tuple:
        t = self.next()
        if t is None:
            raise self.fail("unexpected end")
        kind, text = t
        if kind == "op" and text == "-":
            return ("neg", self.unary())
        if kind == "op" and text == "!":
            return ("not", self.unary())
        if kind == "num":
            return ("num", float(text))
        if kind == "op" and text == "(":
            e = self.expr(1)
            if self.next() != ("op", ")"):
                raise self.fail("missing `)`")
            return e
        if kind == "name":
            if self.peek() != ("op", "("):
                return ("var", text)
            self.next()
            args: list[tuple] = []
            if self.peek() == ("op", ")"):
                self.next()
            else:
                while True:
                    args.append(self.expr(1))
                    sep = self.next()
                    if sep == ("op", ","):
                        continue
                    if sep == ("op", ")"):
                        break
                    raise self.fail(f"bad argument list for `{text}`")
            if text not in _FUNCTIONS:
                raise self.fail(f"unknown function `{text}`")
            if len(args) != _FUNCTIONS[text]:
                raise self.fail(f"`{text}` takes {_FUNCTIONS[text]} arguments")
            return ("call", text, tuple(args))
        raise self.fail(f"unexpected token `{text}`")


def _trunc_div(a: float, b: float) -> float:
    # Rust's `a as i64 / b as i64`: both truncated, quotient rounded toward zero.
    x, y = int(a), int(b)
    q = abs(x) // abs(y)
    return float(q if (x < 0) == (y < 0) else -q)


def _trunc_rem(a: float, b: float) -> float:
    x, y = int(a), int(b)
    return float(x - int(_trunc_div(x, y)) * y)


def _evaluate(node: tuple, env: dict[str, int], integer: bool, src: str) -> float:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        if node[1] not in env:
            raise ValueError(f"expression `{src}`: unknown name `{node[1]}`")
        return float(env[node[1]])
    if kind == "neg":
        return -_evaluate(node[1], env, integer, src)
    if kind == "not":
        return 1.0 if _evaluate(node[1], env, integer, src) == 0.0 else 0.0
    if kind == "call":
        name, args = node[1], node[2]
        a = _evaluate(args[0], env, integer, src)
        if name == "sqrt":
            return math.sqrt(a)
        if name == "log2":
            return math.log2(a)
        c = _evaluate(args[1], env, integer, src)
        if name == "min":
            return min(a, c)
        if name == "max":
            return max(a, c)
        if c == 0.0:
            raise ValueError(f"expression `{src}`: division by zero")
        return float((int(a) + int(c) - 1) // int(c))  # ceil_div, Rust's div_euclid
    op, x, y = node[1], node[2], node[3]
    a = _evaluate(x, env, integer, src)
    c = _evaluate(y, env, integer, src)
    if op in ("/", "%"):
        if c == 0.0:
            raise ValueError(f"expression `{src}`: division by zero")
        if op == "%":
            return _trunc_rem(a, c)
        return _trunc_div(a, c) if integer else a / c
    table: dict[str, Callable[[float, float], Any]] = {
        "+": lambda p, q: p + q,
        "-": lambda p, q: p - q,
        "*": lambda p, q: p * q,
        "<": lambda p, q: p < q,
        "<=": lambda p, q: p <= q,
        ">": lambda p, q: p > q,
        ">=": lambda p, q: p >= q,
        "==": lambda p, q: p == q,
        "!=": lambda p, q: p != q,
        "&&": lambda p, q: p != 0.0 and q != 0.0,
        "||": lambda p, q: p != 0.0 or q != 0.0,
    }
    return float(table[op](a, c))


@functools.lru_cache(maxsize=4096)
def parse_expr(expr: str) -> tuple:
    """Parse `expr` (raises ValueError naming the expression and the problem). Cached: the
    same few expressions are evaluated on every call of a kernel."""
    return _Parser(str(expr)).parse()


def eval_expr(expr: str, env: dict[str, int]) -> int:
    """Evaluate a task expression with integer semantics (`/` and `%` truncate toward zero).

    Integers, ``+ - * / %``, comparisons, ``&& || !``, parentheses, ``ceil_div(a, b)``,
    ``min``, ``max`` and names from ``env``. Unknown names, bad syntax and division by zero
    raise ``ValueError``.
    """
    v = _evaluate(parse_expr(expr), env, True, str(expr))
    if not math.isfinite(v):
        raise ValueError(f"expression `{expr}`: not a finite value")
    return int(v)


def eval_expr_float(expr: str, env: dict[str, int]) -> float:
    """Evaluate a task expression in floating point (`/` is real division), as for ``flops``."""
    return _evaluate(parse_expr(expr), env, False, str(expr))


# ---------------------------------------------------------------------------------------------
# Kernel files
# ---------------------------------------------------------------------------------------------

def _section_name(line: str) -> Optional[str]:
    """The entry of a `// @kernel NAME` line, else None (same rule as crates/core/src/mlx.rs:
    any other line, a malformed marker included, is ordinary text)."""
    t = line.strip()
    if not t.startswith("//"):
        return None
    t = t[2:].lstrip()
    if not t.startswith("@kernel"):
        return None
    name = t[len("@kernel") :].strip()
    return name if name and re.fullmatch(r"[A-Za-z0-9_]+", name) else None


class SourceError(ValueError):
    """The kernel file does not fit its launches (missing or duplicate sections)."""


class LaunchError(ValueError):
    """A launch cannot be planned: bad sizes, bad wiring, limits exceeded."""


def split_sections(source: str) -> tuple[str, dict[Optional[str], str]]:
    """Split a kernel file into ``(header, {entry: body})``.

    Text before the first ``// @kernel NAME`` line is the header; each section runs to the
    next such line. A file without one is a single body under the key ``None``, with no
    header. Two sections of one name raise ``SourceError``.
    """
    header: list[str] = []
    sections: dict[Optional[str], str] = {}
    current: Optional[str] = None
    body: list[str] = []
    for line in source.splitlines(keepends=True):
        name = _section_name(line)
        if name is None:
            (body if current is not None else header).append(line)
            continue
        if current is not None:
            sections[current] = "".join(body)
        if name in sections or name == current:
            raise SourceError(f"two `// @kernel {name}` sections")
        current, body = name, []
    if current is None:
        return "", {None: source}
    sections[current] = "".join(body)
    return "".join(header), sections


# ---------------------------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------------------------

DTYPE_SIZES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "f64": 8}


def mx_dtype(name: str) -> Any:
    """The MLX dtype of a task dtype name."""
    table = {
        "f32": mx.float32,
        "f16": mx.float16,
        "bf16": mx.bfloat16,
        "i32": mx.int32,
        "f64": mx.float64,
    }
    if name not in table:
        raise ValueError(f"unknown dtype `{name}` (known: {', '.join(table)})")
    return table[name]


def tensor_dtype(task: dict, backend: str, spec: dict) -> str:
    """A tensor's dtype on `backend`: the back-end's override, else the declared one."""
    overrides = (task.get("backends", {}).get(backend) or {}).get("dtypes") or {}
    return overrides.get(spec["name"], spec.get("dtype", "f32"))


def tensor_shape(spec: dict, axes: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for d in spec.get("shape", []):
        n = eval_expr(str(d), axes)
        if n < 0:
            raise ValueError(f"shape of `{spec['name']}`: negative size {n}")
        shape.append(n)
    return tuple(shape)


def constants_header(constants: dict[str, float], backend: str) -> str:
    """The task's constants as `KS_<NAME>` declarations for the kernel header."""
    qualifier = "constexpr" if backend == "mlx-cuda" else "constant"
    lines = []
    for name in sorted(constants):
        v = float(constants[name])
        if not math.isfinite(v):
            raise ValueError(f"constant `{name}` is not finite")
        lines.append(f"{qualifier} float KS_{name.upper()} = {v!r}f;\n")
    return "".join(lines)


# ---------------------------------------------------------------------------------------------
# Whole CUDA translation units (mlx-cuda, form = "cuda"): NVRTC, names, the entry's parameters
# (pure: no MLX calls, so it can be tested without a GPU)
# ---------------------------------------------------------------------------------------------

FORMS = ("body", "cuda")


def kernel_form(candidate: dict, backend: str) -> str:
    """The candidate's form: ``body`` (MLX writes the signature) or ``cuda`` (a whole CUDA
    translation unit, mlx-cuda only), from its ``options``."""
    form = (candidate.get("options") or {}).get("form", "body")
    if form not in FORMS:
        raise SourceError(f"kernel form `{form}` is unknown (known: {', '.join(FORMS)})")
    if form == "cuda" and backend != "mlx-cuda":
        raise SourceError(f"kernel form `cuda` runs on mlx-cuda only, not on {backend}")
    return form


def source_name(candidate: dict) -> str:
    """The kernel file's name as the task gives it (compile errors name it), else kernel.cu."""
    name = (candidate.get("options") or {}).get("file")
    return str(name) if name else "kernel.cu"


def arch_for(cc: tuple[int, int], source: str, options: dict) -> str:
    """The architecture to compile for on a device of compute capability ``cc``: the candidate's
    fixed ``arch`` option, else sm_XY with the ``a`` suffix (sm_90a) where the source needs it
    (wgmma, setmaxnreg, or the ``arch_specific`` option): the CUDA back-end's rule
    (crates/eval/src/cuda.rs, candidate_arch)."""
    if options.get("arch"):
        return str(options["arch"])
    specific = bool(options.get("arch_specific")) or "wgmma" in source or "setmaxnreg" in source
    return f"sm_{cc[0]}{cc[1]}" + ("a" if specific and cc[0] >= 9 else "")


@dataclass(frozen=True)
class CudaUnit:
    """One build of a translation unit: its CUBIN and, per entry, the name it has in it."""

    cubin: bytes
    names: dict  # entry -> symbol (also MLX's module name: unique per build)
    arch: str
    log: str


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)


def ptx_params(ptx: str) -> dict[str, list[int]]:
    """Byte sizes of every ``.entry``'s parameters in a PTX text."""
    out = {}
    for m in _ENTRY.finditer(ptx):
        sizes = []
        for decl in m.group(2).split(","):
            d = decl.strip()
            if not d:
                continue
            p = re.search(r"\.[a-z](\d+)\b", d.split(".param", 1)[-1].replace(".ptr", "").replace(".global", ""))
            bits = int(p.group(1)) if p else 0
            arr = re.search(r"\[(\d+)\]", d)
            sizes.append(bits // 8 * (int(arr.group(1)) if arr else 1))
        out[m.group(1)] = sizes
    return out


def cuda_unit_options(candidate: dict, task: dict, arch: str) -> list[str]:
    """NVRTC options of a translation unit: the CUDA back-end's (architecture, C++17,
    KS_CUDA, constants as KS_<NAME>, tunables as -D) plus KS_MLX and KS_AXIS=int."""
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-DKS_CUDA=1", "-DKS_MLX=1", "-DKS_AXIS=int"]
    for name in sorted(task.get("constants") or {}):
        v = float(task["constants"][name])
        if not math.isfinite(v):
            raise ValueError(f"constant `{name}` is not finite")
        opts.append(f"-DKS_{name.upper()}={v!r}")
    for name in sorted(candidate.get("defines") or {}):
        opts.append(f"-D{name}={int(candidate['defines'][name])}")
    for flag in (candidate.get("options") or {}).get("nvrtc_flags") or []:
        opts.append(str(flag))
    inc = cuda_include_dir()
    if inc:
        opts.append(f"--include-path={inc}")
    return opts


_UNITS: dict[tuple, Any] = {}


def build_cuda_unit(candidate: dict, task: dict, static: "list[StaticLaunch]", arch: str) -> CudaUnit:
    """Compile the candidate's translation unit for ``arch`` (once per process; a failure is
    remembered too) and check its entries. Each entry is renamed at compile time to
    ``ks_<entry>_<hash of source and options>`` (``-D<entry>=...``): MLX looks a kernel up by
    the name it is given and keeps modules by name for the process's life, so every build needs
    a name of its own. Raises SourceError naming the file: NVRTC's log (``file(line): error``),
    an entry the CUBIN lacks, or parameters that do not follow the ABI."""
    source = candidate.get("source", "")
    opts = cuda_unit_options(candidate, task, arch)
    entries = list(dict.fromkeys(s.entry for s in static))
    key = (source, tuple(opts), tuple(entries))
    got = _UNITS.get(key)
    if got is None:
        try:
            got = _build_cuda_unit(candidate, task, static, source, opts, entries, arch)
        except SourceError as e:
            got = e
        _UNITS[key] = got
    if isinstance(got, SourceError):
        raise got
    return got


def _build_cuda_unit(candidate, task, static, source, opts, entries, arch) -> CudaUnit:
    fname = source_name(candidate)
    try:
        version = ".".join(str(v) for v in nvrtc_version())
    except CompileError as e:
        raise SourceError(f"{fname}: {e}") from None
    digest = hashlib.sha1("\0".join([source, *opts, version]).encode()).hexdigest()[:12]
    names = {e: f"ks_{e}_{digest}" for e in entries}
    renames = [f"-D{e}={n}" for e, n in names.items()]
    try:
        cubin, ptx, log = nvrtc_build(source, opts + renames, fname)
    except CompileError as e:
        raise SourceError(str(e).strip()) from None
    params = ptx_params(ptx)
    axes = list(task.get("axes", []))
    for s in static:
        name = names[s.entry]
        if name not in params:
            raise SourceError(
                f"{fname}: no entry `{s.entry}` in the compiled unit (declare it "
                f'`extern "C" __global__ void {s.entry}(...)`)'
            )
        sizes = params[name]
        want = len(s.inputs) + len(s.outputs) + len(axes)
        if len(sizes) != want:
            raise SourceError(
                f"{fname}: entry `{s.entry}` takes {len(sizes)} parameters; on mlx-cuda it takes its "
                f"{len(s.inputs)} inputs and {len(s.outputs)} outputs as pointers, then the axes "
                f"{', '.join(axes)} as KS_AXIS: {want}"
            )
        for a, size in zip(axes, sizes[len(s.inputs) + len(s.outputs):]):
            if size != 4:
                raise SourceError(
                    f"{fname}: entry `{s.entry}` takes axis `{a}` as a {size * 8}-bit value; MLX passes "
                    "integer scalars as 32-bit int: declare the axes KS_AXIS (-DKS_AXIS=int here, "
                    "long long by default; docs/task-format.md)"
                )
    return CudaUnit(cubin=cubin, names=names, arch=arch, log=log)


_CC: list = []


def device_cc() -> tuple[int, int]:
    """Compute capability of the device MLX runs on: $KSEARCH_CUDA_ARCH (e.g. sm_90), MLX's
    device info, else the CUDA driver's answer for device 0 of the visible ones."""
    if _CC:
        return _CC[0]
    found = None
    env = os.environ.get("KSEARCH_CUDA_ARCH", "")
    m = re.search(r"(\d)(\d+)", env)
    if m:
        found = (int(m.group(1)), int(m.group(2)))
    if found is None:
        try:
            info = mx.device_info()
        except Exception:
            info = {}
        major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
        if isinstance(major, int) and isinstance(minor, int):
            found = (major, minor)
        else:
            m = re.fullmatch(r"\s*(?:sm_?|compute_)?(\d)\.?(\d+)[a-z]?\s*", str(info.get("architecture", "")))
            if m:
                found = (int(m.group(1)), int(m.group(2)))
    if found is None:
        import ctypes

        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0:
                cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
                cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
                if major.value > 0:
                    found = (major.value, minor.value)
        except OSError:
            pass
    if found is None:
        raise LaunchError("cannot tell the GPU's compute capability (set KSEARCH_CUDA_ARCH, e.g. sm_90)")
    _CC.append(found)
    return found


# ---------------------------------------------------------------------------------------------
# Launch planning (pure: no MLX calls, so it can be tested without a GPU)
# ---------------------------------------------------------------------------------------------

BACKENDS = ("mlx-cuda", "mlx-metal")
MAX_THREADS_PER_GROUP = 1024


@dataclass(frozen=True)
class StaticLaunch:
    """What a launch is, independent of the workload."""

    entry: str
    name: str  # MLX kernel name, unique per source + wiring (MLX caches modules by name)
    header: str
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    writes_task_output: bool
    grid: tuple[str, str, str]
    block: tuple[str, str, str]
    shared: str
    form: str = "body"  # "cuda": a whole translation unit (the name is then the build's, see CudaUnit)


@dataclass(frozen=True)
class LaunchPlan:
    """One launch resolved for a workload: everything an MLX kernel call needs."""

    entry: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    shared: int
    template: tuple[tuple[str, int], ...]
    writes_task_output: bool


def kernel_name(entry: str, text: str) -> str:
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    return f"ks_{entry}_{digest}"


def static_launches(candidate: dict, task: dict, backend: str) -> list[StaticLaunch]:
    """Sections, header, wiring and dtypes of every launch (raises SourceError/LaunchError)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MLX back-end `{backend}` (known: {', '.join(BACKENDS)})")
    launches = candidate.get("launches") or []
    if not launches:
        raise LaunchError("the candidate has no launches")
    form = kernel_form(candidate, backend)
    file_header, sections = split_sections(candidate.get("source", ""))
    if form == "cuda":
        if None not in sections:
            raise SourceError(
                f"{source_name(candidate)}: a whole CUDA translation unit (form = \"cuda\") has no `// @kernel` sections"
            )
        header = ""
    else:
        header = constants_header(task.get("constants") or {}, backend) + file_header

    task_inputs = [t["name"] for t in task.get("inputs", [])]
    task_outputs = [t["name"] for t in task.get("outputs", [])]
    dtypes = {t["name"]: tensor_dtype(task, backend, t) for t in task.get("inputs", []) + task.get("outputs", [])}
    scratch = {}
    for s in candidate.get("scratch") or []:
        if s["name"] in dtypes or s["name"] in scratch:
            raise LaunchError(f"scratch `{s['name']}` clashes with another buffer")
        scratch[s["name"]] = s.get("dtype") or "f32"
        mx_dtype(scratch[s["name"]])
    dtypes.update(scratch)

    available = set(task_inputs)
    written: set[str] = set()
    result = []
    for spec in launches:
        entry = spec["entry"]
        if form == "cuda":
            body = sections[None]
        elif None in sections:
            if len(launches) != 1:
                raise SourceError(
                    f"the kernel has {len(launches)} launches but no `// @kernel NAME` sections"
                )
            body = sections[None]
        elif entry in sections:
            body = sections[entry]
        else:
            known = ", ".join(str(k) for k in sections)
            raise SourceError(f"no `// @kernel {entry}` section in the kernel file (sections: {known})")
        reads = list(spec.get("inputs") or task_inputs)
        writes = list(spec.get("outputs") or task_outputs)
        for r in reads:
            if r not in available:
                raise LaunchError(
                    f"launch `{entry}` reads `{r}`, which is no task input and no earlier launch wrote"
                )
        if len(set(reads)) != len(reads) or len(set(writes)) != len(writes):
            raise LaunchError(f"launch `{entry}` names a buffer twice")
        if not writes:
            raise LaunchError(f"launch `{entry}` writes nothing")
        for w in writes:
            if w not in task_outputs and w not in scratch:
                raise LaunchError(f"launch `{entry}` writes `{w}`, which is no task output and no scratch buffer")
            if w in written:
                raise LaunchError(f"`{w}` is written by two launches")
            written.add(w)
        available.update(writes)
        in_dt = tuple(dtypes[r] for r in reads)
        out_dt = tuple(dtypes[w] for w in writes)
        # The generated signature depends on the wiring and dtypes, so they go into the name.
        ident = "\0".join([backend, header, body, ",".join(reads), ",".join(in_dt), ",".join(writes), ",".join(out_dt)])
        grid = tuple(str(g) for g in spec.get("grid", ["1", "1", "1"]))
        block = tuple(str(b) for b in spec.get("block", ["1", "1", "1"]))
        if len(grid) != 3 or len(block) != 3:
            raise LaunchError(f"launch `{entry}`: grid and block need three expressions each")
        result.append(
            StaticLaunch(
                entry=entry,
                name=kernel_name(entry, ident),
                header=header,
                body=body,
                inputs=tuple(reads),
                outputs=tuple(writes),
                input_dtypes=in_dt,
                output_dtypes=out_dt,
                writes_task_output=any(w in task_outputs for w in writes),
                grid=grid,  # type: ignore[arg-type]
                block=block,  # type: ignore[arg-type]
                shared=str(spec.get("shared", "0")),
                form=form,
            )
        )
    missing = [o for o in task_outputs if o not in written]
    if missing:
        raise LaunchError(f"no launch writes output `{missing[0]}`")
    return result


def template_env(task: dict, candidate: dict, axes: dict[str, int]) -> list[tuple[str, int]]:
    """Template parameters: every axis (task order) then every define (sorted), as ints."""
    params: list[tuple[str, int]] = []
    for a in task.get("axes", []):
        if a not in axes:
            raise LaunchError(f"the workload gives no value for axis `{a}`")
        params.append((a, int(axes[a])))
    for k in sorted(candidate.get("defines") or {}):
        if k in axes:
            raise LaunchError(f"define `{k}` clashes with an axis")
        params.append((k, int(candidate["defines"][k])))
    for name, v in params:
        if not -(2**31) <= v < 2**31:
            raise LaunchError(f"template parameter `{name}` = {v} does not fit an int")
    return params


def plan_launches(
    candidate: dict,
    task: dict,
    backend: str,
    axes: dict[str, int],
    static: Optional[list[StaticLaunch]] = None,
) -> list[LaunchPlan]:
    """Every launch resolved for one workload: sizes evaluated, shapes and dtypes of outputs."""
    static = static if static is not None else static_launches(candidate, task, backend)
    params = template_env(task, candidate, axes)
    env = dict(params)
    shapes = {t["name"]: tensor_shape(t, axes) for t in task.get("outputs", [])}
    for s in candidate.get("scratch") or []:
        size = DTYPE_SIZES[s.get("dtype") or "f32"]
        nbytes = eval_expr(s["bytes"], env)
        if nbytes <= 0:
            raise LaunchError(f"scratch `{s['name']}`: {nbytes} bytes (expression `{s['bytes']}`)")
        if nbytes % size:
            raise LaunchError(f"scratch `{s['name']}`: {nbytes} bytes is not a whole number of {s.get('dtype') or 'f32'}")
        shapes[s["name"]] = (nbytes // size,)
    plans = []
    for s in static:

        def sizes(exprs: tuple[str, ...], what: str) -> tuple[int, int, int]:
            try:
                vals = tuple(eval_expr(e, env) for e in exprs)
            except ValueError as e:
                raise LaunchError(f"launch `{s.entry}` {what}: {e}") from None
            if any(v < 1 for v in vals):
                raise LaunchError(f"launch `{s.entry}`: {what} {vals} has a size below 1")
            return vals  # type: ignore[return-value]

        grid = sizes(s.grid, "grid")
        block = sizes(s.block, "block")
        threads = block[0] * block[1] * block[2]
        if threads > MAX_THREADS_PER_GROUP:
            raise LaunchError(f"launch `{s.entry}`: threadgroup {block} has {threads} threads (at most {MAX_THREADS_PER_GROUP})")
        try:
            shared = eval_expr(s.shared, env)
        except ValueError as e:
            raise LaunchError(f"launch `{s.entry}` shared: {e}") from None
        if shared < 0:
            raise LaunchError(f"launch `{s.entry}`: negative shared memory {shared}")
        plans.append(
            LaunchPlan(
                entry=s.entry,
                name=s.name,
                inputs=s.inputs,
                outputs=s.outputs,
                output_shapes=tuple(shapes[o] for o in s.outputs),
                output_dtypes=s.output_dtypes,
                grid=grid,
                threadgroup=block,
                # Metal kernels declare threadgroup memory in the body; only CUDA takes bytes.
                shared=shared if backend == "mlx-cuda" else 0,
                template=tuple(params),
                writes_task_output=s.writes_task_output,
            )
        )
    return plans


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


class CompiledCandidate:
    """A candidate's MLX kernels, ready to run on any workload of its task.

    ``CompiledCandidate(candidate, task, backend)(inputs, axes)`` returns the task outputs.
    Kernels are JIT-compiled by MLX on their first evaluation for each set of template
    values (axes and defines).
    """

    def __init__(self, candidate: dict, task: dict, backend: str):
        self.candidate = candidate
        self.task = task
        self.backend = backend
        self.static = static_launches(candidate, task, backend)
        self.input_specs = {t["name"]: t for t in task.get("inputs", [])}
        self.output_names = [t["name"] for t in task.get("outputs", [])]
        self._plans: dict[tuple, list[LaunchPlan]] = {}
        self._input_specs: dict[tuple, dict[str, tuple]] = {}
        self._kernels: dict[tuple[str, int], Any] = {}
        self.form = self.static[0].form
        self._unit: Optional[CudaUnit] = None
        self._n_axes = len(task.get("axes", []))
        if self.form == "cuda":
            if not hasattr(mx.fast, "precompiled_cuda_kernel"):
                raise LaunchError(f"mlx {mx.__version__} has no mx.fast.precompiled_cuda_kernel (form = \"cuda\" needs it)")
            return
        # Creating the kernel objects compiles nothing, but fails at once where MLX has no
        # back-end for them ("[cuda_kernel] No CUDA back-end.").
        for s in self.static:
            self._kernel(s, 0)

    def unit(self) -> CudaUnit:
        """The compiled translation unit (form = "cuda"), built on first use for this device."""
        if self._unit is None:
            cc = device_cc()
            arch = arch_for(cc, self.candidate.get("source", ""), self.candidate.get("options") or {})
            self._unit = build_cuda_unit(self.candidate, self.task, self.static, arch)
        return self._unit

    def _precompiled(self, s: StaticLaunch, p: "LaunchPlan", **kwargs: Any) -> Any:
        unit = self.unit()
        kwargs.pop("template", None)
        return mx.fast.precompiled_cuda_kernel(
            name=unit.names[s.entry],
            compiled_source=unit.cubin,
            # The axes in task order: the first values of the plan's template (template_env).
            scalars=[v for _, v in p.template[: self._n_axes]],
            shared_memory=p.shared,
            ensure_row_contiguous=True,
            **kwargs,
        )

    def _kernel(self, s: StaticLaunch, shared: int) -> Any:
        # A CUDA kernel takes its dynamic shared memory when it is made, not per call, so
        # there is one kernel object per size. The size is a function of the template values,
        # which MLX puts in the module's name, so one name never meets two sizes.
        key = (s.name, shared)
        if key not in self._kernels:
            common = dict(
                name=s.name,
                input_names=list(s.inputs),
                output_names=list(s.outputs),
                source=s.body,
                header=s.header,
            )
            if self.backend == "mlx-cuda":
                self._kernels[key] = mx.fast.cuda_kernel(**common, shared_memory=shared)
            else:
                self._kernels[key] = mx.fast.metal_kernel(**common)
        return self._kernels[key]

    def plan(self, axes: dict[str, int], key: Optional[tuple] = None) -> list[LaunchPlan]:
        key = key if key is not None else tuple(sorted((k, int(v)) for k, v in axes.items()))
        if key not in self._plans:
            self._plans[key] = plan_launches(self.candidate, self.task, self.backend, dict(axes), self.static)
        return self._plans[key]

    def _check_inputs(self, inputs: dict[str, Any], axes: dict[str, int], key: tuple) -> dict[str, Any]:
        # Shapes and dtypes per workload, worked out once: this runs inside timed calls.
        if key not in self._input_specs:
            self._input_specs[key] = {
                name: (tensor_shape(spec, axes), mx_dtype(tensor_dtype(self.task, self.backend, spec)))
                for name, spec in self.input_specs.items()
            }
        ready = {}
        for name, (want_shape, want) in self._input_specs[key].items():
            if name not in inputs:
                raise ValueError(f"missing input `{name}`")
            a = inputs[name]
            if tuple(a.shape) != want_shape:
                raise ValueError(f"input `{name}` has shape {tuple(a.shape)}, the task wants {want_shape}")
            ready[name] = a if a.dtype == want else a.astype(want)
        return ready

    def __call__(
        self,
        inputs: dict[str, Any],
        axes: dict[str, int],
        init_value: Optional[float] = None,
    ) -> dict[str, Any]:
        """Run every launch in order; returns ``{output name: array}`` (lazy MLX arrays).

        ``init_value`` fills the outputs of every launch that writes a task output before it
        runs (MLX's ``init_value``); without it outputs start uninitialised.
        """
        return self.run(inputs, axes, init_value)[0]

    def run(
        self,
        inputs: dict[str, Any],
        axes: dict[str, int],
        init_value: Optional[float] = None,
        guard_bytes: int = 0,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """As a call, and with ``guard_bytes`` > 0 every task output is allocated that many
        bytes longer, as a flat buffer, and returned as a view of its first elements in its
        shape; the second value holds the tails (``{output name: flat array}``). MLX hands an
        output to the kernel as a bare pointer (no shape), so the body cannot tell. With
        ``init_value`` the tails hold it too: a write past the end changes them."""
        key = tuple(sorted((k, int(v)) for k, v in axes.items()))  # once: this runs inside timed calls
        plans = self.plan(axes, key)
        buffers = self._check_inputs(inputs, axes, key)
        tails: dict[str, Any] = {}
        for s, p in zip(self.static, plans):
            shapes, cuts = [], []
            for name, shape, dt in zip(p.outputs, p.output_shapes, p.output_dtypes):
                extra = guard_bytes // DTYPE_SIZES[dt] if guard_bytes > 0 and name in self.output_names else 0
                n = math.prod(shape)
                shapes.append([n + extra] if extra else list(shape))
                cuts.append(n if extra else None)
            kwargs: dict[str, Any] = dict(
                inputs=[buffers[n] for n in p.inputs],
                output_shapes=shapes,
                output_dtypes=[mx_dtype(d) for d in p.output_dtypes],
                grid=p.grid,
                threadgroup=p.threadgroup,
                template=list(p.template),
            )
            if init_value is not None and p.writes_task_output:
                kwargs["init_value"] = float(init_value)
            if s.form == "cuda":
                outs = self._precompiled(s, p, **kwargs)
            else:
                outs = self._kernel(s, p.shared)(**kwargs)
            for name, shape, n, arr in zip(p.outputs, p.output_shapes, cuts, outs):
                if n is None:
                    buffers[name] = arr
                else:
                    buffers[name] = arr[:n].reshape(shape)
                    tails[name] = arr[n:]
        return {name: buffers[name] for name in self.output_names}, tails
