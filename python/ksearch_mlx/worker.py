"""The ksearch MLX worker: JSON lines on stdin/stdout, as docs/protocol.md describes.

    python -m ksearch_mlx.worker --backend mlx-cuda|mlx-metal [--device N] [--cache DIR]

Requests (one JSON object a line): ``hello``, ``eval``, ``baseline``, ``reference``,
``shutdown``. Every request with an id gets exactly one reply; a line that cannot be read gets
``{"reply": "error", ...}`` and the worker keeps serving. The reply channel is a duplicate of
the original stdout; file descriptor 1 points at stderr before anything else runs, so a
kernel (or MLX) that prints cannot corrupt the channel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

from . import __version__

# A device fault leaves MLX's CUDA context unusable: the worker says why on stderr and exits
# with the code the Rust CUDA worker uses, so the supervisor reports a crash and starts afresh.
FAULT_EXIT_CODE = 75
# The byte peak is the measured copy bandwidth over this (as the Rust CUDA device states it,
# crates/eval/src/cuda.rs): a kernel that mostly reads can beat a copy by a little.
FLOOR_SLACK = 0.8
# Upper bounds on any device's arithmetic and special-function peaks (per second), those of
# the Rust CUDA device: the floor never rejects an honest time, it only catches kernels that
# skip the work.
PEAK_FLOPS = 1000e12
PEAK_TRANSCENDENTALS = 4.5e12
FLUSH_BYTES = {"mlx-cuda": 256 << 20, "mlx-metal": 64 << 20}


class Fault(Exception):
    """The device faulted; the process cannot go on."""


def one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).strip().split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Error classes (docs/mlx.md: compile, launch, infra; faults end the worker)
# ---------------------------------------------------------------------------------------------

_FAULT_WORDS = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "device-side assert",
    "hardware exception",
    "gpu address fault",
    "caused gpu timeout",
    "gpu hang",
    "context is destroyed",
)
_COMPILE_WORDS = (
    "failed to compile",  # NVRTC's log follows (mlx/backend/cuda/jit_module.cpp)
    "nvrtc",
    "failed to load compiled",  # the module did not load (e.g. static shared memory over the limit)
    "unable to build metal library",
    "program_source:",  # Metal compiler diagnostics
)
_LAUNCH_WORDS = (
    "too many resources",
    "invalid configuration",
    "invalid argument",
    "shared memory",
    "threadgroup",
    "launch",
    "exceeds",
    "out of resources",
    "max_dynamic_shared",
)
_MEMORY_WORDS = ("out of memory", "unable to allocate", "[malloc]")


def classify(exc: BaseException) -> tuple[str, str]:
    """(failure class, message) for an exception raised by building or running a candidate."""
    from .runtime import LaunchError, SourceError

    text = str(exc) or type(exc).__name__
    low = text.lower()
    if isinstance(exc, SourceError):
        return "compile", text
    if isinstance(exc, (LaunchError, ValueError)):
        return "launch", text
    if any(w in low for w in _FAULT_WORDS):
        raise Fault(text)
    if any(w in low for w in _MEMORY_WORDS):
        return "out_of_memory", text
    if any(w in low for w in _COMPILE_WORDS):
        return "compile", text
    if any(w in low for w in _LAUNCH_WORDS):
        return "launch", text
    return "infra", f"{type(exc).__name__}: {text}"


def die(message: str) -> None:
    sys.stderr.write(f"mlx device fault, worker exits: {message}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_reps(run: Callable[[], None], timing: dict, flush: Optional[Callable[[], None]]) -> list[float]:
    """Warm-up calls, then timed repetitions (microseconds each) until `min_reps` and
    `target_ms`, at most `max_reps`; `flush` runs between repetitions, outside the timed region.
    A plain loop for measurements of MLX itself; candidates are timed by the judge (judge.py)."""
    for _ in range(int(timing.get("warmup", 2))):
        run()
    max_reps = max(1, int(timing.get("max_reps", 50)))
    min_reps = min(int(timing.get("min_reps", 5)), max_reps)
    target_ms = float(timing.get("target_ms", 300.0))
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_reps:
        if flush is not None and timing.get("flush", True):
            flush()
        t = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t) * 1e6)
        if len(samples) >= min_reps and (time.perf_counter() - started) * 1e3 >= target_ms:
            break
    return samples


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, backend: str, cache: Optional[str]):
        import mlx.core as mx

        self.mx = mx
        self.backend = backend
        self.cache = cache
        self.kernels, self.device, self.reason = detect(backend)
        self._copy_bps: Optional[float] = None
        self._flush_src: Any = None
        self._compiled: set[tuple] = set()  # kernel instantiations compiled in this process
        self._first_calls = 0  # first (compiling) calls made in the current evaluation
        self._clock: Any = None
        self.clock_note = "host clock"
        if backend == "mlx-cuda" and self.kernels and not host_clock_asked():
            from . import gpuclock
            from .gpuclock import GpuClock

            self._clock, why = GpuClock.create()
            self.clock_note = (
                f"GPU clock (a gate, the cache flush, then stamps around the calls on MLX's stream, empty bracket "
                f"{self._clock.empty_ns / 1e3:.1f} us; "
                f"self-check: {gpuclock.CHECK_CALLS} calls of {gpuclock.CHECK_NS / 1e3:.0f} us measured "
                f"{self._clock.check_us:.1f} us each)"
                if self._clock is not None
                else f"host clock (no GPU clock: {one_line(why, 200)})"
            )
        elif backend == "mlx-cuda" and host_clock_asked():
            self.clock_note = "host clock (KSEARCH_MLX_CLOCK=host)"

    def hello(self) -> dict:
        return {
            "reply": "hello",
            "backend": self.backend,
            "device": self.device,
            "pid": os.getpid(),
            "version": __version__,
            "mlx": self.mx.__version__,
            "kernels": self.kernels,
            "clock": self.clock_note,
        }

    # -- device measurements ------------------------------------------------------------------

    def on_gpu(self) -> bool:
        return self.mx.default_device() == self.mx.gpu

    def copy_bps(self) -> float:
        """Device copy bandwidth (bytes read + written per second), measured once.

        Two sizes, and the bandwidth from the difference of their times: every MLX evaluation
        carries a fixed cost (tens of microseconds on CUDA) that would otherwise lower it.
        """
        if self._copy_bps is None:
            mx = self.mx
            small, big = ((64 << 20) // 4, (512 << 20) // 4) if self.on_gpu() else ((8 << 20) // 4, (32 << 20) // 4)

            def best_time(n: int) -> float:
                x = mx.zeros((n,), mx.float32)
                mx.eval(x)
                best = math.inf
                for _ in range(5):
                    t = time.perf_counter()
                    mx.eval(x + 1.0)
                    mx.synchronize()
                    best = min(best, time.perf_counter() - t)
                return best

            best_time(small)  # warm-up: the first evaluation compiles the add
            t_small, t_big = best_time(small), best_time(big)
            if t_big > t_small:
                self._copy_bps = 2 * (big - small) * 4 / (t_big - t_small)
            else:
                self._copy_bps = 2 * big * 4 / max(t_big, 1e-9)
        return self._copy_bps

    def flush(self) -> None:
        """Write a buffer well past the last-level cache, so no repetition starts warm."""
        mx = self.mx
        if self._flush_src is None:
            nbytes = FLUSH_BYTES.get(self.backend, 64 << 20) if self.on_gpu() else 64 << 20
            self._flush_src = mx.zeros((nbytes // 4,), mx.float32)
            mx.eval(self._flush_src)
        mx.eval(self._flush_src + 1.0)
        mx.synchronize()

    def flush_lead(self, after: list) -> list:
        """The flush as GPU work queued behind `after` (a GPU-clock sample's lead: gpuclock.py)."""
        mx = self.mx
        if self._flush_src is None:
            self.flush()
        src = mx.depends([self._flush_src], after)[0]
        return [src + 1.0]

    def peaks(self) -> Any:
        """What this device states for the floor rule: the measured copy bandwidth over
        FLOOR_SLACK, and generous arithmetic and special-function peaks."""
        from .judge import Peaks

        return Peaks(bytes=self.copy_bps() / FLOOR_SLACK, flops=PEAK_FLOPS, transcendentals=PEAK_TRANSCENDENTALS)

    # -- requests -----------------------------------------------------------------------------

    def reference(self, req: dict) -> dict:
        from .data import as_f32, draw_inputs, to_numpy
        from .reference import compute

        task, w = req["task"], req["workload"]
        backend = req.get("backend", self.backend)
        inputs = draw_inputs(task, backend, w["axes"], int(w["seed"]))
        refs = compute(task, as_f32(inputs), w["axes"])
        return {
            "reply": "reference",
            "id": req.get("id"),
            "inputs": {k: to_numpy(v).tolist() for k, v in inputs.items()},
            "outputs": {k: to_numpy(v).tolist() for k, v in refs.items()},
        }

    def eval(self, req: dict, progress: Callable[[str], None]) -> dict:
        reply = empty_reply(req.get("id", 0))
        started = time.perf_counter()
        state: dict[str, Any] = {"compiled": None}

        def compiled() -> None:
            if state["compiled"] is None:
                state["compiled"] = time.perf_counter()
                progress("compiled")

        try:
            self._eval(req, reply, compiled, progress)
        except Fault as f:
            die(str(f))
        except Exception as e:  # never let an evaluation go unanswered
            traceback.print_exc(file=sys.stderr)
            reply["failure"] = {"class": "infra", "message": one_line(f"{type(e).__name__}: {e}")}
        finally:
            self.mx.clear_cache()
        reply["overhead_s"] = max(0.0, time.perf_counter() - started - reply["kernel_s"] - reply["compile"]["seconds"])
        account(reply, started, state["compiled"])
        return reply

    def _eval(self, req: dict, reply: dict, compiled: Callable[[], None], progress: Callable[[str], None]) -> None:
        from .runtime import CompiledCandidate

        backend = req.get("backend", self.backend)
        if backend != self.backend:
            reply["failure"] = {"class": "infra", "message": f"this worker serves {self.backend}, the request asks for {backend}"}
            return
        if not self.kernels:
            reply["failure"] = {"class": "infra", "message": self.reason}
            return
        task, candidate = req["task"], req["candidate"]
        try:
            cc = CompiledCandidate(candidate, task, backend)
        except Exception as e:
            cls, msg = classify(e)
            reply["failure"] = {"class": cls, "message": one_line(msg)}
            if cls == "compile":
                reply["compile"]["log"] = msg
            return
        workloads = req.get("workloads", [])
        self._first_calls = 0
        for i, w in enumerate(workloads):
            res = workload_result(w)
            if self._run_workload(req, cc, w, res, reply, compiled):
                return  # a compile error: the evaluation has no results to show
            reply["workloads"].append(res)
            compiled()
            progress(f"workload {i + 1}/{len(workloads)}")
        # The launch configuration first, then the judge's notes (how each workload was timed).
        notes = reply["resources"].get("raw", "")
        reply["resources"] = resources(cc, workloads)
        reply["resources"]["raw"] = "\n".join(r for r in (reply["resources"]["raw"], notes) if r)

    def _instances(self, cc: Any, axes: dict[str, int]) -> list[tuple]:
        """The kernel instantiations a workload needs (name and template values)."""
        return [(p.name, p.template, p.shared) for p in cc.plan(axes)]

    def _run_workload(self, req: dict, cc: Any, w: dict, res: dict, reply: dict, compiled: Callable[[], None]) -> bool:
        """Check and time one workload (judge.py); True when the evaluation must stop (compile
        error)."""
        from .judge import GUARD_BYTES, Judge, RunError

        axes = w["axes"]
        try:
            instances = self._instances(cc, axes)
        except Exception as e:
            res["failure"] = {"class": classify(e)[0], "message": one_line(classify(e)[1])}
            return False
        # MLX 0.32 keeps custom kernels in memory only (its PTX disk cache holds its own JIT
        # kernels): they are cached when this process compiled these instantiations before.
        seen = all(i in self._compiled for i in instances)

        def first(seconds: float) -> None:
            reply["compile"]["seconds"] += seconds
            reply["compile"]["cached"] = seen if not self._first_calls else (reply["compile"]["cached"] and seen)
            self._first_calls += 1
            self._compiled.update(instances)
            compiled()

        judge = Judge(
            task=req["task"],
            backend=req["backend"],
            timing=req.get("timing") or {},
            peaks=self.peaks(),
            flush=self.flush,
            flush_lead=self.flush_lead,
            check_only=bool(req.get("check_only", False)),
            on_first=first,
            clock=self._clock,
        )
        try:
            # Guard tails only on poisoned (checked) calls: a timed call stays one kernel node
            # per launch, as the native baseline's calls are (the tail's slices would add MLX
            # graph nodes), and a poisoned call is told apart by its contents anyway.
            judge.workload(lambda inputs, init: cc.run(inputs, axes, init, GUARD_BYTES if init is not None else 0), w, res)
        except RunError as e:
            cls, msg = classify(e.exc)
            if e.first and cls == "compile":
                reply["compile"]["log"] = msg
                where = "" if not reply["workloads"] else f"workload {w.get('label', '')}: "
                reply["failure"] = {"class": "compile", "message": one_line(where + msg)}
                return True
            res["failure"] = {"class": cls, "message": one_line(msg if e.first else f"while timing: {msg}")}
        finally:
            reply["kernel_s"] += judge.kernel_s
            if judge.raw:
                reply["resources"]["raw"] = (reply["resources"].get("raw", "") + "\n" + "\n".join(judge.raw)).strip()
        return False

    def baseline(self, req: dict, progress: Callable[[str], None]) -> dict:
        reply = empty_reply(req.get("id", 0))
        reply["compile"]["cached"] = True
        started = time.perf_counter()
        try:
            self._baseline(req, reply, progress)
        except Fault as f:
            die(str(f))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            reply["failure"] = {"class": "infra", "message": one_line(f"{type(e).__name__}: {e}")}
        finally:
            self.mx.clear_cache()
        reply["overhead_s"] = max(0.0, time.perf_counter() - started - reply["kernel_s"])
        account(reply, started, started)
        return reply

    def _baseline(self, req: dict, reply: dict, progress: Callable[[str], None]) -> None:
        from .baselines import BASELINES, describe
        from .judge import Judge, RunError
        from .runtime import mx_dtype, tensor_dtype

        task = req["task"]
        backend = req.get("backend", self.backend)
        name = task.get("reference", "")
        if name not in BASELINES:
            reply["failure"] = {"class": "infra", "message": f"no MLX baseline for `{name}`"}
            return
        fn = BASELINES[name]
        out_specs = task.get("outputs", [])
        consts = task.get("constants") or {}
        reply["resources"]["raw"] = describe(name)
        progress("compiled")
        workloads = req.get("workloads", [])
        # The baseline is what users run: its check is reported, not held against it (mlx-lm's
        # Mamba forms delta * x * B in f16, so its f32 state is f16-accurate). It is timed on
        # the same pools and fresh windows as a candidate.
        judge = Judge(
            task=task,
            backend=backend,
            timing=req.get("timing") or {},
            peaks=self.peaks(),
            flush=self.flush,
            flush_lead=self.flush_lead,
            check_only=bool(req.get("check_only", False)),
            strict=False,
            on_first=lambda s: reply.__setitem__("kernel_s", reply["kernel_s"] + s),
            clock=self._clock,
        )

        def call(inputs: dict, init: Optional[float]) -> dict:
            outs = fn(inputs, axes, consts)
            return {s["name"]: o.astype(mx_dtype(tensor_dtype(task, backend, s))) for s, o in zip(out_specs, outs)}

        for i, w in enumerate(workloads):
            axes = w["axes"]
            res = workload_result(w)
            try:
                judge.workload(call, w, res)
            except RunError as e:
                cls, msg = classify(e.exc)
                res["failure"] = {"class": "infra" if cls == "compile" else cls, "message": one_line(msg)}
            reply["workloads"].append(res)
            progress(f"workload {i + 1}/{len(workloads)}")
        reply["kernel_s"] += judge.kernel_s
        if judge.notes:
            reply["compile"]["log"] = "outside tolerance (reported, not a failure): " + "; ".join(judge.notes)


def empty_reply(id_: Any) -> dict:
    return {
        "reply": "eval",
        "id": id_,
        "compile": {"log": "", "cached": False, "seconds": 0.0},
        "resources": {"raw": ""},
        "workloads": [],
        "failure": None,
        "overhead_s": 0.0,
        "kernel_s": 0.0,
    }


def account(reply: dict, started: float, compiled: Optional[float]) -> None:
    """The pool's accounting fields (docs/protocol.md): compile seconds from the request to its
    first compiled call (the whole request when none compiled), then the device held to the end
    (this worker is the only one on its device and takes no lock), as a span of the machine's
    monotonic clock."""
    end = time.perf_counter()
    split = end if compiled is None else compiled
    reply["compile_s"] = max(0.0, split - started)
    reply["device_s"] = max(0.0, end - split)
    reply["lock_wait_s"] = 0.0
    if reply["device_s"] > 0:
        now = time.monotonic()
        reply["device_spans"] = [[now - reply["device_s"], now]]


def workload_result(w: dict) -> dict:
    from .data import empty_check

    return {
        "label": w.get("label", ""),
        "axes": w.get("axes", {}),
        "seed": w.get("seed", 0),
        "check": empty_check(),
        "timing": None,
        "bytes": 0.0,
        "flops": 0.0,
        "floor_us": None,
        "failure": None,
    }


def resources(cc: Any, workloads: list[dict]) -> dict:
    """What MLX lets us know: the launch configuration of the first workload, per launch."""
    if not workloads:
        return {"raw": ""}
    try:
        plans = cc.plan(workloads[0]["axes"])
    except Exception:
        return {"raw": ""}
    raw = "; ".join(f"{p.entry}: grid {p.grid} threadgroup {p.threadgroup} shared {p.shared}" for p in plans)
    return {"shared_bytes": max((p.shared for p in plans), default=0), "raw": raw}


def detect(backend: str) -> tuple[bool, str, str]:
    """(kernels available, device string, reason when not)."""
    import mlx.core as mx

    ver = mx.__version__
    try:
        name = str(mx.device_info().get("device_name", "")) or "GPU"
    except Exception:
        name = "GPU"
    if backend == "mlx-cuda":
        has = hasattr(mx, "cuda") and mx.cuda.is_available()
        if has:
            try:
                probe = mx.fast.cuda_kernel(
                    name="ks_probe", input_names=["x"], output_names=["y"], source="y[0] = x[0] + 1.0f;"
                )
                (y,) = probe(
                    inputs=[mx.array([1.0], dtype=mx.float32)],
                    grid=(1, 1, 1),
                    threadgroup=(1, 1, 1),
                    output_shapes=[(1,)],
                    output_dtypes=[mx.float32],
                )
                mx.eval(y)
                if float(y[0].item()) == 2.0:
                    return True, f"{name} (mlx {ver}, cuda)", ""
                reason = f"mlx {ver}: the CUDA probe kernel returned {y[0].item()} instead of 2"
            except Exception as e:
                reason = f"mlx {ver}: a CUDA probe kernel failed: {one_line(str(e), 200)}"
        else:
            reason = (
                f"mlx {ver}: no CUDA back-end; install mlx-cuda-13 on Linux with an NVIDIA GPU, "
                "or run on macOS for Metal"
            )
    elif backend == "mlx-metal":
        if hasattr(mx, "metal") and mx.metal.is_available():
            return True, f"{name} (mlx {ver}, metal)", ""
        reason = (
            f"mlx {ver}: no Metal back-end; Metal needs macOS on Apple silicon "
            "(on Linux with an NVIDIA GPU use --backend mlx-cuda)"
        )
    else:
        reason = f"unknown back-end `{backend}` (mlx-cuda or mlx-metal)"
    return False, f"cpu ({reason})", reason


# ---------------------------------------------------------------------------------------------
# Protocol loop
# ---------------------------------------------------------------------------------------------


def _finite(obj: Any) -> Any:
    # serde_json reads no NaN/Infinity literals: keep every float finite on the wire.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else math.copysign(1.7976931348623157e308, obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class Channel:
    """The reply channel: a duplicate of the original stdout; fd 1 then points at stderr."""

    def __init__(self) -> None:
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)
        self.out = os.fdopen(fd, "w", encoding="utf-8", buffering=1)

    def send(self, msg: dict) -> bool:
        try:
            try:
                line = json.dumps(msg, allow_nan=False)
            except ValueError:
                line = json.dumps(_finite(msg), allow_nan=False)
            self.out.write(line + "\n")
            self.out.flush()
            return True
        except (OSError, ValueError):
            return False


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ksearch_mlx.worker", description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=["mlx-cuda", "mlx-metal"])
    p.add_argument("--device", type=int, default=None, help="GPU ordinal (CUDA)")
    p.add_argument("--cache", default=None, help="directory for MLX's compiled-kernel cache")
    return p.parse_args(argv)


def host_clock_asked() -> bool:
    """KSEARCH_MLX_CLOCK=host: time mlx-cuda calls on the host clock, as mlx-metal does (and
    leave MLX's CUDA graphs on), e.g. to compare the two clocks."""
    return os.environ.get("KSEARCH_MLX_CLOCK", "").strip().lower() == "host"


def setup_environment(args: argparse.Namespace) -> None:
    """Environment MLX reads when it starts: which GPU, where compiled kernels are cached,
    f32 matrix products in f32 (MLX's CUDA back-end uses TF32 by default, about 3e-4 relative
    error, which the f32 references and tolerances cannot afford), and no CUDA graphs (the GPU
    clock's calls must run in order)."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    if args.backend == "mlx-cuda" and not host_clock_asked():
        # Launches straight to MLX's stream, in order: the GPU clock (gpuclock.py) times calls
        # one after the other; a CUDA graph would run a batch's independent calls side by side.
        os.environ["MLX_USE_CUDA_GRAPHS"] = "0"
    if args.device is not None and args.backend == "mlx-cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v for v in visible.split(",") if v.strip()] if visible else None
        if ids is not None and 0 <= args.device < len(ids):
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[args.device]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.device)
    if args.cache and "MLX_PTX_CACHE_DIR" not in os.environ:
        path = os.path.join(args.cache, "mlx-ptx")
        try:
            os.makedirs(path, exist_ok=True)
            os.environ["MLX_PTX_CACHE_DIR"] = path
        except OSError:
            pass


def serve(worker: Worker, channel: Channel) -> int:
    hello = worker.hello()
    if not channel.send(hello):
        return 3
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError("a request is a JSON object with a string `op`")
        except ValueError as e:
            channel.send({"reply": "error", "message": one_line(f"bad request: {e}")})
            continue
        op = req["op"]
        if op == "shutdown":
            return 0
        if op == "hello":
            channel.send(hello)
            continue
        rid = req.get("id")

        def progress(stage: str, rid: Any = rid) -> None:
            channel.send({"reply": "progress", "id": rid, "stage": stage})

        if op == "eval":
            reply = worker.eval(req, progress)
        elif op == "baseline":
            reply = worker.baseline(req, progress)
        elif op == "reference":
            try:
                reply = worker.reference(req)
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                reply = {"reply": "error", "message": one_line(f"reference: {type(e).__name__}: {e}")}
        else:
            reply = {"reply": "error", "message": f"unknown op `{op}` (hello, eval, baseline, reference, shutdown)"}
        if not channel.send(reply):
            return 3


def main(argv: Optional[list[str]] = None) -> int:
    channel = Channel()
    args = parse_args(argv)
    setup_environment(args)
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        # One line for the supervisor to show, instead of a traceback.
        print(
            f"ksearch_mlx: MLX cannot be imported by {sys.executable} ({e}); "
            "pip install mlx==0.32.4 (and mlx-cuda-13 on Linux with an NVIDIA GPU)",
            file=sys.stderr,
        )
        return 4
    worker = Worker(args.backend, args.cache)
    return serve(worker, channel)


if __name__ == "__main__":
    sys.exit(main())
