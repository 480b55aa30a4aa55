//! Planners: who proposes the next modification. The offline planner lives here; the LLM
//! planner implements the same trait, so both write the same node fields and a run can switch
//! planner on resume.

use anyhow::Result;
use std::collections::{BTreeMap, BTreeSet};

use ksearch_core::Backend;
use ksearch_core::protocol::{Candidate, EvalReply, Failure, Lang};
use ksearch_core::task::{KernelSpec, Task};
use ksearch_core::tree::{Action, Assessment, Impact, Node, NodeStatus, Tree};

/// What a planner sees.
pub struct Ctx<'a> {
    pub task: &'a Task,
    pub backend: Backend,
    pub kb: Option<&'a ksearch_kb::Kb>,
    pub tree: &'a Tree,
    pub round: u32,
    pub run_id: i64,
    /// The run's store (candidates of earlier nodes, LLM call records, artifacts).
    pub store: Option<&'a ksearch_store::Store>,
    /// The knowledge-base hardware profile of the target, if detected.
    pub profile: Option<&'a str>,
}

/// A new open node.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub parent: i64,
    pub action: Action,
    pub pattern: Option<String>,
    pub assessment: Assessment,
}

/// A validated edit of the tree.
#[derive(Debug, Clone)]
pub enum TreeEdit {
    /// Revise a node's beliefs (never its measurements).
    Update {
        node: i64,
        assessment: Assessment,
    },
    Insert(Proposal),
    /// Remove an open node from consideration.
    Prune {
        node: i64,
        reason: String,
    },
    /// Replace an open node by narrower ones.
    Split {
        node: i64,
        into: Vec<Proposal>,
    },
    /// Mark a node too hard (it keeps failing).
    TooHard {
        node: i64,
    },
}

/// The candidate for a node, and which kernel it derives from.
pub struct Written {
    pub kernel: String,
    pub candidate: Candidate,
}

/// What an evaluation showed, as the planner sees it.
pub struct Outcome<'a> {
    pub reply: &'a EvalReply,
    pub failure: Option<&'a Failure>,
    pub speedup: Option<f64>,
    pub parent_speedup: Option<f64>,
    /// Fraction of the roofline floor reached (floor / time, geometric mean), 0–1.
    pub roofline_fraction: Option<f64>,
}

pub trait Planner {
    fn name(&self) -> &'static str;
    /// Initial open actions, children of the evaluated seed.
    fn init(&mut self, ctx: &Ctx) -> Result<Vec<Proposal>>;
    /// The coder step: the full candidate for one open node. `Err` is a failure to write one
    /// (recorded on the node), not a crash of the run.
    fn write(&mut self, ctx: &Ctx, node: &Node) -> std::result::Result<Written, String>;
    /// After an evaluation: revise the tree.
    fn update(&mut self, ctx: &Ctx, node: &Node, outcome: &Outcome) -> Result<Vec<TreeEdit>>;
    /// Whether this planner can write `node`'s candidate at all. Nodes it cannot write (an
    /// offline planner resuming a tree with LLM edits) are skipped by selection, not failed.
    fn can_write(&self, _node: &Node) -> bool {
        true
    }
    /// Set when the planner cannot go on (e.g. its LLM budget is spent): the run stops
    /// cleanly, unfinished, and `resume` continues it.
    fn stop_reason(&self) -> Option<String> {
        None
    }
    /// Set when the run cannot go on at all (e.g. the LLM server refused the key): the run
    /// stops with an error (exit 2); `resume` continues it once the cause is fixed.
    fn fatal(&self) -> Option<String> {
        None
    }
    /// Whether the last failed write failed for a reason outside its action (the LLM server
    /// was unreachable, rate-limited or too slow): the node is reopened, not failed.
    fn retry_later(&self) -> bool {
        false
    }
    /// No call of the planner may run past `deadline` (the run's time budget).
    fn set_deadline(&mut self, _deadline: Option<std::time::Instant>) {}
    /// Lines about what the planner did since the last call (failed calls, refused ops,
    /// warnings); the engine passes them on as events.
    fn take_notes(&mut self) -> Vec<String> {
        Vec::new()
    }
    /// On `resume` of a tree that has its first actions: a chance to redo a missing planner
    /// initialisation. Returns the proposals to add.
    fn resumed(&mut self, _ctx: &Ctx) -> Result<Vec<Proposal>> {
        Ok(Vec::new())
    }
}

/// The candidate for `kernel` with tunable values `config`.
pub fn instantiate(backend: Backend, k: &KernelSpec, config: &BTreeMap<String, i64>) -> Candidate {
    Candidate {
        lang: Lang::for_backend(backend),
        source: k.source.clone(),
        launches: k.launches.clone(),
        scratch: k.scratch.clone(),
        defines: config.clone(),
        options: k
            .options
            .iter()
            .filter_map(|(n, v)| serde_json::to_value(v).ok().map(|v| (n.clone(), v)))
            .collect(),
    }
}

/// Assessment seeded from a knowledge-base pattern's priors.
pub fn from_pattern(kb: Option<&ksearch_kb::Kb>, pattern: Option<&str>, base: &Assessment) -> Assessment {
    let mut a = base.clone();
    a.confidence = 0.3;
    if let (Some(kb), Some(p)) = (kb, pattern)
        && let Some(pat) = kb.pattern(p)
    {
        a.prior = pat.prior;
        a.difficulty = pat.difficulty;
        let note = |what: &str| format!("prior from pattern {p}: {what}");
        a.bandwidth = Impact::new(pat.bandwidth, note("bandwidth"));
        a.registers = Impact::new(pat.registers, note("registers"));
        a.hw_fit = Impact::new(pat.hw_fit, note("hardware fit"));
        a.overall = (base.overall + 2.0 * (pat.prior - 0.5)).clamp(0.0, 10.0);
    }
    a.clamped()
}

/// The offline planner: knowledge-base kernels and their tunables, one change at a time.
#[derive(Default)]
pub struct Offline {
    /// (kernel, config) pairs already proposed in this run (kept in sync with the tree).
    seen: BTreeSet<String>,
}

fn config_key(kernel: &str, c: &BTreeMap<String, i64>) -> String {
    format!("{kernel}{}", ksearch_core::tree::fmt_config(c))
}

impl Offline {
    fn sync(&mut self, tree: &Tree) {
        for n in tree.nodes.values() {
            if let Some((k, c)) = n.action.config() {
                self.seen.insert(config_key(k, c));
            }
        }
    }

    fn admitted(task: &Task, backend: Backend, k: &KernelSpec, c: &BTreeMap<String, i64>) -> bool {
        let Some(b) = task.backend(backend) else { return false };
        // Search workloads only (the search must not peek at held-out shapes); each may take
        // its own build of the shape-tied tunables (`KernelSpec::specialise`), so a family
        // with a head-size specialisation serves workloads of several head sizes at once.
        b.search.iter().all(|w| k.specialise(c, w).is_some())
    }

    /// The default configuration, or the first admitted one in lexicographic order.
    fn start_config(task: &Task, backend: Backend, k: &KernelSpec) -> Option<BTreeMap<String, i64>> {
        let d = k.default_config();
        if Self::admitted(task, backend, k, &d) {
            return Some(d);
        }
        let mut idx = vec![0usize; k.tunables.len()];
        for _ in 0..100_000 {
            let c: BTreeMap<String, i64> = k
                .tunables
                .iter()
                .zip(&idx)
                .map(|(t, i)| (t.name.clone(), t.values[*i]))
                .collect();
            if Self::admitted(task, backend, k, &c) {
                return Some(c);
            }
            // next combination
            let mut j = 0;
            loop {
                if j == idx.len() {
                    return None;
                }
                idx[j] += 1;
                if idx[j] < k.tunables[j].values.len() {
                    break;
                }
                idx[j] = 0;
                j += 1;
            }
        }
        None
    }
}

impl Planner for Offline {
    fn name(&self) -> &'static str {
        "offline"
    }

    fn can_write(&self, node: &Node) -> bool {
        !matches!(node.action, Action::Edit { .. })
    }

    fn init(&mut self, ctx: &Ctx) -> Result<Vec<Proposal>> {
        self.sync(ctx.tree);
        let root = ctx.tree.root().map(|r| r.id).unwrap_or(0);
        let mut out = Vec::new();
        for k in ctx.task.kernels(ctx.backend).into_iter().skip(1) {
            let Some(config) = Self::start_config(ctx.task, ctx.backend, k) else {
                continue;
            };
            if !self.seen.insert(config_key(&k.name, &config)) {
                continue;
            }
            let base = Assessment {
                overall: 6.0,
                ..Assessment::default()
            };
            let mut a = from_pattern(ctx.kb, k.pattern.as_deref(), &base);
            // Adopting an expert kernel is a bigger step than turning a knob.
            a.difficulty = a.difficulty.max(2);
            out.push(Proposal {
                parent: root,
                action: Action::Adopt {
                    kernel: k.name.clone(),
                    config,
                },
                pattern: k.pattern.clone(),
                assessment: a,
            });
        }
        Ok(out)
    }

    fn write(&mut self, ctx: &Ctx, node: &Node) -> std::result::Result<Written, String> {
        let (kernel, config) = match &node.action {
            Action::Seed => ("seed", BTreeMap::new()),
            a => match a.config() {
                Some((k, c)) => (k, c.clone()),
                None => return Err(format!("the offline planner cannot write `{}` (an LLM edit)", a.summary())),
            },
        };
        let k = ctx
            .task
            .kernel(ctx.backend, kernel)
            .ok_or_else(|| format!("kernel `{kernel}` is not in task {}", ctx.task.name))?;
        Ok(Written {
            kernel: kernel.to_string(),
            candidate: instantiate(ctx.backend, k, &config),
        })
    }

    fn update(&mut self, ctx: &Ctx, node: &Node, o: &Outcome) -> Result<Vec<TreeEdit>> {
        self.sync(ctx.tree);
        let mut edits = Vec::new();
        let mut a = node.assessment.clone();
        match (o.failure, o.speedup) {
            (None, Some(s)) => {
                let ratio = s / o.parent_speedup.unwrap_or(1.0).max(1e-9);
                a.overall = 5.0 + 4.0 * ratio.log2();
                a.confidence = 0.9;
                if ratio < 0.97 {
                    a.hw_fit.note = format!("measured {ratio:.2}x of its parent: a regression");
                }
            }
            (Some(f), _) => {
                a.overall = 0.5;
                a.confidence = 0.9;
                a.hw_fit.note = format!("failed: {}", f.class);
            }
            _ => {}
        }
        edits.push(TreeEdit::Update {
            node: node.id,
            assessment: a.clone().clamped(),
        });
        // Follow-ups: one-tunable changes from a node that did not regress.
        let Some((kernel, config)) = node.action.config() else {
            return Ok(edits);
        };
        // A knowledge-base kernel adopted at its default configuration gets tuned however far
        // behind it measured (its defaults are a guess made for another device, and one noisy
        // measurement must not end a search), its follow-ups rated by what it measured, so a
        // kernel far behind is tuned only once nothing better is open. A tunable step must not
        // regress.
        let keep = if matches!(node.action, Action::Adopt { .. }) {
            0.0
        } else {
            0.9
        };
        let not_worse = matches!((o.failure, o.speedup), (None, Some(s)) if s >= keep * o.parent_speedup.unwrap_or(1.0));
        if !not_worse {
            return Ok(edits);
        }
        let Some(k) = ctx.task.kernel(ctx.backend, kernel) else {
            return Ok(edits);
        };
        for t in &k.tunables {
            let cur = config.get(&t.name).copied().unwrap_or(t.default_value());
            let pos = t.values.iter().position(|v| *v == cur).unwrap_or(0);
            let mut nexts = Vec::new();
            if t.is_pattern_switch() {
                nexts.push(if cur == 0 { 1 } else { 0 });
            } else {
                if pos + 1 < t.values.len() {
                    nexts.push(t.values[pos + 1]);
                }
                if pos > 0 {
                    nexts.push(t.values[pos - 1]);
                }
            }
            for to in nexts {
                let mut c = config.clone();
                c.insert(t.name.clone(), to);
                if !Self::admitted(ctx.task, ctx.backend, k, &c) || !self.seen.insert(config_key(kernel, &c)) {
                    continue;
                }
                let base = Assessment {
                    overall: a.overall.clamp(3.0, 7.0),
                    difficulty: 1,
                    ..node.assessment.clone()
                };
                let mut assess = from_pattern(ctx.kb, t.pattern.as_deref(), &base);
                let action = if t.is_pattern_switch() {
                    let pattern = t.pattern.clone().unwrap_or_default();
                    assess.difficulty = assess.difficulty.clamp(1, 3);
                    Action::Switch {
                        kernel: kernel.to_string(),
                        name: t.name.clone(),
                        pattern,
                        on: to == 1,
                        config: c,
                    }
                } else {
                    assess.difficulty = 1;
                    Action::SetTunable {
                        kernel: kernel.to_string(),
                        name: t.name.clone(),
                        from: cur,
                        to,
                        config: c,
                    }
                };
                edits.push(TreeEdit::Insert(Proposal {
                    parent: node.id,
                    action,
                    pattern: t.pattern.clone(),
                    assessment: assess,
                }));
            }
        }
        Ok(edits)
    }
}

/// Is `n` a node whose fields an edit may change? Measured nodes keep their measurements,
/// but their beliefs may be revised; pruning and splitting apply to open nodes only.
pub fn validate_edit(tree: &Tree, e: &TreeEdit) -> std::result::Result<(), String> {
    let open = |id: i64| match tree.get(id) {
        Some(n) if n.status == NodeStatus::Open => Ok(()),
        Some(n) => Err(format!("node {id} is {}, not open", n.status.name())),
        None => Err(format!("no node {id}")),
    };
    match e {
        TreeEdit::Update { node, .. } | TreeEdit::TooHard { node } => {
            tree.get(*node).map(|_| ()).ok_or(format!("no node {node}"))
        }
        TreeEdit::Insert(p) => tree.get(p.parent).map(|_| ()).ok_or(format!("no parent node {}", p.parent)),
        TreeEdit::Prune { node, .. } => open(*node),
        TreeEdit::Split { node, into } => {
            open(*node)?;
            if into.is_empty() {
                Err("split into nothing".into())
            } else {
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax() -> Task {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks/softmax/task.toml");
        Task::load(&p).unwrap()
    }

    /// Tunable follow-ups after a measurement at `speedup` (the parent is the seed, 1.0x).
    fn follow_ups(action: Action, speedup: f64) -> usize {
        follow_up_ratings(action, speedup).len()
    }

    /// The ratings (overall) of those follow-ups.
    fn follow_up_ratings(action: Action, speedup: f64) -> Vec<f64> {
        let task = softmax();
        let tree = Tree::default();
        let ctx = Ctx {
            task: &task,
            backend: Backend::Cpu,
            kb: None,
            tree: &tree,
            round: 1,
            run_id: 1,
            store: None,
            profile: None,
        };
        let node = Node::new(2, Some(1), action, None, Assessment::default(), 1);
        let reply = EvalReply::default();
        let o = Outcome {
            reply: &reply,
            failure: None,
            speedup: Some(speedup),
            parent_speedup: Some(1.0),
            roofline_fraction: None,
        };
        let edits = Offline::default().update(&ctx, &node, &o).unwrap();
        edits
            .iter()
            .filter_map(|e| match e {
                TreeEdit::Insert(p) => Some(p.assessment.overall),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_adopted_kernel_is_tuned_however_far_behind_but_a_regressing_step_is_not() {
        let k = softmax().kernel(Backend::Cpu, "rows_simd").unwrap().clone();
        let cfg = k.default_config();
        let adopt = || Action::Adopt {
            kernel: k.name.clone(),
            config: cfg.clone(),
        };
        assert!(follow_ups(adopt(), 0.8) > 0, "defaults 20% behind the seed: tune them");
        assert_eq!(
            follow_ups(adopt(), 0.3),
            follow_ups(adopt(), 0.8),
            "far behind at its defaults: still tuned (rated low)"
        );
        let best = |v: Vec<f64>| v.into_iter().fold(f64::MIN, f64::max);
        assert!(
            best(follow_up_ratings(adopt(), 0.3)) < best(follow_up_ratings(adopt(), 0.8)),
            "the further behind, the lower its follow-ups rate"
        );
        let step = Action::SetTunable {
            kernel: k.name.clone(),
            name: "VEC".into(),
            from: 8,
            to: 16,
            config: cfg.clone(),
        };
        assert_eq!(follow_ups(step, 0.8), 0, "a tunable step that regressed is a dead end");
    }
}
