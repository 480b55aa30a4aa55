//! The world model: a search tree of action nodes with ratings, confidence and impacts.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::protocol::FailureClass;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    /// Proposed, not yet tried.
    Open,
    /// Being evaluated (a node left here by a killed run is reopened on resume).
    Running,
    /// Tried, correct, measured.
    Solved,
    /// Tried and failed (see `failure`).
    Failed,
    /// Removed from consideration by the planner.
    Pruned,
    /// Failed repeatedly; down-rated and not retried.
    TooHard,
}

impl NodeStatus {
    pub fn name(self) -> &'static str {
        match self {
            NodeStatus::Open => "open",
            NodeStatus::Running => "running",
            NodeStatus::Solved => "solved",
            NodeStatus::Failed => "failed",
            NodeStatus::Pruned => "pruned",
            NodeStatus::TooHard => "too_hard",
        }
    }
    pub fn parse(s: &str) -> Option<NodeStatus> {
        use NodeStatus::*;
        [Open, Running, Solved, Failed, Pruned, TooHard]
            .into_iter()
            .find(|x| x.name() == s)
    }
}

/// An estimated impact on one resource: a 0–10 rating (10 = best use) and a note.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Impact {
    pub rating: f64,
    pub note: String,
}

impl Impact {
    pub fn new(rating: f64, note: impl Into<String>) -> Impact {
        Impact {
            rating: rating.clamp(0.0, 10.0),
            note: note.into(),
        }
    }
}

/// What the planner believes about a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assessment {
    /// Overall rating 0–10.
    pub overall: f64,
    /// Confidence 0–1 in the rating (measured nodes are high).
    pub confidence: f64,
    pub bandwidth: Impact,
    pub registers: Impact,
    pub hw_fit: Impact,
    /// 1 (trivial) – 5 (very hard).
    pub difficulty: u8,
    /// Prior score 0–1 before any measurement.
    pub prior: f64,
}

impl Default for Assessment {
    fn default() -> Self {
        Assessment {
            overall: 5.0,
            confidence: 0.3,
            bandwidth: Impact::new(5.0, ""),
            registers: Impact::new(5.0, ""),
            hw_fit: Impact::new(5.0, ""),
            difficulty: 2,
            prior: 0.5,
        }
    }
}

impl Assessment {
    /// Clamp every field into its range (planners, LLM replies included, go through this).
    pub fn clamped(mut self) -> Assessment {
        let fix = |v: f64, lo: f64, hi: f64, d: f64| if v.is_finite() { v.clamp(lo, hi) } else { d };
        self.overall = fix(self.overall, 0.0, 10.0, 5.0);
        self.confidence = fix(self.confidence, 0.0, 1.0, 0.3);
        self.prior = fix(self.prior, 0.0, 1.0, 0.5);
        for i in [&mut self.bandwidth, &mut self.registers, &mut self.hw_fit] {
            i.rating = fix(i.rating, 0.0, 10.0, 5.0);
        }
        self.difficulty = self.difficulty.clamp(1, 5);
        self
    }
}

/// What a node does to its parent's candidate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// The naive seed kernel (the tree's root).
    Seed,
    /// Switch to a knowledge-base kernel with the given tunables.
    Adopt { kernel: String, config: BTreeMap<String, i64> },
    /// Change one tunable of the parent's kernel.
    SetTunable {
        kernel: String,
        name: String,
        from: i64,
        to: i64,
        config: BTreeMap<String, i64>,
    },
    /// Turn a pattern on or off (a 0/1 tunable tagged with a pattern).
    Switch {
        kernel: String,
        name: String,
        pattern: String,
        on: bool,
        config: BTreeMap<String, i64>,
    },
    /// A free-form modification proposed by the LLM planner, written by the coder.
    Edit { description: String },
}

impl Action {
    /// The kernel and full tunable configuration this action produces, for offline actions.
    pub fn config(&self) -> Option<(&str, &BTreeMap<String, i64>)> {
        match self {
            Action::Adopt { kernel, config }
            | Action::SetTunable { kernel, config, .. }
            | Action::Switch { kernel, config, .. } => Some((kernel, config)),
            _ => None,
        }
    }
    pub fn summary(&self) -> String {
        match self {
            Action::Seed => "naive seed".into(),
            Action::Adopt { kernel, config } => format!("adopt {kernel} {}", fmt_config(config)),
            Action::SetTunable { name, from, to, .. } => format!("{name} {from} -> {to}"),
            Action::Switch { pattern, on, name, .. } => format!("{} {pattern} ({name})", if *on { "enable" } else { "disable" }),
            Action::Edit { description } => description.clone(),
        }
    }
}

pub fn fmt_config(c: &BTreeMap<String, i64>) -> String {
    if c.is_empty() {
        return String::new();
    }
    let v: Vec<String> = c.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("[{}]", v.join(" "))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub id: i64,
    pub parent: Option<i64>,
    pub action: Action,
    /// The optimisation pattern this action expresses, if any.
    pub pattern: Option<String>,
    pub status: NodeStatus,
    /// Key of the evaluated candidate (see `Candidate::key`).
    pub candidate: Option<String>,
    pub assessment: Assessment,
    /// How many of this node's children have been tried.
    pub visits: u32,
    /// Failed children.
    pub failures: u32,
    /// Attempts at this node itself (debug rounds for LLM edits).
    pub attempts: u32,
    /// Measured speed-up over the seed (geometric mean over search workloads).
    pub speedup: Option<f64>,
    /// Geometric-mean median time over search workloads (microseconds).
    pub time_us: Option<f64>,
    pub failure: Option<FailureClass>,
    /// Round in which it was created / evaluated.
    pub round_created: u32,
    pub round_evaluated: Option<u32>,
}

impl Node {
    pub fn new(id: i64, parent: Option<i64>, action: Action, pattern: Option<String>, a: Assessment, round: u32) -> Node {
        Node {
            id,
            parent,
            action,
            pattern,
            status: NodeStatus::Open,
            candidate: None,
            assessment: a.clamped(),
            visits: 0,
            failures: 0,
            attempts: 0,
            speedup: None,
            time_us: None,
            failure: None,
            round_created: round,
            round_evaluated: None,
        }
    }
}

/// An in-memory view of a run's tree.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    pub nodes: BTreeMap<i64, Node>,
}

impl Tree {
    pub fn from_nodes(nodes: Vec<Node>) -> Tree {
        Tree {
            nodes: nodes.into_iter().map(|n| (n.id, n)).collect(),
        }
    }
    pub fn get(&self, id: i64) -> Option<&Node> {
        self.nodes.get(&id)
    }
    pub fn children(&self, id: i64) -> Vec<&Node> {
        self.nodes.values().filter(|n| n.parent == Some(id)).collect()
    }
    pub fn root(&self) -> Option<&Node> {
        self.nodes.values().find(|n| n.parent.is_none())
    }
    pub fn open(&self) -> Vec<&Node> {
        self.nodes.values().filter(|n| n.status == NodeStatus::Open).collect()
    }
    /// The best solved node by measured speed-up (ties: the earlier node).
    pub fn best(&self) -> Option<&Node> {
        self.nodes
            .values()
            .filter(|n| n.status == NodeStatus::Solved && n.speedup.is_some())
            .fold(None, |b: Option<&Node>, n| match b {
                Some(b) if b.speedup >= n.speedup => Some(b),
                _ => Some(n),
            })
    }
    /// Path from the root to `id`.
    pub fn path(&self, id: i64) -> Vec<&Node> {
        let mut out = Vec::new();
        let mut cur = self.nodes.get(&id);
        while let Some(n) = cur {
            out.push(n);
            cur = n.parent.and_then(|p| self.nodes.get(&p));
            if out.len() > self.nodes.len() {
                break;
            }
        }
        out.reverse();
        out
    }
    pub fn total_visits(&self) -> u32 {
        self.nodes
            .values()
            .filter(|n| matches!(n.status, NodeStatus::Solved | NodeStatus::Failed | NodeStatus::TooHard))
            .count() as u32
    }
}
