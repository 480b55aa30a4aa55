//! The judge: the one evaluation skeleton every Rust back-end runs (poison → run → check →
//! time → re-check → floor). It is trusted code and never trusts the candidate:
//!
//! - inputs come from a pool drawn once per workload; every run copies each input from a fresh
//!   random offset of its pool, so no run sees inputs it has seen before at that address, and
//!   outputs get a fresh random NaN poison, so a checked run looks like any other;
//! - the first run is checked; among the timed runs, one chosen at random among the first
//!   `min_reps`, the last, and each other with probability 1/min_reps (a few in all) are
//!   checked too (the back-end stops the candidate before outputs are read), each against its
//!   own reference, computed only after the candidate's runs; where reading back is cheap
//!   (`Device::uniform_read_back`) every timed run is read back alike, so the candidate cannot
//!   tell the checked ones;
//! - inputs are read back after checked runs and compared byte for byte (`mutated_input`);
//! - the time is measured by trusted code around the run, and a median under the physical
//!   floor is `below_floor`, never a result.
//!
//! A back-end implements [`Device`]: where buffers live and how the candidate is run.

use ksearch_core::data::{self, Rng};
use ksearch_core::protocol::{Failure, FailureClass, Timing, TimingReq, WorkloadReq, WorkloadResult};
use ksearch_core::task::{DType, Task};

use crate::common::{HostTensor, host_reference};

/// Why a workload stopped. `fatal`: the candidate's process or context is gone (crash, device
/// fault); the evaluation ends with this failure.
#[derive(Debug, Clone)]
pub struct Stop {
    pub failure: Failure,
    pub fatal: bool,
}

impl Stop {
    pub fn fail(class: FailureClass, message: impl Into<String>) -> Stop {
        Stop {
            failure: Failure {
                class,
                message: message.into(),
            },
            fatal: false,
        }
    }
    pub fn fatal(class: FailureClass, message: impl Into<String>) -> Stop {
        Stop {
            failure: Failure {
                class,
                message: message.into(),
            },
            fatal: true,
        }
    }
}

/// Every output's bytes, then every input's, as read back after a run.
pub type ReadBack = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// Where one workload's buffers live and how the candidate runs on them. Trusted code.
pub trait Device {
    /// Prepare workload `index` of the request: input pools (bytes), input and output sizes
    /// (bytes) and the dimensions passed to the kernel.
    fn bind(&mut self, index: usize, dims: &[i64], pools: &[&[u8]], inputs: &[usize], outputs: &[usize]) -> Result<(), Stop>;
    /// Copy input `i` from its pool, starting at byte `offsets[i]`, into the input buffer.
    fn stage(&mut self, offsets: &[usize]) -> Result<(), Stop>;
    /// Fill output `i` with copies of `patterns[i]`.
    fn poison(&mut self, patterns: &[Vec<u8>]) -> Result<(), Stop>;
    /// Does the device take `stage_fresh` (every value of every run new)? A device whose
    /// staging is a copy on another processor takes windows as they are.
    fn fresh_values(&self) -> bool {
        false
    }
    /// `stage`, each input's window changed by `fresh[i]` on its way (see `data::Fresh`).
    fn stage_fresh(&mut self, offsets: &[usize], fresh: &[data::Fresh]) -> Result<(), Stop> {
        let _ = fresh;
        self.stage(offsets)
    }
    /// Evict caches before a timed run.
    fn flush(&mut self) {}
    /// Run every launch once; the seconds it took, measured by trusted code.
    fn run(&mut self) -> Result<f64, Stop>;
    /// After a run: make sure the candidate is no longer running (e.g. stop its process), then
    /// read back every output and input.
    fn read_back(&mut self) -> Result<ReadBack, Stop>;
    /// `read_back` into buffers the judge owns (their contents replaced), so that a read-back
    /// costs the same whether the judge then keeps it or not.
    fn read_back_into(&mut self, into: &mut ReadBack) -> Result<(), Stop> {
        *into = self.read_back()?;
        Ok(())
    }
    /// Is every timed run read back (`read_back_into`), checked or not, so that nothing the
    /// candidate can observe tells the checked runs from the others? Cheap where the outputs
    /// are in host memory (the CPU runner); a device whose read-back copies large outputs off
    /// the device reads back only the runs it checks.
    fn uniform_read_back(&self) -> bool {
        false
    }
    /// The reference outputs for these inputs (f64, the task's declared outputs).
    fn reference(&mut self, task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, Stop> {
        host_reference(task, w, inputs).map_err(|e| Stop::fail(FailureClass::Infra, e))
    }
    /// Buffers the judge is done with (read-backs, references): a device may keep them for its
    /// next read-backs and references, whose pages are then already mapped.
    fn recycle(&mut self, _bytes: Vec<Vec<u8>>, _refs: Vec<Vec<f64>>) {}
    /// The fastest this device can possibly go, for the floor rule.
    fn peaks(&self) -> Peaks;
    /// Does the judge's host work (comparing inputs, preparing references, checking outputs)
    /// disturb what this device measures? Then the device lock is held across it too; otherwise
    /// it is released for that work, so other workers measure on the device meanwhile.
    fn host_work_disturbs_timing(&self) -> bool {
        true
    }
}

/// The device lock as one workload uses it: taken for the device's phases (runs, read-backs,
/// device references), let go for the judge's host work when that does not disturb timings.
/// Every hold is accounted (`device_s`, `lock_wait_s`, `device_spans`).
pub struct Phases<'a> {
    lock: &'a mut crate::common::DeviceLock,
    hold: Option<crate::common::Hold>,
    keep: bool,
    pub device_s: f64,
    pub waited_s: f64,
    pub spans: Vec<[f64; 2]>,
}

impl<'a> Phases<'a> {
    pub fn new(lock: &'a mut crate::common::DeviceLock, keep: bool) -> Phases<'a> {
        Phases {
            lock,
            hold: None,
            keep,
            device_s: 0.0,
            waited_s: 0.0,
            spans: Vec::new(),
        }
    }
    /// Hold the lock (waiting for it if another worker measures).
    pub fn device(&mut self) -> Result<(), Stop> {
        if self.hold.is_none() {
            let h = self.lock.acquire().map_err(|e| Stop::fatal(FailureClass::Infra, e))?;
            self.waited_s += h.waited_s;
            self.hold = Some(h);
        }
        Ok(())
    }
    /// Host work follows: let the lock go unless host work disturbs this device's timings.
    pub fn host(&mut self) {
        if !self.keep {
            self.release();
        }
    }
    /// Let the lock go.
    pub fn release(&mut self) {
        if let Some(h) = self.hold.take() {
            let span = self.lock.release(h);
            self.device_s += span[1] - span[0];
            self.spans.push(span);
        }
    }
}

/// Upper bounds a device states for itself (per second). Each back-end derives them from what
/// it measured, with its own margin for what the measurement cannot see (caches, noise).
#[derive(Debug, Clone, Copy)]
pub struct Peaks {
    pub bytes: f64,
    pub flops: f64,
    /// Transcendental functions (exp, log…); infinite where not limiting.
    pub transcendentals: f64,
}

/// The one floor rule: no run can move its minimum bytes faster than the device's peak
/// bandwidth, nor do its flops or transcendentals faster than their peaks. A median below
/// this is a bug or a cheat (`below_floor`), never a result.
pub fn floor_s(p: Peaks, bytes: f64, flops: f64, transcendentals: f64) -> f64 {
    (bytes / p.bytes.max(1.0))
        .max(flops / p.flops.max(1.0))
        .max(transcendentals / p.transcendentals.max(1.0))
}

/// An input's pool: values drawn once for the workload, longer than the input so each run
/// takes a window at a fresh offset.
struct Pool {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
    /// The pool's encoded elements (`len` plus the extra that offsets range over).
    bytes: Vec<u8>,
}

/// Where a judge's time goes, per step, for diagnosis: with `KSEARCH_JUDGE_PROFILE=<file>` set
/// in the search's environment, every worker appends one line per workload to that file
/// (`judge-profile <task> <workload> step=seconds …`). Nothing is measured otherwise.
mod profile {
    use std::cell::RefCell;
    use std::time::Instant;

    thread_local! {
        static STEPS: RefCell<Option<Vec<(&'static str, f64)>>> = const { RefCell::new(None) };
    }

    pub fn enabled() -> bool {
        std::env::var_os("KSEARCH_JUDGE_PROFILE").is_some()
    }

    /// Start a workload's record.
    pub fn begin() {
        if enabled() {
            STEPS.with(|s| *s.borrow_mut() = Some(Vec::new()));
        }
    }

    /// Run `f`, adding its seconds to `step`.
    pub fn time<T>(step: &'static str, f: impl FnOnce() -> T) -> T {
        let on = STEPS.with(|s| s.borrow().is_some());
        if !on {
            return f();
        }
        let t = Instant::now();
        let r = f();
        add(step, t);
        r
    }

    /// Add the seconds since `t` to `step`.
    pub fn add(step: &'static str, t: Instant) {
        let dt = t.elapsed().as_secs_f64();
        STEPS.with(|s| {
            if let Some(v) = s.borrow_mut().as_mut() {
                match v.iter_mut().find(|(n, _)| *n == step) {
                    Some(e) => e.1 += dt,
                    None => v.push((step, dt)),
                }
            }
        });
    }

    /// Append the workload's record to the profile file.
    pub fn end(task: &str, label: &str) {
        let Some(steps) = STEPS.with(|s| s.borrow_mut().take()) else {
            return;
        };
        let Some(path) = std::env::var_os("KSEARCH_JUDGE_PROFILE") else {
            return;
        };
        let mut line = format!("judge-profile {task} {label}");
        for (n, t) in steps {
            line.push_str(&format!(" {n}={t:.4}"));
        }
        line.push('\n');
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// The most timed runs of a workload that are checked (the random one among the first
/// `min_reps` and the last included).
const CHECKED_TIMED: usize = 4;
/// Bytes of read-backs a workload may keep for its checks: fewer checked timed runs (never
/// fewer than two) where a run's inputs and outputs are larger.
const KEPT_BYTES: usize = 1 << 30;

/// Extra pool elements beyond the input: enough distinct windows that runs almost never
/// repeat one.
fn pool_extra(n: usize) -> usize {
    (n / 4).max(4096)
}

fn make_pools(task: &Task, backend: ksearch_core::Backend, w: &WorkloadReq) -> Result<Vec<Pool>, String> {
    let drawn = crate::common::draw_inputs(task, backend, std::slice::from_ref(w), 1 << 20, |n| n + pool_extra(n), false)?;
    Ok(drawn
        .into_iter()
        .next()
        .unwrap_or_default()
        .into_iter()
        .map(|t| Pool {
            len: t.shape.iter().product(),
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            bytes: t.bytes,
        })
        .collect())
}

/// What one checked run saw.
struct Seen {
    /// Element offsets into each pool.
    offsets: Vec<usize>,
    /// The run's change of each input's values (`Fresh::NONE` where the device takes windows
    /// as they are).
    fresh: Vec<data::Fresh>,
    poisons: Vec<Vec<u8>>,
    outputs: Vec<Vec<u8>>,
    inputs: Vec<Vec<u8>>,
    what: &'static str,
}

/// Evaluate the candidate (already loaded in `dev`) on workload `index` of the request, with
/// the input pools drawn for it. `kernel_s` accumulates the seconds the candidate ran.
#[allow(clippy::too_many_arguments)]
fn judge_workload(
    dev: &mut dyn Device,
    ph: &mut Phases,
    task: &Task,
    backend: ksearch_core::Backend,
    index: usize,
    w: &WorkloadReq,
    timing: &TimingReq,
    check_only: bool,
    pools: Vec<Pool>,
    kernel_s: &mut f64,
) -> Result<WorkloadResult, Stop> {
    let mut res = WorkloadResult {
        label: w.label.clone(),
        axes: w.axes.clone(),
        seed: w.seed,
        ..WorkloadResult::default()
    };
    let outs = crate::common::output_specs(task, backend, w).map_err(|e| Stop::fail(FailureClass::Infra, e))?;
    let dims: Vec<i64> = task.axes.iter().map(|a| w.axes.get(a).copied().unwrap_or(0)).collect();
    let in_bytes: Vec<usize> = pools.iter().map(|p| p.len * p.dtype.size()).collect();
    let out_bytes: Vec<usize> = outs.iter().map(|(_, n, dt)| n * dt.size()).collect();
    let pool_bytes: Vec<&[u8]> = pools.iter().map(|p| p.bytes.as_slice()).collect();
    profile::time("lock", || ph.device())?;
    profile::time("bind", || dev.bind(index, &dims, &pool_bytes, &in_bytes, &out_bytes))?;
    res.bytes = task.min_bytes(backend, &w.axes).unwrap_or(0.0);
    res.flops = task.flops(&w.axes);
    let floor_s = floor_s(dev.peaks(), res.bytes, res.flops, task.transcendentals(&w.axes));
    res.floor_us = Some(floor_s * 1e6);

    // The judge's own randomness (offsets, poisons, which runs are checked): derived from the
    // evaluation's seed, which the candidate never sees.
    let mut rng = Rng::new(data::sub_seed(w.seed, 0x4A55_4447));
    let out_types: Vec<DType> = outs.iter().map(|(_, _, d)| *d).collect();
    type Prepared = (Vec<usize>, Vec<data::Fresh>, Vec<Vec<u8>>);
    let fresh_values = dev.fresh_values();
    let prepare = |dev: &mut dyn Device, rng: &mut Rng, flush: bool| -> Result<Prepared, Stop> {
        let offsets: Vec<usize> = pools
            .iter()
            .map(|p| (rng.next_u64() % (pools_extra_of(p) as u64 + 1)) as usize)
            .collect();
        let byte_offsets: Vec<usize> = offsets.iter().zip(&pools).map(|(o, p)| o * p.dtype.size()).collect();
        // Every value new in every run: a window of the pool changed by a fresh scale.
        let fresh: Vec<data::Fresh> = pools
            .iter()
            .zip(&task.inputs)
            .map(|(p, t)| {
                if fresh_values {
                    data::Fresh::draw(&t.init, p.dtype, rng)
                } else {
                    data::Fresh::NONE
                }
            })
            .collect();
        if fresh_values {
            profile::time("stage", || dev.stage_fresh(&byte_offsets, &fresh))?;
        } else {
            profile::time("stage", || dev.stage(&byte_offsets))?;
        }
        let poisons: Vec<Vec<u8>> = out_types.iter().map(|d| data::random_poison(*d, rng)).collect();
        profile::time("poison", || dev.poison(&poisons))?;
        if flush {
            profile::time("flush", || dev.flush());
        }
        Ok((offsets, fresh, poisons))
    };

    // 1. A first run, checked at once: a wrong kernel is not timed.
    let (offsets, fresh, poisons) = prepare(dev, &mut rng, false)?;
    *kernel_s += profile::time("run", || dev.run())?;
    let (outputs, inputs) = profile::time("read_back", || dev.read_back())?;
    let first = Seen {
        offsets,
        fresh,
        poisons,
        outputs,
        inputs,
        what: "",
    };
    if let Some(f) = verify(dev, ph, task, backend, w, &pools, first, &mut res)? {
        res.failure = Some(f);
        return Ok(res);
    }
    if check_only {
        return Ok(res);
    }

    // 2. Warm-up and timed runs, each on fresh inputs and poison.
    profile::time("lock", || ph.device())?;
    for _ in 0..timing.warmup {
        prepare(dev, &mut rng, false)?;
        *kernel_s += profile::time("run", || dev.run())?;
    }
    let min_reps = timing.min_reps.max(1);
    let max_reps = timing.max_reps.max(min_reps);
    // Checked timed runs, from the judge's own randomness: one among the first `min_reps` (the
    // spot), the last, and of the others each is a candidate with probability 1/min_reps; the
    // candidates are sampled down to the `cap - 2` places left (a reservoir: every candidate,
    // early or late, equally likely kept). All are checked after the last run, so no pause
    // between two runs says which were kept; where the device reads back every timed run, each
    // is copied alike into buffers made (and touched) beforehand.
    let spot = (rng.next_u64() % min_reps as u64) as u32;
    let set_bytes: usize = in_bytes.iter().chain(&out_bytes).sum();
    let cap = (KEPT_BYTES / set_bytes.max(1)).clamp(2, CHECKED_TIMED);
    let places = cap - 2;
    let uniform = dev.uniform_read_back();
    let mut spare: Vec<ReadBack> = if uniform {
        let touched = |sizes: &[usize]| -> Vec<Vec<u8>> { sizes.iter().map(|n| vec![1u8; *n]).collect() };
        (0..cap).map(|_| (touched(&out_bytes), touched(&in_bytes))).collect()
    } else {
        Vec::new()
    };
    let mut samples = Vec::new();
    let mut seen = Vec::new();
    let mut extras: Vec<Seen> = Vec::new();
    let mut candidates = 0u64;
    let mut spent = 0.0;
    loop {
        let rep = samples.len() as u32;
        let (offsets, fresh, poisons) = prepare(dev, &mut rng, timing.flush)?;
        let (extra, pick) = (rng.next_u64().is_multiple_of(min_reps as u64), rng.next_u64());
        let t = profile::time("run", || dev.run())?;
        *kernel_s += t;
        spent += t;
        samples.push(t * 1e6);
        let last = samples.len() as u32 >= max_reps || (samples.len() as u32 >= min_reps && spent * 1e3 >= timing.target_ms);
        // Where this run's read-back goes: `seen` (the spot, the last), place `i` of `extras`
        // (a new one, or in place of an earlier candidate), or nowhere.
        let mut place = None;
        if !last && rep != spot && extra && places > 0 {
            candidates += 1;
            let i = if extras.len() < places {
                extras.len()
            } else {
                (pick % candidates) as usize
            };
            place = (i < places).then_some(i);
        }
        let kept = last || rep == spot || place.is_some();
        let back = if uniform {
            let mut back = spare.pop().unwrap_or_default();
            profile::time("read_back", || dev.read_back_into(&mut back))?;
            if !kept {
                spare.push(back);
                None
            } else {
                Some(back)
            }
        } else if kept {
            Some(profile::time("read_back", || dev.read_back())?)
        } else {
            None
        };
        if let Some((outputs, inputs)) = back {
            let s = Seen {
                offsets,
                fresh,
                poisons,
                outputs,
                inputs,
                what: if last { "last timed run" } else { "a timed run" },
            };
            match place {
                Some(i) if i < extras.len() => {
                    let old = std::mem::replace(&mut extras[i], s);
                    if uniform {
                        spare.push((old.outputs, old.inputs));
                    }
                }
                Some(_) => extras.push(s),
                None => seen.push(s),
            }
        }
        if last {
            break;
        }
    }
    drop(spare);
    // The spot first, then the other candidates kept, then the last.
    let last_seen = seen.pop();
    seen.extend(extras);
    seen.extend(last_seen);
    // 3. The checked timed runs must be as right as the first one.
    for s in seen {
        let mut probe = WorkloadResult::default();
        let what = s.what;
        if let Some(mut f) = verify(dev, ph, task, backend, w, &pools, s, &mut probe)? {
            f.message = format!("{what}: {}", f.message);
            res.check = probe.check;
            res.failure = Some(f);
            return Ok(res);
        }
    }
    let timing = Timing::from_samples(samples);
    if timing.median_us < floor_s * 1e6 {
        res.failure = Some(Failure {
            class: FailureClass::BelowFloor,
            message: format!(
                "median {:.2} us is below the physical floor {:.2} us ({:.3e} bytes, {:.3e} flops)",
                timing.median_us,
                floor_s * 1e6,
                res.bytes,
                res.flops
            ),
        });
    }
    res.timing = Some(timing);
    Ok(res)
}

fn pools_extra_of(p: &Pool) -> usize {
    p.bytes.len() / p.dtype.size() - p.len
}

/// Check one run: inputs unchanged, every output element against the reference of exactly
/// the inputs that run saw. Fills `res.check`; returns the failure, if any.
#[allow(clippy::too_many_arguments)]
fn verify(
    dev: &mut dyn Device,
    ph: &mut Phases,
    task: &Task,
    backend: ksearch_core::Backend,
    w: &WorkloadReq,
    pools: &[Pool],
    s: Seen,
    res: &mut WorkloadResult,
) -> Result<Option<Failure>, Stop> {
    // The candidate is stopped and everything it touched is read back: the host work needs
    // no device.
    ph.host();
    let t_inputs = std::time::Instant::now();
    for (((p, got), off), fresh) in pools.iter().zip(&s.inputs).zip(&s.offsets).zip(&s.fresh) {
        let sz = p.dtype.size();
        let window = &p.bytes[off * sz..(off + p.len) * sz];
        let changed_copy;
        let want: &[u8] = if fresh.is_none() {
            window
        } else {
            let mut v = vec![0u8; window.len()];
            fresh.apply(window, &mut v, p.dtype);
            changed_copy = v;
            &changed_copy
        };
        if got.as_slice() != want {
            let first = got
                .chunks_exact(sz)
                .zip(want.chunks_exact(sz))
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            let changed = got
                .chunks_exact(sz)
                .zip(want.chunks_exact(sz))
                .filter(|(a, b)| a != b)
                .count();
            return Ok(Some(Failure {
                class: FailureClass::MutatedInput,
                message: format!(
                    "input `{}`: {changed} elements changed by the kernel (first at {first})",
                    p.name
                ),
            }));
        }
    }
    // The inputs as read back, now known to be exactly what the run was given.
    let inputs: Vec<HostTensor> = pools
        .iter()
        .zip(s.inputs)
        .map(|(p, bytes)| HostTensor {
            name: p.name.clone(),
            dtype: p.dtype,
            shape: p.shape.clone(),
            // Decoded only where a host reference needs them (`host_reference`).
            values: Vec::new(),
            bytes,
        })
        .collect();
    profile::add("inputs", t_inputs);
    profile::time("lock", || ph.device())?;
    let refs = profile::time("reference", || dev.reference(task, w, &inputs))?;
    ph.host();
    let (check, failure) = profile::time("check", || {
        check_outputs_poisoned(task, backend, &s.outputs, &refs, &s.poisons)
    });
    res.check = check;
    let mut spent = s.outputs;
    spent.extend(inputs.into_iter().map(|t| t.bytes));
    dev.recycle(spent, refs);
    Ok(failure)
}

/// Every element of every output, on several threads for large outputs.
fn check_outputs_poisoned(
    task: &Task,
    backend: ksearch_core::Backend,
    outputs: &[Vec<u8>],
    refs: &[Vec<f64>],
    poisons: &[Vec<u8>],
) -> (data::Check, Option<Failure>) {
    let (mut c, f) = crate::common::check_outputs_parallel(task, backend, outputs, refs, poisons);
    // JSON has no NaN or infinity (serde_json writes null, which does not read back as f64).
    for v in [&mut c.max_abs_err, &mut c.max_rel_err] {
        if !v.is_finite() {
            *v = f64::MAX;
        }
    }
    (c, f)
}

/// The evaluation of every workload of a request on a loaded candidate, in order. A fatal
/// stop ends the evaluation: the remaining workloads are not run. Each workload's inputs are
/// drawn first; then the device's `lock` is held while the candidate runs, is checked and
/// timed on it (`reply.device_s`, `lock_wait_s`, `device_spans` account for it).
pub fn judge_request(
    dev: &mut dyn Device,
    req: &ksearch_core::protocol::EvalRequest,
    progress: &mut dyn FnMut(&str),
    reply: &mut ksearch_core::protocol::EvalReply,
    lock: &mut crate::common::DeviceLock,
) {
    // Where the judge's host work cannot disturb what the device measures, the next workload's
    // inputs are drawn while this one is judged.
    let ahead = !dev.host_work_disturbs_timing();
    std::thread::scope(|scope| judge_workloads(dev, req, progress, reply, lock, ahead.then_some(scope)));
}

type Drawn = Result<Vec<Pool>, String>;

fn judge_workloads<'s, 'e: 's>(
    dev: &mut dyn Device,
    req: &'e ksearch_core::protocol::EvalRequest,
    progress: &mut dyn FnMut(&str),
    reply: &mut ksearch_core::protocol::EvalReply,
    lock: &mut crate::common::DeviceLock,
    ahead: Option<&'s std::thread::Scope<'s, 'e>>,
) {
    let n = req.workloads.len();
    let mut kernel_s = 0.0;
    let draw = |w: &'e WorkloadReq| -> Option<std::thread::ScopedJoinHandle<'s, Drawn>> {
        ahead.map(|s| s.spawn(move || make_pools(&req.task, req.backend, w)))
    };
    let mut next = req.workloads.first().and_then(draw);
    for (i, w) in req.workloads.iter().enumerate() {
        let t = std::time::Instant::now();
        let mut k = 0.0;
        let mut waited = 0.0;
        profile::begin();
        let this = next.take();
        next = req.workloads.get(i + 1).and_then(draw);
        let drawn = profile::time("draw_pools", || match this {
            Some(h) => h.join().unwrap_or_else(|_| Err("drawing the inputs failed (a panic)".into())),
            None => make_pools(&req.task, req.backend, w),
        });
        let judged = match drawn {
            Err(e) => Err(Stop::fail(FailureClass::Infra, e)),
            Ok(pools) => {
                let mut ph = Phases::new(lock, dev.host_work_disturbs_timing());
                let r = judge_workload(
                    dev,
                    &mut ph,
                    &req.task,
                    req.backend,
                    i,
                    w,
                    &req.timing,
                    req.check_only,
                    pools,
                    &mut k,
                );
                ph.release();
                waited = ph.waited_s;
                reply.device_s += ph.device_s;
                reply.lock_wait_s += ph.waited_s;
                reply.device_spans.extend(ph.spans);
                r
            }
        };
        // The worker's own time outside the candidate's runs and the wait for the lock.
        let overhead = (t.elapsed().as_secs_f64() - k - waited).max(0.0);
        match judged {
            Ok(r) => reply.workloads.push(r),
            Err(stop) => {
                let r = WorkloadResult {
                    label: w.label.clone(),
                    axes: w.axes.clone(),
                    seed: w.seed,
                    failure: Some(stop.failure.clone()),
                    ..WorkloadResult::default()
                };
                reply.workloads.push(r);
                if stop.fatal {
                    reply.failure = Some(stop.failure);
                    kernel_s += k;
                    reply.overhead_s += overhead;
                    break;
                }
            }
        }
        kernel_s += k;
        reply.overhead_s += overhead;
        profile::end(&req.task.name, &w.label);
        progress(&format!("workload {}/{n}", i + 1));
    }
    reply.kernel_s = kernel_s;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::DeviceLock;
    use std::os::fd::AsRawFd;

    /// A device whose "kernel" writes the reference softmax, and which records whether the
    /// device lock was held at each of its calls (probed with a second, non-blocking flock).
    struct Probe {
        task: Task,
        lock_file: std::path::PathBuf,
        pools: Vec<Vec<u8>>,
        dims: Vec<i64>,
        inputs: Vec<Vec<u8>>,
        outputs: Vec<Vec<u8>>,
        /// (call, lock held by someone)
        calls: Vec<(&'static str, bool)>,
        /// Every timed run read back (`Device::uniform_read_back`).
        uniform: bool,
        /// Runs so far, and the one (counted from the first) whose outputs the "kernel" skips.
        runs: usize,
        skip: Option<usize>,
        /// The inputs of each run, and the runs whose outputs were checked (by their inputs).
        staged: Vec<Vec<u8>>,
        checked: Vec<usize>,
    }

    impl Probe {
        fn held(&self) -> bool {
            let f = std::fs::File::open(&self.lock_file).unwrap();
            // SAFETY: flock on a descriptor this function owns.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            r != 0
        }
        fn note(&mut self, call: &'static str) {
            let h = self.held();
            self.calls.push((call, h));
        }
    }

    impl Device for Probe {
        fn bind(&mut self, _i: usize, dims: &[i64], pools: &[&[u8]], inputs: &[usize], outputs: &[usize]) -> Result<(), Stop> {
            self.note("bind");
            self.pools = pools.iter().map(|p| p.to_vec()).collect();
            self.dims = dims.to_vec();
            self.inputs = inputs.iter().map(|n| vec![0; *n]).collect();
            self.outputs = outputs.iter().map(|n| vec![0; *n]).collect();
            Ok(())
        }
        fn stage(&mut self, offsets: &[usize]) -> Result<(), Stop> {
            for ((i, p), o) in self.inputs.iter_mut().zip(&self.pools).zip(offsets) {
                let n = i.len();
                i.copy_from_slice(&p[*o..o + n]);
            }
            Ok(())
        }
        fn poison(&mut self, patterns: &[Vec<u8>]) -> Result<(), Stop> {
            for (o, p) in self.outputs.iter_mut().zip(patterns) {
                for c in o.chunks_exact_mut(p.len()) {
                    c.copy_from_slice(p);
                }
            }
            Ok(())
        }
        fn run(&mut self) -> Result<f64, Stop> {
            self.note("run");
            let (rows, cols) = (self.dims[0] as usize, self.dims[1] as usize);
            let x: Vec<f32> = self.inputs[0]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let mut y = Vec::with_capacity(rows * cols * 4);
            for r in x.chunks_exact(cols) {
                let m = r.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
                let s: f64 = r.iter().map(|v| ((v - m) as f64).exp()).sum();
                y.extend(r.iter().flat_map(|v| ((((v - m) as f64).exp() / s) as f32).to_le_bytes()));
            }
            if self.skip != Some(self.runs) {
                self.outputs[0] = y;
            }
            self.staged.push(self.inputs[0].clone());
            self.runs += 1;
            Ok(1e-3)
        }
        fn read_back(&mut self) -> Result<ReadBack, Stop> {
            self.note("read_back");
            Ok((self.outputs.clone(), self.inputs.clone()))
        }
        fn uniform_read_back(&self) -> bool {
            self.uniform
        }
        fn reference(&mut self, task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, Stop> {
            self.note("reference");
            if let Some(i) = self.staged.iter().rposition(|s| *s == inputs[0].bytes) {
                self.checked.push(i);
            }
            host_reference(task, w, inputs).map_err(|e| Stop::fail(FailureClass::Infra, e))
        }
        fn peaks(&self) -> Peaks {
            Peaks {
                bytes: f64::INFINITY,
                flops: f64::INFINITY,
                transcendentals: f64::INFINITY,
            }
        }
        fn host_work_disturbs_timing(&self) -> bool {
            self.task.name == "keep"
        }
    }

    fn judge(keep: bool) -> (WorkloadResult, Phases<'static>, Vec<(&'static str, bool)>) {
        let timing = TimingReq {
            warmup: 1,
            min_reps: 3,
            max_reps: 3,
            target_ms: 0.0,
            flush: false,
        };
        let (r, ph, dev) = judge_probe(keep, &timing, 7, false, None);
        (r, ph, dev.calls)
    }

    /// Judge the probe on a 4x64 softmax with `timing`, the judge's randomness from `seed`.
    fn judge_probe(
        keep: bool,
        timing: &TimingReq,
        seed: u64,
        uniform: bool,
        skip: Option<usize>,
    ) -> (WorkloadResult, Phases<'static>, Probe) {
        let dir = std::env::temp_dir().join(format!("ksearch-phases-{}-{keep}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks/softmax/task.toml");
        let mut task = Task::load(&root).unwrap();
        let lock = Box::leak(Box::new(DeviceLock::cpu(&dir)));
        let mut ph = Phases::new(lock, keep);
        // Create the lock file before the probe opens it.
        ph.device().unwrap();
        ph.release();
        ph.spans.clear();
        ph.device_s = 0.0;
        let lock_file = ph.lock.path().to_path_buf();
        let w = WorkloadReq {
            label: "rows=4,cols=64".into(),
            axes: [("rows".to_string(), 4), ("cols".to_string(), 64)].into_iter().collect(),
            seed,
        };
        let pools = make_pools(&task, ksearch_core::Backend::Cpu, &w).unwrap();
        let real = task.clone();
        task.name = if keep { "keep".into() } else { "free".into() };
        let mut dev = Probe {
            task: task.clone(),
            lock_file,
            pools: vec![],
            dims: vec![],
            inputs: vec![],
            outputs: vec![],
            calls: vec![],
            uniform,
            runs: 0,
            skip,
            staged: vec![],
            checked: vec![],
        };
        let mut k = 0.0;
        let r = judge_workload(
            &mut dev,
            &mut ph,
            &real,
            ksearch_core::Backend::Cpu,
            0,
            &w,
            timing,
            false,
            pools,
            &mut k,
        )
        .unwrap();
        ph.release();
        (r, ph, dev)
    }

    #[test]
    fn the_device_is_held_for_its_phases_and_let_go_for_host_work_where_that_cannot_disturb_it() {
        let (r, ph, calls) = judge(false);
        assert!(r.failure.is_none(), "{:?}", r.failure);
        assert!(r.timing.is_some());
        // Every device call runs under the lock, the references included.
        assert!(calls.iter().all(|(_, held)| *held), "{calls:?}");
        // First run | its reference | timed runs | a reference per checked timed run (the spot,
        // the last, at most CHECKED_TIMED in all): holds with host work between.
        let refs = calls.iter().filter(|(c, _)| *c == "reference").count();
        assert!((2..=1 + CHECKED_TIMED).contains(&refs), "{calls:?}");
        assert_eq!(ph.spans.len(), 2 + refs, "{:?}", ph.spans);
    }

    #[test]
    fn a_device_whose_timings_host_work_disturbs_keeps_the_lock_throughout() {
        let (r, ph, calls) = judge(true);
        assert!(r.failure.is_none(), "{:?}", r.failure);
        assert!(calls.iter().all(|(_, held)| *held), "{calls:?}");
        assert_eq!(ph.spans.len(), 1, "{:?}", ph.spans);
    }

    fn timing(min_reps: u32, max_reps: u32) -> TimingReq {
        TimingReq {
            warmup: 2,
            min_reps,
            max_reps,
            target_ms: 1e9,
            flush: false,
        }
    }

    #[test]
    fn a_device_that_reads_back_uniformly_reads_back_every_timed_run_and_checks_a_few() {
        let (r, _, dev) = judge_probe(false, &timing(5, 30), 11, true, None);
        assert!(r.failure.is_none(), "{:?}", r.failure);
        let seq: Vec<&str> = dev.calls.iter().map(|(c, _)| *c).filter(|c| *c != "bind").collect();
        // First run, read back and checked; two warm-ups; then every timed run read back.
        let runs: Vec<usize> = (0..seq.len()).filter(|i| seq[*i] == "run").collect();
        assert_eq!(runs.len(), 1 + 2 + 30, "{seq:?}");
        assert_eq!(&seq[..5], ["run", "read_back", "reference", "run", "run"], "{seq:?}");
        let timed = &seq[runs[3]..runs[3] + 2 * 30];
        assert!(timed.chunks(2).all(|p| p == ["run", "read_back"]), "{seq:?}");
        let refs = seq.iter().filter(|c| **c == "reference").count();
        assert!((3..=1 + CHECKED_TIMED).contains(&refs), "{refs} references: {seq:?}");
    }

    /// The timed runs checked (0 = the first timed run); none where two runs had the same
    /// inputs (the same window of the pool), which would make that ambiguous.
    fn checked_timed(dev: &Probe) -> Option<Vec<usize>> {
        let s = &dev.staged;
        if (0..s.len()).any(|i| s[i + 1..].contains(&s[i])) {
            return None;
        }
        Some(dev.checked.iter().filter(|i| **i >= 3).map(|i| i - 3).collect())
    }

    #[test]
    fn the_checked_timed_runs_are_few_and_spread_over_all_of_them() {
        let (min_reps, reps) = (5usize, 30usize);
        let mut kept = vec![0u32; reps];
        for seed in 0..2000 {
            let (r, _, dev) = judge_probe(false, &timing(min_reps as u32, reps as u32), seed, seed % 2 == 0, None);
            assert!(r.failure.is_none(), "{:?}", r.failure);
            let Some(mine) = checked_timed(&dev) else {
                continue;
            };
            assert!(mine.len() <= CHECKED_TIMED, "seed {seed}: {mine:?}");
            assert!(
                mine.contains(&(reps - 1)),
                "seed {seed}: the last is always checked: {mine:?}"
            );
            assert!(mine.iter().any(|k| *k < min_reps), "seed {seed}: one of the first: {mine:?}");
            for k in mine {
                kept[k] += 1;
            }
        }
        // Every other timed run, early or late, is checked now and then, about equally often.
        let others = &kept[min_reps..reps - 1];
        let (lo, hi) = (others.iter().min().unwrap(), others.iter().max().unwrap());
        assert!(*lo > 0 && f64::from(*lo) > 0.5 * f64::from(*hi), "{kept:?}");
    }

    #[test]
    fn a_skipped_timed_run_that_is_checked_fails_the_workload() {
        let t = timing(5, 30);
        let (r, _, _) = judge_probe(false, &t, 3, true, Some(3 + 29));
        let f = r.failure.expect("the last timed run is checked");
        assert!(f.message.starts_with("last timed run: "), "{}", f.message);
        let (_, _, dev) = judge_probe(false, &t, 3, true, None);
        let mine = checked_timed(&dev).expect("no two runs with the same inputs");
        assert!(mine.len() >= 2, "{mine:?}");
        for rep in 0..30 {
            let (r, _, _) = judge_probe(false, &t, 3, true, Some(3 + rep));
            assert_eq!(r.failure.is_some(), mine.contains(&rep), "timed run {rep}; checked {mine:?}");
        }
    }
}
