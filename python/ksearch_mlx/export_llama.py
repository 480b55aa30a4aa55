# ---- ksearch export: the mlx-lm Llama attention patch -----------------------------------------------
#
# `ksearch export <run> --mlx` appends this file after the tail (`ksearch_mlx/export_tail.py`) in a
# module exported for the attention task, where it defines
#
#   patch_mlx_lm_llama(attention=None, min_len=LLAMA_MIN_LEN, admits=None, dtypes=None,
#                      choose="measured", lhd=None, rope="auto") -> unpatch
#
# with `attention` defaulting to the module's own `attention(q, k, v, causal)` (the searched
# kernel), `admits` to the kernel's constraints and builds, `dtypes` to the kernel's input dtype.
# Imported on its own (`from ksearch_mlx.export_llama import patch_mlx_lm_llama`) the attention
# callable must be given; the tests and `bench/mlx_llama.py` use it so.
#
# Private names start with `_llama_` so that they cannot clash with the runtime's or the tail's.

import math as _llama_math

import mlx.core as mx

# The shortest query length (prompt chunk) that may run the searched kernel; shorter ones, decode
# (one token) among them, run mlx-lm's stock attention (mx.fast.scaled_dot_product_attention).
# With choose="measured" (the default) a longer chunk runs the kernel only where it was measured
# faster than stock's attention at its shape class (below), so min_len only spares the short
# prompts that timing: on the H200 (2026-12-03/04, bench/h200-2026-12-03-mlx-attention.txt,
# bench/h200-2026-12-04-mlx-llama.txt) the task.toml wgmma kernel at its default tunables was
# slower than SDPA at every shape measured (0.43-0.92x at L = 512..4096, 0.26-0.63x at L = 1); the
# persistent flash_ws is 1.06-1.27x of it at L = 1024..4096 (GPU clock) and a prefill through its
# QO_LHD build ran 0.99x / 0.95x of stock at L = 2048 / 4096 (bench/h200-2026-12-04-llama-lhd.txt).
LLAMA_MIN_LEN = 128

# Timed calls per side when choose="measured" meets a new shape class (after one warm-up each),
# in LLAMA_TIMING_ROUNDS alternating rounds (kernel, stock, kernel, ...: drift and a busy moment
# fall on both); the kernel is kept only where the median of its rounds is below LLAMA_MARGIN
# times stock's. On the H200 (2026-12-04, bench/h200-2026-12-04-mlx-scan-llama.txt) one round of
# 3 calls each took a kernel that is 0.73x of SDPA at L = 2048 for faster, and the prefill ran
# 0.82x stock: a default keeps stock unless the kernel is measurably faster.
LLAMA_TIMING_REPS = 3
LLAMA_TIMING_BATCH = 8
LLAMA_TIMING_ROUNDS = 3
LLAMA_MARGIN = 0.95

# Shapes (B, L, ...) the patch's compiled stretches may be traced for; MLX keeps each trace for the
# process's life, so a server meeting many prompt lengths stops compiling new ones after these.
LLAMA_COMPILE_SHAPES = 64

# The fused tail's products with fewer rows (B * L) than this are a matmul and an add, not one
# mx.addmm with the residual in it. On MLX's CUDA back-end (0.32) a one-row matmul takes MLX's own
# gemv kernel, while AddMM always builds a cuBLASLt GEMM with a bias epilogue, host set-up and all:
# a decode step through addmm ran 0.83-0.88x of stock's tokens/s where stock's block ran 1.00-1.13x
# in the same call (H100, 2026-12-07, bench/h100-2026-12-07-mlx-anchors.txt); with this rule the step
# ran 1.11x of stock in mlx-lm's generate_step, through addmm 0.87-0.92x in the same rounds
# (bench/h100-2026-12-07-llama-decode.txt). Read when a patch is made (1: always addmm, as before).
LLAMA_ADDMM_MIN_ROWS = 2

# fuse_decode keeps what it checked of a block on its first decode step (see decode_plan in
# patch_mlx_lm_llama) and later steps only confirm the block's modules and weights are the same
# objects; False checks everything at every step (the path as it was, for A/B timing). Read when a
# patch is made.
LLAMA_DECODE_PLAN = True


# RoPE of the query and key projections, and the value projection's move to the cache's order, in
# one launch, for mlx-lm's `nn.RoPE` (not traditional, dims = head size) on MLX's CUDA back-end.
# mlx-lm applies RoPE to q and k viewed as [B, H, L, D] over [B, L, H, D] storage; on the H200
# (2026-12-04, bench/h200-2026-12-04-llama-trace.txt) MLX's rope kernel on those views took 18-24%
# of a 1.0 B Llama's prefill GPU time, about as much as the attention itself (193 us per layer at
# L = 4096), and v's transpose to [B, Hkv, L, D] another 24 us. This kernel reads the three
# projections in their own [B, L, H, D] storage and writes q in that storage (what the QO_LHD
# attention reads), k and v in [B, Hkv, L, D] (what the KV cache holds). One block per position
# (blockIdx.x = l, blockIdx.y = b); each row of the position (H query heads, Hkv key heads, Hkv
# value heads) is D / 8 threads of 4 element pairs each (d and d + D / 2 turned together; v
# copied), 8-byte loads and stores, a thread's first NR rows loaded before anything else; meanwhile
# the D / 2 (cos, sin) pairs of the position are computed once into shared memory, as MLX's rope
# computes them (theta = scale * (offset + l) * 2^(-(i / (D/2)) * log2(base)), f32). f32
# arithmetic; no integer division but by compile-time constants.
# Inputs q [B, L, H, D], k and v [B, L, Hkv, D] (f16), dims (int32: B, L, H, Hkv, offset), p (f32:
# log2(base), scale); outputs qo [B, L, H, D], ko and vo [B, Hkv, L, D]; template D (head size,
# a multiple of 8) and QKV (1: q is the fused projection [B, L, H + 2 Hkv, D], its heads q's, k's
# and v's in that order; k and v are not read); threadgroup a multiple of D / 8 threads; grid (L
# blocks, B).
_LLAMA_ROPE_BODY = """
constexpr int T = D / 8;
constexpr int HALF = D / 2;
constexpr int NR = 4;
__shared__ float2 cs[HALF];
const int LL = dims[1], HQ = dims[2], HK = dims[3];
const int l = blockIdx.x, b = blockIdx.y;
const int d = 4 * (threadIdx.x % T);
const int rpb = blockDim.x / T;
const int rows = HQ + 2 * HK;
const long long bl = (long long)b * LL + l;
auto src_of = [&](int r) -> const __half* {
  if (QKV) return q + (bl * rows + r) * D;
  if (r < HQ) return q + (bl * HQ + r) * D;
  if (r < HQ + HK) return k + (bl * HK + (r - HQ)) * D;
  return v + (bl * HK + (r - HQ - HK)) * D;
};
auto dst_of = [&](int r) -> __half* {
  if (r < HQ) return qo + (bl * HQ + r) * D;
  if (r < HQ + HK) return ko + (((long long)b * HK + (r - HQ)) * LL + l) * D;
  return vo + (((long long)b * HK + (r - HQ - HK)) * LL + l) * D;
};
uint2 lo[NR], hi[NR];
auto load = [&](int rb) {
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int r = rb + i * rpb;
    if (r < rows) {
      const __half* s = src_of(r);
      lo[i] = *reinterpret_cast<const uint2*>(s + d);
      hi[i] = *reinterpret_cast<const uint2*>(s + d + HALF);
    }
  }
};
int rb = threadIdx.x / T;
load(rb);
{
  // the position's angles, while the first rows are on their way
  const float pos = p[1] * (float)(l + dims[4]);
  for (int i = threadIdx.x; i < HALF; i += blockDim.x) {
    float s, c;
    sincosf(pos * exp2f(-((float)i / (float)HALF) * p[0]), &s, &c);
    cs[i] = make_float2(c, s);
  }
}
__syncthreads();
while (true) {
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int r = rb + i * rpb;
    if (r < rows) {
      if (r < HQ + HK) {
        __half2* l2 = reinterpret_cast<__half2*>(&lo[i]);
        __half2* h2 = reinterpret_cast<__half2*>(&hi[i]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float2 x1 = __half22float2(l2[j]);
          const float2 x2 = __half22float2(h2[j]);
          const float2 a = cs[d + 2 * j], e = cs[d + 2 * j + 1];
          l2[j] = __floats2half2_rn(x1.x * a.x - x2.x * a.y, x1.y * e.x - x2.y * e.y);
          h2[j] = __floats2half2_rn(x1.x * a.y + x2.x * a.x, x1.y * e.y + x2.y * e.x);
        }
      }
      __half* o = dst_of(r);
      *reinterpret_cast<uint2*>(o + d) = lo[i];
      *reinterpret_cast<uint2*>(o + d + HALF) = hi[i];
    }
  }
  rb += NR * rpb;
  if (rb >= rows) break;
  load(rb);
}
"""
_llama_kernels = {}  # the patch's own kernel objects (mx.fast.cuda_kernel), made on first use


class _LlamaRopeArgs:
    """What the fused RoPE reads of mlx-lm's nn.RoPE (base and scale), checked beforehand."""

    def __init__(self, base, scale):
        self.base, self.scale = base, scale


def _llama_rope_fits_shape(rope, D, *dtypes):
    """Whether the fused RoPE computes what `rope` would for head size D and these dtypes."""
    import mlx.nn as nn

    return (type(rope) is nn.RoPE and not rope.traditional and rope.dims == D and D % 8 == 0
            and all(t == mx.float16 for t in dtypes))


def _llama_rope_fits(rope, q, k, v):
    """Whether the fused RoPE computes what `rope` (mlx-lm's module) would on q and k (and moves v)."""
    D = q.shape[-1]
    return (_llama_rope_fits_shape(rope, D, q.dtype, k.dtype, v.dtype)
            and k.shape[-1] == D and v.shape[-1] == D and k.shape[:3] == v.shape[:3])


# Per (B, L, H, Hkv, offset, base, scale): the kernel's small dims and p arrays, made once (a
# prefill calls the kernel once per layer with the same ones).
_llama_rope_args = {}


def _llama_rope_cuda(q, k, v, rope, offset=0):
    """(q rotated in [B, L, H, D], k rotated in [B, Hkv, L, D], v in [B, Hkv, L, D]) from the
    projections q [B, L, H, D], k and v [B, L, Hkv, D] in one launch (MLX's CUDA back-end), or
    None where the kernel does not compute what `rope` would (then the caller runs stock's RoPE)."""
    if not _llama_rope_fits(rope, q, k, v):
        return None
    B, L, H, D = q.shape
    Hkv = k.shape[2]
    return _llama_rope_launch(_llama_rope_kernel(), q, k, v, _llama_rope_args_for(B, L, H, Hkv, offset, rope), 0,
                              B, L, H, Hkv, D)


def _llama_rope_launch(kern, q, k, v, args, fused, B, L, H, Hkv, D):
    t = D // 8
    threads = t * max(1, 256 // t)
    return tuple(kern(inputs=[q, k, v, *args], template=[("D", D), ("QKV", fused)], grid=(L * threads, B, 1),
                      threadgroup=(threads, 1, 1), output_shapes=[(B, L, H, D), (B, Hkv, L, D), (B, Hkv, L, D)],
                      output_dtypes=[q.dtype, q.dtype, q.dtype]))


def _llama_rope_kernel():
    kern = _llama_kernels.get("rope")
    if kern is None:
        kern = _llama_kernels["rope"] = mx.fast.cuda_kernel(
            name="ks_llama_rope", input_names=["q", "k", "v", "dims", "p"], output_names=["qo", "ko", "vo"],
            source=_LLAMA_ROPE_BODY)
    return kern


def _llama_rope_args_for(B, L, H, Hkv, offset, rope):
    key = (B, L, H, Hkv, int(offset), float(rope.base), float(rope.scale))
    args = _llama_rope_args.get(key)
    if args is None:
        if len(_llama_rope_args) >= 256:
            _llama_rope_args.clear()
        args = _llama_rope_args[key] = (mx.array([B, L, H, Hkv, int(offset)], dtype=mx.int32),
                                        mx.array([_llama_math.log2(float(rope.base)), float(rope.scale)], dtype=mx.float32))
    return args


def _llama_rope_qkv_dims(qkv, H, Hkv, dims, p):
    """As _llama_rope_cuda_qkv with the kernel's `dims` and `p` arrays given (see
    _llama_rope_args_for): the position offset is dims[4], an input of the launch rather than a
    constant of it, so a decode step compiled once serves every position."""
    B, L, _, D = qkv.shape
    return _llama_rope_launch(_llama_rope_kernel(), qkv, qkv, qkv, (dims, p), 1, B, L, H, Hkv, D)


def _llama_rope_cuda_qkv(qkv, H, Hkv, rope, offset=0):
    """As _llama_rope_cuda, from the fused projection qkv [B, L, H + 2 Hkv, D] (q's heads, then
    k's, then v's)."""
    B, L, R, D = qkv.shape
    if R != H + 2 * Hkv or not (isinstance(rope, _LlamaRopeArgs) or _llama_rope_fits(rope, qkv, qkv, qkv)):
        return None
    return _llama_rope_launch(_llama_rope_kernel(), qkv, qkv, qkv, _llama_rope_args_for(B, L, H, Hkv, offset, rope), 1,
                              B, L, H, Hkv, D)


def _llama_stack_weights(module, names, slot):
    """The weights of `module`'s sub-layers `names` (plain bias-free nn.Linear layers of one dtype)
    stacked along the output rows into one matrix, or None where they are not (quantised, LoRA,
    with bias: stock's separate layers). Made on first use and kept on the module under `slot`;
    the layers' weights then become views of its rows (same values, no second copy in memory: the
    model's parameters are re-pointed, not duplicated), and it is made again when one of them is
    replaced (loading, fine-tuning)."""
    layers = [module[n] for n in names]  # dict access: Module.__getattr__ is slow
    got = module.__dict__.get(slot)
    if got is not None and all(a is p.get("weight") for a, p in zip(got[0], layers)):
        return got[1]
    import mlx.nn as nn

    if any(type(p) is not nn.Linear or "bias" in p for p in layers):
        return None
    ws = [p["weight"] for p in layers]
    if any(w.dtype != ws[0].dtype for w in ws):
        return None
    w = mx.concatenate(ws, axis=0)
    views, a = [], 0
    for p, wi in zip(layers, ws):
        views.append(w[a : a + wi.shape[0]])
        a += wi.shape[0]
        p["weight"] = views[-1]
    object.__setattr__(module, slot, (tuple(views), w))  # not Module.__setattr__: no parameter of the model
    return w


def _llama_qkv_weight(attn):
    """The q, k and v projections' weights of mlx-lm's Attention `attn` stacked into one
    [(H + 2 Hkv) D, hidden] matrix (see _llama_stack_weights), or None."""
    return _llama_stack_weights(attn, ("q_proj", "k_proj", "v_proj"), "_ks_qkv")


def _llama_gate_up_weight(mlp):
    """The gate and up projections' weights of mlx-lm's Llama MLP `mlp` stacked into one
    [2 I, hidden] matrix (see _llama_stack_weights), or None."""
    return _llama_stack_weights(mlp, ("gate_proj", "up_proj"), "_ks_gu")


# SwiGLU of the stacked gate/up projection, silu(g) * u, for the patch's MLP path on MLX's CUDA
# back-end: gu [M, 2 I] (f16; g in columns 0..I-1, u in I..2I-1) -> out [M, I], f32 arithmetic,
# one rounding. Each thread turns 8 consecutive columns (three 16-byte accesses); dims (int32: M);
# template I (a multiple of 8). mlx-lm's swiglu (a compiled elementwise kernel on the two
# projections' outputs) took 49-50 us per layer at L = 4096 on the H200 (2026-12-04,
# bench/h200-2026-12-04-llama-v2.txt) for 138 MB moved, 2.8 TB/s.
_LLAMA_SWIGLU_BODY = """
constexpr int V = I / 8;
const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
if (i >= (long long)dims[0] * V) return;
const long long r = i / V;
const int c = (int)(i - r * V) * 8;
const __half* row = gu + r * (2LL * I);
const uint4 a = *reinterpret_cast<const uint4*>(row + c);
const uint4 b = *reinterpret_cast<const uint4*>(row + I + c);
const __half2* g2 = reinterpret_cast<const __half2*>(&a);
const __half2* u2 = reinterpret_cast<const __half2*>(&b);
uint4 o;
__half2* o2 = reinterpret_cast<__half2*>(&o);
#pragma unroll
for (int j = 0; j < 4; ++j) {
  const float2 g = __half22float2(g2[j]);
  const float2 u = __half22float2(u2[j]);
  o2[j] = __floats2half2_rn(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y);
}
*reinterpret_cast<uint4*>(out + r * I + c) = o;
"""
_llama_swiglu_dims = {}


def _llama_swiglu_ops(gu):
    """silu(g) * u of gu [..., 2 I] in MLX ops (mlx-lm's own swiglu), any back-end and dtype."""
    from mlx_lm.models.activations import swiglu

    i = gu.shape[-1] // 2
    return swiglu(gu[..., :i], gu[..., i:])


def _llama_swiglu_cuda(gu):
    """silu(g) * u of gu [M, 2 I] in one launch (MLX's CUDA back-end, f16, I a multiple of 8),
    else in MLX ops."""
    M, I2 = gu.shape
    I = I2 // 2
    if gu.dtype != mx.float16 or I % 8 or I2 != 2 * I:
        return _llama_swiglu_ops(gu)
    kern = _llama_kernels.get("swiglu")
    if kern is None:
        kern = _llama_kernels["swiglu"] = mx.fast.cuda_kernel(
            name="ks_llama_swiglu", input_names=["gu", "dims"], output_names=["out"], source=_LLAMA_SWIGLU_BODY)
    dims = _llama_swiglu_dims.get(M)
    if dims is None:
        if len(_llama_swiglu_dims) >= 256:
            _llama_swiglu_dims.clear()
        dims = _llama_swiglu_dims[M] = mx.array([M], dtype=mx.int32)
    return kern(inputs=[gu, dims], template=[("I", I)], grid=(M * (I // 8), 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[(M, I)], output_dtypes=[gu.dtype])[0]


def _llama_rope_default():
    """The fused RoPE where MLX runs on CUDA (the GPU is the default device), else None."""
    try:
        cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    except AttributeError:
        cuda = False
    return _llama_rope_cuda if cuda else None


def _llama_module_defaults():
    """(attention, admits, dtypes, lhd) of the exported module this file was appended to, or
    Nones. `lhd` where the kernel's source has QO_LHD (q and o in [B, L, H, D] storage)."""
    g = globals()
    if g.get("CANDIDATE") is None or (g.get("TASK") or {}).get("name") != "attention":
        return None, None, None, None
    cand = g["CANDIDATE"]
    lhd = _LlamaLhdBuilds(cand, g["TASK"], g["BACKEND"]) if "QO_LHD" in (cand.get("source") or "") else None

    def admits(axes):
        try:
            g["_tail_build_for"](cand, axes)
        except ValueError:
            return False
        return True

    dtypes = (g["expected_dtypes"](g["TASK"], g["BACKEND"])["q"],)
    return g["attention"], admits, dtypes, lhd


class _LlamaLhdBuilds:
    """The exported kernel built with QO_LHD=1 (one build per shape class, as the module's own):
    (q [B, L, H, D], k, v [B, Hkv, L, D], causal) -> o [B, L, H, D]. The task's q and o are
    [B, H, L, D]; these builds read and write them in [B, L, H, D] storage, so the arrays are
    handed over reshaped (row-major order kept: no copy)."""

    def __init__(self, cand, task, backend):
        self.cand, self.task, self.backend = cand, task, backend
        self.compiled = {}
        # per shape: the build that runs it. Choosing one evaluates the kernel's constraints in
        # Python, which a prefill would otherwise pay once per layer while it builds its graph
        # (the GPU idle meanwhile).
        self.for_shape = {}

    def __call__(self, q, k, v, causal=0):
        B, L, H, D = q.shape
        axes = {"B": B, "H": H, "Hkv": k.shape[1], "L": L, "D": D, "causal": int(causal)}
        shape = (B, L, H, axes["Hkv"], D, axes["causal"])
        kern = self.for_shape.get(shape)
        if kern is None:
            d = dict(globals()["_tail_build_for"](self.cand, axes))
            d["QO_LHD"] = 1
            key = tuple(sorted(d.items()))
            if key not in self.compiled:
                self.compiled[key] = globals()["CompiledCandidate"]({**self.cand, "defines": d}, self.task, self.backend)
            if len(self.for_shape) >= 4096:
                self.for_shape.clear()
            kern = self.for_shape[shape] = self.compiled[key]
        o = kern({"q": q.reshape(B, H, L, D), "k": k, "v": v}, axes)["o"]
        return o.reshape(B, L, H, D)


def _llama_time(label, fn, reps):
    """Median seconds per call of `fn()`, after one warm-up (`label`: "kernel" or "stock", for
    whoever replaces this function in a test). Each of the `reps` timings queues a batch of calls
    (up to LLAMA_TIMING_BATCH, fewer where the outputs in flight would pass 256 MB), each handed to
    the GPU as soon as it is built (mx.async_eval), then waits for all: the host builds the next
    call while the GPU runs the last, as in a prefill, whose host work runs ahead of the GPU's.
    Built together and evaluated by one mx.eval, a batch's host work ran before its GPU work
    instead of beside it, and each call's time was the sum of the two: on an H100 (2026-12-06,
    bench/h100-2026-12-06-llama-choice.txt) flash_ws then measured 271 us against stock's 265 at
    L = 4096 (225 against 263 on the GPU's clock), and the patch kept stock's attention at every
    length. A lone synchronised call is worse still (the H200's kernel: 0.61 ms for 0.26 ms of GPU
    time, bench/h200-2026-12-04-llama-v2.txt)."""
    import time

    first = fn()
    mx.eval(first)
    batch = max(1, min(LLAMA_TIMING_BATCH, (256 << 20) // max(1, first.nbytes)))
    del first
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(batch):
            mx.async_eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - t0) / batch)
    times.sort()
    return times[len(times) // 2]


def _llama_shape_class(axes, dtype):
    """The key of a measured choice: every axis as is but L, rounded up to a power of two."""
    L = axes["L"]
    return (axes["B"], axes["H"], axes["Hkv"], 1 << max(L - 1, 1).bit_length(), axes["D"], axes["causal"], str(dtype))


def patch_mlx_lm_llama(attention=None, min_len=LLAMA_MIN_LEN, admits=None, dtypes=None, choose="measured", lhd=None,
                       rope="auto", fuse_qkv=True, compile=True, fuse_mlp=True, fuse_decode=True):
    """Replaces mlx-lm's `mlx_lm.models.llama.Attention.__call__` (mlx-lm 0.32) so that a prompt
    chunk of at least `min_len` tokens attends with `attention(q, k, v, causal=0|1) -> o`
    (q [B, H, L, D], k and v [B, Hkv, L, D], o [B, H, L, D]) instead of
    `mx.fast.scaled_dot_product_attention`; projections, RoPE, the KV cache update and o_proj are
    stock's. Stock runs instead (the original method, or stock's SDPA after the cache update)
    wherever the kernel's shape class does not hold:
      "short"           fewer than `min_len` query tokens (decode: one token);
      "quantized_cache" a quantised KV cache (mlx-lm's quantised attention);
      "mask"            a mask other than "causal" or none (an array: sliding window, padding);
      "cache_offset"    a cache that already holds tokens (chunked prefill, a continued prompt):
                        the kernel attends L queries to the same L keys only (stock's SDPA
                        attends; the fused RoPE and stacked projection below still run there);
      "scale"           a scale other than 1/sqrt(head_dim), the kernel's;
      "dtype"           q in a dtype outside `dtypes` (None: any);
      "constraints"     `admits(axes)` is false (axes B, H, Hkv, L, D, causal).
    In a module exported for the attention task `attention` defaults to the module's kernel,
    `admits` to its constraints and builds (head sizes 64, 96, 128) and `dtypes` to its input
    dtype (f16: a bf16 or f32 model keeps stock); imported on its own, `attention` is required
    and `admits` / `dtypes` default to accepting everything.
      "slower"          choose="measured" and the kernel was not timed clearly faster than stock here;
      "untimed"         choose="measured", a new shape class met inside mx.compile (no timing).
    `min_len`: see LLAMA_MIN_LEN. `choose`: "measured" (default) times the kernel against stock's
    attention on the first call of each shape class (B, H, Hkv, D, causal, dtype and L rounded up
    to a power of two; LLAMA_TIMING_ROUNDS alternating rounds of LLAMA_TIMING_REPS calls each,
    medians) and keeps the kernel only where it is below LLAMA_MARGIN times stock's time, so
    patching never makes a model's attention slower than stock's by more than that timing's noise; a
    call inside a function transformation (mx.compile) cannot be timed and runs stock until one
    outside has chosen. "always" runs the kernel wherever it is admitted.
    Returns `unpatch()`, which restores the method found; `unpatch.stats` counts the calls per
    path ({"kernel": n, "stock": n}), `unpatch.reasons` the stock calls per reason above,
    `unpatch.choices` the measured choices ({shape class: (kernel s, stock s, kernel chosen)}).
    `lhd`: the same attention with q and o in mlx-lm's own [B, L, H, D] order,
    `(q [B, L, H, D], k, v, causal) -> o [B, L, H, D]` (default: `attention.lhd` if it has one; in
    an exported module, the kernel built with QO_LHD=1 where its source has that switch). It runs
    instead of `attention` where given: mlx-lm's RoPE leaves q in that storage and o_proj reads o
    that way, so neither is copied (`attention` makes q contiguous in [B, H, L, D] and o is
    transposed back: two copies of a query-sized array per call).
    `rope`: q and k of a prompt chunk that passed the checks above (before the measured choice:
    stock's attention then reads them too) are rotated (and v moved to the cache's order) by `rope(q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, D], module.rope) ->
    (q [B, L, H, D], k [B, Hkv, L, D], v [B, Hkv, L, D])` (or None: stock's RoPE and transpose)
    instead of stock's RoPE on transposed views; "auto" (default) is the fused RoPE kernel on MLX's
    CUDA back-end (mlx-lm's `nn.RoPE`, f16, head size a multiple of 8) and stock's RoPE elsewhere,
    None is always stock's. q stays in [B, L, H, D] storage: `lhd` reads it so, stock's SDPA reads
    the transposed view, `attention` gets that view (a kernel that needs it contiguous copies it).
    `unpatch.rope` counts the calls it rotated ({"fused": n}).
    `fuse_qkv`: where the fused RoPE ("auto") runs, the q, k and v projections are one matmul with
    their weights stacked and the RoPE kernel reads its output (default True). The stacked weight
    is made on a layer's first kernel-path call and kept on its Attention module; the three
    projections' weights become views of its rows (the same values, no second copy: the model's
    parameters are re-pointed and stay so after unpatch). Projections other than bias-free
    nn.Linear keep stock's three. `unpatch.qkv` counts the calls ({"fused": n}).
    `compile`: the kernel path's array code (the stacked projection with the fused RoPE; the lhd
    attention) runs through mx.compile, traced once per shape for every layer (up to
    LLAMA_COMPILE_SHAPES shapes, then uncompiled), so that building a prefill's graph costs less
    host time than stock's instead of more.
    `fuse_mlp`: mlx-lm's `llama.TransformerBlock.__call__` is replaced too, so that a prompt chunk
    of at least `min_len` tokens runs the rest of the block fused (default True): o_proj with the
    residual added in the matmul's epilogue (mx.addmm) where the attention took a path of this
    patch, then the post-attention RMSNorm, the gate and up projections as one matmul over their
    stacked weights (re-pointed as fuse_qkv's are), silu(g) * u in one launch on MLX's CUDA back-end
    (f16; mlx-lm's swiglu elsewhere) and down_proj with the second residual in its epilogue,
    compiled as `compile` says. Blocks whose MLP or norm are not mlx-lm's Llama ones (bias-free
    nn.Linear of the activations' dtype, nn.RMSNorm), shorter chunks and decode run stock's block.
    The residual sums are rounded once instead of twice (stock rounds the product, then the sum;
    a one-row chunk keeps stock's two, see LLAMA_ADDMM_MIN_ROWS): logits agree with stock's to f16
    rounding, not bit for bit. `unpatch.mlp` counts the blocks it
    ran ({"fused": n}).
    `fuse_decode`: where fuse_qkv and fuse_mlp hold, a chunk shorter than `min_len` with a KV cache
    (decode: one token) runs the whole block as few launches: the input RMSNorm, the stacked q, k and
    v projection and the fused RoPE at the cache's offset in one compiled stretch (the offset an input
    of the RoPE launch, so one trace serves every position), the cache update and stock's SDPA over
    the cache, then the fused rest above (default True). Stock's block is about 19 launches a layer
    (three projections, two RoPEs, the output's transpose, the residual adds...) and decode on MLX's
    CUDA back-end is bound by them, not by the weights' bytes; this path is about 13 (one token:
    o_proj and down_proj each a gemv and an add, LLAMA_ADDMM_MIN_ROWS).
    Its attention is stock's SDPA: `unpatch.stats` counts it as stock ("short"), `unpatch.decode`
    counts the blocks ({"fused": n}). A block's checks run on its first decode step and what they
    found is kept on it (its decode plan); later steps compare only the ids of its modules and
    weights, so a replaced weight or module makes the plan again (LLAMA_DECODE_PLAN)."""
    d_attention, d_admits, d_dtypes, d_lhd = _llama_module_defaults()
    if attention is None:
        attention = d_attention
        if admits is None:
            admits = d_admits
        if dtypes is None:
            dtypes = d_dtypes
        if lhd is None:
            lhd = d_lhd
    if lhd is None:
        lhd = getattr(attention, "lhd", None)
    if lhd is not None and not callable(lhd):
        raise TypeError("patch_mlx_lm_llama: lhd must be callable")
    if isinstance(rope, str):
        if rope != "auto":
            raise ValueError(f"patch_mlx_lm_llama: rope must be 'auto', None or a callable, not {rope!r}")
        rope = _llama_rope_default()
    if rope is not None and not callable(rope):
        raise TypeError("patch_mlx_lm_llama: rope must be 'auto', None or a callable")
    if attention is None:
        raise ValueError("patch_mlx_lm_llama: give attention= (a callable (q, k, v, causal) -> o)")
    if not callable(attention):
        raise TypeError("patch_mlx_lm_llama: attention must be callable")
    min_len = int(min_len)
    if min_len < 2:
        raise ValueError("patch_mlx_lm_llama: min_len must be >= 2 (one-token decode always runs stock)")
    dtypes = tuple(dtypes) if dtypes is not None else None
    if choose not in ("measured", "always"):
        raise ValueError(f"patch_mlx_lm_llama: choose must be 'measured' or 'always', not {choose!r}")
    choices = {}

    from mlx_lm.models import llama as _llama

    cls = _llama.Attention
    previous = cls.__dict__["__call__"]
    stock = getattr(previous, "_ksearch_stock", previous)
    stats = {"kernel": 0, "stock": 0}
    reasons = {}
    rope_stats = {"fused": 0}
    qkv_stats = {"fused": 0}
    mlp_stats = {"fused": 0}
    decode_stats = {"fused": 0}
    blk_cls = _llama.TransformerBlock
    blk_previous = blk_cls.__dict__["__call__"]
    blk_stock = getattr(blk_previous, "_ksearch_stock", blk_previous)
    swiglu = _llama_swiglu_cuda if _llama_rope_default() is not None else _llama_swiglu_ops

    # What `admits` said per shape: it evaluates the kernel's constraints and builds in Python
    # (~0.1 ms), once per layer and call otherwise, which a prefill of 16 layers notices.
    admitted = {}

    def _admitted(axes):
        k = tuple(sorted(axes.items()))
        ok = admitted.get(k)
        if ok is None:
            if len(admitted) >= 4096:
                admitted.clear()
            ok = admitted[k] = bool(admits(axes))
        return ok

    # The kernel path's two stretches of pure array code, compiled (mx.compile, one trace per
    # shape: the same for every layer, the weights being inputs) where `compile`: front, the
    # projections stacked into one matmul and the fused RoPE; back, the attention kernel up to
    # o_proj's input. Building a prefill's lazy graph in Python (the GPU idle meanwhile) took 1.7
    # ms for stock and 3.1 ms for the uncompiled patch at L = 4096 on the H200 (16 layers,
    # 2026-12-04, bench/h200-2026-12-04-llama-v2.txt): a tenth of the prefill.
    def front(x, w, H, Hkv, base, scale, offset):
        B, L, _ = x.shape
        qkv = (x @ w.T).reshape(B, L, H + 2 * Hkv, -1)
        return _llama_rope_cuda_qkv(qkv, H, Hkv, _LlamaRopeArgs(base, scale), offset)

    def back(q, k, v, causal):
        B, L = q.shape[:2]
        o = lhd(q, k, v, causal=causal).reshape(B, L, -1)
        return o if o.dtype == q.dtype else o.astype(q.dtype)

    # The block's rest after the attention (fuse_mlp): o_proj and the residual, the post-attention
    # norm, the MLP and its residual; `o` is o_proj's input (None: `r` is the attention's output).
    # With fewer than LLAMA_ADDMM_MIN_ROWS rows (decode), each product and its residual are a matmul
    # and an add, stock's arithmetic (see LLAMA_ADDMM_MIN_ROWS).
    addmm_rows = LLAMA_ADDMM_MIN_ROWS
    keep_plan = LLAMA_DECODE_PLAN

    def tail(x, o, wo, r, ln_w, wgu, wd, eps):
        B, L, M = x.shape
        rows = B * L
        x2 = x.reshape(rows, M)
        fold = rows >= addmm_rows
        if o is None:
            h = x2 + r.reshape(rows, M)
        else:
            o2 = o.reshape(rows, -1)
            h = mx.addmm(x2, o2, wo.T) if fold else x2 + o2 @ wo.T
        act = swiglu(mx.fast.rms_norm(h, ln_w, eps) @ wgu.T)
        return (mx.addmm(h, act, wd.T) if fold else h + act @ wd.T).reshape(B, L, M)

    # A decode step's front (fuse_decode): the input norm, the stacked projection and the fused RoPE
    # with its dims (the offset among them) and p arrays as inputs.
    def front_d(x, ln_w, w, dims, p, H, Hkv, eps):
        B, L, _ = x.shape
        qkv = (mx.fast.rms_norm(x, ln_w, eps) @ w.T).reshape(B, L, H + 2 * Hkv, -1)
        return _llama_rope_qkv_dims(qkv, H, Hkv, dims, p)

    front_c, back_c = (mx.compile(front), mx.compile(back)) if compile else (None, None)
    front_d_c = mx.compile(front_d) if compile else None
    tail_o_c = mx.compile(lambda x, o, wo, ln_w, wgu, wd, eps: tail(x, o, wo, None, ln_w, wgu, wd, eps)) if compile else None
    tail_r_c = mx.compile(lambda x, r, ln_w, wgu, wd, eps: tail(x, None, None, r, ln_w, wgu, wd, eps)) if compile else None
    compiled_sigs = set()

    def _compiled_for(sig, fn_c, fn):
        """The compiled function for a signature it may trace (LLAMA_COMPILE_SHAPES of them: MLX
        keeps every trace for the process's life), else the plain one."""
        if fn_c is None:
            return fn
        if sig not in compiled_sigs:
            if len(compiled_sigs) >= LLAMA_COMPILE_SHAPES:
                return fn
            compiled_sigs.add(sig)
        return fn_c

    def stock_call(reason, self, x, mask, cache):
        stats["stock"] += 1
        reasons[reason] = reasons.get(reason, 0) + 1
        return stock(self, x, mask, cache)

    def fused_front(self, x, offset):
        """(q [B, L, H, D], k, v [B, Hkv, L, D]) rotated at `offset` by the stacked projection and
        the fused RoPE, or None where fuse_qkv does not hold here."""
        if not (fuse_qkv and rope is _llama_rope_cuda):
            return None
        if not _llama_rope_fits_shape(self.rope, self.head_dim, x.dtype, self["q_proj"].get("weight", x).dtype):
            return None  # checked before stacking: a model the kernel does not serve keeps its weights as they are
        w = _llama_qkv_weight(self)
        if w is None or w.dtype != x.dtype:
            return None
        B, L, _ = x.shape
        H, Hkv, r = self.n_heads, self.n_kv_heads, self.rope
        sig = ("front", B, L, x.shape[2], H, Hkv, self.head_dim, str(x.dtype), float(r.base), float(r.scale), offset)
        qkv_stats["fused"] += 1
        return _compiled_for(sig, front_c, front)(x, w, H, Hkv, r.base, r.scale, offset)

    def chunk_call(self, x, mask, cache, offset):
        """A prompt chunk after others (chunked prefill): the kernel attends L queries to the same
        L keys only, so stock's SDPA attends, to the whole cache; the projections and RoPE are the
        patch's where they hold (MLX's CUDA back-end), stock's whole call elsewhere."""
        B, L, _ = x.shape
        rotated = fused_front(self, x, offset)
        if rotated is None and rope is _llama_rope_cuda:
            rotated = _llama_rope_cuda(self.q_proj(x).reshape(B, L, self.n_heads, -1),
                                       self.k_proj(x).reshape(B, L, self.n_kv_heads, -1),
                                       self.v_proj(x).reshape(B, L, self.n_kv_heads, -1), self.rope, offset)
        if rotated is None:
            return None, stock_call("cache_offset", self, x, mask, cache)
        stats["stock"] += 1
        reasons["cache_offset"] = reasons.get("cache_offset", 0) + 1
        rope_stats["fused"] += 1
        queries = rotated[0].transpose(0, 2, 1, 3)
        keys, values = cache.update_and_fetch(rotated[1], rotated[2])
        o = _llama.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return o.transpose(0, 2, 1, 3).reshape(B, L, -1), None

    def attend(self, x, mask, cache):
        """(o, None) with o_proj's input o [B, L, H * D] where a path of this patch ran, or
        (None, r) with stock's whole output r."""
        B, L, _ = x.shape
        if L < min_len:
            return None, stock_call("short", self, x, mask, cache)
        if hasattr(cache, "bits"):
            return None, stock_call("quantized_cache", self, x, mask, cache)
        if not (mask is None or (isinstance(mask, str) and mask == "causal")):
            return None, stock_call("mask", self, x, mask, cache)
        if cache is not None:
            off = getattr(cache, "offset", None)
            if not (isinstance(off, int) and off == 0):
                if isinstance(off, int) and off > 0 and hasattr(cache, "update_and_fetch"):
                    return chunk_call(self, x, mask, cache, off)
                return None, stock_call("cache_offset", self, x, mask, cache)
        if abs(self.scale * _llama_math.sqrt(self.head_dim) - 1.0) > 1e-6:
            return None, stock_call("scale", self, x, mask, cache)

        # stock's arithmetic (mlx-lm 0.32 llama.Attention.__call__) up to the attention
        rotated = fused_front(self, x, 0)
        if rotated is None:
            queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if rope is not None:
                rotated = rope(queries.reshape(B, L, self.n_heads, -1), keys.reshape(B, L, self.n_kv_heads, -1),
                               values.reshape(B, L, self.n_kv_heads, -1), self.rope)
        if rotated is not None:
            # q in [B, L, H, D] storage (viewed as [B, H, L, D]), k and v in [B, Hkv, L, D], as
            # stock's RoPE and transpose would give them (the cache offset is 0 here)
            rope_stats["fused"] += 1
            queries, keys, values = rotated[0].transpose(0, 2, 1, 3), rotated[1], rotated[2]
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
        else:
            values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            if cache is not None:
                queries = self.rope(queries, offset=cache.offset)
                keys = self.rope(keys, offset=cache.offset)
                keys, values = cache.update_and_fetch(keys, values)
            else:
                queries = self.rope(queries)
                keys = self.rope(keys)

        causal = 1 if mask is not None else 0
        axes = {"B": B, "H": queries.shape[1], "Hkv": keys.shape[1], "L": L, "D": queries.shape[3],
                "causal": causal}
        key = _llama_shape_class(axes, queries.dtype)
        reason = None
        if keys.shape[2] != L or values.shape[2] != L:
            reason = "cache_offset"  # a cache that returned more (or fewer) keys than queries
        elif dtypes is not None and queries.dtype not in dtypes:
            reason = "dtype"
        elif values.shape[3] != queries.shape[3] or keys.shape[1] != values.shape[1]:
            reason = "constraints"
        elif choose == "measured" and key in choices and not choices[key][2]:
            reason = "slower"  # decided for this shape class: nothing more to check
        elif admits is not None and not _admitted(axes):
            reason = "constraints"
        def sdpa():
            return _llama.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

        # Each path up to o_proj's input [B, L, H * D], as the layer runs it (what is timed).
        def stock_out():
            return sdpa().transpose(0, 2, 1, 3).reshape(B, L, -1)

        def kernel_out():
            if lhd is not None:
                sig = ("back", B, L, axes["H"], axes["Hkv"], axes["D"], causal, str(queries.dtype))
                o = _compiled_for(sig, back_c, back)(queries.transpose(0, 2, 1, 3), keys, values, causal)
            else:
                o = attention(queries, keys, values, causal=causal).transpose(0, 2, 1, 3).reshape(B, L, -1)
            return o if o.dtype == queries.dtype else o.astype(queries.dtype)

        if reason is None and choose == "measured":
            if key not in choices:
                try:
                    mx.eval(queries, keys, values)
                    tk, ts = [], []
                    for _ in range(LLAMA_TIMING_ROUNDS):
                        tk.append(_llama_time("kernel", kernel_out, LLAMA_TIMING_REPS))
                        ts.append(_llama_time("stock", stock_out, LLAMA_TIMING_REPS))
                    t_kernel, t_stock = sorted(tk)[len(tk) // 2], sorted(ts)[len(ts) // 2]
                    choices[key] = (t_kernel, t_stock, t_kernel < LLAMA_MARGIN * t_stock)
                except Exception:  # a tracer (mx.compile, grad): nothing can be timed in here
                    choices.pop(key, None)
                    reason = "untimed"
            if reason is None and not choices[key][2]:
                reason = "slower"
        if reason is None:
            stats["kernel"] += 1
            output = kernel_out()
        else:
            stats["stock"] += 1
            reasons[reason] = reasons.get(reason, 0) + 1
            output = stock_out()
        return output, None

    def __call__(self, x, mask=None, cache=None):
        if x.shape[1] < min_len:  # decode and short chunks: stock's, with no frame of this patch between
            stats["stock"] += 1
            reasons["short"] = reasons.get("short", 0) + 1
            return stock(self, x, mask, cache)
        o, r = attend(self, x, mask, cache)
        return r if o is None else self.o_proj(o)

    def mlp_weights(self, x):
        """(post-attention norm, stacked gate/up weight, down_proj's weight) of block `self` where
        fuse_mlp's path serves it with activations of x's dtype, else None."""
        import mlx.nn as nn

        mlp, ln = self["mlp"], self["post_attention_layernorm"]
        if type(mlp) is not _llama.MLP or type(ln) is not nn.RMSNorm or "weight" not in ln:
            return None
        down = mlp["down_proj"]
        if type(down) is not nn.Linear or "bias" in down or down["weight"].dtype != x.dtype:
            return None
        if mlp["gate_proj"].get("weight", x).dtype != x.dtype:
            return None  # checked before stacking: a model this path does not serve keeps its weights
        wgu = _llama_gate_up_weight(mlp)
        return None if wgu is None else (ln, wgu, down["weight"])

    def o_weight(attn, x):
        """o_proj's weight where it is a bias-free nn.Linear of x's dtype (the fused tail's matmul),
        else None."""
        import mlx.nn as nn

        op = attn["o_proj"]
        return op["weight"] if type(op) is nn.Linear and "bias" not in op and op["weight"].dtype == x.dtype else None

    def tail_with_o(x, o, wo, ln, wgu, wd):
        B, L, M = x.shape
        eps = float(ln.eps)
        f = _compiled_for(("tail_o", B, L, M, o.shape[-1], wgu.shape[0], str(x.dtype), eps), tail_o_c, None)
        if f is not None:
            return f(x, o, wo, ln["weight"], wgu, wd, eps)
        return tail(x, o, wo, None, ln["weight"], wgu, wd, eps)

    def fused_block(self, x, mask, cache):
        """The block's output through the fused tail, or None where fuse_mlp does not hold."""
        B, L, M = x.shape
        if not fuse_mlp or L < min_len:
            return None
        mw = mlp_weights(self, x)
        if mw is None:
            return None
        ln, wgu, wd = mw
        attn = self["self_attn"]
        xn = self["input_layernorm"](x)
        if type(attn) is cls and cls.__dict__.get("__call__") is __call__:
            o, r = attend(attn, xn, mask, cache)
        else:
            o, r = None, attn(xn, mask, cache)
        if o is not None:
            wo = o_weight(attn, x)
            if wo is None:
                o, r = None, attn["o_proj"](o)
        mlp_stats["fused"] += 1
        eps = float(ln.eps)
        if o is not None:
            return tail_with_o(x, o, wo, ln, wgu, wd)
        f = _compiled_for(("tail_r", B, L, M, wgu.shape[0], str(x.dtype), eps), tail_r_c, None)
        if f is not None:
            return f(x, r, ln["weight"], wgu, wd, eps)
        return tail(x, None, None, r, ln["weight"], wgu, wd, eps)

    def decode_leaves(blk):
        """What a decode plan of block `blk` is checked on: its attention, MLP and norms, the norms'
        weights and the projections' (the stacked matrices' row views once made)."""
        attn, mlp = blk.get("self_attn"), blk.get("mlp")
        ln0, ln = blk.get("input_layernorm"), blk.get("post_attention_layernorm")
        leaves = [attn, mlp, ln0, ln]
        for m, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                sub = m.get(n) if isinstance(m, dict) else None
                leaves.append(sub.get("weight") if isinstance(sub, dict) else sub)
        leaves += [n.get("weight") if isinstance(n, dict) else None for n in (ln0, ln)]
        return leaves

    def decode_plan(self, x):
        """What fuse_decode's path serves block `self` with for activations of x's dtype, or None
        where it does not hold: (the attention, H, Hkv, its RoPE module, the input norm's weight and
        eps, the stacked q/k/v weight, o_proj's weight, the post-attention norm's weight and eps, the
        stacked gate/up weight, down_proj's weight, the compiled steps per (B, L)). Checked on a
        block's first decode step and kept on the block with the objects it was checked on; a later
        step only compares their ids (a replaced weight or module: loading, fine-tuning, quantising,
        makes it again). The checks cost about 7.5 us of Python a layer and step, a tenth of a
        millisecond a token over 16 layers, where the host's work is what bounds decode."""
        import mlx.nn as nn

        plan = self.__dict__.get("_ks_decode_plan") if keep_plan else None
        if (plan is not None and plan[0] is decode_block and plan[1] == x.dtype
                and plan[2] == tuple(map(id, decode_leaves(self)))):
            return plan[4]
        attn, ln0 = self["self_attn"], self["input_layernorm"]
        got = None
        if type(attn) is cls and type(ln0) is nn.RMSNorm and "weight" in ln0 and _llama_rope_fits_shape(
                attn.rope, attn.head_dim, x.dtype, attn["q_proj"].get("weight", x).dtype):  # before stacking
            mw = mlp_weights(self, x)
            wo = o_weight(attn, x)
            w = None if mw is None or wo is None else _llama_qkv_weight(attn)
            if w is not None and w.dtype == x.dtype:
                ln, wgu, wd = mw
                got = (attn, attn.n_heads, attn.n_kv_heads, attn.rope, ln0["weight"], float(ln0.eps), w, wo,
                       ln["weight"], float(ln.eps), wgu, wd, {})
        if not keep_plan:
            return got
        leaves = decode_leaves(self)  # after stacking: the projections' weights are its rows now
        # not Module.__setattr__: no parameter or child of the model; the leaves are kept so that their ids stay theirs
        object.__setattr__(self, "_ks_decode_plan", (decode_block, x.dtype, tuple(map(id, leaves)), leaves, got))
        return got

    def decode_block(self, x, mask, cache):
        """A chunk shorter than min_len (decode) through fuse_decode's path, or None where it does
        not hold (then stock's block runs)."""
        if not (fuse_decode and fuse_mlp and fuse_qkv and rope is _llama_rope_cuda) or cache is None:
            return None
        if cls.__dict__.get("__call__") is not __call__ or hasattr(cache, "bits"):
            return None
        off = getattr(cache, "offset", None)
        if not (isinstance(off, int) and off >= 0 and hasattr(cache, "update_and_fetch")):
            return None
        if not (mask is None or (isinstance(mask, str) and mask == "causal")):
            return None
        plan = decode_plan(self, x)
        if plan is None:
            return None
        attn, H, Hkv, r, ln0_w, eps0, w, wo, ln_w, eps, wgu, wd, steps = plan
        B, L, M = x.shape
        fns = steps.get((B, L))
        if fns is None:
            dt = str(x.dtype)
            fns = steps[(B, L)] = (
                _compiled_for(("front_d", B, L, M, H, Hkv, attn.head_dim, dt, eps0), front_d_c, front_d),
                _compiled_for(("tail_o", B, L, M, H * attn.head_dim, wgu.shape[0], dt, eps), tail_o_c, None))
        dims, p = _llama_rope_args_for(B, L, H, Hkv, off, r)
        q, k, v = fns[0](x, ln0_w, w, dims, p, H, Hkv, eps0)
        keys, values = cache.update_and_fetch(k, v)
        o = _llama.scaled_dot_product_attention(q.transpose(0, 2, 1, 3), keys, values, cache=cache, scale=attn.scale,
                                                mask=mask)
        stats["stock"] += 1
        reasons["short"] = reasons.get("short", 0) + 1
        decode_stats["fused"] += 1
        # [B, H, 1, D] is [B, 1, H, D] in memory: one token's output needs no transpose (a copy)
        o = o.reshape(B, L, -1) if L == 1 else o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if fns[1] is not None:
            return fns[1](x, o, wo, ln_w, wgu, wd, eps)
        return tail(x, o, wo, None, ln_w, wgu, wd, eps)

    def block_call(self, x, mask=None, cache=None):
        if x.shape[1] < min_len:  # decode: fuse_decode's path, else stock's block as it is
            out = decode_block(self, x, mask, cache)
            return blk_stock(self, x, mask, cache) if out is None else out
        out = fused_block(self, x, mask, cache)
        return blk_stock(self, x, mask, cache) if out is None else out

    __call__._ksearch_stock = stock
    __call__._ksearch_patched = True
    cls.__call__ = __call__
    block_call._ksearch_stock = blk_stock
    block_call._ksearch_patched = True
    blk_cls.__call__ = block_call

    def unpatch():
        if cls.__dict__.get("__call__") is __call__:
            cls.__call__ = previous
        if blk_cls.__dict__.get("__call__") is block_call:
            blk_cls.__call__ = blk_previous

    unpatch.stats = stats
    unpatch.reasons = reasons
    unpatch.min_len = min_len
    unpatch.lhd = lhd is not None
    unpatch.rope = rope_stats
    unpatch.qkv = qkv_stats
    unpatch.mlp = mlp_stats
    unpatch.decode = decode_stats
    unpatch.choices = choices
    unpatch.admitted = admitted
    return unpatch


if globals().get("CANDIDATE") is not None and (globals().get("TASK") or {}).get("name") == "attention":
    if "__all__" in globals() and "patch_mlx_lm_llama" not in __all__:  # noqa: F821 (the tail's)
        __all__.append("patch_mlx_lm_llama")  # noqa: F821
        __all__.append("LLAMA_MIN_LEN")  # noqa: F821
