//! The search engine: one run = one tree in the store. Each round selects an open node,
//! has the planner write its candidate, checks it statically, evaluates it through the
//! [`Evaluator`], records everything in one transaction, and lets the planner revise the tree.
//! At the end the best candidates are re-timed against the seed and validated on held-out
//! workloads. Progress goes to an [`Event`] callback; nothing is printed here.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ksearch_core::Backend;
use ksearch_core::protocol::{Candidate, EvalReply, EvalRequest, Failure, FailureClass, TimingReq, WorkloadReq, workload_label};
use ksearch_core::task::{Task, Workload};
use ksearch_core::tree::{Action, Assessment, Node, NodeStatus, Tree};
use ksearch_store::Store;

use crate::evaluator::{Evaluator, Window};
use crate::planner::{Ctx, Outcome, Planner, Proposal, TreeEdit, validate_edit};

/// Everything a run needs, persisted as the run's config so `resume` continues alike.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunConfig {
    pub task: String,
    pub task_path: PathBuf,
    pub backend: Backend,
    pub planner: String,
    pub rounds: u32,
    pub patience: u32,
    pub seed: u64,
    pub context: String,
    pub workers: u32,
    pub devices: Vec<usize>,
    pub compile_timeout_s: f64,
    pub run_timeout_s: f64,
    pub mem_limit_bytes: u64,
    pub timing: TimingReq,
    pub kb_dir: Option<PathBuf>,
    pub cache_dir: PathBuf,
    /// LLM settings (no secrets: only the name of the key's environment variable).
    #[serde(default)]
    pub llm: Option<serde_json::Value>,
    /// How workers are started (local child processes, or Slurm job steps).
    #[serde(default)]
    pub launcher: ksearch_eval::Launcher,
    /// The task's digest when the run started (`Task::digest`): `resume` refuses a task that
    /// changed since (older runs have none).
    #[serde(default)]
    pub task_digest: Option<String>,
}

/// When a run stops searching and goes on to its final phase.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StopRules {
    /// The round budget: no round beyond this one.
    pub rounds: u32,
    /// Stop after this many rounds without a new best.
    pub patience: u32,
    /// Wall time of this invocation (it also bounds every LLM call in flight).
    pub time_budget: Option<Duration>,
}

impl StopRules {
    /// The rules of `cfg` with a time budget.
    pub fn of(cfg: &RunConfig, time_budget: Option<Duration>) -> StopRules {
        StopRules {
            rounds: cfg.rounds,
            patience: cfg.patience,
            time_budget,
        }
    }
}

/// What the engine reports while it works.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A line about the search (a node's result, a refused edit, a step of the final phase).
    Note(String),
    /// `resume` rebuilt the run from the store and continues at `round`.
    Resumed { round: u32, nodes: usize, evaluations: u64 },
    /// A round ended: the best in-search speed-up so far and the evaluations of this invocation.
    Round { round: u32, best: f64, evaluations: u64 },
    /// The search stopped (why) and the final phase begins.
    Finishing { reason: String },
}

/// How a run (or a resumed run) ended.
#[derive(Debug, Clone)]
pub enum RunEnd {
    /// The search ended and the final phase reported.
    Finished(Box<Report>),
    /// The planner had to stop (its budget is spent): the run is resumable, no final phase ran.
    Stopped { reason: String },
    /// The stop flag was raised (a signal): the run is `interrupted`, everything booked is kept,
    /// a node whose evaluation was in flight is open again; `resume` goes on.
    Interrupted,
}

/// The error that unwinds the final phase when the stop flag is raised (see `RunEnd::Interrupted`).
#[derive(Debug)]
struct InterruptedErr;

impl std::fmt::Display for InterruptedErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for InterruptedErr {}

/// What a [`Search`] is made of.
pub struct Parts {
    pub store: Store,
    /// The run in the store (created by the caller, or the one to resume).
    pub run_id: i64,
    pub cfg: RunConfig,
    pub task: Task,
    pub evaluator: Box<dyn Evaluator>,
    pub kb: Option<ksearch_kb::Kb>,
    /// The hardware profile (in `kb`) whose rules and roofline apply.
    pub profile: Option<String>,
    pub planner: Box<dyn Planner>,
}

pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

macro_rules! ctx {
    ($s:ident) => {
        Ctx {
            task: &$s.task,
            backend: $s.cfg.backend,
            kb: $s.kb.as_ref(),
            tree: &$s.tree,
            round: $s.round,
            run_id: $s.run_id,
            store: Some(&$s.store),
            profile: $s.profile.as_deref(),
        }
    };
}

/// A final re-timing: the seed's medians, the candidate's, and the worse spread of the two.
type Pair = (Vec<f64>, Vec<f64>, f64);

/// How the rounds ended.
enum Flow {
    /// A stop rule held (why); the final phase follows.
    Reason(String),
    /// The planner stopped the run (why); no final phase.
    Stopped(String),
    /// The run ended there (interrupted).
    End(RunEnd),
}

/// A node's evaluation in flight (`Search::rounds_window`).
struct Sub {
    id: i64,
    parent_speedup: Option<f64>,
    key: String,
    cand: Candidate,
    kernel: String,
    /// The requests in flight: the evaluation, or its re-timing.
    plan: Planned,
    /// An infrastructure failure was tried once more.
    retried: bool,
    /// The first reading of a possible new best (reply, wall share), while it is re-timed.
    first: Option<(EvalReply, f64)>,
}

/// The requests of one evaluation (see `Search::plan`).
struct Planned {
    reqs: Vec<EvalRequest>,
    /// The defines of each request when the shapes need their own builds (None: one plain
    /// request).
    builds: Option<Vec<BTreeMap<String, i64>>>,
    /// The workloads' labels in the list's order.
    order: Vec<String>,
}

/// One run of the search.
pub struct Search {
    store: Store,
    run_id: i64,
    cfg: RunConfig,
    task: Task,
    tree: Tree,
    evaluator: Box<dyn Evaluator>,
    kb: Option<ksearch_kb::Kb>,
    profile: Option<String>,
    planner: Box<dyn Planner>,
    round: u32,
    /// Seed medians per search workload (microseconds).
    seed_times: Vec<f64>,
    evals: u64,
    rounds_since_best: u32,
    /// Wall seconds per evaluation seen so far, the seed's own measurement apart (sum, count):
    /// what the time budget keeps for one more round and for the final phase is estimated from
    /// it and from `seed_wall`.
    eval_wall: (f64, u64),
    /// Wall seconds of the seed's measurement. A naive seed can take far longer than every
    /// candidate (MLX attention on the H200: 19.8 s against ~2 s); averaged in, it made a
    /// 100-second budget look spent before the first round.
    seed_wall: Option<f64>,
    /// The end of this invocation's time budget.
    deadline: Option<Instant>,
    started: Instant,
    events: Box<dyn FnMut(&Event)>,
    /// Raised from outside (a signal handler) to stop between evaluations.
    interrupt: Option<&'static AtomicBool>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub run: i64,
    pub task: String,
    pub backend: Backend,
    pub device: String,
    pub rounds: u32,
    pub evaluations: u64,
    pub stop_reason: String,
    pub best_node: Option<i64>,
    pub best_action: Option<String>,
    pub seed_us: Vec<f64>,
    pub best_us: Vec<f64>,
    pub workloads: Vec<String>,
    /// The chosen candidate's speed-up over the seed in the final re-timing (back to back with
    /// the seed): the verified figure.
    pub speedup: Option<f64>,
    pub heldout: Option<HeldOut>,
    /// The chosen candidate's speed-up as measured during the search (not verified).
    #[serde(default)]
    pub search_speedup: Option<f64>,
    /// Every candidate re-timed at the end, best verified figure first.
    #[serde(default)]
    pub retimed: Vec<Retimed>,
    /// Spread of the chosen candidate's final timings (worst workload, seed or candidate).
    #[serde(default)]
    pub spread: Option<f64>,
    /// The back-end's native implementation (MLX: its own attention, mlx-lm's scan…) timed
    /// on the search workloads right after the final re-timing.
    #[serde(default)]
    pub native: Option<Native>,
}

/// One candidate of the final re-timing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Retimed {
    pub node: i64,
    /// Speed-up measured during the search.
    pub search: Option<f64>,
    /// Speed-up in the final re-timing, back to back with the seed (None: it failed).
    pub verified: Option<f64>,
}

/// Above this spread ((p90 - p10) / median) a timing is called noisy.
pub const NOISY_SPREAD: f64 = 0.25;

/// How many of the best candidates the final re-timing measures again, back to back.
const FINAL_CANDIDATES: usize = 3;

/// The line that says timings were noisy, if they were.
pub fn noise_line(spread: Option<f64>) -> Option<String> {
    spread
        .filter(|s| *s > NOISY_SPREAD)
        .map(|s| format!("timings noisy: spread {:.0}%, machine busy?", s * 100.0))
}

/// The timing settings for a second look at noisy timings: three times the repetitions.
pub fn more_reps(t: &TimingReq) -> TimingReq {
    let min_reps = (t.min_reps * 3).max(10);
    TimingReq {
        min_reps,
        max_reps: (t.max_reps * 3).max(min_reps),
        target_ms: t.target_ms * 3.0,
        ..t.clone()
    }
}

/// The worst spread over a reply's timed workloads.
pub fn max_spread(r: &EvalReply) -> f64 {
    r.workloads
        .iter()
        .filter_map(|w| w.timing.as_ref().map(|t| t.spread))
        .fold(0.0, f64::max)
}

impl Report {
    /// Why the run has no result (None: it has one). A result is a candidate faster than the
    /// seed once re-timed, correct on the held-out workloads and faster there too.
    pub fn no_result(&self) -> Option<String> {
        let sp = match (self.best_node, self.speedup) {
            (Some(_), Some(sp)) => sp,
            _ => return Some(NO_FASTER.into()),
        };
        if !faster(sp) {
            return Some(format!("{NO_FASTER} once re-timed (best {sp:.2}x)"));
        }
        match &self.heldout {
            None => Some("not validated on held-out workloads".into()),
            Some(h) if !h.passed => Some(format!(
                "held-out validation failed: {}",
                h.message.clone().unwrap_or_default()
            )),
            // Slower on the held-out workloads is no result when that is measured, not when
            // the held-out timings are noise (a busy machine): then the figure is reported as
            // noisy. Noise excuses a small slowdown only: a kernel controls its own timings'
            // spread, so a large one is never waived.
            Some(h) => match h.speedup {
                Some(hs) if !faster(hs) && !excused(h, hs) => Some(format!(
                    "{sp:.2}x on the search workloads but slower than the seed on the held-out ones ({hs:.2}x)"
                )),
                _ => None,
            },
        }
    }
}

/// The held-out speed-up below which noisy timings no longer excuse a slowdown.
const NOISE_EXCUSES: f64 = 0.8;

/// Whether noisy held-out timings excuse a held-out speed-up below 1.
fn excused(h: &HeldOut, speedup: f64) -> bool {
    h.noisy() && speedup >= NOISE_EXCUSES
}

/// Whether a speed-up is one (NaN is not).
fn faster(speedup: f64) -> bool {
    speedup > 1.0
}

/// The message of a run without a candidate faster than the seed.
pub const NO_FASTER: &str = "no candidate faster than the seed";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Native {
    /// What was timed (e.g. `mx.fast.scaled_dot_product_attention`).
    pub name: String,
    pub us: Vec<f64>,
    /// Geometric mean of native time / best time: above 1, the searched kernel is faster.
    pub ratio: Option<f64>,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeldOut {
    pub passed: bool,
    pub workloads: Vec<String>,
    pub speedup: Option<f64>,
    pub message: Option<String>,
    /// Worst spread of the held-out timings (seed or candidate).
    #[serde(default)]
    pub spread: Option<f64>,
}

impl HeldOut {
    /// Whether its timings are too noisy to decide that a correct kernel is slower there.
    pub fn noisy(&self) -> bool {
        self.spread.is_some_and(|s| s > NOISY_SPREAD)
    }
}

/// Geometric mean of seed time / candidate time over workloads: the speed-up.
fn ratio(seed: &[f64], cand: &[f64]) -> f64 {
    geomean(&seed.iter().zip(cand).map(|(s, c)| s / c).collect::<Vec<_>>())
}

fn geomean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp()
}

/// Median times per workload of a successful reply.
fn medians(r: &EvalReply) -> Option<Vec<f64>> {
    if !r.ok() {
        return None;
    }
    r.workloads.iter().map(|w| w.timing.as_ref().map(|t| t.median_us)).collect()
}

/// The failure of a reply, whole-candidate or first workload's.
pub fn failure_of(r: &EvalReply) -> Option<Failure> {
    if let Some(f) = &r.failure {
        return Some(f.clone());
    }
    for w in &r.workloads {
        if let Some(f) = &w.failure {
            return Some(Failure {
                class: f.class,
                message: format!("{}: {}", w.label, f.message),
            });
        }
        if !w.check.passed() {
            return Some(Failure {
                class: FailureClass::Wrong,
                message: format!("{}: check failed", w.label),
            });
        }
    }
    None
}

impl Search {
    /// A search over `parts`; nothing runs until [`Search::run`] or [`Search::resume`].
    pub fn new(parts: Parts) -> Search {
        Search {
            store: parts.store,
            run_id: parts.run_id,
            cfg: parts.cfg,
            task: parts.task,
            tree: Tree::default(),
            evaluator: parts.evaluator,
            kb: parts.kb,
            profile: parts.profile,
            planner: parts.planner,
            round: 0,
            seed_times: vec![],
            evals: 0,
            rounds_since_best: 0,
            eval_wall: (0.0, 0),
            seed_wall: None,
            deadline: None,
            started: Instant::now(),
            events: Box::new(|_| {}),
            interrupt: None,
        }
    }

    /// A flag that, once raised, stops the run between evaluations: what is booked stays, a
    /// node whose evaluation was in flight is reopened, the run is marked `interrupted` and
    /// `run`/`resume` return [`RunEnd::Interrupted`].
    pub fn set_interrupt(&mut self, flag: &'static AtomicBool) {
        self.interrupt = Some(flag);
    }

    fn interrupted(&self) -> bool {
        self.interrupt.is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// Mark the run interrupted (resumable).
    fn mark_interrupted(&mut self) -> Result<RunEnd> {
        self.store
            .set_run_status(self.run_id, "interrupted", Some("interrupted by a signal"))?;
        Ok(RunEnd::Interrupted)
    }

    /// Where progress goes (by default nowhere).
    pub fn on_event(&mut self, f: impl FnMut(&Event) + 'static) {
        self.events = Box::new(f);
    }

    pub fn run_id(&self) -> i64 {
        self.run_id
    }

    pub fn task(&self) -> &Task {
        &self.task
    }

    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// What this invocation's evaluations cost, in one line (the evaluator's accounting).
    pub fn cost_line(&self) -> Option<String> {
        self.evaluator.cost_line(self.started.elapsed().as_secs_f64())
    }

    /// The last round started (the round counter of the run).
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Run a fresh run: measure the seed, let the planner open the first actions, search until
    /// a stop rule holds, then re-time, validate and report.
    pub fn run(&mut self, stop: StopRules) -> Result<RunEnd> {
        // One deadline: the time budget also bounds every LLM call in flight, the first included.
        self.deadline = stop.time_budget.map(|b| self.started + b);
        self.planner.set_deadline(self.deadline);
        self.start()?;
        self.drive(stop)
    }

    /// Continue the run from the store after an interruption in any phase: nodes left running
    /// are tried again once (a node running both times the process died is failed as
    /// `killed_orchestrator`), a seed never measured is measured now, the round counter and
    /// the rounds since the best go on; a search that had ended goes straight to its final phase.
    pub fn resume(&mut self, stop: StopRules) -> Result<RunEnd> {
        self.deadline = stop.time_budget.map(|b| self.started + b);
        self.planner.set_deadline(self.deadline);
        let run_id = self.run_id;
        let row = self.store.run(run_id)?;
        // What evaluations took before, for the time the final phase needs.
        for e in self.store.evaluations(run_id, None)? {
            if e.purpose == "seed" {
                self.seed_wall = Some(e.wall_s);
            } else {
                self.eval_wall.0 += e.wall_s;
                self.eval_wall.1 += 1;
            }
        }
        let mut nodes = self.store.nodes(run_id)?;
        for n in nodes.iter_mut().filter(|n| n.status == NodeStatus::Running) {
            if n.attempts >= 2 {
                n.status = NodeStatus::Failed;
                n.failure = Some(FailureClass::KilledOrchestrator);
                n.assessment.overall = 0.0;
                n.assessment.hw_fit.note = format!(
                    "the search process died while this node ran ({} times): not retried",
                    n.attempts
                );
                self.log(&format!(
                    "node {} was running when the search process died twice: failed (killed_orchestrator)",
                    n.id
                ));
            } else {
                n.status = NodeStatus::Open;
            }
            self.store.update_node(n)?;
        }
        // The round counter counts booked rounds: a round whose node was in flight when the
        // process died was persisted as started, but it is tried again, not counted twice.
        let booked = nodes.iter().filter_map(|n| n.round_evaluated).max().unwrap_or(0);
        self.tree = Tree::from_nodes(nodes);
        self.round = row.round.min(booked);
        self.evals = self.store.count_evaluations(run_id)? + 1000;
        match self.tree.root().cloned() {
            // Interrupted before or while the seed was measured: measure it now.
            None => self.start()?,
            Some(root) if root.status == NodeStatus::Failed => {
                bail!("run {run_id}: its seed failed; start a new run")
            }
            Some(root) if root.status != NodeStatus::Solved => {
                self.tree = Tree::default();
                self.measure_seed(root)?;
                self.open_first()?;
            }
            Some(root) => {
                let seed_eval = self
                    .store
                    .evaluations(run_id, Some(root.id))?
                    .into_iter()
                    .find(|e| e.purpose == "seed")
                    .context("the seed's evaluation is missing")?;
                self.seed_times = seed_eval
                    .reply
                    .workloads
                    .iter()
                    .filter_map(|w| w.timing.as_ref().map(|t| t.median_us))
                    .collect();
                // Rounds since the best, from the tree.
                let best_round = self.tree.best().and_then(|b| b.round_evaluated).unwrap_or(0);
                self.rounds_since_best = self.round.saturating_sub(best_round);
                // A fresh tree gets the planner's first actions; otherwise a planner
                // initialisation that failed before is tried again.
                let props = if self.tree.nodes.len() == 1 {
                    self.planner.init(&ctx!(self))
                } else {
                    self.planner.resumed(&ctx!(self))
                };
                self.planner_notes();
                let props = props?;
                for p in props {
                    self.insert(p)?;
                }
            }
        }
        let evaluations = self.store.count_evaluations(run_id)?;
        (self.events)(&Event::Resumed {
            round: self.round,
            nodes: self.tree.nodes.len(),
            evaluations,
        });
        self.drive(stop)
    }

    /// Wall time of one candidate's evaluation so far (a mean; zero before any).
    fn per_eval_s(&self) -> Duration {
        let (sum, n) = self.eval_wall;
        if n == 0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((sum / n as f64).max(0.0))
    }

    /// The time the final phase is estimated to take: each of the best candidates (at most
    /// `FINAL_CANDIDATES`, at least one) re-timed with the seed, then held-out validation of the
    /// chosen one with the seed: that many seed measurements at the seed's time and candidate
    /// evaluations at their mean so far.
    fn final_reserve(&self) -> Duration {
        let better = self
            .tree
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Solved && n.parent.is_some() && n.speedup.unwrap_or(0.0) > 1.0)
            .count();
        let pairs = better.clamp(1, FINAL_CANDIDATES) as u32 + 1;
        let seed = self
            .seed_wall
            .map(Duration::from_secs_f64)
            .unwrap_or_else(|| self.per_eval_s());
        (seed + self.per_eval_s()) * pairs
    }

    /// Whether the time budget leaves room for `evals` more evaluations.
    fn time_for(&self, evals: u32) -> bool {
        self.deadline.is_none_or(|d| Instant::now() + self.per_eval_s() * evals <= d)
    }

    /// Rounds until a stop rule holds, then the final phase.
    fn drive(&mut self, stop: StopRules) -> Result<RunEnd> {
        let evals0 = self.store.count_evaluations(self.run_id)?;
        let reason = loop {
            self.planner_notes();
            if self.interrupted() {
                return self.mark_interrupted();
            }
            if self.round >= stop.rounds {
                break "round budget reached".to_string();
            }
            if let Some(b) = stop.time_budget
                && self.started.elapsed() + self.final_reserve() + self.per_eval_s() >= b
            {
                // The budget covers the final phase: the rounds stop early enough to leave it
                // the time it is estimated to take.
                break format!("time budget {} reached", humantime::format_duration(b));
            }
            if self.rounds_since_best >= stop.patience {
                break format!("plateau: no new best in {} rounds", stop.patience);
            }
            if let Some(why) = self.planner.stop_reason() {
                self.store.set_run_status(self.run_id, "stopped", Some(&why))?;
                return Ok(RunEnd::Stopped { reason: why });
            }
            let k = self.evaluator.parallelism().max(1);
            if k > 1 {
                match self.rounds_window(&stop, evals0, k)? {
                    Flow::Reason(r) => break r,
                    Flow::Stopped(why) => {
                        self.store.set_run_status(self.run_id, "stopped", Some(&why))?;
                        return Ok(RunEnd::Stopped { reason: why });
                    }
                    Flow::End(end) => return Ok(end),
                }
            }
            let more = self.step()?;
            if !more {
                break "no open actions left".to_string();
            }
            let evaluations = self.store.count_evaluations(self.run_id)?.saturating_sub(evals0);
            let best = self.best_speedup();
            (self.events)(&Event::Round {
                round: self.round,
                best,
                evaluations,
            });
        };
        if self.interrupted() {
            return self.mark_interrupted();
        }
        (self.events)(&Event::Finishing { reason: reason.clone() });
        match self.finish(&reason) {
            Ok(r) => Ok(RunEnd::Finished(Box::new(r))),
            Err(e) if e.is::<InterruptedErr>() => self.mark_interrupted(),
            Err(e) => Err(e),
        }
    }

    fn workloads(&self, list: &[Workload], purpose: u64) -> Vec<WorkloadReq> {
        list.iter()
            .enumerate()
            .map(|(i, w)| WorkloadReq {
                label: workload_label(w, &self.task.axes),
                axes: w.clone(),
                seed: mix(mix(self.cfg.seed, self.evals + 1), mix(purpose, i as u64)),
            })
            .collect()
    }

    fn request(&mut self, cand: &Candidate, heldout: bool, check_only: bool) -> EvalRequest {
        let b = self.task.backend(self.cfg.backend).expect("backend checked at start");
        let list = if heldout { b.heldout.clone() } else { b.search.clone() };
        self.request_for(cand, &list, heldout as u64, check_only)
    }

    fn request_for(&mut self, cand: &Candidate, list: &[Workload], purpose: u64, check_only: bool) -> EvalRequest {
        let ws = self.workloads(list, purpose);
        self.evals += 1;
        EvalRequest {
            id: self.evals,
            task: self.task.clone(),
            backend: self.cfg.backend,
            candidate: cand.clone(),
            workloads: ws,
            timing: self.cfg.timing.clone(),
            check_only,
        }
    }

    /// The requests of one evaluation of `cand` (of knowledge-base kernel `kernel`) on
    /// `list`, with the build each shape needs: a tunable its constraints tie to the shape
    /// (e.g. `HD == D`) is specialised per workload (same source, same other tunables), one
    /// request per distinct build. Search and held-out workloads are treated alike.
    fn plan(&mut self, cand: &Candidate, kernel: &str, list: &[Workload], heldout: bool) -> Planned {
        let spec = self.task.kernel(self.cfg.backend, kernel).cloned();
        let mut groups: Vec<(BTreeMap<String, i64>, Vec<Workload>)> = Vec::new();
        for w in list {
            let mut c = cand.defines.clone();
            if let Some(k) = &spec
                && let Some(c2) = specialise(k, &c, w)
            {
                c = c2;
            }
            match groups.iter_mut().find(|(g, _)| *g == c) {
                Some((_, v)) => v.push(w.clone()),
                None => groups.push((c, vec![w.clone()])),
            }
        }
        let order = list.iter().map(|w| workload_label(w, &self.task.axes)).collect();
        if groups.len() == 1 && groups[0].0 == cand.defines {
            // One build for every shape: a plain evaluation.
            let req = self.request_for(cand, list, heldout as u64, false);
            return Planned {
                reqs: vec![req],
                builds: None,
                order,
            };
        }
        let mut reqs = Vec::new();
        let mut builds = Vec::new();
        for (defs, ws) in groups {
            let mut c = cand.clone();
            c.defines = defs.clone();
            reqs.push(self.request_for(&c, &ws, heldout as u64, false));
            builds.push(defs);
        }
        Planned {
            reqs,
            builds: Some(builds),
            order,
        }
    }

    /// One reply for a planned evaluation: per-shape builds merged in the list's order, each
    /// workload recording the defines it ran with (the candidate's dispatch table).
    fn merge(&self, p: &Planned, replies: Vec<EvalReply>) -> EvalReply {
        let Some(builds) = &p.builds else {
            let mut r = replies.into_iter().next().unwrap_or_default();
            r.id = p.reqs[0].id;
            self.apply_profile_floor(&mut r);
            return r;
        };
        let mut merged = EvalReply::default();
        for ((req, defs), r) in p.reqs.iter().zip(builds).zip(replies) {
            merged.id = req.id;
            if merged.failure.is_none() || r.infra() {
                merged.failure = r.failure.clone();
            }
            merged.compile.log.push_str(&r.compile.log);
            merged.compile.seconds += r.compile.seconds;
            merged.kernel_s += r.kernel_s;
            merged.overhead_s += r.overhead_s;
            merged.compile_s += r.compile_s;
            merged.device_s += r.device_s;
            merged.lock_wait_s += r.lock_wait_s;
            merged.device_spans.extend(r.device_spans.iter().copied());
            merged.resources = r.resources.clone();
            merged.workloads.extend(r.workloads.into_iter().map(|mut w| {
                w.defines = Some(defs.clone());
                w
            }));
        }
        self.apply_profile_floor(&mut merged);
        // Back in the list's order, so seed and candidate line up.
        merged
            .workloads
            .sort_by_key(|w| p.order.iter().position(|l| *l == w.label).unwrap_or(usize::MAX));
        merged
    }

    /// Evaluate independent things as one batch (the evaluator may run them at once): one
    /// reply per plan, in order, each with its share of the batch's wall time.
    fn evaluate_batch(&mut self, plans: Vec<Planned>) -> Vec<(EvalReply, f64)> {
        self.evaluate_batch_on(plans, false)
    }

    /// `evaluate_batch`, every request on one device when `same_device` (times compared with
    /// each other: the final re-timing and held-out validation against the seed).
    fn evaluate_batch_on(&mut self, plans: Vec<Planned>, same_device: bool) -> Vec<(EvalReply, f64)> {
        let all: Vec<EvalRequest> = plans.iter().flat_map(|p| p.reqs.iter().cloned()).collect();
        let t = Instant::now();
        let mut replies = if same_device {
            self.evaluator.eval_same_device(&all)
        } else {
            self.evaluator.eval_many(&all)
        };
        let share = t.elapsed().as_secs_f64() / plans.len().max(1) as f64;
        self.eval_wall.0 += share * plans.len() as f64;
        self.eval_wall.1 += plans.len() as u64;
        // An evaluator that answers fewer requests than it was given failed on the rest.
        for q in all.iter().skip(replies.len()) {
            replies.push(EvalReply::failed(q.id, FailureClass::Infra, "the evaluator gave no reply"));
        }
        let mut it = replies.into_iter();
        plans
            .iter()
            .map(|p| (self.merge(p, it.by_ref().take(p.reqs.len()).collect()), share))
            .collect()
    }

    /// Evaluate one thing (see `plan`).
    fn evaluate_built(&mut self, cand: &Candidate, kernel: &str, list: &[Workload], heldout: bool) -> (EvalReply, f64) {
        let p = self.plan(cand, kernel, list, heldout);
        self.evaluate_batch(vec![p]).pop().unwrap_or_default()
    }

    /// An evaluation whose failure is the machine's (`infra`) is tried once more.
    fn evaluate_retrying_infra(&mut self, mut eval: impl FnMut(&mut Self) -> (EvalReply, f64)) -> (EvalReply, f64) {
        let (r, w) = eval(self);
        if !r.infra() {
            return (r, w);
        }
        self.log(&format!(
            "infrastructure failure, trying once more: {}",
            r.failure.as_ref().map(|f| first_line(&f.message)).unwrap_or_default()
        ));
        eval(self)
    }

    /// Static rules of the translation layer, before any compile.
    fn static_check(&self, cand: &Candidate) -> Option<Failure> {
        let kb = self.kb.as_ref()?;
        let profile = self.profile.as_deref().and_then(|p| kb.profile(p))?;
        let forbid = self
            .task
            .backend(self.cfg.backend)
            .map(|b| b.forbid.clone())
            .unwrap_or_default();
        // A whole CUDA translation unit run through MLX (form = "cuda") is checked as CUDA, not
        // by the rules for bodies MLX wraps (no signature, no includes).
        let lang = match ksearch_core::mlx::Form::of_candidate(cand) {
            ksearch_core::mlx::Form::Cuda => ksearch_core::protocol::Lang::Cuda,
            ksearch_core::mlx::Form::Body => cand.lang,
        };
        let v = ksearch_kb::check_source(kb, &cand.source, lang, profile, &forbid, None);
        if v.is_empty() {
            return None;
        }
        let msg: Vec<String> = v.iter().map(|x| format!("rule {}: {}", x.rule, x.message)).collect();
        Some(Failure {
            class: FailureClass::Check,
            message: msg.join("; "),
        })
    }

    /// Evaluate `cand` as it is (one build for every shape).
    fn evaluate(&mut self, cand: &Candidate, heldout: bool) -> (EvalReply, f64) {
        let b = self.task.backend(self.cfg.backend).expect("backend checked at start");
        let list = if heldout { b.heldout.clone() } else { b.search.clone() };
        self.evaluate_built(cand, "", &list, heldout)
    }

    /// The hardware profile's roofline floor (bytes at the memory bandwidth, flops at the
    /// highest peak) on top of the worker's own: a time below it is `below_floor`, never a
    /// result. Transcendentals are left out here: a polynomial on the FMA units can beat the
    /// special-function rate.
    fn apply_profile_floor(&self, r: &mut EvalReply) {
        let Some(p) = self
            .kb
            .as_ref()
            .zip(self.profile.as_deref())
            .and_then(|(kb, n)| kb.profile(n))
        else {
            return;
        };
        for w in r.workloads.iter_mut() {
            let floor = ksearch_kb::floor_us(p, w.bytes, w.flops, "any", 0.0, None);
            w.floor_us = Some(w.floor_us.unwrap_or(0.0).max(floor));
            if let Some(t) = &w.timing
                && w.failure.is_none()
                && t.median_us < floor
            {
                w.failure = Some(Failure {
                    class: FailureClass::BelowFloor,
                    message: format!(
                        "median {:.2} us is below the {} roofline floor {:.2} us",
                        t.median_us, p.name, floor
                    ),
                });
            }
        }
    }

    /// Evaluate candidates as they are (no per-shape builds) on the search or held-out
    /// workloads, as one batch, with `timing` instead of the run's when given; nothing is
    /// stored. For comparing a kernel file with the seed (`ksearch bench`).
    pub fn evaluate_as_is(&mut self, cands: &[&Candidate], heldout: bool, timing: Option<&TimingReq>) -> Vec<EvalReply> {
        let saved = self.cfg.timing.clone();
        if let Some(t) = timing {
            self.cfg.timing = t.clone();
        }
        let reqs: Vec<EvalRequest> = cands.iter().map(|c| self.request(c, heldout, false)).collect();
        self.cfg.timing = saved;
        // Compared with each other: on one device.
        let mut replies = self.evaluator.eval_same_device(&reqs);
        replies.resize_with(reqs.len(), EvalReply::default);
        for (r, q) in replies.iter_mut().zip(&reqs) {
            r.id = q.id;
            self.apply_profile_floor(r);
        }
        replies
    }

    /// Evaluate on the search workloads with the build each shape needs.
    fn evaluate_search(&mut self, cand: &Candidate, kernel: &str) -> (EvalReply, f64) {
        let b = self.task.backend(self.cfg.backend).expect("backend").clone();
        self.evaluate_built(cand, kernel, &b.search, false)
    }

    /// The knowledge-base kernel a node's candidate was written from ("" if none).
    fn kernel_of(&self, n: &Node) -> String {
        n.candidate
            .as_deref()
            .and_then(|k| self.store.candidate(k).ok().flatten())
            .map(|(k, _)| k)
            .unwrap_or_default()
    }

    fn speedup(&self, r: &EvalReply) -> Option<f64> {
        let m = medians(r)?;
        if m.len() != self.seed_times.len() {
            return None;
        }
        Some(geomean(
            &self.seed_times.iter().zip(&m).map(|(s, c)| s / c).collect::<Vec<_>>(),
        ))
    }

    fn roofline_fraction(r: &EvalReply) -> Option<f64> {
        let f: Vec<f64> = r
            .workloads
            .iter()
            .filter_map(|w| Some((w.floor_us?, w.timing.as_ref()?.median_us)))
            .filter(|(f, m)| *f > 0.0 && *m > 0.0)
            .map(|(f, m)| (f / m).min(1.0))
            .collect();
        if f.is_empty() { None } else { Some(geomean(&f)) }
    }

    /// Create the run: evaluate the seed and let the planner open the first actions.
    fn start(&mut self) -> Result<()> {
        let mut root = Node::new(
            0,
            None,
            Action::Seed,
            None,
            Assessment {
                overall: 5.0,
                ..Assessment::default()
            },
            0,
        );
        root.id = self.store.insert_node(self.run_id, &root)?;
        self.measure_seed(root)?;
        self.open_first()
    }

    /// Evaluate the seed as the root node `root` (already in the store).
    fn measure_seed(&mut self, mut root: Node) -> Result<()> {
        let seed_k = self
            .task
            .kernel(self.cfg.backend, "seed")
            .context("task has no seed")?
            .clone();
        let cand = crate::planner::instantiate(self.cfg.backend, &seed_k, &BTreeMap::new());
        let before = self.eval_wall;
        let (reply, wall) = self.evaluate_retrying_infra(|s| s.evaluate(&cand, false));
        // The seed's time is kept apart from the candidates' (`seed_wall`).
        self.eval_wall = before;
        self.seed_wall = Some(wall);
        if let Some(f) = reply.failure.as_ref().filter(|_| reply.infra()) {
            let why = format!("infrastructure failure (not the seed's): {}", first_line(&f.message));
            self.store.set_run_status(self.run_id, "stopped", Some(&why))?;
            bail!("{why}");
        }
        let key = self.store.put_candidate("seed", &cand)?;
        root.candidate = Some(key.clone());
        root.round_evaluated = Some(0);
        root.attempts = 1;
        let fail = failure_of(&reply);
        match (&fail, medians(&reply)) {
            (None, Some(m)) => {
                self.seed_times = m.clone();
                root.status = NodeStatus::Solved;
                root.speedup = Some(1.0);
                root.time_us = Some(geomean(&m));
                root.assessment.confidence = 0.9;
                measured_impacts(&mut root.assessment, &reply);
            }
            _ => {
                root.status = NodeStatus::Failed;
                root.failure = fail.as_ref().map(|f| f.class);
            }
        }
        let rid = self.run_id;
        let dev = self.evaluator.device();
        self.store.atomic(|s| {
            s.insert_evaluation(rid, Some(root.id), Some(&key), 0, "seed", &reply, wall)?;
            s.update_node(&root)?;
            s.set_run_device(rid, &dev)?;
            Ok(())
        })?;
        self.tree.nodes.insert(root.id, root.clone());
        if let Some(f) = fail {
            self.store
                .set_run_status(self.run_id, "failed", Some(&format!("seed failed: {}", f.message)))?;
            bail!(
                "the seed kernel of {} failed on {} ({}): {}",
                self.task.name,
                self.cfg.backend,
                f.class,
                f.message
            );
        }
        Ok(())
    }

    /// The planner's first actions under the seed.
    fn open_first(&mut self) -> Result<()> {
        let props = self.planner.init(&ctx!(self));
        self.planner_notes();
        let props = props?;
        for p in props {
            self.insert(p)?;
        }
        Ok(())
    }

    fn insert(&mut self, p: Proposal) -> Result<i64> {
        let mut n = Node::new(0, Some(p.parent), p.action, p.pattern, p.assessment, self.round);
        n.id = self.store.insert_node(self.run_id, &n)?;
        let id = n.id;
        self.tree.nodes.insert(id, n);
        Ok(id)
    }

    fn best_speedup(&self) -> f64 {
        self.tree.best().and_then(|b| b.speedup).unwrap_or(1.0)
    }

    /// A planner that cannot go on at all (its LLM server refused the key) stops the run with an
    /// error; the run stays resumable.
    fn check_fatal(&self) -> Result<()> {
        if let Some(f) = self.planner.fatal() {
            self.store.set_run_status(self.run_id, "stopped", Some(&f))?;
            bail!("{f}; fix the key, then continue with `ksearch resume {}`", self.run_id);
        }
        Ok(())
    }

    /// The open node the policy picks next, leaving out `taken` (already picked for a batch).
    fn select_open(&self, taken: &[i64]) -> Option<i64> {
        // Open nodes this planner cannot write (LLM edits under the offline planner) are
        // skipped, not failed: they stay open for a later run with a planner that can.
        let mut skip: Vec<i64> = self
            .tree
            .open()
            .into_iter()
            .filter(|n| !self.planner.can_write(n))
            .map(|n| n.id)
            .collect();
        skip.extend_from_slice(taken);
        let picked = if skip.is_empty() {
            ksearch_core::policy::select(&self.tree)
        } else {
            let mut view = self.tree.clone();
            for i in &skip {
                if let Some(n) = view.nodes.get_mut(i) {
                    n.status = NodeStatus::Pruned;
                }
            }
            ksearch_core::policy::select(&view)
        };
        picked.map(|(id, _)| id)
    }

    /// Book node `id` as a duplicate of the measured node `prev` (same candidate `key`).
    fn book_duplicate(&mut self, id: i64, prev: &Node, key: String) -> Result<()> {
        let round = self.round;
        let n = self.tree.nodes.get_mut(&id).expect("node");
        n.status = prev.status;
        n.speedup = prev.speedup;
        n.time_us = prev.time_us;
        n.failure = prev.failure;
        n.candidate = Some(key);
        n.round_evaluated = Some(round);
        n.assessment.hw_fit.note = format!("duplicate of node {}: not re-evaluated", prev.id);
        let snap = n.clone();
        let rid = self.run_id;
        self.store.atomic(|s| {
            s.update_node(&snap)?;
            s.set_run_round(rid, round)
        })?;
        self.log(&format!("round {round}: node {id} is a duplicate of node {}", prev.id));
        Ok(())
    }

    /// Node `id` (running) goes back to open, its attempt undone: it was not tried.
    fn reopen(&mut self, id: i64) -> Result<()> {
        let n = self.tree.nodes.get_mut(&id).expect("node");
        n.status = NodeStatus::Open;
        n.attempts = n.attempts.saturating_sub(1);
        let snapshot = n.clone();
        self.store.update_node(&snapshot)?;
        Ok(())
    }

    /// The measured node with candidate `key`, other than `id`.
    fn measured_with(&self, id: i64, key: &str) -> Option<Node> {
        self.tree
            .nodes
            .values()
            .find(|n| {
                n.id != id && n.candidate.as_deref() == Some(key) && matches!(n.status, NodeStatus::Solved | NodeStatus::Failed)
            })
            .cloned()
    }

    /// The rounds with `k` nodes in flight: whenever a node's evaluation comes back it is
    /// booked (one round, exactly as `step` books one) and the policy's next open node is
    /// written and handed over, so the evaluator always has `k` candidates to work on and a
    /// device never waits for the slowest of a batch. A possible new best (faster than the best
    /// when it came back) is re-timed before it is booked, as another submission. The window
    /// stops taking nodes when a stop rule holds (counting the rounds in flight), then books
    /// what is in flight. Returns why the rounds ended.
    fn rounds_window(&mut self, stop: &StopRules, evals0: u64, k: usize) -> Result<Flow> {
        let mut subs: BTreeMap<u64, Sub> = BTreeMap::new();
        // Nodes whose candidate is a duplicate of one in flight: booked after it.
        let mut twins: Vec<(i64, String)> = Vec::new();
        let mut window = Window::default();
        let mut next_tag = 0u64;
        let mut last = Instant::now();
        let mut ended: Option<Flow> = None;
        let mut infra: Option<String> = None;
        let mut cancelled = false;
        // The planner could not write a node now (it retries later): the window may be empty.
        let mut retry = false;
        loop {
            self.planner_notes();
            // Fill the window.
            while ended.is_none() && infra.is_none() && !self.interrupted() {
                let flying: Vec<i64> = subs.values().map(|s| s.id).chain(twins.iter().map(|t| t.0)).collect();
                let in_flight = subs.len() as u32;
                if subs.len() >= k {
                    break;
                }
                if let Some(f) = self.stop_check(stop, flying.len() as u32, in_flight) {
                    ended = Some(f);
                    break;
                }
                let Some(id) = self.select_open(&flying) else {
                    if subs.is_empty() {
                        ended = Some(Flow::Reason("no open actions left".into()));
                    }
                    break;
                };
                self.start_node(id)?;
                let node = self.tree.get(id).cloned().expect("node");
                let parent_speedup = node.parent.and_then(|p| self.tree.get(p)).and_then(|p| p.speedup);
                let written = self.planner.write(&ctx!(self), &node);
                self.planner_notes();
                let w = match written {
                    Err(msg) if self.planner.stop_reason().is_some() || self.planner.retry_later() => {
                        // Not tried: open again, for a later round or `resume`.
                        self.reopen(id)?;
                        let r = self.round;
                        self.log(&format!("round {r}: node {id} not written: {msg}"));
                        self.check_fatal()?;
                        retry = true;
                        break;
                    }
                    Err(msg) => {
                        let reply = EvalReply::failed(
                            0,
                            FailureClass::Check,
                            format!("no candidate written (by the {} planner): {msg}", self.planner.name()),
                        );
                        self.book(id, None, None, reply, 0.0, parent_speedup, None, evals0)?;
                        continue;
                    }
                    Ok(w) => w,
                };
                let key = w.candidate.key();
                if subs.values().any(|s| s.key == key) {
                    twins.push((id, key));
                    continue;
                }
                if let Some(prev) = self.measured_with(id, &key) {
                    self.round += 1;
                    self.book_duplicate(id, &prev, key)?;
                    self.round_event(evals0)?;
                    continue;
                }
                if let Some(f) = self.static_check(&w.candidate) {
                    let reply = EvalReply::failed(self.evals, f.class, f.message);
                    self.book(
                        id,
                        Some((w.kernel, w.candidate)),
                        Some(key),
                        reply,
                        0.0,
                        parent_speedup,
                        None,
                        evals0,
                    )?;
                    continue;
                }
                let b = self.task.backend(self.cfg.backend).expect("backend").clone();
                let plan = self.plan(&w.candidate, &w.kernel, &b.search, false);
                window.submit(self.evaluator.as_mut(), next_tag, plan.reqs.clone(), false);
                let sub = Sub {
                    id,
                    parent_speedup,
                    key,
                    cand: w.candidate,
                    kernel: w.kernel,
                    plan,
                    retried: false,
                    first: None,
                };
                subs.insert(next_tag, sub);
                next_tag += 1;
            }
            if (self.interrupted() || infra.is_some()) && !cancelled {
                // Stop what has not started; what runs finishes and is booked.
                window.cancel_queued(self.evaluator.as_mut());
                cancelled = true;
            }
            if subs.is_empty() {
                if std::mem::take(&mut retry) && ended.is_none() && infra.is_none() && !self.interrupted() {
                    continue;
                }
                break;
            }
            let Some((tag, replies)) = window.wait_any(self.evaluator.as_mut()) else {
                // The evaluator lost what was in flight: open again, stop the run.
                for s in std::mem::take(&mut subs).into_values() {
                    self.reopen(s.id)?;
                }
                infra.get_or_insert_with(|| "the evaluator gave no reply".into());
                break;
            };
            let Some(mut sub) = subs.remove(&tag) else { continue };
            // Each evaluation's share of the wall time: the time since the one before came back.
            let share = last.elapsed().as_secs_f64();
            last = Instant::now();
            self.eval_wall.0 += share;
            self.eval_wall.1 += 1;
            let reply = self.merge(&sub.plan, replies);
            if let Some(f) = reply.failure.as_ref().filter(|_| reply.infra()) {
                if !sub.retried && !self.interrupted() && infra.is_none() {
                    self.log("infrastructure failure, trying once more");
                    sub.retried = true;
                    window.submit(self.evaluator.as_mut(), next_tag, sub.plan.reqs.clone(), false);
                    subs.insert(next_tag, sub);
                    next_tag += 1;
                    continue;
                }
                if !self.interrupted() {
                    infra.get_or_insert_with(|| first_line(&f.message).to_string());
                }
                self.reopen(sub.id)?;
                for (t, _) in twins.extract_if(.., |(_, key)| *key == sub.key) {
                    self.reopen(t)?;
                }
                continue;
            }
            let (reply, wall, again) = match sub.first.take() {
                // The re-timing of a possible new best came back.
                Some(first) => (first.0, first.1, Some((reply, share))),
                None => {
                    let maybe_best =
                        failure_of(&reply).is_none() && self.speedup(&reply).is_some_and(|s| s > self.best_speedup() * 1.01);
                    if maybe_best && (self.interrupted() || infra.is_some()) {
                        // Not believed before it is re-timed, and nothing more is handed over.
                        self.reopen(sub.id)?;
                        for (t, _) in twins.extract_if(.., |(_, key)| *key == sub.key) {
                            self.reopen(t)?;
                        }
                        continue;
                    }
                    if maybe_best {
                        sub.first = Some((reply, share));
                        let b = self.task.backend(self.cfg.backend).expect("backend").clone();
                        sub.plan = self.plan(&sub.cand, &sub.kernel, &b.search, false);
                        window.submit(self.evaluator.as_mut(), next_tag, sub.plan.reqs.clone(), false);
                        subs.insert(next_tag, sub);
                        next_tag += 1;
                        continue;
                    }
                    (reply, share, None)
                }
            };
            let Sub {
                id,
                parent_speedup,
                key,
                cand,
                kernel,
                ..
            } = sub;
            self.book(
                id,
                Some((kernel, cand)),
                Some(key.clone()),
                reply,
                wall,
                parent_speedup,
                again,
                evals0,
            )?;
            for (t, _) in twins.extract_if(.., |(_, k2)| *k2 == key) {
                match self.measured_with(t, &key) {
                    Some(prev) => {
                        self.round += 1;
                        self.book_duplicate(t, &prev, key.clone())?;
                        self.round_event(evals0)?;
                    }
                    None => self.reopen(t)?,
                }
            }
        }
        for (t, _) in std::mem::take(&mut twins) {
            self.reopen(t)?;
        }
        let rid = self.run_id;
        self.store.set_run_round(rid, self.round)?;
        if self.interrupted() {
            return self.mark_interrupted().map(Flow::End);
        }
        if let Some(why) = infra {
            let why = format!("infrastructure failure (not the candidate's): {why}");
            self.store.set_run_status(rid, "stopped", Some(&why))?;
            bail!("{why}; fix it, then continue with `ksearch resume {rid}`");
        }
        Ok(ended.unwrap_or_else(|| Flow::Reason("no open actions left".into())))
    }

    /// A node is taken: running, one more attempt (a kill now leaves it running; `resume`
    /// reopens it and counts booked rounds only).
    fn start_node(&mut self, id: i64) -> Result<()> {
        let n = self.tree.nodes.get_mut(&id).expect("selected node exists");
        n.status = NodeStatus::Running;
        n.attempts += 1;
        let snap = n.clone();
        self.store.update_node(&snap)?;
        Ok(())
    }

    /// Book a node as one round and say so.
    #[allow(clippy::too_many_arguments)]
    fn book(
        &mut self,
        id: i64,
        cand: Option<(String, Candidate)>,
        key: Option<String>,
        reply: EvalReply,
        wall: f64,
        parent_speedup: Option<f64>,
        again: Option<(EvalReply, f64)>,
        evals0: u64,
    ) -> Result<()> {
        self.round += 1;
        self.finish_node(id, cand, key, reply, wall, parent_speedup, again)?;
        self.check_fatal()?;
        self.round_event(evals0)
    }

    fn round_event(&mut self, evals0: u64) -> Result<()> {
        let evaluations = self.store.count_evaluations(self.run_id)?.saturating_sub(evals0);
        let best = self.best_speedup();
        (self.events)(&Event::Round {
            round: self.round,
            best,
            evaluations,
        });
        Ok(())
    }

    /// The stop rule that holds before one more node is taken, with `flying` nodes taken and
    /// not booked, `in_flight` of them being evaluated (they finish before the final phase).
    fn stop_check(&mut self, stop: &StopRules, flying: u32, in_flight: u32) -> Option<Flow> {
        if self.round + flying >= stop.rounds {
            return Some(Flow::Reason("round budget reached".into()));
        }
        if let Some(b) = stop.time_budget
            && self.started.elapsed() + self.final_reserve() + self.per_eval_s() * (in_flight + 1) >= b
        {
            // The budget covers the final phase and what is in flight.
            return Some(Flow::Reason(format!("time budget {} reached", humantime::format_duration(b))));
        }
        if self.rounds_since_best >= stop.patience {
            return Some(Flow::Reason(format!("plateau: no new best in {} rounds", stop.patience)));
        }
        if let Some(why) = self.planner.stop_reason() {
            return Some(Flow::Stopped(why));
        }
        None
    }

    /// One round. Returns false when nothing is left to try.
    fn step(&mut self) -> Result<bool> {
        let Some(id) = self.select_open(&[]) else {
            return Ok(false);
        };
        self.round += 1;
        let round = self.round;
        let rid = self.run_id;
        {
            let n = self.tree.nodes.get_mut(&id).expect("selected node exists");
            n.status = NodeStatus::Running;
            n.attempts += 1;
            let snapshot = n.clone();
            self.store.atomic(|s| {
                s.update_node(&snapshot)?;
                s.set_run_round(rid, round)
            })?;
        }
        let node = self.tree.get(id).cloned().expect("node");
        let parent_speedup = node.parent.and_then(|p| self.tree.get(p)).and_then(|p| p.speedup);
        let written = self.planner.write(&ctx!(self), &node);
        self.planner_notes();
        let (kernel, cand) = match written {
            Ok(w) => (w.kernel, w.candidate),
            Err(msg) if self.planner.stop_reason().is_some() || self.planner.retry_later() => {
                // The planner had to stop (its budget is spent, its key was refused) or could
                // not reach its LLM server before writing: the node was not tried. Reopen it and
                // undo the round, so that a later round (or `resume`) tries it.
                let n = self.tree.nodes.get_mut(&id).expect("node");
                n.status = NodeStatus::Open;
                n.attempts = n.attempts.saturating_sub(1);
                let snapshot = n.clone();
                self.round -= 1;
                let r = self.round;
                self.store.atomic(|s| {
                    s.update_node(&snapshot)?;
                    s.set_run_round(rid, r)
                })?;
                self.log(&format!("round {round}: node {id} not written: {msg}"));
                self.check_fatal()?;
                return Ok(true);
            }
            Err(msg) => {
                let reply = EvalReply::failed(
                    0,
                    FailureClass::Check,
                    format!("no candidate written (by the {} planner): {msg}", self.planner.name()),
                );
                self.finish_node(id, None, None, reply, 0.0, parent_speedup, None)?;
                return Ok(true);
            }
        };
        let key = cand.key();
        // Same normalised candidate as an earlier node: reuse its result, evaluate nothing.
        if let Some(prev) = self
            .tree
            .nodes
            .values()
            .find(|n| {
                n.id != id
                    && n.candidate.as_deref() == Some(key.as_str())
                    && matches!(n.status, NodeStatus::Solved | NodeStatus::Failed)
            })
            .cloned()
        {
            let n = self.tree.nodes.get_mut(&id).expect("node");
            n.status = prev.status;
            n.speedup = prev.speedup;
            n.time_us = prev.time_us;
            n.failure = prev.failure;
            n.candidate = Some(key);
            n.round_evaluated = Some(round);
            n.assessment.hw_fit.note = format!("duplicate of node {}: not re-evaluated", prev.id);
            let snap = n.clone();
            self.store.update_node(&snap)?;
            self.log(&format!("round {round}: node {id} is a duplicate of node {}", prev.id));
            return Ok(true);
        }
        let (reply, wall) = match self.static_check(&cand) {
            Some(f) => (EvalReply::failed(self.evals, f.class, f.message), 0.0),
            None => self.evaluate_retrying_infra(|s| s.evaluate_search(&cand, &kernel)),
        };
        if self.interrupted() {
            // Stopped while it was measured: not booked, open again for `resume`.
            let n = self.tree.nodes.get_mut(&id).expect("node");
            n.status = NodeStatus::Open;
            n.attempts = n.attempts.saturating_sub(1);
            let snapshot = n.clone();
            self.round -= 1;
            let r = self.round;
            self.store.atomic(|s| {
                s.update_node(&snapshot)?;
                s.set_run_round(rid, r)
            })?;
            return Ok(true);
        }
        if let Some(f) = reply.failure.as_ref().filter(|_| reply.infra()) {
            // Not the candidate's failure: the node stays open (the round undone) and the run
            // stops, so that a resume tries it again once the machine is fixed.
            let why = format!("infrastructure failure (not the candidate's): {}", first_line(&f.message));
            let n = self.tree.nodes.get_mut(&id).expect("node");
            n.status = NodeStatus::Open;
            n.attempts = n.attempts.saturating_sub(1);
            let snapshot = n.clone();
            self.round -= 1;
            let r = self.round;
            self.store.atomic(|s| {
                s.update_node(&snapshot)?;
                s.set_run_round(rid, r)?;
                s.set_run_status(rid, "stopped", Some(&why))
            })?;
            bail!("{why}; fix it, then continue with `ksearch resume {rid}`");
        }
        self.finish_node(id, Some((kernel, cand)), Some(key), reply, wall, parent_speedup, None)?;
        Ok(true)
    }

    /// Book a node's evaluation. `again` is the candidate's re-timing when it was made ahead (the
    /// window re-times a possible new best as a submission of its own before booking it).
    #[allow(clippy::too_many_arguments)]
    fn finish_node(
        &mut self,
        id: i64,
        cand: Option<(String, Candidate)>,
        key: Option<String>,
        reply: EvalReply,
        wall: f64,
        parent_speedup: Option<f64>,
        again: Option<(EvalReply, f64)>,
    ) -> Result<()> {
        let round = self.round;
        let fail = failure_of(&reply);
        let mut speedup = if fail.is_none() { self.speedup(&reply) } else { None };
        let mut extra: Vec<(EvalReply, f64)> = Vec::new();
        // A new best is re-timed before it is believed; the slower reading counts. A re-timing
        // made ahead counts the same way even where an earlier candidate of its batch has
        // since become the better best: it was measured, so it is booked and believed.
        let new_best = speedup.is_some_and(|s| s > self.best_speedup() * 1.01);
        let again = match (again, cand.as_ref()) {
            (Some(a), _) => Some(a),
            (None, Some((k, c))) if new_best => Some(self.evaluate_search(c, k)),
            (None, _) => None,
        };
        if let (Some(s), Some((r2, w2))) = (speedup, again) {
            let s2 = if failure_of(&r2).is_none() { self.speedup(&r2) } else { None };
            speedup = s2.map(|s2| s.min(s2));
            extra.push((r2, w2));
        }
        let fail = match (&fail, speedup, &extra.last()) {
            (None, None, Some((r2, _))) => failure_of(r2).or(Some(Failure {
                class: FailureClass::Wrong,
                message: "re-timing failed".into(),
            })),
            _ => fail,
        };
        let best_before = self.best_speedup();
        {
            let n = self.tree.nodes.get_mut(&id).expect("node");
            n.candidate = key.clone();
            n.round_evaluated = Some(round);
            match (&fail, speedup) {
                (None, Some(s)) => {
                    n.status = NodeStatus::Solved;
                    n.speedup = Some(s);
                    n.time_us = medians(&reply).map(|m| geomean(&m));
                    n.failure = None;
                    measured_impacts(&mut n.assessment, &reply);
                }
                _ => {
                    n.status = NodeStatus::Failed;
                    n.failure = fail.as_ref().map(|f| f.class);
                }
            }
        }
        if let Some(p) = self.tree.get(id).and_then(|n| n.parent) {
            let failed = fail.is_some();
            if let Some(pn) = self.tree.nodes.get_mut(&p) {
                pn.visits += 1;
                if failed {
                    pn.failures += 1;
                }
            }
        }
        let node = self.tree.get(id).cloned().expect("node");
        let outcome = Outcome {
            reply: &reply,
            failure: fail.as_ref(),
            speedup,
            parent_speedup,
            roofline_fraction: Self::roofline_fraction(&reply),
        };
        let edits = self.planner.update(&ctx!(self), &node, &outcome);
        self.planner_notes();
        let edits = edits?;
        self.check_fatal()?;
        let mut applied = Vec::new();
        for e in edits {
            match validate_edit(&self.tree, &e) {
                Ok(()) => applied.push(e),
                Err(why) => self.log(&format!("round {round}: planner edit refused: {why}")),
            }
        }
        // Apply in memory, then persist everything of this round in one transaction.
        let mut inserts = Vec::new();
        let mut touched = vec![id];
        if let Some(p) = node.parent {
            touched.push(p);
        }
        for e in applied {
            match e {
                TreeEdit::Update { node, assessment } => {
                    if let Some(n) = self.tree.nodes.get_mut(&node) {
                        n.assessment = assessment.clamped();
                        touched.push(node);
                    }
                }
                TreeEdit::Insert(p) => inserts.push(p),
                TreeEdit::Prune { node, reason } => {
                    self.log(&format!("round {round}: node {node} pruned: {reason}"));
                    if let Some(n) = self.tree.nodes.get_mut(&node) {
                        n.status = NodeStatus::Pruned;
                        touched.push(node);
                    }
                }
                TreeEdit::Split { node, into } => {
                    if let Some(n) = self.tree.nodes.get_mut(&node) {
                        n.status = NodeStatus::Pruned;
                        touched.push(node);
                    }
                    inserts.extend(into);
                }
                TreeEdit::TooHard { node } => {
                    if let Some(n) = self.tree.nodes.get_mut(&node) {
                        n.status = NodeStatus::TooHard;
                        n.assessment.overall = n.assessment.overall.min(1.0);
                        touched.push(node);
                    }
                }
            }
        }
        let new_best = matches!(speedup, Some(s) if fail.is_none() && s > best_before);
        if new_best {
            self.rounds_since_best = 0;
        } else {
            self.rounds_since_best += 1;
        }
        let rid = self.run_id;
        touched.sort();
        touched.dedup();
        let snaps: Vec<Node> = touched.iter().filter_map(|i| self.tree.get(*i).cloned()).collect();
        let mut new_nodes = Vec::new();
        let round_created = self.round;
        let inserted: Vec<Node> = self.store.atomic(|s| {
            if let Some((kernel, c)) = &cand {
                s.put_candidate(kernel, c)?;
            }
            s.insert_evaluation(rid, Some(id), key.as_deref(), round, "search", &reply, wall)?;
            for (r2, w2) in &extra {
                s.insert_evaluation(rid, Some(id), key.as_deref(), round, "retime", r2, *w2)?;
            }
            for n in &snaps {
                s.update_node(n)?;
            }
            for p in inserts {
                let mut n = Node::new(0, Some(p.parent), p.action, p.pattern, p.assessment, round_created);
                n.id = s.insert_node(rid, &n)?;
                new_nodes.push(n);
            }
            if new_best && let Some(sp) = speedup {
                s.set_run_best(rid, id, sp)?;
            }
            s.set_run_round(rid, round)?;
            Ok(new_nodes)
        })?;
        for n in inserted {
            self.tree.nodes.insert(n.id, n);
        }
        let what = node.action.summary();
        match (&fail, speedup) {
            (None, Some(s)) => self.log(&format!(
                "round {round}: node {id} {what}: {s:.2}x{}",
                if new_best { " (new best)" } else { "" }
            )),
            (Some(f), _) => self.log(&format!(
                "round {round}: node {id} {what}: {} — {}",
                f.class,
                first_line(&f.message)
            )),
            _ => {}
        }
        Ok(())
    }

    fn log(&mut self, s: &str) {
        (self.events)(&Event::Note(s.to_string()));
    }

    /// The planner's lines, as notes.
    fn planner_notes(&mut self) {
        for n in self.planner.take_notes() {
            self.log(&n);
        }
    }

    /// Re-time the best candidates against the seed and validate them on held-out workloads.
    fn finish(&mut self, stop_reason: &str) -> Result<Report> {
        let rid = self.run_id;
        // A finish replaces every final-phase row an earlier, interrupted finish wrote.
        self.store.new_phase();
        self.store.drop_earlier_phases(rid)?;
        let round = self.round;
        let seed_node = self.tree.root().cloned().context("run has no seed node")?;
        let seed_cand = self.load_candidate(&seed_node)?;
        let mut ranked: Vec<Node> = self
            .tree
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Solved && n.parent.is_some() && n.speedup.unwrap_or(0.0) > 1.0)
            .cloned()
            .collect();
        ranked.sort_by(|a, b| b.speedup.partial_cmp(&a.speedup).unwrap_or(std::cmp::Ordering::Equal));
        let b = self.task.backend(self.cfg.backend).expect("backend").clone();
        let labels: Vec<String> = b.search.iter().map(|w| workload_label(w, &self.task.axes)).collect();
        let device = self.evaluator.device();
        let mut report = Report {
            run: rid,
            task: self.task.name.clone(),
            backend: self.cfg.backend,
            device,
            rounds: round,
            evaluations: 0,
            stop_reason: stop_reason.to_string(),
            best_node: None,
            best_action: None,
            seed_us: Vec::new(),
            best_us: Vec::new(),
            workloads: labels,
            speedup: None,
            heldout: None,
            search_speedup: None,
            retimed: Vec::new(),
            spread: None,
            native: None,
        };
        // Re-time the best few back to back with the seed (fresh inputs, the same moment); the
        // answer is chosen by these figures, not by the search's.
        struct Final {
            node: Node,
            kernel: String,
            cand: Candidate,
            seed_us: Vec<f64>,
            best_us: Vec<f64>,
            speedup: f64,
            spread: f64,
        }
        let mut finals: Vec<Final> = Vec::new();
        let seed_key = seed_node.candidate.clone();
        let mut todo: Vec<(Node, Candidate, String)> = Vec::new();
        for n in ranked.iter().take(FINAL_CANDIDATES) {
            todo.push((n.clone(), self.load_candidate(n)?, self.kernel_of(n)));
        }
        // Each candidate with the seed, all pairs in one batch; noisy pairs are taken once more,
        // with three times the repetitions, and the calmer pair counts.
        let mut got: Vec<Option<Pair>> = vec![None; todo.len()];
        let mut pending: Vec<usize> = (0..todo.len()).collect();
        for attempt in 0..2 {
            if pending.is_empty() {
                break;
            }
            if self.interrupted() {
                return Err(InterruptedErr.into());
            }
            let saved = self.cfg.timing.clone();
            if attempt > 0 {
                self.cfg.timing = more_reps(&saved);
            }
            let mut plans = Vec::new();
            for &i in &pending {
                plans.push(self.plan(&seed_cand, "", &b.search, false));
                plans.push(self.plan(&todo[i].1, &todo[i].2, &b.search, false));
            }
            self.cfg.timing = saved;
            let mut out = self.evaluate_batch_on(plans, true).into_iter();
            let mut noisy = Vec::new();
            for &i in &pending {
                let (Some((rs, ws)), Some((rc, wc))) = (out.next(), out.next()) else {
                    break;
                };
                let (node_id, key) = (todo[i].0.id, todo[i].0.candidate.clone());
                self.store.atomic(|s| {
                    s.insert_evaluation(rid, Some(seed_node.id), seed_key.as_deref(), round, "final", &rs, ws)?;
                    s.insert_evaluation(rid, Some(node_id), key.as_deref(), round, "final", &rc, wc)?;
                    Ok(())
                })?;
                let (Some(ms), Some(mc)) = (medians(&rs), medians(&rc)) else {
                    self.log(&format!(
                        "final: node {node_id} failed its re-timing: {:?}",
                        failure_of(&rc).or(failure_of(&rs)).map(|f| f.message)
                    ));
                    got[i] = None;
                    continue;
                };
                let spread = max_spread(&rs).max(max_spread(&rc));
                if got[i].as_ref().is_none_or(|g| spread < g.2) {
                    got[i] = Some((ms, mc, spread));
                }
                if spread > NOISY_SPREAD && attempt == 0 && !self.time_for(3 * 2 * 2) {
                    self.log(&format!(
                        "final: node {node_id} timings noisy (spread {:.0}%), no time left in the budget to time them again",
                        spread * 100.0
                    ));
                } else if spread > NOISY_SPREAD && attempt == 0 {
                    self.log(&format!(
                        "final: node {node_id} timings noisy (spread {:.0}%), timing again",
                        spread * 100.0
                    ));
                    noisy.push(i);
                }
            }
            pending = noisy;
        }
        for ((cand_node, cand, kname), got) in todo.into_iter().zip(got) {
            let verified = got.as_ref().map(|(ms, mc, _)| ratio(ms, mc));
            report.retimed.push(Retimed {
                node: cand_node.id,
                search: cand_node.speedup,
                verified,
            });
            if let Some((ms, mc, spread)) = got {
                let speedup = ratio(&ms, &mc);
                finals.push(Final {
                    node: cand_node,
                    kernel: kname,
                    cand,
                    seed_us: ms,
                    best_us: mc,
                    speedup,
                    spread,
                });
            }
        }
        let by_verified = |a: &Option<f64>, b: &Option<f64>| {
            b.unwrap_or(f64::NEG_INFINITY)
                .partial_cmp(&a.unwrap_or(f64::NEG_INFINITY))
                .unwrap_or(std::cmp::Ordering::Equal)
        };
        report.retimed.sort_by(|a, b| by_verified(&a.verified, &b.verified));
        finals.sort_by(|a, b| by_verified(&Some(a.speedup), &Some(b.speedup)));
        for (i, f) in finals.iter().enumerate() {
            // The first (fastest re-timed) is reported even when it is no result.
            if i > 0 && !faster(f.speedup) {
                break;
            }
            report.best_node = Some(f.node.id);
            report.best_action = Some(f.node.action.summary());
            report.seed_us = f.seed_us.clone();
            report.best_us = f.best_us.clone();
            report.speedup = Some(f.speedup);
            report.search_speedup = f.node.speedup;
            report.spread = Some(f.spread);
            report.heldout = None;
            if !faster(f.speedup) {
                break;
            }
            if self.interrupted() {
                return Err(InterruptedErr.into());
            }
            let held = if b.heldout.is_empty() {
                HeldOut {
                    passed: true,
                    workloads: vec![],
                    speedup: None,
                    message: Some("the task declares no held-out workloads".into()),
                    spread: None,
                }
            } else {
                let key = f.node.candidate.clone();
                // The seed and every build of the candidate, in one batch; timed once more, with
                // three times the repetitions, where the timings are noisy and say slower (a busy
                // machine), and the calmer look counts, as in the final re-timing. Every look is
                // stored.
                let mut kept: Option<(EvalReply, EvalReply, f64)> = None;
                for attempt in 0..2 {
                    let saved = self.cfg.timing.clone();
                    if attempt > 0 {
                        self.cfg.timing = more_reps(&saved);
                    }
                    let plans = vec![
                        self.plan(&seed_cand, "seed", &b.heldout, true),
                        self.plan(&f.cand, &f.kernel, &b.heldout, true),
                    ];
                    self.cfg.timing = saved;
                    let mut out = self.evaluate_batch_on(plans, true).into_iter();
                    let ((hs, hws), (hc, hwc)) = (out.next().unwrap_or_default(), out.next().unwrap_or_default());
                    // The second look has a purpose of its own: one `heldout` pair per candidate
                    // tried stays the mark of one finish.
                    let purpose = if attempt == 0 { "heldout" } else { "heldout-again" };
                    self.store.atomic(|s| {
                        s.insert_evaluation(rid, Some(seed_node.id), seed_key.as_deref(), round, purpose, &hs, hws)?;
                        s.insert_evaluation(rid, Some(f.node.id), key.as_deref(), round, purpose, &hc, hwc)?;
                        Ok(())
                    })?;
                    let spread = max_spread(&hs).max(max_spread(&hc));
                    let slower = matches!((medians(&hs), medians(&hc)), (Some(a), Some(c)) if !faster(ratio(&a, &c)));
                    let failed = failure_of(&hc).is_some();
                    if failed || kept.as_ref().is_none_or(|k| spread < k.2) {
                        kept = Some((hs, hc, spread));
                    }
                    if failed || !(slower && spread > NOISY_SPREAD) || attempt > 0 {
                        break;
                    }
                    if !self.time_for(3 * 2 * 2) {
                        self.log(&format!(
                            "final: node {} held-out timings noisy (spread {:.0}%), no time left in the budget to time them again",
                            f.node.id,
                            spread * 100.0
                        ));
                        break;
                    }
                    self.log(&format!(
                        "final: node {} held-out timings noisy (spread {:.0}%) and slower than the seed, timing again",
                        f.node.id,
                        spread * 100.0
                    ));
                }
                let (hs, hc, _) = kept.expect("one look at least");
                let labels = b.heldout.iter().map(|w| workload_label(w, &self.task.axes)).collect();
                match failure_of(&hc) {
                    None => HeldOut {
                        passed: true,
                        workloads: labels,
                        speedup: match (medians(&hs), medians(&hc)) {
                            (Some(a), Some(c)) => Some(ratio(&a, &c)),
                            _ => None,
                        },
                        message: None,
                        spread: Some(max_spread(&hs).max(max_spread(&hc))),
                    },
                    Some(fl) => HeldOut {
                        passed: false,
                        workloads: labels,
                        speedup: None,
                        message: Some(format!("{}: {}", fl.class, fl.message)),
                        spread: None,
                    },
                }
            };
            report.heldout = Some(held);
            match report.no_result() {
                None => break,
                Some(why) => self.log(&format!("final: node {}: {why}; trying the next best", f.node.id)),
            }
        }
        if self.interrupted() {
            return Err(InterruptedErr.into());
        }
        if self.cfg.backend.is_mlx() && !report.best_us.is_empty() {
            report.native = Some(self.native_baseline(&seed_cand, &report.best_us)?);
        }
        report.evaluations = self.store.count_evaluations(rid)?;
        let ok = report.no_result().is_none();
        let js = serde_json::to_value(&report)?;
        self.store.atomic(|s| {
            s.set_run_report(rid, &js)?;
            s.set_run_status(rid, if ok { "done" } else { "done_no_result" }, Some(stop_reason))
        })?;
        Ok(report)
    }

    /// Ask the worker to time the back-end's native implementation on fresh search inputs
    /// (stored as a `baseline` evaluation) and compare it with the best kernel's times.
    fn native_baseline(&mut self, seed: &Candidate, best_us: &[f64]) -> Result<Native> {
        let req = self.request(seed, false, false);
        let t = Instant::now();
        let r = self.evaluator.baseline(&req);
        let secs = t.elapsed().as_secs_f64();
        let (rid, round) = (self.run_id, self.round);
        self.store
            .atomic(|s| s.insert_evaluation(rid, None, None, round, "baseline", &r, secs).map(|_| ()))?;
        let name = if r.resources.raw.is_empty() {
            "native".to_string()
        } else {
            r.resources.raw.clone()
        };
        // The native code is timed even where its results stray from the f32 reference (e.g.
        // mlx-lm's scan keeps its state in f16): its time is what users get; the mismatch is noted.
        let timed: Option<Vec<f64>> = if r.failure.is_none() {
            r.workloads.iter().map(|w| w.timing.as_ref().map(|t| t.median_us)).collect()
        } else {
            None
        };
        let off: usize = r
            .workloads
            .iter()
            .map(|w| w.check.mismatches + w.check.nan + w.check.unwritten)
            .sum();
        Ok(match timed.filter(|v| !v.is_empty()) {
            Some(us) => {
                let ratio = geomean(&us.iter().zip(best_us).map(|(n, b)| n / b).collect::<Vec<_>>());
                self.log(&format!("native baseline {name}: {us:?} us, {ratio:.2}x of it"));
                Native {
                    name,
                    us,
                    ratio: Some(ratio),
                    message: (off > 0)
                        .then(|| format!("its outputs differ from the f32 reference beyond the tolerance on {off} elements")),
                }
            }
            None => Native {
                name,
                us: vec![],
                ratio: None,
                message: failure_of(&r).map(|f| format!("{}: {}", f.class, f.message)),
            },
        })
    }

    pub fn load_candidate(&self, n: &Node) -> Result<Candidate> {
        let key = n
            .candidate
            .as_deref()
            .with_context(|| format!("node {} has no candidate", n.id))?;
        Ok(self
            .store
            .candidate(key)?
            .with_context(|| format!("candidate {key} missing from the store"))?
            .1)
    }
}

/// Values of the kernel's specialisation tunables (pattern `specialisation`) that make `config`
/// admissible for `w`, keeping every other tunable as it is.
fn specialise(k: &ksearch_core::KernelSpec, config: &BTreeMap<String, i64>, w: &Workload) -> Option<BTreeMap<String, i64>> {
    k.specialise(config, w)
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// Measured evidence for a node's impacts: roofline fraction → bandwidth and hardware fit;
/// the compiler's resource report → register pressure.
pub fn measured_impacts(a: &mut Assessment, r: &EvalReply) {
    if let Some(f) = Search::roofline_fraction(r) {
        a.bandwidth.rating = (10.0 * f).clamp(0.0, 10.0);
        a.bandwidth.note = format!("measured: {:.1}% of the roofline floor", 100.0 * f);
        a.hw_fit.rating = (10.0 * f.sqrt()).clamp(0.0, 10.0);
        a.hw_fit.note = format!("measured: time is {:.1}x the floor", 1.0 / f.max(1e-9));
    }
    let res = &r.resources;
    if let Some(regs) = res.registers {
        let spills = res.spill_stores.unwrap_or(0) + res.spill_loads.unwrap_or(0);
        let rating = if spills > 0 { 1.0 } else { 10.0 * (1.0 - regs as f64 / 255.0) };
        a.registers.rating = rating.clamp(0.0, 10.0);
        a.registers.note = format!("measured: {regs} registers, {spills} spill bytes");
    } else if a.registers.note.is_empty() {
        a.registers.note = "no resource report on this back-end".into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ksearch_core::task::{KernelSpec, Tunable};

    fn kernel() -> KernelSpec {
        let t = |n: &str, v: &[i64], p: Option<&str>| Tunable {
            name: n.into(),
            values: v.to_vec(),
            default: None,
            pattern: p.map(String::from),
        };
        KernelSpec {
            name: "k".into(),
            file: "k.cu".into(),
            entry: Some("k".into()),
            launches: vec![],
            scratch: vec![],
            tunables: vec![
                t("HD", &[64, 128], Some("specialisation")),
                t("BLOCK", &[32, 64], Some("tiling")),
            ],
            constraints: vec!["HD == D".into(), "BLOCK <= 64".into()],
            pattern: None,
            description: String::new(),
            options: Default::default(),
            source: String::new(),
        }
    }

    fn report(speedup: f64, held: f64, spread: f64) -> Report {
        serde_json::from_value(serde_json::json!({
            "run": 1, "task": "t", "backend": "cpu", "device": "d", "rounds": 1, "evaluations": 3,
            "stop_reason": "r", "best_node": 2, "best_action": null, "seed_us": [2.0], "best_us": [1.0],
            "workloads": ["w"], "speedup": speedup,
            "heldout": {"passed": true, "workloads": ["h"], "speedup": held, "message": null, "spread": spread}
        }))
        .unwrap()
    }

    #[test]
    fn slower_on_held_out_is_no_result_unless_those_timings_are_noise() {
        assert!(report(3.0, 1.5, 0.1).no_result().is_none());
        let why = report(3.0, 0.8, 0.1).no_result().expect("measured slower: no result");
        assert!(why.contains("slower than the seed on the held-out"), "{why}");
        assert!(
            report(3.0, 0.8, 2.4).no_result().is_none(),
            "noisy held-out timings do not decide a small slowdown"
        );
        // A kernel controls its own timings' spread: noise never excuses a large slowdown.
        let why = report(3.0, 0.04, 25.0)
            .no_result()
            .expect("25x slower is measured, however noisy");
        assert!(why.contains("(0.04x)"), "{why}");
        assert!(report(0.9, 1.5, 0.1).no_result().is_some(), "slower once re-timed");
    }

    #[test]
    fn specialise_changes_only_shape_tied_tunables() {
        let k = kernel();
        let cfg: BTreeMap<String, i64> = [("HD".to_string(), 128), ("BLOCK".to_string(), 64)].into();
        let w = |d: i64| -> Workload { [("D".to_string(), d)].into() };
        let got = specialise(&k, &cfg, &w(64)).expect("D=64 is supported");
        assert_eq!(got.get("HD"), Some(&64));
        assert_eq!(got.get("BLOCK"), Some(&64), "the searched tunable is kept");
        assert_eq!(specialise(&k, &cfg, &w(128)), Some(cfg.clone()));
        assert_eq!(specialise(&k, &cfg, &w(96)), None, "no build for an unsupported shape");
    }

    #[test]
    fn noise_is_named_above_a_quarter_of_spread_only() {
        assert_eq!(noise_line(None), None);
        assert_eq!(noise_line(Some(0.25)), None);
        assert_eq!(
            noise_line(Some(0.48)).as_deref(),
            Some("timings noisy: spread 48%, machine busy?")
        );
    }

    #[test]
    fn a_second_look_takes_three_times_the_repetitions() {
        let t = TimingReq {
            warmup: 2,
            min_reps: 5,
            max_reps: 30,
            target_ms: 200.0,
            flush: true,
        };
        let m = more_reps(&t);
        assert_eq!((m.min_reps, m.max_reps, m.target_ms), (15, 90, 600.0));
        assert_eq!((m.warmup, m.flush), (2, true));
    }

    #[test]
    fn geomean_and_seeds() {
        assert!((geomean(&[2.0, 8.0]) - 4.0).abs() < 1e-12);
        assert_ne!(mix(1, 2), mix(2, 1));
        assert_ne!(mix(1, 2), mix(1, 3));
    }
}
