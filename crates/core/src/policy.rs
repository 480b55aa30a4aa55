//! Node selection: which open action to try next.
//!
//! Each open node `n` (an action applied to its parent `p`) gets
//!
//! ```text
//! score(n) = W_VALUE   * V(p)                       measured value of the parent
//!          + W_PRIOR   * P(n)                       belief about the action itself
//!          + W_EXPLORE * sqrt(ln(1 + N) / (1 + visits(p)))   UCB exploration
//!          - W_DIFF    * (difficulty(n) - 1) / 4
//!          - W_FAIL    * failures(p) / (1 + visits(p))
//! ```
//!
//! - `V(p) = ln(speedup(p)) / ln(best)` clipped to [-1, 1], where `best` is the best speed-up so
//!   far (1 when nothing beats the seed yet: then `V = ln(speedup(p))` clipped). A parent that
//!   regressed has a negative value: its children are not favoured.
//! - `P(n) = c * overall/10 + (1 - c) * prior`, with `c` the node's confidence: the rating counts
//!   as much as the planner is sure of it, the prior fills the rest.
//! - `N` is the number of actions tried in the run.
//!
//! The highest score wins; ties go to the older node. This is not a greedy sort on speed: a
//! fresh family of actions keeps an exploration bonus until it has been tried, and a parent
//! whose children keep failing loses its appeal.

use crate::tree::{Node, NodeStatus, Tree};

pub const W_VALUE: f64 = 1.0;
pub const W_PRIOR: f64 = 0.6;
pub const W_EXPLORE: f64 = 0.5;
pub const W_DIFF: f64 = 0.3;
pub const W_FAIL: f64 = 0.8;

/// The numbers the policy looks at, for one open node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Features {
    /// Speed-up of the parent over the seed (1.0 for the seed; `None` when unmeasured).
    pub parent_speedup: Option<f64>,
    pub parent_visits: u32,
    pub parent_failures: u32,
    pub overall: f64,
    pub confidence: f64,
    pub prior: f64,
    pub difficulty: u8,
}

pub fn score(f: &Features, best: f64, total_visits: u32) -> f64 {
    let sp = f.parent_speedup.filter(|s| s.is_finite() && *s > 0.0).unwrap_or(1.0);
    let v = if best > 1.0 + 1e-9 { sp.ln() / best.ln() } else { sp.ln() };
    let v = if v.is_finite() { v.clamp(-1.0, 1.0) } else { 0.0 };
    let c = if f.confidence.is_finite() {
        f.confidence.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let overall = if f.overall.is_finite() {
        f.overall.clamp(0.0, 10.0)
    } else {
        5.0
    };
    let prior = if f.prior.is_finite() { f.prior.clamp(0.0, 1.0) } else { 0.5 };
    let p = c * overall / 10.0 + (1.0 - c) * prior;
    let visits = f.parent_visits as f64;
    let e = ((1.0 + total_visits as f64).ln() / (1.0 + visits)).sqrt();
    let d = (f.difficulty.clamp(1, 5) as f64 - 1.0) / 4.0;
    let fail = (f.parent_failures as f64 / (1.0 + visits)).min(1.0);
    W_VALUE * v + W_PRIOR * p + W_EXPLORE * e - W_DIFF * d - W_FAIL * fail
}

pub fn features(tree: &Tree, n: &Node) -> Features {
    let parent = n.parent.and_then(|p| tree.get(p));
    Features {
        parent_speedup: parent.and_then(|p| p.speedup),
        parent_visits: parent.map(|p| p.visits).unwrap_or(0),
        parent_failures: parent.map(|p| p.failures).unwrap_or(0),
        overall: n.assessment.overall,
        confidence: n.assessment.confidence,
        prior: n.assessment.prior,
        difficulty: n.assessment.difficulty,
    }
}

/// The open node to try next, with its score; `None` when nothing is open.
pub fn select(tree: &Tree) -> Option<(i64, f64)> {
    let best = tree.best().and_then(|b| b.speedup).unwrap_or(1.0).max(1.0);
    let total = tree.total_visits();
    let mut out: Option<(i64, f64)> = None;
    for n in tree.nodes.values().filter(|n| n.status == NodeStatus::Open) {
        let s = score(&features(tree, n), best, total);
        match out {
            Some((_, bs)) if bs >= s => {}
            _ => out = Some((n.id, s)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Action, Assessment};
    use proptest::prelude::*;

    fn feat() -> impl Strategy<Value = Features> {
        (
            proptest::option::of(0.01f64..100.0),
            0u32..50,
            0u32..50,
            0.0f64..10.0,
            0.0f64..1.0,
            0.0f64..1.0,
            1u8..=5,
        )
            .prop_map(|(s, v, f, o, c, p, d)| Features {
                parent_speedup: s,
                parent_visits: v,
                parent_failures: f.min(v),
                overall: o,
                confidence: c,
                prior: p,
                difficulty: d,
            })
    }

    proptest! {
        #[test]
        fn score_is_finite(f in feat(), best in 1.0f64..100.0, n in 0u32..1000) {
            prop_assert!(score(&f, best, n).is_finite());
        }

        #[test]
        fn faster_parent_never_scores_lower(f in feat(), best in 1.0f64..100.0, n in 0u32..1000, k in 1.0f64..10.0) {
            let mut g = f;
            g.parent_speedup = Some(f.parent_speedup.unwrap_or(1.0) * k);
            prop_assert!(score(&g, best, n) >= score(&f, best, n) - 1e-12);
        }

        #[test]
        fn failures_are_penalised(f in feat(), best in 1.0f64..100.0, n in 0u32..1000) {
            let mut g = f;
            g.parent_visits = f.parent_visits + 1;
            g.parent_failures = f.parent_failures + 1;
            let mut h = f;
            h.parent_visits = f.parent_visits + 1;
            // same visits, one more failure: never better
            prop_assert!(score(&g, best, n) <= score(&h, best, n) + 1e-12);
        }

        #[test]
        fn harder_is_never_better(f in feat(), best in 1.0f64..100.0, n in 0u32..1000) {
            let mut g = f;
            g.difficulty = (f.difficulty + 1).min(5);
            prop_assert!(score(&g, best, n) <= score(&f, best, n) + 1e-12);
        }

        #[test]
        fn less_visited_parent_gets_more_exploration(f in feat(), best in 1.0f64..100.0, n in 1u32..1000) {
            let mut g = f;
            g.parent_failures = 0;
            let mut h = g;
            h.parent_visits = g.parent_visits + 5;
            prop_assert!(score(&g, best, n) >= score(&h, best, n) - 1e-12);
        }

        #[test]
        fn selection_picks_an_open_node(statuses in proptest::collection::vec(0usize..6, 1..30), speeds in proptest::collection::vec(0.1f64..20.0, 30)) {
            use NodeStatus::*;
            let all = [Open, Running, Solved, Failed, Pruned, TooHard];
            let mut nodes = vec![];
            for (i, s) in statuses.iter().enumerate() {
                let mut n = Node::new(i as i64 + 1, if i == 0 { None } else { Some(i as i64) }, Action::Seed, None, Assessment::default(), 0);
                n.status = all[*s];
                if n.status == Solved { n.speedup = Some(speeds[i]); }
                nodes.push(n);
            }
            let tree = Tree::from_nodes(nodes);
            match select(&tree) {
                Some((id, s)) => {
                    prop_assert_eq!(tree.get(id).unwrap().status, Open);
                    prop_assert!(s.is_finite());
                    // and it is a maximum
                    for n in tree.open() {
                        let best = tree.best().and_then(|b| b.speedup).unwrap_or(1.0).max(1.0);
                        prop_assert!(score(&features(&tree, n), best, tree.total_visits()) <= s + 1e-12);
                    }
                }
                None => prop_assert!(tree.open().is_empty()),
            }
        }
    }

    #[test]
    fn not_a_greedy_sort() {
        // A child of a slightly slower but unexplored parent can beat a child of the best,
        // heavily visited parent.
        let best = Features {
            parent_speedup: Some(4.0),
            parent_visits: 30,
            parent_failures: 10,
            overall: 5.0,
            confidence: 0.3,
            prior: 0.5,
            difficulty: 2,
        };
        let fresh = Features {
            parent_speedup: Some(3.5),
            parent_visits: 0,
            parent_failures: 0,
            overall: 5.0,
            confidence: 0.3,
            prior: 0.5,
            difficulty: 2,
        };
        assert!(score(&fresh, 4.0, 40) > score(&best, 4.0, 40));
    }
}
