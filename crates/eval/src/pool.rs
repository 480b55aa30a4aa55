//! A pool of workers: several worker processes per device, several requests evaluated at once.
//!
//! Each worker is a process of its own (see `supervisor.rs`); a request goes to the next idle
//! worker. Workers of one device compile at the same time and measure one at a time: each
//! holds its device's lock (`common::DeviceLock`) only while the candidate runs on the device.
//! The pool adds up what the workers report (compile, device and lock-wait seconds) and the
//! critical path of every batch, from which a run's overhead is computed (`Accounting`,
//! definitions in `docs/protocol.md`).

use std::sync::atomic::{AtomicUsize, Ordering};

use ksearch_core::Backend;
use ksearch_core::protocol::{EvalReply, EvalRequest, FailureClass};

use crate::supervisor::Supervisor;

/// Workers on a device, several per device.
pub struct Pool {
    pub workers: Vec<Supervisor>,
    /// The device of each worker, in the order of `workers`.
    devices: Vec<usize>,
    acct: Accounting,
}

/// What the pool's evaluations cost, summed over the calls since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Accounting {
    /// Requests answered (evaluations and baselines).
    pub evaluations: u64,
    /// Wall seconds spent inside `eval_many` / `baseline_many` calls.
    pub batch_s: f64,
    /// Σ over calls of the call's critical path: the longer of the busiest worker's chain
    /// (compile + lock wait + device, summed over its requests) and the busiest device's
    /// measuring time (Σ device seconds of its workers); at most the call's wall time.
    pub critical_s: f64,
    /// Σ of the workers' compile seconds (request to loaded candidate).
    pub compile_s: f64,
    /// Σ of the seconds workers held a device lock.
    pub device_s: f64,
    /// Σ of the seconds workers waited for a device lock.
    pub lock_wait_s: f64,
}

impl Accounting {
    /// Evaluations per minute over `wall_s` seconds.
    pub fn per_minute(&self, wall_s: f64) -> f64 {
        self.evaluations as f64 * 60.0 / wall_s.max(1e-9)
    }

    /// The share of `wall_s` that is neither compiling nor measuring on the critical path:
    /// (wall − Σ critical paths) / wall, in [0, 1].
    pub fn overhead(&self, wall_s: f64) -> f64 {
        if wall_s <= 0.0 {
            return 0.0;
        }
        ((wall_s - self.critical_s) / wall_s).clamp(0.0, 1.0)
    }

    /// One line for a run's summary.
    pub fn line(&self, wall_s: f64) -> String {
        format!(
            "evaluations: {} in {:.1} s, {:.1}/min; overhead {:.1}% ({:.1} s between the pool's calls; compile {:.1} s, device {:.1} s, lock wait {:.1} s, summed over workers)",
            self.evaluations,
            wall_s,
            self.per_minute(wall_s),
            100.0 * self.overhead(wall_s),
            (wall_s - self.batch_s).max(0.0),
            self.compile_s,
            self.device_s,
            self.lock_wait_s
        )
    }
}

impl Pool {
    /// A pool whose workers all serve device 0.
    pub fn new(workers: Vec<Supervisor>) -> Pool {
        let devices = vec![0; workers.len()];
        Pool::with_devices(workers, devices)
    }

    /// A pool of `workers`, worker `i` serving device `devices[i]`. Requests go to the first
    /// idle worker in this order: interleave the devices (one worker of each, then the next)
    /// so that a small batch spreads over them.
    pub fn with_devices(workers: Vec<Supervisor>, mut devices: Vec<usize>) -> Pool {
        devices.resize(workers.len(), 0);
        Pool {
            workers,
            devices,
            acct: Accounting::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// How many requests to hand the pool at once so that its devices stay busy. On CUDA the
    /// judge lets the device lock go for its host work (drawing inputs, checking outputs), so
    /// two requests per worker: a worker compiles and draws the inputs of its second request
    /// while the device measures another worker's first, instead of every worker starting its
    /// request at the same moment and the device waiting for the first of them. Elsewhere the
    /// host work holds the lock (it would disturb the timings) or is not measured: one each.
    pub fn in_flight(&self) -> usize {
        let per_worker = match self.workers.first().and_then(|w| w.backend.parse::<Backend>().ok()) {
            Some(Backend::Cuda) => 2,
            Some(Backend::Cpu | Backend::MlxCuda | Backend::MlxMetal) | None => 1,
        };
        self.workers.len().max(1) * per_worker
    }
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// What the evaluations so far cost.
    pub fn accounting(&self) -> Accounting {
        self.acct
    }

    /// Evaluate `reqs` concurrently, each on the next idle worker; replies in request order.
    /// A worker that crashes or hangs answers its request with the failure and is restarted
    /// for the next one.
    pub fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.run_many(reqs, Supervisor::eval, None)
    }

    /// Like `eval_many`, on the workers of one device only (the first worker's): for times
    /// compared with each other (a candidate against the seed), never taken on two devices.
    pub fn eval_many_on_one_device(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        let dev = self.devices.first().copied();
        self.run_many(reqs, Supervisor::eval, dev)
    }

    /// Time the back-end's native implementation on `reqs` (see `Supervisor::baseline`),
    /// concurrently like `eval_many`.
    pub fn baseline_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.run_many(reqs, Supervisor::baseline, None)
    }

    /// `op` on every request, concurrently over the workers (of device `only` when given).
    fn run_many(
        &mut self,
        reqs: &[EvalRequest],
        op: fn(&mut Supervisor, &EvalRequest) -> EvalReply,
        only: Option<usize>,
    ) -> Vec<EvalReply> {
        if reqs.is_empty() {
            return Vec::new();
        }
        if self.workers.is_empty() {
            return reqs
                .iter()
                .map(|r| EvalReply::failed(r.id, FailureClass::Infra, "no worker in the pool"))
                .collect();
        }
        let t = std::time::Instant::now();
        let next = AtomicUsize::new(0);
        let eligible = self.devices.iter().filter(|d| only.is_none_or(|o| **d == o)).count();
        let busy = reqs.len().min(eligible);
        // Each thread: (its device, its replies with their request index).
        let done: Vec<(usize, Vec<(usize, EvalReply)>)> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .zip(&self.devices)
                .filter(|(_, d)| only.is_none_or(|o| **d == o))
                .take(busy)
                .map(|(w, &dev)| {
                    let next = &next;
                    s.spawn(move || {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::SeqCst);
                            let Some(r) = reqs.get(i) else { break };
                            mine.push((i, op(w, r)));
                        }
                        (dev, mine)
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let wall = t.elapsed().as_secs_f64();
        let mut out: Vec<Option<EvalReply>> = vec![None; reqs.len()];
        let mut chain_max: f64 = 0.0;
        let mut per_device: Vec<(usize, f64)> = Vec::new();
        for (dev, mine) in done {
            let mut chain = 0.0;
            for (i, r) in mine {
                chain += r.compile_s + r.lock_wait_s + r.device_s;
                match per_device.iter_mut().find(|(d, _)| *d == dev) {
                    Some((_, s)) => *s += r.device_s,
                    None => per_device.push((dev, r.device_s)),
                }
                self.acct.compile_s += r.compile_s;
                self.acct.device_s += r.device_s;
                self.acct.lock_wait_s += r.lock_wait_s;
                out[i] = Some(r);
            }
            chain_max = chain_max.max(chain);
        }
        let device_max = per_device.iter().map(|(_, s)| *s).fold(0.0, f64::max);
        self.acct.evaluations += reqs.len() as u64;
        self.acct.batch_s += wall;
        self.acct.critical_s += chain_max.max(device_max).min(wall);
        out.into_iter()
            .zip(reqs)
            .map(|(r, q)| r.unwrap_or_else(|| EvalReply::failed(q.id, FailureClass::Infra, "supervisor thread panicked")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::{Limits, WorkerSpec};
    use std::time::Duration;

    fn said(backend: &str) -> Supervisor {
        let spec = WorkerSpec {
            program: "ksearch".into(),
            args: Vec::new(),
            env: Vec::new(),
        };
        let limits = Limits {
            compile_timeout: Duration::from_secs(1),
            run_timeout: Duration::from_secs(1),
            mem_limit_bytes: 1 << 30,
        };
        let mut s = Supervisor::new(spec, limits);
        s.backend = backend.to_string();
        s
    }

    /// CUDA workers leave the device lock for their host work: two requests each keep the
    /// device busy. The CPU's (lock held throughout) and unstarted workers take one each.
    #[test]
    fn requests_in_flight_follow_the_back_end() {
        let pool = |b: &str, n: usize| Pool::new((0..n).map(|_| said(b)).collect());
        assert_eq!(pool("cuda", 3).in_flight(), 6);
        assert_eq!(pool("cpu", 3).in_flight(), 3);
        assert_eq!(pool("mlx-cuda", 2).in_flight(), 2);
        assert_eq!(pool("", 2).in_flight(), 2);
        assert_eq!(pool("cuda", 0).in_flight(), 1);
    }
}
