//! The engine in process: a real SQLite store in a temporary folder, the real offline planner,
//! and a scripted evaluator whose replies (times, failures, spreads) follow from the kernel
//! text, its defines and the workload, so every outcome below is decided by the script.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ksearch_core::data::Check;
use ksearch_core::protocol::{EvalReply, EvalRequest, Failure, FailureClass, Timing, TimingReq, WorkloadResult};
use ksearch_core::task::Task;
use ksearch_core::tree::NodeStatus;
use ksearch_search::planner::Offline;
use ksearch_search::{Evaluator, Event, Parts, Report, RunConfig, RunEnd, Search, StopRules};
use ksearch_store::Store;

/// Two search shapes and one held-out shape; `fixed` is built per row length (`COLS == cols`,
/// a shape-tied tunable) and has a free tunable `UNROLL`.
const TASK: &str = r#"
name = "shapes"
description = "row softmax over two row lengths"
reference = "softmax"
axes = ["rows", "cols"]

[[inputs]]
name = "x"
shape = ["rows", "cols"]
dtype = "f32"

[[outputs]]
name = "y"
shape = ["rows", "cols"]
dtype = "f32"

[tolerance]
f32 = { atol = 1e-5, rtol = 1e-4 }

[backends.cpu]
search = [{ rows = 64, cols = 256 }, { rows = 32, cols = 512 }]
heldout = [{ rows = 7, cols = 128 }]

[backends.cpu.seed]
file = "seed.cpp"
entry = "softmax"

[[backends.cpu.kernels]]
name = "fixed"
file = "fixed.cpp"
entry = "softmax"
constraints = ["COLS == cols"]
[[backends.cpu.kernels.tunables]]
name = "COLS"
values = [128, 256, 512]
default = 256
pattern = "specialisation"
[[backends.cpu.kernels.tunables]]
name = "UNROLL"
values = [1, 2, 4]
default = 1
pattern = "tiling"
"#;

/// What one evaluation of a candidate on one workload gives: a time in microseconds with its
/// spread, or a failure.
#[derive(Clone, Copy, Debug)]
enum Says {
    Time(f64, f64),
    Fail(FailureClass),
}

/// What the script knows about a request: the kernel (by its text), its defines, the
/// workload's axes, how often this exact build was evaluated (1: the first time) and whether
/// the engine had announced its final phase.
struct Call<'a> {
    seed: bool,
    defines: &'a BTreeMap<String, i64>,
    cols: i64,
    nth: usize,
    finishing: bool,
    /// The fewest repetitions asked for (a second look at noisy timings asks for more).
    min_reps: u32,
}

type Rule = Box<dyn Fn(&Call) -> Says>;

/// Shared view of what the evaluator was asked, for the assertions.
#[derive(Default)]
struct Log {
    requests: Vec<EvalRequest>,
    /// Sizes of the batches handed over.
    batches: Vec<usize>,
    /// The most submissions outstanding at once (an evaluator that `streams`).
    most_queued: usize,
    /// Panic (a simulated kill) when this many requests have been answered.
    kill_after: Option<usize>,
    /// Panic on the first request once the engine says it is finishing.
    kill_in_final: bool,
    /// Answer the requests with these indices (0: the first) with an infrastructure failure.
    infra_at: Vec<usize>,
    finishing: bool,
    /// Raise this stop flag while answering the request with this index (a signal arriving
    /// during an evaluation), or on the first request of the final phase when the index is
    /// `usize::MAX`.
    raise: Option<(usize, &'static AtomicBool)>,
    /// Wall time every evaluation of the seed takes (a slow naive seed).
    seed_wall: Option<Duration>,
}

struct Scripted {
    rule: Rule,
    seen: BTreeMap<String, usize>,
    log: Rc<RefCell<Log>>,
    /// Requests it says it evaluates at once.
    parallel: usize,
    /// Overlap submissions (`streams`): answer the one submitted last first, so that the
    /// engine gets its nodes back out of order.
    lifo: bool,
    queued: Vec<(u64, Vec<EvalRequest>)>,
}

impl Scripted {
    fn new(rule: impl Fn(&Call) -> Says + 'static) -> (Scripted, Rc<RefCell<Log>>) {
        let log = Rc::new(RefCell::new(Log::default()));
        (
            Scripted {
                rule: Box::new(rule),
                seen: BTreeMap::new(),
                log: log.clone(),
                parallel: 1,
                lifo: false,
                queued: Vec::new(),
            },
            log,
        )
    }

    fn one(&mut self, req: &EvalRequest) -> EvalReply {
        {
            let l = self.log.borrow();
            if l.kill_after.is_some_and(|n| l.requests.len() >= n) || (l.kill_in_final && l.finishing) {
                drop(l);
                panic!("simulated kill of the search process");
            }
        }
        self.log.borrow_mut().requests.push(req.clone());
        let index = self.log.borrow().requests.len() - 1;
        if let Some((at, flag)) = self.log.borrow().raise
            && (at == index || (at == usize::MAX && self.log.borrow().finishing))
        {
            flag.store(true, Ordering::SeqCst);
        }
        if self.log.borrow().infra_at.contains(&index) {
            return EvalReply::failed(req.id, FailureClass::Infra, "scripted: the worker's disk is full");
        }
        let key = format!("{}|{:?}", req.candidate.source, req.candidate.defines);
        let nth = {
            let n = self.seen.entry(key).or_insert(0);
            *n += 1;
            *n
        };
        let mut reply = EvalReply {
            id: req.id,
            ..EvalReply::default()
        };
        let finishing = self.log.borrow().finishing;
        if let Some(d) = self.log.borrow().seed_wall
            && req.candidate.source.contains("SEED")
        {
            std::thread::sleep(d);
        }
        for w in &req.workloads {
            let call = Call {
                seed: req.candidate.source.contains("SEED"),
                defines: &req.candidate.defines,
                cols: w.axes["cols"],
                nth,
                finishing,
                min_reps: req.timing.min_reps,
            };
            let mut r = WorkloadResult {
                label: w.label.clone(),
                axes: w.axes.clone(),
                seed: w.seed,
                check: Check::default(),
                ..WorkloadResult::default()
            };
            match (self.rule)(&call) {
                Says::Time(us, spread) => {
                    r.timing = Some(Timing {
                        median_us: us,
                        min_us: us,
                        spread,
                        reps: req.timing.min_reps,
                    })
                }
                Says::Fail(class) => {
                    r.failure = Some(Failure {
                        class,
                        message: format!("scripted {class}"),
                    })
                }
            }
            reply.workloads.push(r);
        }
        reply
    }
}

impl Evaluator for Scripted {
    fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.log.borrow_mut().batches.push(reqs.len());
        reqs.iter().map(|r| self.one(r)).collect()
    }

    fn baseline(&mut self, req: &EvalRequest) -> EvalReply {
        EvalReply::failed(req.id, FailureClass::Launch, "no native implementation here")
    }

    fn device(&self) -> String {
        "scripted device".into()
    }

    fn parallelism(&self) -> usize {
        self.parallel
    }

    fn streams(&self) -> bool {
        self.lifo
    }

    fn submit(&mut self, tag: u64, reqs: Vec<EvalRequest>, _same_device: bool) {
        self.queued.push((tag, reqs));
        let mut l = self.log.borrow_mut();
        l.most_queued = l.most_queued.max(self.queued.len());
    }

    fn wait_any(&mut self) -> Option<(u64, Vec<EvalReply>)> {
        let (tag, reqs) = self.queued.pop()?;
        self.log.borrow_mut().batches.push(reqs.len());
        Some((tag, reqs.iter().map(|r| self.one(r)).collect()))
    }

    fn cancel_queued(&mut self) {}
}

/// A shape-tied build that does not match its workload computes garbage.
fn wrong_build(c: &Call) -> bool {
    !c.seed && c.defines.get("COLS").is_some_and(|v| *v != c.cols)
}

/// The seed takes 100 us everywhere; `fixed` takes 100 / (UNROLL + 1) us when built for the
/// workload's row length.
fn plain(c: &Call) -> Says {
    if c.seed {
        return Says::Time(100.0, 0.01);
    }
    if wrong_build(c) {
        return Says::Fail(FailureClass::Wrong);
    }
    Says::Time(100.0 / (c.defines["UNROLL"] + 1) as f64, 0.01)
}

struct Bench {
    dir: tempfile::TempDir,
    task: Task,
}

impl Bench {
    fn new() -> Bench {
        let dir = tempfile::tempdir().expect("temp dir");
        let t = dir.path().join("shapes");
        std::fs::create_dir_all(&t).unwrap();
        std::fs::write(t.join("task.toml"), TASK).unwrap();
        std::fs::write(t.join("seed.cpp"), "// SEED\n").unwrap();
        std::fs::write(t.join("fixed.cpp"), "// FIXED\n").unwrap();
        let task = Task::load(&t.join("task.toml")).expect("task loads");
        Bench { dir, task }
    }

    fn db(&self) -> PathBuf {
        self.dir.path().join("store.db")
    }

    fn config(&self, rounds: u32, patience: u32) -> RunConfig {
        RunConfig {
            task: "shapes".into(),
            task_path: self.task.dir.join("task.toml"),
            backend: ksearch_core::Backend::Cpu,
            planner: "offline".into(),
            rounds,
            patience,
            seed: 1,
            context: "full".into(),
            workers: 1,
            devices: vec![],
            compile_timeout_s: 10.0,
            run_timeout_s: 10.0,
            mem_limit_bytes: 1 << 30,
            timing: TimingReq {
                warmup: 1,
                min_reps: 5,
                max_reps: 5,
                target_ms: 1.0,
                flush: false,
            },
            kb_dir: None,
            cache_dir: self.dir.path().join("cache"),
            llm: None,
            launcher: Default::default(),
            task_digest: None,
        }
    }

    /// A new run in the store, and a search over it.
    fn search(&self, cfg: &RunConfig, ev: Scripted) -> (Search, Rc<RefCell<Vec<Event>>>) {
        let store = Store::open(&self.db()).expect("store");
        let run_id = store
            .create_run(
                "shapes",
                ksearch_core::Backend::Cpu,
                "offline",
                1,
                "",
                &serde_json::to_value(cfg).unwrap(),
            )
            .unwrap();
        self.attach(run_id, cfg, ev)
    }

    /// A search over run `run_id` of the store (to resume it).
    fn attach(&self, run_id: i64, cfg: &RunConfig, ev: Scripted) -> (Search, Rc<RefCell<Vec<Event>>>) {
        let store = Store::open(&self.db()).expect("store");
        let log = ev.log.clone();
        let mut s = Search::new(Parts {
            store,
            run_id,
            cfg: cfg.clone(),
            task: self.task.clone(),
            evaluator: Box::new(ev),
            kb: None,
            profile: None,
            planner: Box::new(Offline::default()),
        });
        let events = Rc::new(RefCell::new(Vec::new()));
        let ev2 = events.clone();
        s.on_event(move |e| {
            if matches!(e, Event::Finishing { .. }) {
                log.borrow_mut().finishing = true;
            }
            ev2.borrow_mut().push(e.clone())
        });
        (s, events)
    }
}

fn finished(end: RunEnd) -> Report {
    match end {
        RunEnd::Finished(r) => *r,
        RunEnd::Stopped { reason } => panic!("stopped instead of finishing: {reason}"),
        RunEnd::Interrupted => panic!("interrupted instead of finishing"),
    }
}

fn stop(cfg: &RunConfig) -> StopRules {
    StopRules::of(cfg, None)
}

fn purposes(db: &Path, run: i64) -> Vec<String> {
    let store = Store::open(db).unwrap();
    store.evaluations(run, None).unwrap().into_iter().map(|e| e.purpose).collect()
}

#[test]
fn a_run_finds_the_fastest_build_and_validates_it_per_held_out_shape() {
    let b = Bench::new();
    let cfg = b.config(12, 12);
    let (ev, log) = Scripted::new(plain);
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    assert_eq!(r.no_result(), None, "{r:?}");
    let sp = r.speedup.expect("a verified figure");
    assert!((sp - 5.0).abs() < 1e-9, "UNROLL=4 is 5x the seed: {sp}");
    let held = r.heldout.as_ref().expect("validated");
    assert!(held.passed, "held-out shape built with its own COLS: {held:?}");
    // The held-out request carried the build for cols=128, not the searched one.
    let log = log.borrow();
    let held_req = log
        .requests
        .iter()
        .rev()
        .find(|q| q.workloads.iter().any(|w| w.axes["cols"] == 128) && !q.candidate.source.contains("SEED"))
        .expect("a held-out request for the candidate");
    assert_eq!(held_req.candidate.defines.get("COLS"), Some(&128));
    assert_eq!(
        held_req.candidate.defines.get("UNROLL"),
        Some(&4),
        "the searched tunable is kept"
    );
}

#[test]
fn a_new_best_is_timed_again_and_the_slower_reading_counts() {
    let b = Bench::new();
    let cfg = b.config(3, 10);
    // The first reading of every candidate build is four times too fast.
    let (ev, _) = Scripted::new(|c| match plain(c) {
        Says::Time(us, s) if !c.seed && c.nth == 1 => Says::Time(us / 4.0, s),
        other => other,
    });
    let (mut s, _) = b.search(&cfg, ev);
    finished(s.run(stop(&cfg)).expect("run"));
    let p = purposes(&b.db(), s.run_id());
    assert!(p.iter().any(|x| x == "retime"), "a new best was re-timed: {p:?}");
    for n in s
        .tree()
        .nodes
        .values()
        .filter(|n| n.parent.is_some() && n.status == NodeStatus::Solved)
    {
        let sp = n.speedup.unwrap();
        assert!(sp < 6.0, "node {} kept its too-fast first reading: {sp}", n.id);
    }
}

/// In a batch, every candidate faster than the best before it is re-timed in one batch (the
/// device keeps several requests) instead of one request at a time while the batch is booked.
#[test]
fn a_batch_re_times_its_possible_new_bests_together() {
    let b = Bench::new();
    let cfg = b.config(6, 10);
    // Every reading of a candidate is faster than the one before: each candidate of a batch
    // looks like a new best against the best before the batch.
    let readings = std::cell::Cell::new(0u32);
    let (mut ev, log) = Scripted::new(move |c| match plain(c) {
        Says::Time(_, s) if !c.seed => {
            readings.set(readings.get() + 1);
            Says::Time(50.0 / readings.get() as f64, s)
        }
        other => other,
    });
    ev.parallel = 3;
    let (mut s, _) = b.search(&cfg, ev);
    finished(s.run(stop(&cfg)).expect("run"));
    let p = purposes(&b.db(), s.run_id());
    assert!(p.iter().filter(|x| *x == "retime").count() >= 3, "re-timings: {p:?}");
    // The first batch of three candidates (two builds each), then their re-timings in one batch.
    let batches = log.borrow().batches.clone();
    let first = batches.iter().position(|n| *n == 6).expect("a batch of three candidates");
    assert_eq!(batches.get(first + 1), Some(&6), "{batches:?}");
}

#[test]
fn the_answer_is_chosen_by_the_final_re_timing_not_the_search() {
    let b = Bench::new();
    // Four rounds: the adoption (2x), a row-length change (2x), UNROLL 2 (3x), UNROLL 4 (5x).
    let cfg = b.config(4, 12);
    // In the search UNROLL=4 looks best; once re-timed at the end it is slower than UNROLL=2.
    let (ev, _) = Scripted::new(|c| match (plain(c), c.defines.get("UNROLL")) {
        (Says::Time(_, s), Some(4)) if c.finishing => Says::Time(60.0, s),
        (other, _) => other,
    });
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    let best = s.tree().get(r.best_node.expect("a best")).unwrap().clone();
    assert_eq!(r.retimed.len(), 3, "{:?}", r.retimed);
    assert!(
        r.retimed.iter().any(|t| t.search.unwrap() > 4.5),
        "the in-search 5x candidate was re-timed: {:?}",
        r.retimed
    );
    assert!(
        r.search_speedup.unwrap() < 4.5,
        "the in-search 5x candidate was not chosen: {best:?}"
    );
    let sp = r.speedup.unwrap();
    assert!((sp - 3.0).abs() < 1e-9, "UNROLL=2 re-times at 3x: {sp}");
    assert_eq!(
        r.retimed[0].node, best.id,
        "the re-timed ranking comes first: {:?}",
        r.retimed
    );
}

#[test]
fn a_best_no_faster_than_the_seed_once_re_timed_is_no_result() {
    let b = Bench::new();
    let cfg = b.config(6, 12);
    // Everything is fast in the search and as slow as the seed at the end.
    let (ev, _) = Scripted::new(|c| match plain(c) {
        Says::Time(_, s) if !c.seed && c.finishing => Says::Time(100.0, s),
        other => other,
    });
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    let why = r.no_result().expect("no result");
    assert!(why.contains("once re-timed"), "{why}");
    let row = s.store().run(s.run_id()).unwrap();
    assert_eq!(row.status, "done_no_result");
}

#[test]
fn the_round_budget_stops_the_search() {
    let b = Bench::new();
    let cfg = b.config(2, 50);
    let (ev, _) = Scripted::new(plain);
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    assert_eq!(r.stop_reason, "round budget reached");
    assert_eq!(r.rounds, 2);
}

#[test]
fn patience_stops_a_search_without_new_bests() {
    let b = Bench::new();
    let cfg = b.config(50, 3);
    // Every candidate is slower than the seed: no new best ever.
    let (ev, _) = Scripted::new(|c| {
        if c.seed {
            Says::Time(100.0, 0.01)
        } else {
            Says::Time(150.0, 0.01)
        }
    });
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    assert_eq!(r.stop_reason, "plateau: no new best in 3 rounds");
    assert_eq!(r.rounds, 3);
    assert!(r.no_result().is_some());
}

#[test]
fn a_spent_time_budget_stops_before_the_first_round() {
    let b = Bench::new();
    let cfg = b.config(50, 50);
    let (ev, _) = Scripted::new(plain);
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(StopRules::of(&cfg, Some(Duration::ZERO))).expect("run"));
    assert!(r.stop_reason.starts_with("time budget"), "{}", r.stop_reason);
    assert_eq!(r.rounds, 0);
}

#[test]
fn a_slow_seed_leaves_rounds_to_a_budget_that_holds_its_final_phase() {
    // The seed takes 0.3 s, the candidates next to nothing. At the mean of all evaluations the
    // budget looked spent after the seed (one more evaluation plus a final phase of four, at
    // 0.3 s each: 1.5 s + 0.3 s elapsed); the seed's time counts only for the seed's share of
    // the final phase (two measurements before a better candidate exists).
    let b = Bench::new();
    let cfg = b.config(50, 50);
    let (ev, log) = Scripted::new(plain);
    log.borrow_mut().seed_wall = Some(Duration::from_millis(300));
    let (mut s, _) = b.search(&cfg, ev);
    let r = finished(s.run(StopRules::of(&cfg, Some(Duration::from_millis(1500)))).expect("run"));
    assert!(r.stop_reason.starts_with("time budget"), "{}", r.stop_reason);
    assert!(r.rounds >= 1, "no round ran: {}", r.stop_reason);
    assert!(r.speedup.is_some_and(|x| x > 1.0), "{:?}", r.speedup);
}

#[test]
fn the_final_phase_hands_its_evaluations_over_in_batches() {
    let b = Bench::new();
    let cfg = b.config(12, 12);
    let (ev, log) = Scripted::new(plain);
    let (mut s, _) = b.search(&cfg, ev);
    finished(s.run(stop(&cfg)).expect("run"));
    let log = log.borrow();
    // The last batches are the final phase's: the re-timing of the best three with the seed,
    // then held-out validation (seed and candidate, each shape's build) in one.
    assert!(
        log.batches.iter().any(|n| *n >= 6),
        "the final re-timing of three candidates and the seed is one batch: {:?}",
        log.batches
    );
}

/// Run until the scripted kill, then resume over the same store with a healthy evaluator.
fn killed_then_resumed(kill: impl FnOnce(&mut Log)) -> (Bench, i64, Report, Vec<Event>) {
    let b = Bench::new();
    let cfg = b.config(8, 50);
    let (ev, log) = Scripted::new(plain);
    kill(&mut log.borrow_mut());
    let (mut s, _) = b.search(&cfg, ev);
    let run_id = s.run_id();
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.run(stop(&cfg))));
    assert!(died.is_err(), "the scripted kill happened");
    drop(s);
    let (ev, _) = Scripted::new(plain);
    let (mut s, events) = b.attach(run_id, &cfg, ev);
    let r = finished(s.resume(stop(&cfg)).expect("resume"));
    let events = events.borrow().clone();
    (b, run_id, r, events)
}

#[test]
fn resume_after_a_kill_while_the_seed_ran() {
    let (b, run_id, r, _) = killed_then_resumed(|l| l.kill_after = Some(0));
    assert_eq!(r.no_result(), None, "{r:?}");
    let p = purposes(&b.db(), run_id);
    assert_eq!(p.iter().filter(|x| *x == "seed").count(), 1, "{p:?}");
    assert_eq!(r.rounds, 8);
}

#[test]
fn resume_after_a_kill_in_a_round() {
    // The seed, then a few rounds (two builds per candidate, a new best timed twice), then the
    // kill in the middle of one.
    let (b, run_id, r, events) = killed_then_resumed(|l| l.kill_after = Some(8));
    assert!(
        events.iter().any(|e| matches!(e, Event::Resumed { round, .. } if *round > 0)),
        "{events:?}"
    );
    assert_eq!(r.no_result(), None, "{r:?}");
    assert_eq!(r.rounds, 8, "the round counter went on");
    let store = Store::open(&b.db()).unwrap();
    let nodes = store.nodes(run_id).unwrap();
    assert!(nodes.iter().all(|n| n.status != NodeStatus::Running));
    assert!(
        nodes.iter().any(|n| n.attempts == 2),
        "the node running at the kill was tried again"
    );
    // The round killed midway is not counted: 8 rounds booked, each on one node.
    let booked = nodes
        .iter()
        .filter(|n| n.parent.is_some() && n.round_evaluated.is_some())
        .count();
    assert_eq!(booked, 8, "{nodes:?}");
    let p = purposes(&b.db(), run_id);
    assert_eq!(p.iter().filter(|x| *x == "search").count(), 8, "{p:?}");
}

/// A stop flag raised during an evaluation at request `at`; then a resume to the end.
fn interrupted_then_resumed(at: usize) -> (Bench, i64, Report) {
    let b = Bench::new();
    let cfg = b.config(8, 50);
    let flag: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    let (ev, log) = Scripted::new(plain);
    log.borrow_mut().raise = Some((at, flag));
    let (mut s, _) = b.search(&cfg, ev);
    s.set_interrupt(flag);
    let run_id = s.run_id();
    let end = s.run(stop(&cfg)).expect("run");
    assert!(matches!(end, RunEnd::Interrupted), "{end:?}");
    drop(s);
    let store = Store::open(&b.db()).unwrap();
    assert_eq!(store.run(run_id).unwrap().status, "interrupted");
    let nodes = store.nodes(run_id).unwrap();
    assert!(nodes.iter().all(|n| n.status != NodeStatus::Running), "{nodes:?}");
    drop(store);
    let (ev, _) = Scripted::new(plain);
    let (mut s, _) = b.attach(run_id, &cfg, ev);
    let r = finished(s.resume(stop(&cfg)).expect("resume"));
    (b, run_id, r)
}

#[test]
fn an_interrupted_round_is_not_booked_and_resume_finishes_the_run() {
    let (b, run_id, r) = interrupted_then_resumed(3);
    assert_eq!(r.no_result(), None, "{r:?}");
    assert_eq!(r.rounds, 8);
    let store = Store::open(&b.db()).unwrap();
    assert!(store.run(run_id).unwrap().status.starts_with("done"));
    let evals = store.evaluations(run_id, None).unwrap();
    // No node was measured twice in the search: the one in flight was left open, then tried once.
    let mut per_node = BTreeMap::new();
    for e in evals.iter().filter(|e| e.purpose == "search") {
        *per_node.entry(e.node_id).or_insert(0) += 1;
    }
    assert!(per_node.values().all(|n| *n == 1), "{per_node:?}");
    assert_eq!(per_node.len(), 8);
    assert!(store.nodes(run_id).unwrap().iter().all(|n| n.attempts <= 1));
}

#[test]
fn an_interrupted_final_phase_leaves_no_duplicate_final_rows() {
    let (b, run_id, r) = interrupted_then_resumed(usize::MAX);
    assert_eq!(r.no_result(), None, "{r:?}");
    let p = purposes(&b.db(), run_id);
    // One re-timing per candidate (with the seed) and one held-out pair, from the finish that
    // completed only.
    assert_eq!(p.iter().filter(|x| *x == "final").count(), 2 * r.retimed.len(), "{p:?}");
    assert_eq!(p.iter().filter(|x| *x == "heldout").count(), 2, "{p:?}");
    assert_eq!(r.evaluations, p.len() as u64);
}

#[test]
fn resume_after_a_kill_in_the_final_phase() {
    let (b, run_id, r, events) = killed_then_resumed(|l| l.kill_in_final = true);
    assert_eq!(r.no_result(), None, "{r:?}");
    assert!(
        !events.iter().any(|e| matches!(e, Event::Round { .. })),
        "no round after the search had ended: {events:?}"
    );
    let row = Store::open(&b.db()).unwrap().run(run_id).unwrap();
    assert_eq!(row.status, "done");
}

#[test]
fn noisy_final_timings_are_taken_again_with_more_repetitions() {
    let b = Bench::new();
    let cfg = b.config(4, 12);
    // At the end, timings spread by 60% unless taken with at least 15 repetitions.
    let (ev, log) = Scripted::new(|c| match plain(c) {
        Says::Time(us, _) if c.finishing && c.min_reps < 15 => Says::Time(us, 0.6),
        other => other,
    });
    let (mut s, events) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    assert!(r.spread.unwrap() < 0.25, "the calmer pair counts: {:?}", r.spread);
    let more = log.borrow().requests.iter().filter(|q| q.timing.min_reps >= 15).count();
    assert!(more >= 2, "seed and candidate timed again with more repetitions");
    assert!(
        events
            .borrow()
            .iter()
            .any(|e| matches!(e, Event::Note(l) if l.contains("timings noisy"))),
        "the second look is reported"
    );
}

#[test]
fn noisy_held_out_timings_that_say_slower_are_taken_again_with_more_repetitions() {
    let b = Bench::new();
    let cfg = b.config(4, 12);
    // On the held-out shape (cols 128) the candidate looks 50x slower with a spread of 30x (a
    // busy machine) unless timed with at least 15 repetitions.
    let (ev, log) = Scripted::new(|c| match plain(c) {
        Says::Time(us, _) if c.cols == 128 && !c.seed && c.min_reps < 15 => Says::Time(us * 50.0, 30.0),
        other => other,
    });
    let (mut s, events) = b.search(&cfg, ev);
    let r = finished(s.run(stop(&cfg)).expect("run"));
    assert_eq!(r.no_result(), None, "the calmer look counts: {r:?}");
    let held = r.heldout.as_ref().expect("validated");
    assert!(held.passed && held.speedup.unwrap() > 1.0, "{held:?}");
    let again = log
        .borrow()
        .requests
        .iter()
        .filter(|q| q.timing.min_reps >= 15 && q.workloads.iter().any(|w| w.axes.get("cols") == Some(&128)))
        .count();
    assert!(again >= 2, "seed and candidate timed again on the held-out shape");
    let p = purposes(&b.db(), s.run_id());
    assert_eq!(p.iter().filter(|x| *x == "heldout").count(), 2, "one pair a finish: {p:?}");
    assert_eq!(p.iter().filter(|x| *x == "heldout-again").count(), 2, "{p:?}");
    assert!(
        events
            .borrow()
            .iter()
            .any(|e| matches!(e, Event::Note(l) if l.contains("held-out timings noisy"))),
        "the second look is reported"
    );
}

#[test]
fn an_infrastructure_failure_stops_the_run_and_resume_tries_the_node_again() {
    let b = Bench::new();
    let cfg = b.config(6, 50);
    let (ev, log) = Scripted::new(plain);
    // The seed answers (request 0); then the first round's two builds (1, 2) and their retry
    // (3, 4) each have one build failing on the machine.
    log.borrow_mut().infra_at = vec![1, 3];
    let (mut s, _) = b.search(&cfg, ev);
    let run_id = s.run_id();
    let err = s.run(stop(&cfg)).expect_err("an infra failure stops the run");
    assert!(err.to_string().contains("infrastructure failure"), "{err}");
    let row = s.store().run(run_id).unwrap();
    assert_eq!(row.status, "stopped");
    assert!(
        s.tree().nodes.values().all(|n| n.failure != Some(FailureClass::Infra)),
        "never booked on a candidate"
    );
    drop(s);
    let (ev, _) = Scripted::new(plain);
    let (mut s, _) = b.attach(run_id, &cfg, ev);
    let r = finished(s.resume(stop(&cfg)).expect("resume"));
    assert_eq!(r.no_result(), None, "{r:?}");
    assert_eq!(r.rounds, 6);
}

/// Every candidate measured in the search of run `run`: its key, status and speed-up.
fn measured(db: &Path, run: i64) -> BTreeMap<String, (NodeStatus, Option<String>)> {
    let store = Store::open(db).unwrap();
    store
        .nodes(run)
        .unwrap()
        .into_iter()
        .filter(|n| n.round_evaluated.is_some())
        .map(|n| {
            (
                n.candidate.clone().unwrap_or_default(),
                (n.status, n.speedup.map(|s| format!("{s:.6}"))),
            )
        })
        .collect()
}

#[test]
fn with_three_workers_the_rounds_hand_over_batches_of_three_and_measure_the_same() {
    // Until no open action is left: the whole space is measured either way.
    let b1 = Bench::new();
    let cfg = b1.config(60, 60);
    let (ev, log1) = Scripted::new(plain);
    let (mut s, _) = b1.search(&cfg, ev);
    let r1 = finished(s.run(stop(&cfg)).expect("run, one at a time"));
    let run1 = s.run_id();
    drop(s);
    let b3 = Bench::new();
    let (mut ev, log3) = Scripted::new(plain);
    ev.parallel = 3;
    let (mut s, _) = b3.search(&cfg, ev);
    let r3 = finished(s.run(stop(&cfg)).expect("run, three at a time"));
    let run3 = s.run_id();
    drop(s);
    assert_eq!(r1.stop_reason, "no open actions left");
    assert_eq!(r3.stop_reason, "no open actions left");
    // One at a time: no search batch above one candidate's builds (two shapes, two builds).
    assert!(
        log1.borrow().batches.iter().take(5).all(|n| *n <= 2),
        "{:?}",
        log1.borrow().batches
    );
    // Three at a time: the rounds hand over three candidates (two builds each) at once.
    let batches = log3.borrow().batches.clone();
    assert!(batches.iter().filter(|n| **n == 6).count() >= 2, "{batches:?}");
    let (m1, m3) = (measured(&b1.db(), run1), measured(&b3.db(), run3));
    assert_eq!(m1, m3, "the same candidates measured, with the same results");
    assert_eq!(r1.speedup, r3.speedup);
    assert_eq!(r1.rounds, r3.rounds);
    let p = purposes(&b3.db(), run3);
    assert_eq!(
        p.iter().filter(|x| *x == "search").count() as u32,
        r3.rounds - dups(&b3.db(), run3)
    );
}

/// Nodes booked as duplicates (no evaluation of their own).
fn dups(db: &Path, run: i64) -> u32 {
    let store = Store::open(db).unwrap();
    let ev = store.evaluations(run, None).unwrap();
    store
        .nodes(run)
        .unwrap()
        .iter()
        .filter(|n| n.parent.is_some() && n.round_evaluated.is_some())
        .filter(|n| !ev.iter().any(|e| e.purpose == "search" && e.node_id == Some(n.id)))
        .count() as u32
}

/// An evaluator that answers out of order (the node handed over last comes back first): every
/// node is booked once, as one round, and the search measures what it measures one at a time.
#[test]
fn nodes_that_come_back_out_of_order_are_each_booked_once() {
    let b1 = Bench::new();
    let cfg = b1.config(60, 60);
    let (ev, _) = Scripted::new(plain);
    let (mut s, _) = b1.search(&cfg, ev);
    let r1 = finished(s.run(stop(&cfg)).expect("run, one at a time"));
    let run1 = s.run_id();
    drop(s);
    let b3 = Bench::new();
    let (mut ev, log) = Scripted::new(plain);
    ev.parallel = 3;
    ev.lifo = true;
    let (mut s, events) = b3.search(&cfg, ev);
    let r3 = finished(s.run(stop(&cfg)).expect("run, out of order"));
    let run3 = s.run_id();
    drop(s);
    assert_eq!(r3.stop_reason, "no open actions left");
    assert_eq!(measured(&b1.db(), run1), measured(&b3.db(), run3));
    assert_eq!((r1.speedup, r1.rounds), (r3.speedup, r3.rounds));
    let store = Store::open(&b3.db()).unwrap();
    let evals = store.evaluations(run3, None).unwrap();
    let mut per_node = BTreeMap::new();
    for e in evals.iter().filter(|e| e.purpose == "search") {
        *per_node.entry(e.node_id).or_insert(0) += 1;
    }
    assert!(per_node.values().all(|n| *n == 1), "{per_node:?}");
    assert_eq!(per_node.len() as u32, r3.rounds - dups(&b3.db(), run3));
    // Rounds are numbered 1, 2, 3… in the order they were booked, none twice.
    let mut rounds: Vec<u32> = store
        .nodes(run3)
        .unwrap()
        .iter()
        .filter_map(|n| n.round_evaluated)
        .filter(|r| *r > 0)
        .collect();
    rounds.sort();
    assert_eq!(rounds, (1..=r3.rounds).collect::<Vec<_>>());
    let announced: Vec<u32> = events
        .borrow()
        .iter()
        .filter_map(|e| match e {
            Event::Round { round, .. } => Some(*round),
            _ => None,
        })
        .collect();
    assert_eq!(announced, (1..=r3.rounds).collect::<Vec<_>>());
    // Three nodes in flight at once.
    assert_eq!(log.borrow().most_queued, 3);
}
