//! Host-side pieces every back-end shares: inputs from a seed, the f64 reference, checks.

use ksearch_core::data::{self, Check};
use ksearch_core::protocol::{Failure, FailureClass, WorkloadReq};
use ksearch_core::reference::{self, RefArgs};
use ksearch_core::task::{DType, Task, shape_of};

/// The name of a signal that ends a process running candidate code.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        31 => "SIGSYS",
        _ => "a signal",
    }
}

/// One tensor on the host: its values as f64 (exactly representable in `dtype`) and its bytes.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
    pub bytes: Vec<u8>,
}

impl HostTensor {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Fresh inputs for workload `w`, drawn from its seed.
pub fn make_inputs(task: &Task, backend: ksearch_core::Backend, w: &WorkloadReq) -> Result<Vec<HostTensor>, String> {
    task.inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let shape = shape_of(t, &w.axes)?;
            let n: usize = shape.iter().product();
            let dtype = task.dtype_on(backend, t);
            let values = data::draw(&t.init, dtype, n, data::sub_seed(w.seed, i));
            let bytes = data::encode(&values, dtype);
            Ok(HostTensor {
                name: t.name.clone(),
                dtype,
                shape,
                values,
                bytes,
            })
        })
        .collect()
}

/// Output element counts and dtypes for workload `w`.
pub fn output_specs(task: &Task, backend: ksearch_core::Backend, w: &WorkloadReq) -> Result<Vec<(String, usize, DType)>, String> {
    task.outputs
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                shape_of(t, &w.axes)?.iter().product(),
                task.dtype_on(backend, t),
            ))
        })
        .collect()
}

/// The host f64 reference for these inputs: a built-in one, or the C++ file the task brings
/// (compiled and called here, on the trusted side; see `task_ref`).
pub fn host_reference(task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, String> {
    // A tensor that carries only its bytes (the judge's checked inputs) is decoded here.
    let decoded: Vec<std::borrow::Cow<[f64]>> = inputs
        .iter()
        .map(|t| {
            if t.values.len() == t.len() {
                std::borrow::Cow::Borrowed(t.values.as_slice())
            } else {
                std::borrow::Cow::Owned(ksearch_core::data::decode(&t.bytes, t.dtype))
            }
        })
        .collect();
    let values: Vec<&[f64]> = decoded.iter().map(|c| c.as_ref()).collect();
    let out = match task.reference.name() {
        Some(name) => {
            let f = reference::lookup(name).ok_or_else(|| format!("unknown reference `{name}`"))?;
            // A built-in reference on a task whose tensors it does not fit (the task file's
            // mistake) must not take the worker down and be blamed on a kernel.
            let args = RefArgs {
                axes: &w.axes,
                constants: &task.constants,
                inputs: values,
            };
            quiet_catch(|| f(&args)).map_err(|why| {
                format!(
                    "the built-in reference `{name}` does not fit task `{}` on this workload ({why}; or its inputs, outputs or axes differ from what `{name}` computes)",
                    task.name
                )
            })?
        }
        None => crate::task_ref::run(task, &w.axes, &values)?,
    };
    if out.len() != task.outputs.len() {
        return Err(format!(
            "reference `{}` returned {} outputs, task declares {}",
            task.reference,
            out.len(),
            task.outputs.len()
        ));
    }
    for (t, o) in task.outputs.iter().zip(&out) {
        let want: usize = ksearch_core::task::shape_of(t, &w.axes)?.iter().product();
        if o.len() != want {
            return Err(format!(
                "reference `{}` gave {} values for output `{}`, whose shape has {want}",
                task.reference,
                o.len(),
                t.name
            ));
        }
    }
    Ok(out)
}

/// Check every output against the reference; the merged check and the failure it implies.
pub fn check_outputs(
    task: &Task,
    backend: ksearch_core::Backend,
    outputs: &[Vec<u8>],
    refs: &[Vec<f64>],
) -> (Check, Option<Failure>) {
    check_outputs_with(task, backend, outputs, refs, |i, out, r, tol| {
        data::check(out, task.dtype_on(backend, &task.outputs[i]), r, tol)
    })
}

/// `check_outputs` with the element check supplied (output index, bytes, reference, tolerance).
pub fn check_outputs_with(
    task: &Task,
    backend: ksearch_core::Backend,
    outputs: &[Vec<u8>],
    refs: &[Vec<f64>],
    check: impl Fn(usize, &[u8], &[f64], ksearch_core::task::Tolerance) -> Check,
) -> (Check, Option<Failure>) {
    let mut all = Check::default();
    let mut msg = None;
    for (i, ((spec, out), r)) in task.outputs.iter().zip(outputs).zip(refs).enumerate() {
        let dt = task.dtype_on(backend, spec);
        let tol = task.tolerance_of(dt);
        let c = check(i, out, r, tol);
        if !c.passed() && msg.is_none() {
            let (i, got, want) = c.first_bad.clone().unwrap_or((0, "?".into(), "?".into()));
            msg = Some((spec.name.clone(), i, got, want, c.clone(), tol));
        }
        all.merge(&c);
    }
    let failure = msg.map(|(name, i, got, want, c, tol)| {
        let class = if c.unwritten > 0 {
            FailureClass::Unwritten
        } else if c.nan > 0 {
            FailureClass::Nan
        } else {
            FailureClass::Wrong
        };
        let message = match class {
            FailureClass::Unwritten => format!("output `{name}`: {} of {} elements never written (first at {i})", c.unwritten, c.elements),
            FailureClass::Nan => format!("output `{name}`: {} NaN/inf elements (first at {i}: {got}, reference {want})", c.nan),
            _ => format!(
                "output `{name}`: {} of {} elements outside tolerance (atol {}, rtol {}); first at {i}: got {got}, reference {want}; max abs err {:.3e}",
                c.mismatches, c.elements, tol.atol, tol.rtol, c.max_abs_err
            ),
        };
        Failure { class, message }
    });
    (all, failure)
}

// Inputs

/// The same tensors as [`make_inputs`] for each of `ws` (byte for byte: the same seeded draws),
/// drawn on several threads: large tensors are cut into parts, each part's generator skipped
/// ahead to its first element. Large workloads (attention 4x32x2048x128: 100 M values) otherwise
/// spend seconds here per evaluation.
pub fn make_inputs_parallel(
    task: &Task,
    backend: ksearch_core::Backend,
    ws: &[WorkloadReq],
) -> Result<Vec<Vec<HostTensor>>, String> {
    make_inputs_parts(task, backend, ws, 1 << 20, |n| n)
}

/// [`make_inputs_parallel`] with parts of at least `min_part` elements (tests force small parts)
/// and `len(n)` values drawn for a tensor of `n` elements (longer for the judge's pools; the
/// first `n` are the same either way).
pub fn make_inputs_parts(
    task: &Task,
    backend: ksearch_core::Backend,
    ws: &[WorkloadReq],
    min_part: usize,
    len: impl Fn(usize) -> usize,
) -> Result<Vec<Vec<HostTensor>>, String> {
    draw_inputs(task, backend, ws, min_part, len, true)
}

/// [`make_inputs_parts`], keeping only the encoded bytes when `keep_values` is false (the
/// tensors' `values` are then empty: the judge's pools, whose windows are decoded only where
/// a host reference needs them).
pub fn draw_inputs(
    task: &Task,
    backend: ksearch_core::Backend,
    ws: &[WorkloadReq],
    min_part: usize,
    len: impl Fn(usize) -> usize,
    keep_values: bool,
) -> Result<Vec<Vec<HostTensor>>, String> {
    use ksearch_core::data;
    use ksearch_core::task::shape_of;
    struct Job {
        wi: usize,
        ti: usize,
        seed: u64,
        shape: Vec<usize>,
        n: usize,
    }
    let mut jobs: Vec<Job> = Vec::new();
    for (wi, w) in ws.iter().enumerate() {
        for (ti, t) in task.inputs.iter().enumerate() {
            let shape = shape_of(t, &w.axes)?;
            let n = len(shape.iter().product());
            jobs.push(Job {
                wi,
                ti,
                seed: data::sub_seed(w.seed, ti),
                shape,
                n,
            });
        }
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 32);
    let total: usize = jobs.iter().map(|j| j.n).sum();
    let target = (total / threads).max(min_part.max(1));
    // Each tensor's buffers, filled in place by parts of `step` elements.
    let mut bufs: Vec<(Vec<f64>, Vec<u8>, ksearch_core::task::DType)> = jobs
        .iter()
        .map(|j| {
            let dtype = task.dtype_on(backend, &task.inputs[j.ti]);
            (
                vec![0.0f64; if keep_values { j.n } else { 0 }],
                vec![0u8; j.n * dtype.size()],
                dtype,
            )
        })
        .collect();
    {
        // (tensor, first element, its values when kept, its bytes)
        type Part<'a> = (usize, usize, Option<&'a mut [f64]>, &'a mut [u8]);
        let mut work: Vec<Part> = Vec::new();
        for (k, (j, (v, b, dtype))) in jobs.iter().zip(bufs.iter_mut()).enumerate() {
            let step = j.n.div_ceil(j.n.div_ceil(target).max(1)).max(1);
            if keep_values {
                for (i, (vs, bs)) in v.chunks_mut(step).zip(b.chunks_mut(step * dtype.size())).enumerate() {
                    work.push((k, i * step, Some(vs), bs));
                }
            } else {
                for (i, bs) in b.chunks_mut(step * dtype.size()).enumerate() {
                    work.push((k, i * step, None, bs));
                }
            }
        }
        // Largest parts first.
        work.sort_by_key(|w| w.3.len());
        let fill = |(k, start, kept, bs): Part| {
            let j = &jobs[k];
            let t = &task.inputs[j.ti];
            let dtype = task.dtype_on(backend, t);
            data::draw_range(&t.init, dtype, j.seed, start, bs, kept);
        };
        if threads == 1 || work.len() <= 1 {
            work.into_iter().for_each(fill);
        } else {
            let n_threads = threads.min(work.len());
            let queue = std::sync::Mutex::new(work);
            std::thread::scope(|s| {
                for _ in 0..n_threads {
                    s.spawn(|| {
                        loop {
                            let item = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                            match item {
                                Some(w) => fill(w),
                                None => break,
                            }
                        }
                    });
                }
            });
        }
    }
    let mut out: Vec<Vec<HostTensor>> = ws.iter().map(|_| Vec::new()).collect();
    for (j, (values, bytes, dtype)) in jobs.iter().zip(bufs) {
        out[j.wi].push(HostTensor {
            name: task.inputs[j.ti].name.clone(),
            dtype,
            shape: j.shape.clone(),
            values,
            bytes,
        });
    }
    Ok(out)
}

/// [`check_outputs`] on several threads: every element of every output is compared in parts;
/// when all pass, the merged [`ksearch_core::data::Check`] is the one `check_outputs` returns
/// (counts and maxima do not depend on the order). Anything else (a failure, an output with no
/// tolerance of its own) goes through `check_outputs` itself, for its exact report.
pub fn check_outputs_parallel(
    task: &Task,
    backend: ksearch_core::Backend,
    outputs: &[Vec<u8>],
    refs: &[Vec<f64>],
    poisons: &[Vec<u8>],
) -> (ksearch_core::data::Check, Option<Failure>) {
    let serial = || {
        check_outputs_with(task, backend, outputs, refs, |i, out, r, tol| {
            let dt = task.dtype_on(backend, &task.outputs[i]);
            match poisons.get(i) {
                Some(p) => data::check_with_poison(out, dt, r, tol, p),
                None => data::check(out, dt, r, tol),
            }
        })
    };
    use ksearch_core::data::Check;
    const PART: usize = 1 << 20;
    let total: usize = refs.iter().map(|r| r.len()).sum();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 32);
    let own_tol = task
        .outputs
        .iter()
        .all(|t| task.tolerance.contains_key(&task.dtype_on(backend, t)));
    if threads == 1 || total < 2 * PART || !own_tol || outputs.len() != refs.len() || task.outputs.len() != refs.len() {
        return serial();
    }
    type Part<'a> = (
        &'a [u8],
        &'a [f64],
        ksearch_core::task::DType,
        ksearch_core::task::Tolerance,
        Option<&'a [u8]>,
    );
    let mut work: Vec<Part> = Vec::new();
    for (i, ((spec, out), r)) in task.outputs.iter().zip(outputs).zip(refs).enumerate() {
        let dt = task.dtype_on(backend, spec);
        let tol = task.tolerance[&dt];
        if out.len() != r.len() * dt.size() {
            return serial();
        }
        for (o, rr) in out.chunks(PART * dt.size()).zip(r.chunks(PART)) {
            work.push((o, rr, dt, tol, poisons.get(i).map(|p| p.as_slice())));
        }
    }
    let queue = std::sync::Mutex::new(work);
    let merged = std::sync::Mutex::new(Check::default());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut mine = Check::default();
                loop {
                    let item = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some((o, r, dt, tol, p)) = item else { break };
                    mine.merge(&match p {
                        Some(p) => data::check_with_poison(o, dt, r, tol, p),
                        None => data::check(o, dt, r, tol),
                    });
                }
                merged.lock().unwrap_or_else(|e| e.into_inner()).merge(&mine);
            });
        }
    });
    let c = merged.into_inner().unwrap_or_else(|e| e.into_inner());
    if !c.passed() {
        return serial();
    }
    (c, None)
}

/// This machine's host name ("localhost" when it has none).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(h) if rc == 0 && !h.is_empty() => h.to_string(),
        _ => "localhost".into(),
    }
}

/// Seconds of the machine's monotonic clock (`CLOCK_MONOTONIC`): one clock for every process
/// of the machine, so spans reported by different workers can be compared.
pub fn monotonic_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The measurement lock of one device: an exclusive `flock` on
/// `<cache>/locks/<backend>-<host>-<device>.lock`, held by a worker only while it runs a
/// candidate on the device (runs, checks, timing), never while it compiles or draws inputs.
/// Several worker processes of one device thus compile at the same time and measure one at a
/// time. The name says which physical device (the machine's host name, and on CUDA the GPU's
/// PCI address rather than an ordinal a launcher may remap), so workers on several machines
/// sharing one cache folder lock only their own device. The kernel releases the lock when its
/// holder dies, so a crashed worker never leaves it taken.
#[derive(Debug)]
pub struct DeviceLock {
    path: std::path::PathBuf,
    file: Option<std::fs::File>,
}

/// What one hold of the lock cost and when it began.
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    pub waited_s: f64,
    pub from: f64,
}

impl DeviceLock {
    /// The lock of `device` (e.g. `0`, or a PCI address) of this machine for `backend`.
    pub fn new(cache: &std::path::Path, backend: ksearch_core::Backend, device: &str) -> DeviceLock {
        let name: String = format!("{backend}-{}-{device}", host_name())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        DeviceLock {
            path: cache.join("locks").join(format!("{name}.lock")),
            file: None,
        }
    }

    /// The lock of this machine's cores (the CPU back-end's device).
    pub fn cpu(cache: &std::path::Path) -> DeviceLock {
        DeviceLock::new(cache, ksearch_core::Backend::Cpu, "0")
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Wait for the lock (opening its file the first time). An error is the machine's, not a
    /// candidate's (`infra`).
    pub fn acquire(&mut self) -> Result<Hold, String> {
        use std::os::fd::AsRawFd;
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("cannot create the device lock folder {}: {e}", dir.display()))?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&self.path)
                .map_err(|e| format!("cannot open the device lock {}: {e}", self.path.display()))?;
            self.file = Some(f);
        }
        let fd = self.file.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
        let t0 = monotonic_s();
        loop {
            // SAFETY: flock on a descriptor this value owns.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("cannot lock {}: {e}", self.path.display()));
            }
        }
        let from = monotonic_s();
        Ok(Hold {
            waited_s: from - t0,
            from,
        })
    }

    /// Release the lock taken by `acquire`; the span it was held, `[from, to]`.
    pub fn release(&mut self, hold: Hold) -> [f64; 2] {
        use std::os::fd::AsRawFd;
        let to = monotonic_s();
        if let Some(f) = &self.file {
            // SAFETY: flock on a descriptor this value owns.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
        [hold.from, to]
    }
}

pub(crate) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "unknown panic".into()
    }
}

/// Run `f`, turning a panic (cudarc panics when a library or symbol is missing) into an error,
/// without the default hook printing it.
pub(crate) fn quiet_catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    // The panic hook is process-wide: threads inside `quiet_catch` at once share one silenced
    // hook, and the first one in keeps the previous hook to put back when the last one leaves
    // (swapping it per call would leave the silent hook installed when calls overlap).
    type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;
    static QUIET: std::sync::Mutex<(usize, Option<Hook>)> = std::sync::Mutex::new((0, None));
    {
        let mut q = QUIET.lock().unwrap_or_else(|e| e.into_inner());
        if q.0 == 0 {
            q.1 = Some(std::panic::take_hook());
            std::panic::set_hook(Box::new(|_| {}));
        }
        q.0 += 1;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    {
        let mut q = QUIET.lock().unwrap_or_else(|e| e.into_inner());
        q.0 -= 1;
        if q.0 == 0
            && let Some(prev) = q.1.take()
        {
            std::panic::set_hook(prev);
        }
    }
    r.map_err(panic_message)
}
