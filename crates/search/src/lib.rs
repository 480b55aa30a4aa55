//! ksearch-search: the search engine as a library. One run is one tree in the store: each round
//! selects an open node, has the planner write its candidate, checks it statically, has the
//! [`Evaluator`] compile, check and time it, records everything in one transaction and lets the
//! planner revise the tree. At the end the best candidates are re-timed against the seed and
//! validated on held-out workloads ([`Report`]).
//!
//! The engine prints nothing: it reports progress as [`Event`]s to a callback.

pub mod engine;
pub mod evaluator;
pub mod llm_planner;
pub mod planner;

pub use engine::{
    Event, HeldOut, NO_FASTER, NOISY_SPREAD, Native, Parts, Report, Retimed, RunConfig, RunEnd, Search, StopRules, failure_of,
    max_spread, measured_impacts, mix, more_reps, noise_line,
};
pub use evaluator::Evaluator;
