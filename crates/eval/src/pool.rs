//! A pool of workers: several worker processes per device, several requests evaluated at once.
//!
//! Each worker is a process of its own (see `supervisor.rs`); a request goes to the next idle
//! worker. Workers of one device compile at the same time and measure one at a time: each
//! holds its device's lock (`common::DeviceLock`) only while the candidate runs on the device.
//!
//! Requests arrive in *submissions* (`submit`): a submission is answered as a whole, its replies
//! in request order, as soon as its last request is (`wait_any`), while later submissions keep
//! the workers busy. A search keeps its window of submissions full this way, so the devices do
//! not wait at the start and end of every batch. `eval_many` is one submission waited for.
//! While requests are outstanding, each worker is driven by a thread of its own that takes the
//! next queued request it may serve; when none is left the threads stop and hand their
//! workers back.
//!
//! The pool adds up what the workers report (compile, device and lock-wait seconds) and the
//! critical path of every *busy period* (from the first request submitted to an idle pool to
//! its last reply), from which a run's overhead is computed (`Accounting`, definitions in
//! `docs/protocol.md`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use ksearch_core::Backend;
use ksearch_core::protocol::{EvalReply, EvalRequest, FailureClass};

use crate::supervisor::Supervisor;

/// What a worker does with a request: evaluate it, or time the native implementation.
type Op = fn(&mut Supervisor, &EvalRequest) -> EvalReply;

/// Workers on a device, several per device.
pub struct Pool {
    /// The workers, while the pool is idle (while requests are outstanding, their threads own
    /// them; `park` hands them back).
    pub workers: Vec<Supervisor>,
    /// The device of each worker, in the order of `workers`.
    devices: Vec<usize>,
    acct: Accounting,
    /// The first worker's device name and back-end, kept while the threads own the workers.
    first: (String, String),
    running: Option<Running>,
    /// Submissions not yet answered in full, by tag.
    pending: BTreeMap<u64, Pending>,
    /// Submissions answered in full, not yet taken by `wait_any`.
    ready: VecDeque<(u64, Vec<EvalReply>)>,
}

/// A submission being answered.
struct Pending {
    replies: Vec<Option<EvalReply>>,
    left: usize,
}

/// One queued request.
struct Job {
    tag: u64,
    index: usize,
    req: EvalRequest,
    op: Op,
    /// Only a worker of this device may take it.
    device: Option<usize>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// A reply as a worker's thread sends it.
struct Done {
    tag: u64,
    index: usize,
    worker: usize,
    reply: EvalReply,
}

/// The worker threads of one busy period.
struct Running {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    replies: Receiver<Done>,
    threads: Vec<std::thread::JoinHandle<Supervisor>>,
    started: Instant,
    /// Per worker: Σ (compile + lock wait + device) of the requests it served in this period.
    chain: Vec<f64>,
    /// Per device: Σ device seconds of its workers in this period.
    device: BTreeMap<usize, f64>,
}

/// What the pool's evaluations cost, summed over its busy periods since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Accounting {
    /// Requests answered (evaluations and baselines).
    pub evaluations: u64,
    /// Wall seconds the pool was busy: Σ over busy periods, each from the first request handed
    /// to an idle pool to the last reply.
    pub batch_s: f64,
    /// Σ over busy periods of the period's critical path: the longer of the busiest worker's
    /// chain (compile + lock wait + device, summed over its requests) and the busiest device's
    /// measuring time (Σ device seconds of its workers); at most the period's wall time.
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
            "evaluations: {} in {:.1} s, {:.1}/min; overhead {:.1}% ({:.1} s with no request in the pool; compile {:.1} s, device {:.1} s, lock wait {:.1} s, summed over workers)",
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

    /// A pool of `workers`, worker `i` serving device `devices[i]`.
    pub fn with_devices(workers: Vec<Supervisor>, mut devices: Vec<usize>) -> Pool {
        devices.resize(workers.len(), 0);
        Pool {
            workers,
            devices,
            acct: Accounting::default(),
            first: Default::default(),
            running: None,
            pending: BTreeMap::new(),
            ready: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// The first worker's device, in words, and back-end (as its hello said).
    fn first_worker(&self) -> (&str, &str) {
        match self.workers.first() {
            Some(w) => (&w.device, &w.backend),
            None => (&self.first.0, &self.first.1),
        }
    }

    /// The device the first worker runs on, in words.
    pub fn device(&self) -> String {
        self.first_worker().0.to_string()
    }

    /// How many requests to keep outstanding so that its devices stay busy. On CUDA the
    /// judge lets the device lock go for its host work (drawing inputs, checking outputs), so
    /// two requests per worker: a worker compiles and draws the inputs of its second request
    /// while the device measures another worker's first. Elsewhere the host work holds the
    /// lock (it would disturb the timings) or is not measured: one each.
    pub fn in_flight(&self) -> usize {
        let per_worker = match self.first_worker().1.parse::<Backend>().ok() {
            Some(Backend::Cuda) => 2,
            Some(Backend::Cpu | Backend::MlxCuda | Backend::MlxMetal) | None => 1,
        };
        self.len().max(1) * per_worker
    }

    /// What the evaluations so far cost.
    pub fn accounting(&self) -> Accounting {
        self.acct
    }

    /// Evaluate `reqs` concurrently, each on the next idle worker; replies in request order.
    /// A worker that crashes or hangs answers its request with the failure and is restarted
    /// for the next one.
    pub fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.run_now(reqs, Supervisor::eval, None)
    }

    /// Like `eval_many`, on the workers of one device only (the first worker's): for times
    /// compared with each other (a candidate against the seed), never taken on two devices.
    pub fn eval_many_on_one_device(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        let dev = self.devices.first().copied();
        self.run_now(reqs, Supervisor::eval, dev)
    }

    /// Time the back-end's native implementation on `reqs` (see `Supervisor::baseline`),
    /// concurrently like `eval_many`.
    pub fn baseline_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.run_now(reqs, Supervisor::baseline, None)
    }

    /// Queue `reqs` as one submission named `tag` (unique among those outstanding) and return
    /// at once; `same_device`: every request on the first worker's device. `wait_any` answers it.
    pub fn submit(&mut self, tag: u64, reqs: Vec<EvalRequest>, same_device: bool) {
        let dev = if same_device { self.devices.first().copied() } else { None };
        self.enqueue(tag, reqs, Supervisor::eval, dev);
    }

    /// Requests queued or running, over every outstanding submission.
    pub fn outstanding(&self) -> usize {
        self.pending.values().map(|p| p.left).sum()
    }

    /// The next submission answered in full (its tag, its replies in request order), waiting
    /// for one if needed; `None` when nothing is outstanding.
    pub fn wait_any(&mut self) -> Option<(u64, Vec<EvalReply>)> {
        loop {
            if let Some(done) = self.ready.pop_front() {
                return Some(done);
            }
            if self.pending.is_empty() {
                return None;
            }
            self.receive_one();
        }
    }

    /// Requests not yet taken by a worker are dropped: they are answered at once as not run
    /// (an infrastructure failure), those running finish.
    pub fn cancel_queued(&mut self) {
        let Some(r) = &self.running else { return };
        let jobs: Vec<Job> = {
            let mut q = r.queue.0.lock().unwrap_or_else(|e| e.into_inner());
            q.jobs.drain(..).collect()
        };
        for j in jobs {
            let reply = EvalReply::failed(j.req.id, FailureClass::Infra, "cancelled before it ran");
            self.answer(j.tag, j.index, reply);
        }
        if self.pending.is_empty() {
            self.park();
        }
    }

    /// `op` on every request, concurrently over the workers (of device `only` when given);
    /// submissions outstanding meanwhile keep their replies for `wait_any`.
    fn run_now(&mut self, reqs: &[EvalRequest], op: Op, only: Option<usize>) -> Vec<EvalReply> {
        if reqs.is_empty() {
            return Vec::new();
        }
        let tag = u64::MAX - self.pending.len() as u64;
        self.enqueue(tag, reqs.to_vec(), op, only);
        loop {
            if let Some(i) = self.ready.iter().position(|(t, _)| *t == tag) {
                return self.ready.remove(i).map(|(_, r)| r).unwrap_or_default();
            }
            self.receive_one();
        }
    }

    fn enqueue(&mut self, tag: u64, reqs: Vec<EvalRequest>, op: Op, only: Option<usize>) {
        if reqs.is_empty() {
            self.ready.push_back((tag, Vec::new()));
            return;
        }
        if self.devices.is_empty() || only.is_some_and(|d| !self.devices.contains(&d)) {
            let replies = reqs
                .iter()
                .map(|r| EvalReply::failed(r.id, FailureClass::Infra, "no worker in the pool"))
                .collect();
            self.ready.push_back((tag, replies));
            return;
        }
        self.start_threads();
        self.pending.insert(
            tag,
            Pending {
                replies: vec![None; reqs.len()],
                left: reqs.len(),
            },
        );
        let r = self.running.as_ref().expect("threads started");
        let mut q = r.queue.0.lock().unwrap_or_else(|e| e.into_inner());
        for (index, req) in reqs.into_iter().enumerate() {
            q.jobs.push_back(Job {
                tag,
                index,
                req,
                op,
                device: only,
            });
        }
        r.queue.1.notify_all();
    }

    /// One thread per worker, each owning its worker until `park`.
    fn start_threads(&mut self) {
        if self.running.is_some() {
            return;
        }
        if let Some(w) = self.workers.first() {
            self.first = (w.device.clone(), w.backend.clone());
        }
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let (tx, rx) = channel::<Done>();
        let threads = std::mem::take(&mut self.workers)
            .into_iter()
            .zip(self.devices.clone())
            .enumerate()
            .map(|(i, (sup, dev))| {
                let (queue, tx) = (queue.clone(), tx.clone());
                std::thread::spawn(move || serve(sup, i, dev, &queue, &tx))
            })
            .collect();
        self.running = Some(Running {
            queue,
            replies: rx,
            threads,
            started: Instant::now(),
            chain: vec![0.0; self.devices.len()],
            device: BTreeMap::new(),
        });
    }

    /// Take one reply from the workers' threads and book it.
    fn receive_one(&mut self) {
        let got = self.running.as_ref().map(|r| r.replies.recv());
        match got {
            Some(Ok(d)) => {
                if let Some(r) = self.running.as_mut() {
                    let dev = self.devices.get(d.worker).copied().unwrap_or(0);
                    if let Some(c) = r.chain.get_mut(d.worker) {
                        *c += d.reply.compile_s + d.reply.lock_wait_s + d.reply.device_s;
                    }
                    *r.device.entry(dev).or_default() += d.reply.device_s;
                }
                self.acct.compile_s += d.reply.compile_s;
                self.acct.device_s += d.reply.device_s;
                self.acct.lock_wait_s += d.reply.lock_wait_s;
                self.answer(d.tag, d.index, d.reply);
            }
            // Every thread is gone (none should be while requests are outstanding): what is
            // outstanding cannot be answered by a worker.
            _ => {
                let open: Vec<(u64, Vec<usize>)> = self
                    .pending
                    .iter()
                    .map(|(t, p)| (*t, (0..p.replies.len()).filter(|i| p.replies[*i].is_none()).collect()))
                    .collect();
                for (tag, idx) in open {
                    for i in idx {
                        self.answer(
                            tag,
                            i,
                            EvalReply::failed(0, FailureClass::Infra, "the pool's workers are gone"),
                        );
                    }
                }
            }
        }
        if self.pending.is_empty() {
            self.park();
        }
    }

    fn answer(&mut self, tag: u64, index: usize, reply: EvalReply) {
        let Some(p) = self.pending.get_mut(&tag) else { return };
        if let Some(slot) = p.replies.get_mut(index)
            && slot.is_none()
        {
            *slot = Some(reply);
            p.left -= 1;
            self.acct.evaluations += 1;
        }
        if p.left == 0
            && let Some(p) = self.pending.remove(&tag)
        {
            self.ready
                .push_back((tag, p.replies.into_iter().map(Option::unwrap_or_default).collect()));
        }
    }

    /// The busy period is over: stop the threads, take the workers back, book the period.
    fn park(&mut self) {
        let Some(r) = self.running.take() else { return };
        {
            let mut q = r.queue.0.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
            r.queue.1.notify_all();
        }
        let wall = r.started.elapsed().as_secs_f64();
        let chain = r.chain.iter().copied().fold(0.0, f64::max);
        let device = r.device.values().copied().fold(0.0, f64::max);
        self.acct.batch_s += wall;
        self.acct.critical_s += chain.max(device).min(wall);
        // A thread that panicked outside a request loses its worker (and its process with it):
        // the pool goes on with the others.
        let mut back: Vec<(usize, Supervisor)> = Vec::new();
        let mut devices = Vec::new();
        for (i, h) in r.threads.into_iter().enumerate() {
            if let Ok(s) = h.join() {
                back.push((i, s));
            }
        }
        for (i, s) in back {
            devices.push(self.devices[i]);
            self.workers.push(s);
        }
        self.devices = devices;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.cancel_queued();
        while self.wait_any().is_some() {}
    }
}

/// A worker's thread: the next queued request it may serve, until the queue closes.
fn serve(mut sup: Supervisor, me: usize, dev: usize, queue: &(Mutex<Queue>, Condvar), tx: &Sender<Done>) -> Supervisor {
    loop {
        let job = {
            let mut q = queue.0.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(i) = q.jobs.iter().position(|j| j.device.is_none_or(|d| d == dev)) {
                    break q.jobs.remove(i);
                }
                if q.closed {
                    return sup;
                }
                q = queue.1.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(job) = job else { continue };
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.op)(&mut sup, &job.req)))
            .unwrap_or_else(|_| EvalReply::failed(job.req.id, FailureClass::Infra, "supervisor thread panicked"));
        let done = Done {
            tag: job.tag,
            index: job.index,
            worker: me,
            reply,
        };
        if tx.send(done).is_err() {
            return sup;
        }
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
