//! The judge: the one evaluation skeleton every Rust back-end runs (poison → run → check →
//! time → re-check → floor). It is trusted code and never trusts the candidate:
//!
//! - inputs come from a pool drawn once per workload; every run copies each input from a fresh
//!   random offset of its pool, so no run sees inputs it has seen before at that address, and
//!   outputs get a fresh random NaN poison, so a checked run looks like any other;
//! - the first run is checked; among the timed runs, one chosen at random and the last are
//!   checked too (the back-end stops the candidate before outputs are read), each against its
//!   own reference, computed only after the candidate's runs;
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
    /// Evict caches before a timed run.
    fn flush(&mut self) {}
    /// Run every launch once; the seconds it took, measured by trusted code.
    fn run(&mut self) -> Result<f64, Stop>;
    /// After a run: make sure the candidate is no longer running (e.g. stop its process), then
    /// read back every output and input.
    fn read_back(&mut self) -> Result<ReadBack, Stop>;
    /// The reference outputs for these inputs (f64, the task's declared outputs).
    fn reference(&mut self, task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, Stop> {
        host_reference(task, w, inputs).map_err(|e| Stop::fail(FailureClass::Infra, e))
    }
    /// The fastest this device can possibly go, for the floor rule.
    fn peaks(&self) -> Peaks;
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
    values: Vec<f64>,
    bytes: Vec<u8>,
}

/// Extra pool elements beyond the input: enough distinct windows that runs almost never
/// repeat one.
fn pool_extra(n: usize) -> usize {
    (n / 4).max(4096)
}

fn make_pools(task: &Task, backend: ksearch_core::Backend, w: &WorkloadReq) -> Result<Vec<Pool>, String> {
    let drawn = crate::common::make_inputs_parts(task, backend, std::slice::from_ref(w), 1 << 20, |n| n + pool_extra(n))?;
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
            values: t.values,
            bytes: t.bytes,
        })
        .collect())
}

/// What one checked run saw.
struct Seen {
    /// Element offsets into each pool.
    offsets: Vec<usize>,
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
    dev.bind(index, &dims, &pool_bytes, &in_bytes, &out_bytes)?;
    res.bytes = task.min_bytes(backend, &w.axes).unwrap_or(0.0);
    res.flops = task.flops(&w.axes);
    let floor_s = floor_s(dev.peaks(), res.bytes, res.flops, task.transcendentals(&w.axes));
    res.floor_us = Some(floor_s * 1e6);

    // The judge's own randomness (offsets, poisons, which runs are checked): derived from the
    // evaluation's seed, which the candidate never sees.
    let mut rng = Rng::new(data::sub_seed(w.seed, 0x4A55_4447));
    let out_types: Vec<DType> = outs.iter().map(|(_, _, d)| *d).collect();
    let prepare = |dev: &mut dyn Device, rng: &mut Rng, flush: bool| -> Result<(Vec<usize>, Vec<Vec<u8>>), Stop> {
        let offsets: Vec<usize> = pools
            .iter()
            .map(|p| (rng.next_u64() % (pools_extra_of(p) as u64 + 1)) as usize)
            .collect();
        let byte_offsets: Vec<usize> = offsets.iter().zip(&pools).map(|(o, p)| o * p.dtype.size()).collect();
        dev.stage(&byte_offsets)?;
        let poisons: Vec<Vec<u8>> = out_types.iter().map(|d| data::random_poison(*d, rng)).collect();
        dev.poison(&poisons)?;
        if flush {
            dev.flush();
        }
        Ok((offsets, poisons))
    };

    // 1. A first run, checked at once: a wrong kernel is not timed.
    let (offsets, poisons) = prepare(dev, &mut rng, false)?;
    *kernel_s += dev.run()?;
    let (outputs, inputs) = dev.read_back()?;
    let first = Seen {
        offsets,
        poisons,
        outputs,
        inputs,
        what: "",
    };
    if let Some(f) = verify(dev, task, backend, w, &pools, &first, &mut res)? {
        res.failure = Some(f);
        return Ok(res);
    }
    if check_only {
        return Ok(res);
    }

    // 2. Warm-up and timed runs, each on fresh inputs and poison.
    for _ in 0..timing.warmup {
        prepare(dev, &mut rng, false)?;
        *kernel_s += dev.run()?;
    }
    let min_reps = timing.min_reps.max(1);
    let max_reps = timing.max_reps.max(min_reps);
    // One timed run among the first `min_reps`, chosen at random, is checked (and the last).
    let spot = (rng.next_u64() % min_reps as u64) as u32;
    let mut samples = Vec::new();
    let mut seen = Vec::new();
    let mut spent = 0.0;
    loop {
        let rep = samples.len() as u32;
        let (offsets, poisons) = prepare(dev, &mut rng, timing.flush)?;
        let t = dev.run()?;
        *kernel_s += t;
        spent += t;
        samples.push(t * 1e6);
        let last = samples.len() as u32 >= max_reps || (samples.len() as u32 >= min_reps && spent * 1e3 >= timing.target_ms);
        if rep == spot || last {
            let (outputs, inputs) = dev.read_back()?;
            seen.push(Seen {
                offsets,
                poisons,
                outputs,
                inputs,
                what: if last { "last timed run" } else { "a timed run" },
            });
        }
        if last {
            break;
        }
    }
    // 3. The checked timed runs must be as right as the first one.
    for s in &seen {
        let mut probe = WorkloadResult::default();
        if let Some(mut f) = verify(dev, task, backend, w, &pools, s, &mut probe)? {
            f.message = format!("{}: {}", s.what, f.message);
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
    p.values.len() - p.len
}

/// Check one run: inputs unchanged, every output element against the reference of exactly
/// the inputs that run saw. Fills `res.check`; returns the failure, if any.
#[allow(clippy::too_many_arguments)]
fn verify(
    dev: &mut dyn Device,
    task: &Task,
    backend: ksearch_core::Backend,
    w: &WorkloadReq,
    pools: &[Pool],
    s: &Seen,
    res: &mut WorkloadResult,
) -> Result<Option<Failure>, Stop> {
    for ((p, got), off) in pools.iter().zip(&s.inputs).zip(&s.offsets) {
        let sz = p.dtype.size();
        let want = &p.bytes[off * sz..(off + p.len) * sz];
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
    let inputs: Vec<HostTensor> = pools
        .iter()
        .zip(&s.offsets)
        .map(|(p, off)| {
            let sz = p.dtype.size();
            HostTensor {
                name: p.name.clone(),
                dtype: p.dtype,
                shape: p.shape.clone(),
                values: p.values[*off..off + p.len].to_vec(),
                bytes: p.bytes[off * sz..(off + p.len) * sz].to_vec(),
            }
        })
        .collect();
    let refs = dev.reference(task, w, &inputs)?;
    let (check, failure) = check_outputs_poisoned(task, backend, &s.outputs, &refs, &s.poisons);
    res.check = check;
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
    let n = req.workloads.len();
    let mut kernel_s = 0.0;
    for (i, w) in req.workloads.iter().enumerate() {
        let t = std::time::Instant::now();
        let mut k = 0.0;
        let mut waited = 0.0;
        let judged = match make_pools(&req.task, req.backend, w) {
            Err(e) => Err(Stop::fail(FailureClass::Infra, e)),
            Ok(pools) => match lock.acquire() {
                Err(e) => Err(Stop::fatal(FailureClass::Infra, e)),
                Ok(hold) => {
                    let r = judge_workload(dev, &req.task, req.backend, i, w, &req.timing, req.check_only, pools, &mut k);
                    let span = lock.release(hold);
                    waited = hold.waited_s;
                    reply.device_s += span[1] - span[0];
                    reply.lock_wait_s += hold.waited_s;
                    reply.device_spans.push(span);
                    r
                }
            },
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
        progress(&format!("workload {}/{n}", i + 1));
    }
    reply.kernel_s = kernel_s;
}
