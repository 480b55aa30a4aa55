//! What the engine evaluates with. Every evaluation of a run (the seed, search candidates and
//! their re-timing, the final re-timing, held-out validation, native baselines) goes through
//! one [`Evaluator`]; the worker pool of `ksearch-eval` is one, a scripted stand-in in the
//! tests is another.

use ksearch_core::protocol::{EvalReply, EvalRequest, FailureClass};
use ksearch_eval::Pool;

/// Compiles, checks and times candidates. Requests handed over together are independent: an
/// evaluator may run them at the same time; replies come back in request order.
pub trait Evaluator {
    /// Evaluate every request; one reply per request, in order.
    fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply>;
    /// Like `eval_many`, but every request on the same device, for times that are compared
    /// with each other (a candidate against the seed): an evaluator spread over several
    /// devices never compares times from two of them.
    fn eval_same_device(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        self.eval_many(reqs)
    }
    /// How many requests to hand it at once to keep it busy (at least its workers): the engine
    /// hands the search's rounds over in batches of this many candidates.
    fn parallelism(&self) -> usize {
        1
    }
    /// Time the back-end's native implementation on `req`'s workloads (the request's candidate
    /// is the seed, for its signature); a back-end without one answers with a failure.
    fn baseline(&mut self, req: &EvalRequest) -> EvalReply;
    /// The device the evaluations run on, in words (e.g. `NVIDIA H200`).
    fn device(&self) -> String;
    /// What the evaluations so far cost over `wall_s` seconds, in one line (None: not counted).
    fn cost_line(&self, _wall_s: f64) -> Option<String> {
        None
    }
}

impl Evaluator for Pool {
    fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        Pool::eval_many(self, reqs)
    }

    fn eval_same_device(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        Pool::eval_many_on_one_device(self, reqs)
    }

    fn parallelism(&self) -> usize {
        self.in_flight()
    }

    fn baseline(&mut self, req: &EvalRequest) -> EvalReply {
        self.baseline_many(std::slice::from_ref(req))
            .pop()
            .unwrap_or_else(|| EvalReply::failed(req.id, FailureClass::Infra, "no reply from the pool"))
    }

    fn device(&self) -> String {
        self.workers.first().map(|w| w.device.clone()).unwrap_or_default()
    }

    fn cost_line(&self, wall_s: f64) -> Option<String> {
        Some(self.accounting().line(wall_s))
    }
}
