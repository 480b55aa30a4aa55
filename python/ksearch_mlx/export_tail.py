# ---- ksearch export: the task function and the mlx-lm patch -----------------------------------
#
# `ksearch export <run> --mlx` appends this file after the runtime (`ksearch_mlx/runtime.py`) and
# three generated lines that define TASK (the task as JSON), CANDIDATE (the best kernel) and
# BACKEND ("mlx-cuda" or "mlx-metal"). With those globals present it defines:
#
#   KERNEL          CompiledCandidate(CANDIDATE, TASK, BACKEND), built on first use (None before);
#                   where CANDIDATE["builds"] lists the other values of shape-tied tunables (a
#                   head size HD == D), one CompiledCandidate per build, picked per call by the
#                   constraints; assign any callable (inputs, axes) -> {output: array} to replace it.
#   <task name>(…)  e.g. mamba_scan(u, delta, A, Bm, Cm, Dv) -> (y, state): the task's inputs in
#                   order; axes come from the argument shapes, axes in no shape (attention's
#                   `causal`) from keyword arguments; arguments are cast to the kernel's dtypes.
#   run(**named)    the same, by name; returns {output name: array}.
#   patch_mlx_lm(scan=None, step=None) -> unpatch   (mamba_scan / mamba_step modules only)
#
# Imported on its own (no CANDIDATE), it only defines the helpers, which the tests use with a fake
# TASK and kernel. Private names start with `_tail_` so that they cannot clash with the runtime's.

import inspect as _tail_inspect
import re as _tail_re

import mlx.core as mx

_TAIL_DTYPES = {
    "f32": mx.float32,
    "f16": mx.float16,
    "bf16": mx.bfloat16,
    "i32": mx.int32,
    "f64": getattr(mx, "float64", mx.float32),
}

# Axes that appear in no input shape get these defaults when the caller leaves them out.
_TAIL_AXIS_DEFAULTS = {"causal": False}


def _tail_dtype(name):
    try:
        return _TAIL_DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype `{name}`") from None


def expected_dtypes(task, backend):
    """{tensor name: mx dtype} the kernel reads and writes on `backend`: the back-end's `dtypes`
    override where it has one, else the declared dtype."""
    backends = task.get("backends") or {}
    spec = backends.get(backend) if isinstance(backends, dict) else None
    over = (spec or {}).get("dtypes") or {}
    out = {}
    for t in list(task.get("inputs", [])) + list(task.get("outputs", [])):
        out[t["name"]] = _tail_dtype(over.get(t["name"], t["dtype"]))
    return out


# ---- expressions (shape entries such as "N * 2", kernel constraints) -------------------------------
def _tail_eval(expr, env):
    """A ksearch expression over `env`, with the runtime's `eval_expr` (the same grammar and
    integer semantics as the Rust side): the exported module's own copy, else the package's."""
    f = globals().get("eval_expr")
    if f is None:
        from ksearch_mlx.runtime import eval_expr as f
    return int(f(str(expr), env))


def _tail_defines(candidate):
    """The candidate's defines as {name: int}, from a dict, [[name, value]] or ["NAME=VALUE"]."""
    d = (candidate or {}).get("defines") or {}
    if isinstance(d, dict):
        items = d.items()
    else:
        items = []
        for e in d:
            if isinstance(e, str) and "=" in e:
                k, v = e.split("=", 1)
                items.append((k.strip(), v.strip()))
            elif isinstance(e, (list, tuple)) and len(e) == 2:
                items.append((e[0], e[1]))
    out = {}
    for k, v in items:
        try:
            out[str(k)] = int(v)
        except (TypeError, ValueError):
            pass
    return out


# ---- axes from shapes -------------------------------------------------------------------------------
def _tail_int_axis(name, v):
    if isinstance(v, (bool, int)):
        return int(v)
    if isinstance(v, mx.array) and v.size == 1:
        return int(v.item())
    if hasattr(v, "__index__"):  # numpy integers
        return int(v.__index__())
    raise TypeError(f"axis `{name}` must be an int, got {type(v).__name__}")


def axes_from_shapes(task, arrays, given=None):
    """Every axis of `task` (in the task's order): bound from the shapes of `arrays`
    ({input name: array}) against the inputs' shape specs, the rest from `given`.
    Raises ValueError on a rank or size mismatch, TypeError on a missing axis or input."""
    task_axes = list(task["axes"])
    axes = {}
    for k, v in (given or {}).items():
        if k not in task_axes:
            raise TypeError(f"`{k}` is no axis of task `{task.get('name')}` (axes: {task_axes})")
        axes[k] = _tail_int_axis(k, v)
    pending = []
    for spec in task["inputs"]:
        name = spec["name"]
        if name not in arrays:
            raise TypeError(f"missing input `{name}`")
        shape = tuple(arrays[name].shape)
        want = [str(s).strip() for s in spec["shape"]]
        if len(shape) != len(want):
            raise ValueError(
                f"input `{name}`: expected {len(want)} dimensions [{', '.join(want)}], got shape {shape}"
            )
        for i, (s, dim) in enumerate(zip(want, shape)):
            if _tail_re.fullmatch(r"[0-9]+", s):
                if int(s) != dim:
                    raise ValueError(f"input `{name}` dimension {i}: expected {s}, got {dim} (shape {shape})")
            elif s.isidentifier():
                if s not in task_axes:
                    raise ValueError(f"input `{name}`: `{s}` in its shape is no axis of the task")
                if s in axes and axes[s] != dim:
                    raise ValueError(
                        f"input `{name}` dimension {i}: axis `{s}` is {axes[s]} elsewhere, {dim} here (shape {shape})"
                    )
                axes[s] = dim
            else:
                pending.append((name, i, s, dim, shape))
    missing = [a for a in task_axes if a not in axes]
    if missing:
        raise TypeError(f"axes {missing} appear in no input shape: pass them as keyword arguments")
    for name, i, s, dim, shape in pending:
        if _tail_eval(s, axes) != dim:
            raise ValueError(f"input `{name}` dimension {i}: expected `{s}` = {_tail_eval(s, axes)}, got {dim} (shape {shape})")
    return {a: axes[a] for a in task_axes}


def _tail_failed_constraint(candidate, defines, axes):
    """The first of the kernel's constraints that `defines` with `axes` fails, else None."""
    env = dict(defines)
    env.update(axes)
    for c in (candidate or {}).get("constraints") or []:
        try:
            ok = _tail_eval(c, env)
        except ValueError:
            continue
        if not ok:
            return c
    return None


def _tail_build_for(candidate, axes):
    """The defines of the build that runs `axes`: the candidate's own where its constraints admit
    them, else the first of CANDIDATE["builds"] (the candidate with other values of its
    shape-tied tunables, e.g. HD = 64 for D = 64) that they admit. Refuses shapes no build
    supports rather than compute garbage (ValueError naming the constraint the candidate's own
    build fails). Without CANDIDATE["constraints"] nothing is checked."""
    own = dict(_tail_defines(candidate))
    failed = _tail_failed_constraint(candidate, own, axes)
    if failed is None:
        return own
    for b in (candidate or {}).get("builds") or []:
        if _tail_failed_constraint(candidate, b, axes) is None:
            return dict(b)
    env = dict(own)
    env.update(axes)
    shown = ", ".join(f"{k}={v}" for k, v in env.items())
    raise ValueError(f"the exported kernel does not support this workload: `{failed}` fails for {shown}")


def _tail_check_constraints(candidate, axes):
    """The exported kernel was specialised by its defines (e.g. HD = 128): refuse shapes that
    neither its constraints nor one of its other builds admit."""
    _tail_build_for(candidate, axes)


class _TailBuilds:
    """KERNEL when the export carries builds per shape class: the build `_tail_build_for` picks
    for each call's axes, a CompiledCandidate each, made on first use."""

    def __init__(self, candidate, task, backend):
        self.candidate, self.task, self.backend = candidate, task, backend
        self.compiled = {}

    def kernel_for(self, axes):
        d = _tail_build_for(self.candidate, axes)
        key = tuple(sorted(d.items()))
        if key not in self.compiled:
            self.compiled[key] = CompiledCandidate({**self.candidate, "defines": d}, self.task, self.backend)  # noqa: F821
        return self.compiled[key]

    def __call__(self, inputs, axes, *args, **kwargs):
        return self.kernel_for(axes)(inputs, axes, *args, **kwargs)


def make_entry(task, backend, get_kernel, candidate=None):
    """The task function: inputs positionally or by name, extra axes as keywords; returns the
    outputs (a tuple when the task has several). `get_kernel()` returns the callable
    (inputs, axes) -> {output: array}."""
    in_names = [t["name"] for t in task["inputs"]]
    out_names = [t["name"] for t in task["outputs"]]
    in_shapes = set()
    for t in task["inputs"]:
        for s in t["shape"]:
            in_shapes.update(_tail_re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(s)))
    extra = [a for a in task["axes"] if a not in in_shapes]
    dtypes = expected_dtypes(task, backend)

    in_set, axis_set = set(in_names), set(task["axes"])
    known = {}  # (input shapes, given axes) -> axes: decode calls the same shapes every step

    def call_named(named):
        arrays = {}
        given = {}
        for k, v in named.items():
            if k in in_set:
                arrays[k] = v if isinstance(v, mx.array) else mx.array(v)
            elif k in axis_set:
                if v is not None:
                    given[k] = _tail_int_axis(k, v)
            else:
                raise TypeError(f"{task['name']}() got an unexpected argument `{k}`")
        for a in extra:
            if a not in given and a in _TAIL_AXIS_DEFAULTS:
                given[a] = int(_TAIL_AXIS_DEFAULTS[a])
        key = (tuple(tuple(arrays[n].shape) if n in arrays else None for n in in_names), tuple(sorted(given.items())))
        axes = known.get(key)
        if axes is None:
            axes = axes_from_shapes(task, arrays, given)
            _tail_check_constraints(candidate, axes)
            if len(known) > 4096:
                known.clear()
            known[key] = axes
        inputs = {}
        for n in in_names:
            a = arrays[n]
            inputs[n] = a if a.dtype == dtypes[n] else a.astype(dtypes[n])
        return get_kernel()(inputs, dict(axes))

    P = _tail_inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in in_names]
    for a in extra:
        if a in _TAIL_AXIS_DEFAULTS:
            params.append(P(a, P.POSITIONAL_OR_KEYWORD, default=_TAIL_AXIS_DEFAULTS[a]))
    params += [P(a, P.KEYWORD_ONLY) for a in extra if a not in _TAIL_AXIS_DEFAULTS]
    sig = _tail_inspect.Signature(params)

    n_in = len(in_names)

    def entry(*args, **kwargs):
        if not kwargs and len(args) == n_in:  # the common call, without inspect's binding
            named = dict(zip(in_names, args))
        else:
            named = dict(sig.bind(*args, **kwargs).arguments)
        out = call_named(named)
        res = tuple(out[o] for o in out_names)
        return res[0] if len(res) == 1 else res

    def run_named(**named):
        out = call_named(named)
        return {o: out[o] for o in out_names}

    entry.__name__ = entry.__qualname__ = task["name"]
    entry.__signature__ = sig
    shown_inputs = ", ".join("%s[%s]" % (t["name"], ", ".join(map(str, t["shape"]))) for t in task["inputs"])
    entry.__doc__ = (
        "%s\n\nInputs: %s; outputs: %s. Axes are read from the shapes%s"
        % (task.get("description", task["name"]), shown_inputs, ", ".join(out_names),
           ("; %s by keyword." % ", ".join(extra)) if extra else ".")
    )
    run_named.__name__ = run_named.__qualname__ = "run"
    run_named.__doc__ = f"{task['name']} by name: run(**inputs and axes) -> {{output: array}}."
    return entry, run_named


# ---- mlx-lm Mamba patch ---------------------------------------------------------------------------
def _tail_project(block, x):
    """x_proj, split, optional B/C/dt RMS norm and dt_proj + softplus, as mlx-lm's ssm_step."""
    import mlx.nn as nn  # noqa: F811

    r, n = block.time_step_rank, block.ssm_state_size
    deltaBC = block.x_proj(x)
    delta, Bm, Cm = mx.split(deltaBC, [r, r + n], axis=-1)
    if getattr(block, "use_bcdt_rms", False):
        eps = block.args.mixer_rms_eps
        delta = mx.fast.rms_norm(delta, weight=None, eps=eps)
        Bm = mx.fast.rms_norm(Bm, weight=None, eps=eps)
        Cm = mx.fast.rms_norm(Cm, weight=None, eps=eps)
    delta = nn.softplus(block.dt_proj(delta))
    return delta, Bm, Cm


def _tail_continue(y, state, h0, delta, A, Cm, chunk=256):
    """A scan that started from a zero state, continued from the state `h0` ([b, D, N]) instead:
    the recurrence is linear in h, and the decay from step 0 to step t is
    prod_s exp(delta_s * A) = exp(A * sum_s delta_s), so
        y_t += <Cm_t, exp(A * S_t) * h0>,   state += exp(A * S_T) * h0,   S = cumsum(delta).
    Works in time chunks so the [b, chunk, D, N] decay tensor stays small. Used for chunked
    prefill (mlx-lm's generate prefills long prompts in pieces)."""
    f32 = mx.float32
    h0 = h0.astype(f32)[:, None]  # [b, 1, D, N]
    S = mx.cumsum(delta.astype(f32), axis=1)  # [b, T, D]
    C = Cm.astype(f32)
    parts = []
    T = y.shape[1]
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        decay = mx.exp(S[:, t0:t1, :, None] * A)  # [b, c, D, N]
        parts.append(mx.sum(decay * h0 * C[:, t0:t1, None, :], axis=-1))
    corr = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    y = (y.astype(f32) + corr).astype(y.dtype)
    state = state.astype(f32) + mx.exp(S[:, -1, :, None] * A) * h0[:, 0]
    return y, state


def _tail_conv_step(block, x_full, taps=None, bias=None):
    """The depthwise causal conv of ONE new token: its K-token window x_full [b, K, D] against
    the conv weight [D, K, 1] (+ bias), as a weighted sum in f32, cast back to x's dtype. The same
    arithmetic as mlx-lm's grouped `Conv1d` on that window, in one fused elementwise + reduction
    instead of a grouped convolution call. `taps` [D, K] and `bias` [D] may be given ready."""
    f32 = mx.float32
    if taps is None:
        taps = block.conv1d.weight[:, :, 0]
        bias = block.conv1d.bias if "bias" in block.conv1d else None
    out = mx.sum(x_full.astype(f32) * taps.astype(f32).T, axis=1, keepdims=True)
    if bias is not None:
        out = out + bias.astype(f32)
    return out.astype(x_full.dtype)


# ---- fused decode glue (MLX CUDA): fewer kernels per token and layer ------------------------------
# A decode step of mlx-lm's MambaBlock launches one kernel per small op (concatenate, conv,
# silu, x_proj, split copies, dt_proj, softplus, gate …), and at batch 1 each costs far more in
# launch and dispatch than in arithmetic. Two hand-written kernels do the glue around the step:
#   conv_xproj: the one-token depthwise conv from the cache (f32 sums, rounded to the model's
#     f16 as the Conv1d output is), silu, the shifted conv cache, and x_proj (warp dot products,
#     f32 accumulation, f16 result as nn.Linear gives); one block per 8 outputs of x_proj, each
#     recomputing the 2048 conv outputs in shared memory (cheap) so the weight read is spread;
#   dt: dt_proj + bias (f32 accumulation, rounded to f16) and softplus (logaddexp(x, 0)),
#     and B, C copied out contiguous for the step kernel;
#   dt_step (decode_glue="step"): dt as above, then the SSM step, D skip and the silu(z) gate in
#     the same thread, replacing the searched step kernel (to measure what a full fusion gives).
_GLUE_HEADER = ""
_GLUE_CONV_XPROJ = """
const int bb = blockIdx.y;
const int tid = threadIdx.x;
__shared__ float xs[D];
const __half* xrow = xz + (long long)bb * (2 * D);
const __half* crow = cache + (long long)bb * (K - 1) * D;
for (int d = tid; d < D; d += NT) {
    float acc = __half2float(cb[d]);
#pragma unroll
    for (int k = 0; k < K - 1; k++) acc = fmaf(__half2float(cw[d * K + k]), __half2float(crow[k * D + d]), acc);
    const __half xn = xrow[d];
    acc = fmaf(__half2float(cw[d * K + K - 1]), __half2float(xn), acc);
    const float c = __half2float(__float2half_rn(acc));
    const __half sv = __float2half_rn(c / (1.f + __expf(-c)));
    xs[d] = __half2float(sv);
    if (blockIdx.x == 0) {
        xa[(long long)bb * D + d] = sv;
        __half* nrow = ncache + (long long)bb * (K - 1) * D;
#pragma unroll
        for (int k = 0; k < K - 2; k++) nrow[k * D + d] = crow[(k + 1) * D + d];
        nrow[(K - 2) * D + d] = xn;
    }
}
__syncthreads();
const int warp = tid >> 5, lane = tid & 31;
const int j = blockIdx.x * (NT / 32) + warp;
if (j < J) {
    const __half* w = wx + (long long)j * D;
    float acc = 0.f;
    for (int d0 = lane * 8; d0 < D; d0 += 256) {
        const uint4 v = *reinterpret_cast<const uint4*>(w + d0);
        const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 f = __half22float2(h[e]);
            acc = fmaf(f.x, xs[d0 + 2 * e], acc);
            acc = fmaf(f.y, xs[d0 + 2 * e + 1], acc);
        }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (lane == 0) dbc[(long long)bb * J + j] = __float2half_rn(acc);
}
"""
_GLUE_DT_HEAD = """
const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
if (i >= (long long)NB * D) return;
const int bb = (int)(i / D), d = (int)(i % D);
const __half* row = dbc + (long long)bb * J;
const __half* w = wdt + (long long)d * R;
float acc = __half2float(bdt[d]);
for (int r = 0; r < R; r += 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(w + r);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __half22float2(h[e]);
        acc = fmaf(f.x, __half2float(row[r + 2 * e]), acc);
        acc = fmaf(f.y, __half2float(row[r + 2 * e + 1]), acc);
    }
}
const float pre = __half2float(__float2half_rn(acc));
const float dt = __half2float(__float2half_rn(fmaxf(pre, 0.f) + log1pf(__expf(-fabsf(pre)))));
"""
_GLUE_DT = _GLUE_DT_HEAD + """
delta[i] = __float2half_rn(dt);
if (d < N) Bo[bb * N + d] = row[R + d];
else if (d < 2 * N) Co[bb * N + d - N] = row[R + d];
"""
_GLUE_DT_STEP = _GLUE_DT_HEAD + """
const float u = __half2float(xa[i]);
const __half* Bv = row + R;
const __half* Cv = row + R + N;
const float* a = A + (long long)d * N;
const float* h0 = s0 + i * N;
float* h1 = s1 + i * N;
const float du = dt * u;
float y = 0.f;
#pragma unroll
for (int n = 0; n < N; n++) {
    const float hn = fmaf(__expf(dt * a[n]), h0[n], du * __half2float(Bv[n]));
    h1[n] = hn;
    y = fmaf(__half2float(Cv[n]), hn, y);
}
y = __half2float(__float2half_rn(fmaf(Dv[d], u, y)));
const float z = __half2float(xz[(long long)bb * (2 * D) + D + d]);
yg[i] = __float2half_rn(z / (1.f + __expf(-z)) * y);
"""
_GLUE_KERNELS = {  # name -> (inputs, outputs, body)
    "ks_glue_conv_xproj": (["xz", "cache", "cw", "cb", "wx"], ["xa", "ncache", "dbc"], _GLUE_CONV_XPROJ),
    "ks_glue_dt": (["dbc", "wdt", "bdt"], ["delta", "Bo", "Co"], _GLUE_DT),
    "ks_glue_dt_step": (["dbc", "wdt", "bdt", "xa", "A", "Dv", "s0", "xz"], ["yg", "s1"], _GLUE_DT_STEP),
}
_glue_cache = {}


def _glue_kernel(name):
    k = _glue_cache.get(name)
    if k is None:
        ins, outs, body = _GLUE_KERNELS[name]
        k = _glue_cache[name] = mx.fast.cuda_kernel(
            name=name, input_names=ins, output_names=outs, source=body, header=_GLUE_HEADER)
    return k


def _glue_fits(block, x, conv_cache):
    """The fused decode glue runs where it was written for: MLX's CUDA back-end, f16 weights
    and activations, no B/C/dt RMS norm, plain (unquantised) Linear layers, sizes it tiles."""
    import mlx.nn as nn  # noqa: F811

    f16 = mx.float16
    D, R, K = block.intermediate_size, block.time_step_rank, block.conv_kernel_size
    return (globals().get("BACKEND") == "mlx-cuda" and x.dtype == f16 and conv_cache.dtype == f16
            and not getattr(block, "use_bcdt_rms", False) and K >= 2
            and D % 256 == 0 and R % 8 == 0
            and all(type(getattr(block, n)) is nn.Linear for n in ("in_proj", "x_proj", "dt_proj"))
            and block.x_proj.weight.dtype == f16 and block.dt_proj.weight.dtype == f16
            and "bias" in block.dt_proj and block.conv1d.weight.dtype == f16)


def _glue_decode(block, x, conv_cache, state, A, Dv, taps, cbias, step, full):
    """One decode token through the fused glue; returns (out, (new conv cache, new state))."""
    from mlx_lm.models.activations import swiglu

    b = x.shape[0]
    D, K, R, N = block.intermediate_size, block.conv_kernel_size, block.time_step_rank, block.ssm_state_size
    J = R + 2 * N
    f16 = mx.float16
    xz = block.in_proj(x).reshape(b, 2 * D)
    nblk = (J + 7) // 8
    xa, ncache, dbc = _glue_kernel("ks_glue_conv_xproj")(
        inputs=[xz, conv_cache, taps, cbias, block.x_proj.weight],
        template=[("D", D), ("K", K), ("J", J), ("NT", 256)],
        grid=(nblk * 256, b, 1), threadgroup=(256, 1, 1),
        output_shapes=[(b, D), (b, K - 1, D), (b, J)], output_dtypes=[f16, f16, f16])
    tmpl = [("D", D), ("R", R), ("N", N), ("J", J), ("NB", b)]
    grid = (((b * D + 255) // 256) * 256, 1, 1)
    if full:
        yg, s1 = _glue_kernel("ks_glue_dt_step")(
            inputs=[dbc, block.dt_proj.weight, block.dt_proj.bias, xa, A, Dv, state, xz],
            template=tmpl, grid=grid, threadgroup=(256, 1, 1),
            output_shapes=[(b, D), (b, D, N)], output_dtypes=[f16, mx.float32])
    else:
        delta, Bm, Cm = _glue_kernel("ks_glue_dt")(
            inputs=[dbc, block.dt_proj.weight, block.dt_proj.bias],
            template=tmpl, grid=grid, threadgroup=(256, 1, 1),
            output_shapes=[(b, D), (b, N), (b, N)], output_dtypes=[f16, f16, f16])
        y, s1 = step(xa, delta, A, Bm, Cm, Dv, state)
        yg = swiglu(xz[:, D:], y.astype(f16))
    if s1.dtype != mx.float32:
        s1 = s1.astype(mx.float32)
    return block.out_proj(yg[:, None, :]), (ncache, s1)


def patch_mlx_lm(scan=None, step=None, compile_decode=True, fast_conv=True, decode_glue=True):
    """Replaces mlx-lm's `MambaBlock._process_sequence` (mlx-lm 0.32) so that
    - prefill (no incoming SSM state) runs in-proj, conv, silu, x_proj, dt_proj and softplus as
      stock, then ONE call `scan(u, delta, A, Bm, Cm, Dv) -> (y, state)` instead of the Python
      loop over time, then `out_proj(swiglu(z, y))`;
    - decode (T == 1 with a state) calls `step(u, delta, A, Bm, Cm, Dv, state_in) -> (y, state)`
      when given (also for a one-token prompt, from a zero state); the SSM state is kept in the
      cache in f32;
    - T > 1 with an incoming state (chunked prefill) runs the scan from zero and adds the
      incoming state's decayed contribution exactly (`_tail_continue`);
    - anything else (a missing kernel) runs the stock method.
    A = -exp(A_log) and Dv = D are passed in f32, u, delta, Bm, Cm in the model's dtype (the
    exported functions cast them to the kernel's dtypes). In a module exported for mamba_scan
    (mamba_step) `scan` (`step`) defaults to the module's own function.
    With `compile_decode` the decode path is traced once with `mx.compile`, which fuses the
    elementwise glue and builds the graph once instead of per token: `"block"` (or True, the
    default) traces each MambaBlock's decode path alone; `"model"` traces the whole one-token
    step of the backbone (embedding, every layer's norm, mixer and residual, the final norm:
    mlx-lm's `Mamba.__call__` and `ResidualBlock.__call__` arithmetic, unchanged)
    as one function of the token and the caches (slower on the H200: 85 against 109 tok/s);
    False compiles nothing. Where compiling fails the plain path runs instead
    (`unpatch.compiled` counts the compiled calls, says which scope ran, and keeps the error).
    With `fast_conv` a decode step computes the conv of its one new token as a weighted sum of
    the K-token window (`_tail_conv_step`) instead of calling the grouped Conv1d.
    With `decode_glue` (MLX's CUDA back-end, f16 models: `_glue_fits`) a decode step runs the
    fused glue kernels around the step kernel instead (`_glue_decode`): in_proj, conv + silu +
    x_proj in one kernel, dt_proj + softplus in another, the step, the gate, out_proj;
    `decode_glue="step"` fuses the step and the gate into the second kernel too (the searched
    step kernel is then not used). False keeps the MLX-op glue everywhere.
    Returns `unpatch()`; `unpatch.stats` counts the calls per path (scan / step / stock)."""
    g = globals()
    task_name = (g.get("TASK") or {}).get("name") if g.get("CANDIDATE") is not None else None
    if scan is None and task_name == "mamba_scan":
        scan = g["mamba_scan"]
    if step is None and task_name == "mamba_step":
        step = g["mamba_step"]
    if scan is None and step is None:
        raise ValueError("patch_mlx_lm: give scan= and/or step= (nothing to patch)")

    from mlx_lm.models import mamba as _mamba
    from mlx_lm.models.activations import swiglu

    if compile_decode is True:
        # measured on the H200 through MLX's CUDA back-end (2026-12-02, mamba-370m shapes):
        # per block 109 tok/s, the whole backbone in one trace 85 tok/s, uncompiled 80 tok/s
        compile_decode = "block"
    if decode_glue not in (True, False, None, "step"):
        raise ValueError(f"patch_mlx_lm: decode_glue must be True, False or 'step', not {decode_glue!r}")
    if compile_decode not in (False, None, "model", "block"):
        raise ValueError(f"patch_mlx_lm: compile_decode must be 'model', 'block', True or False, not {compile_decode!r}")
    block_scope = compile_decode == "block"
    cls = _mamba.MambaBlock
    bcls = _mamba.Mamba
    previous = cls.__dict__["_process_sequence"]
    previous_backbone = bcls.__dict__["__call__"]
    stock_backbone = getattr(previous_backbone, "_ksearch_stock", previous_backbone)
    stock = getattr(previous, "_ksearch_stock", previous)
    stats = {"scan": 0, "step": 0, "stock": 0}
    # the compiled decode path (unpatch.compiled)
    cstats = {"compiled_calls": 0, "error": None, "scope": compile_decode or None}
    compiled = {}  # id(block) -> (block, compiled decode function)
    import mlx.nn as nn

    f32 = mx.float32
    consts = {}  # id(block) -> (A_log, D, A, Dv): A = -exp(A_log) and D in f32, made once per weights
    kconsts = {}  # id(block) -> (weights, (A, Dv, taps, conv bias)) for the compiled decode step

    def ssm_constants(block):
        c = consts.get(id(block))
        if c is None or c[0] is not block.A_log or c[1] is not block.D:
            A = -mx.exp(block.A_log.astype(f32))
            Dv = block.D if block.D.dtype == f32 else block.D.astype(f32)
            try:
                mx.eval(A, Dv)
            except Exception:  # inside a function transformation (mx.compile, grad): do not keep
                return A, Dv
            c = consts[id(block)] = (block.A_log, block.D, A, Dv)
        return c[2], c[3]

    def block_constants(block):
        """(A, Dv, conv taps [D, K], conv bias [D]) made eagerly once per weights, so a traced
        decode step takes them as inputs instead of recomputing them every token."""
        key = (block.A_log, block.D, block.conv1d.weight)
        c = kconsts.get(id(block))
        if c is None or any(a is not b for a, b in zip(c[0], key)):
            A, Dv = ssm_constants(block)
            w = block.conv1d.weight
            taps = w.reshape(w.shape[0], w.shape[1])
            cb = block.conv1d.bias if "bias" in block.conv1d else mx.zeros((w.shape[0],), dtype=w.dtype)
            mx.eval(A, Dv, taps, cb)
            c = kconsts[id(block)] = (key, (A, Dv, taps, cb))
        return c[1]

    def _process_sequence(self, x, conv_cache, state_cache):
        T = x.shape[1]
        use_step = T == 1 and step is not None
        # one token with a state and no step kernel: stock's step is cheaper than scan + continue
        use_scan = not use_step and scan is not None and (T > 1 or state_cache is None)
        if not (use_scan or use_step):
            stats["stock"] += 1
            return stock(self, x, conv_cache, state_cache)
        if use_step and block_scope and conv_cache is not None and state_cache is not None and cstats["error"] is None:
            entry = compiled.get(id(self))
            if entry is None or entry[0] is not self:
                fn = mx.compile(lambda x_, cc_, sc_, a_, d_, t_, b_, blk=self: _plain(blk, x_, cc_, sc_, (a_, d_, t_, b_)),
                                inputs=self.state)
                entry = compiled[id(self)] = (self, fn)
            # A trace that fails can leave tracers in the module's arrays (mx.compile swaps the
            # captured inputs while tracing): keep the real ones to put back.
            saved = self.parameters() if cstats["compiled_calls"] == 0 else None
            try:
                out = entry[1](x, conv_cache, state_cache, *block_constants(self))
                stats["step"] += 1
                cstats["compiled_calls"] += 1
                return out
            except Exception as e:  # e.g. a primitive mx.compile cannot trace here: run it plainly
                cstats["error"] = f"{type(e).__name__}: {e}"
                compiled.clear()
                consts.clear()
                kconsts.clear()
                if saved is not None:
                    self.update(saved)
        if use_step:
            stats["step"] += 1
        else:
            stats["scan"] += 1
        return _plain(self, x, conv_cache, state_cache)

    def _plain(self, x, conv_cache, state_cache, k=None):
        T = x.shape[1]
        use_step = T == 1 and step is not None
        if k is not None:
            A, Dv, taps, cbias = k
        else:
            A, Dv = ssm_constants(self)
            taps = cbias = None
        if (decode_glue and use_step and conv_cache is not None and state_cache is not None
                and conv_cache.shape[1] == self.conv_kernel_size - 1 and _glue_fits(self, x, conv_cache)):
            if taps is None:
                w = self.conv1d.weight
                taps = w.reshape(w.shape[0], w.shape[1])
                cbias = self.conv1d.bias if "bias" in self.conv1d else mx.zeros((w.shape[0],), dtype=w.dtype)
            sc = state_cache if state_cache.dtype == f32 else state_cache.astype(f32)
            cstats["glue"] = "step" if decode_glue == "step" else "fused"
            return _glue_decode(self, x, conv_cache, sc, A, Dv, taps, cbias, step, decode_glue == "step")
        # as stock: in_proj, causal depthwise conv with its cache, silu
        xz = self.in_proj(x)
        x, z = xz.split(indices_or_sections=2, axis=-1)
        K = self.conv_kernel_size
        if conv_cache is not None:
            x_full = mx.concatenate([conv_cache, x], axis=1)
        else:
            x_full = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
        if fast_conv and use_step and conv_cache is not None and x_full.shape[1] == K:
            conv_out = _tail_conv_step(self, x_full, taps, cbias)
        else:
            conv_out = self.conv1d(x_full)
        new_conv_cache = x_full[:, -(K - 1) :, :]
        x = nn.silu(conv_out)
        delta, Bm, Cm = _tail_project(self, x)
        if not use_step:
            y, state = scan(x, delta, A, Bm, Cm, Dv)
            if state_cache is not None:
                y, state = _tail_continue(y, state, state_cache, delta, A, Cm)
        else:
            if state_cache is None:
                state_cache = mx.zeros((x.shape[0], x.shape[-1], self.ssm_state_size), dtype=f32)
            elif state_cache.dtype != f32:
                state_cache = state_cache.astype(f32)
            y, state = step(x[:, 0], delta[:, 0], A, Bm[:, 0], Cm[:, 0], Dv, state_cache)
            y = mx.expand_dims(y, 1)
        if y.dtype != z.dtype:
            y = y.astype(z.dtype)
        if state.dtype != f32:
            state = state.astype(f32)
        out = self.out_proj(swiglu(z, y))
        return out, (new_conv_cache, state)

    mcompiled = {}  # id(backbone) -> (backbone, compiled one-token step)

    def _backbone_call(self, x, cache=None):
        decode = (compile_decode == "model" and step is not None and cache is not None and x.shape[1] == 1
                  and cstats["error"] is None and len(cache) == len(self.layers)
                  and all(c[0] is not None and c[1] is not None for c in cache)
                  and all(isinstance(layer.mixer, cls) for layer in self.layers))
        if not decode:
            return stock_backbone(self, x, cache)
        entry = mcompiled.get(id(self))
        if entry is None or entry[0] is not self:
            def one_token(ids, convs, states, m=self):
                h = m.embeddings(ids)
                new_convs, new_states = [], []
                for layer, cc, sc in zip(m.layers, convs, states):
                    # ResidualBlock: mixer(norm(h)) + h, the mixer's decode path as in _plain
                    out, (cc2, sc2) = _plain(layer.mixer, layer.norm(h), cc, sc)
                    h = out + h
                    new_convs.append(cc2)
                    new_states.append(sc2)
                return m.norm_f(h), new_convs, new_states

            entry = mcompiled[id(self)] = (self, mx.compile(one_token, inputs=self.state))
        saved = self.parameters() if cstats["compiled_calls"] == 0 else None
        try:
            h, convs, states = entry[1](x, [c[0] for c in cache], [c[1] for c in cache])
        except Exception as e:  # a primitive mx.compile cannot trace here: the plain path
            cstats["error"] = f"{type(e).__name__}: {e}"
            mcompiled.clear()
            consts.clear()
            if saved is not None:
                self.update(saved)
            return stock_backbone(self, x, cache)
        for c, cc, sc in zip(cache, convs, states):
            c[0], c[1] = cc, sc
        stats["step"] += len(self.layers)
        cstats["compiled_calls"] += 1
        return h

    _process_sequence._ksearch_stock = stock
    _process_sequence._ksearch_patched = True
    cls._process_sequence = _process_sequence
    _backbone_call._ksearch_stock = stock_backbone
    _backbone_call._ksearch_patched = True
    bcls.__call__ = _backbone_call

    def unpatch():
        if cls.__dict__.get("_process_sequence") is _process_sequence:
            cls._process_sequence = previous
        if bcls.__dict__.get("__call__") is _backbone_call:
            bcls.__call__ = previous_backbone

    unpatch.stats = stats
    unpatch.compiled = cstats
    return unpatch


# ---- the exported module's own entry points ---------------------------------------------------------
KERNEL = globals().get("KERNEL")


def _tail_kernel():
    global KERNEL
    if KERNEL is None:
        if CANDIDATE.get("builds"):  # noqa: F821
            KERNEL = _TailBuilds(CANDIDATE, TASK, BACKEND)  # noqa: F821
        else:
            KERNEL = CompiledCandidate(CANDIDATE, TASK, BACKEND)  # noqa: F821 (from the runtime)
    return KERNEL


if globals().get("CANDIDATE") is not None:
    _tail_entry, run = make_entry(TASK, BACKEND, _tail_kernel, CANDIDATE)  # noqa: F821
    globals()[TASK["name"]] = _tail_entry  # noqa: F821
    if TASK["name"] not in ("mamba_scan", "mamba_step"):  # noqa: F821
        del patch_mlx_lm
    __all__ = [TASK["name"], "run", "KERNEL", "TASK", "CANDIDATE", "BACKEND"]  # noqa: F821
    if "patch_mlx_lm" in globals():
        __all__.append("patch_mlx_lm")
