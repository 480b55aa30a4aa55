//! What the engine evaluates with. Every evaluation of a run (the seed, search candidates and
//! their re-timing, the final re-timing, held-out validation, native baselines) goes through
//! one [`Evaluator`]; the worker pool of `ksearch-eval` is one, a scripted stand-in in the
//! tests is another.

use std::collections::VecDeque;

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
    /// Whether it overlaps submissions itself (`submit`, `wait_any`): a submission starts when
    /// a worker is free, while earlier ones are still measured. One that does not is handed
    /// every outstanding submission at once by `eval_many` ([`Window`] does that).
    fn streams(&self) -> bool {
        false
    }
    /// Queue `reqs` as one submission named `tag` and return at once (only where `streams`).
    fn submit(&mut self, _tag: u64, _reqs: Vec<EvalRequest>, _same_device: bool) {}
    /// The next submission answered in full, with its replies in request order; `None` when
    /// nothing is outstanding (only where `streams`).
    fn wait_any(&mut self) -> Option<(u64, Vec<EvalReply>)> {
        None
    }
    /// Drop the queued requests that no worker has taken yet; they are answered as not run.
    fn cancel_queued(&mut self) {}
}

/// Submissions in flight on any evaluator: passed through where it streams; otherwise kept
/// until the engine waits, then handed over together (one `eval_many` for the ordinary ones,
/// one `eval_same_device` for the pinned ones) and answered in submission order.
#[derive(Default)]
pub struct Window {
    queued: Vec<(u64, Vec<EvalRequest>, bool)>,
    ready: VecDeque<(u64, Vec<EvalReply>)>,
}

impl Window {
    pub fn submit(&mut self, ev: &mut dyn Evaluator, tag: u64, reqs: Vec<EvalRequest>, same_device: bool) {
        if ev.streams() {
            ev.submit(tag, reqs, same_device);
        } else {
            self.queued.push((tag, reqs, same_device));
        }
    }

    pub fn wait_any(&mut self, ev: &mut dyn Evaluator) -> Option<(u64, Vec<EvalReply>)> {
        if ev.streams() {
            return ev.wait_any();
        }
        if self.ready.is_empty() && !self.queued.is_empty() {
            let subs = std::mem::take(&mut self.queued);
            let mut answers: Vec<Option<Vec<EvalReply>>> = vec![None; subs.len()];
            for pinned in [false, true] {
                let mine: Vec<usize> = (0..subs.len()).filter(|i| subs[*i].2 == pinned).collect();
                if mine.is_empty() {
                    continue;
                }
                let all: Vec<EvalRequest> = mine.iter().flat_map(|i| subs[*i].1.iter().cloned()).collect();
                let replies = if pinned {
                    ev.eval_same_device(&all)
                } else {
                    ev.eval_many(&all)
                };
                let mut it = replies.into_iter();
                for i in mine {
                    answers[i] = Some(
                        subs[i]
                            .1
                            .iter()
                            .map(|q| {
                                it.next().unwrap_or_else(|| {
                                    EvalReply::failed(q.id, FailureClass::Infra, "the evaluator gave no reply")
                                })
                            })
                            .collect(),
                    );
                }
            }
            for ((tag, _, _), a) in subs.into_iter().zip(answers) {
                self.ready.push_back((tag, a.unwrap_or_default()));
            }
        }
        self.ready.pop_front()
    }

    pub fn cancel_queued(&mut self, ev: &mut dyn Evaluator) {
        if ev.streams() {
            ev.cancel_queued();
            return;
        }
        for (tag, reqs, _) in std::mem::take(&mut self.queued) {
            let replies = reqs
                .iter()
                .map(|q| EvalReply::failed(q.id, FailureClass::Infra, "cancelled before it ran"))
                .collect();
            self.ready.push_back((tag, replies));
        }
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
        Pool::device(self)
    }

    fn cost_line(&self, wall_s: f64) -> Option<String> {
        Some(self.accounting().line(wall_s))
    }

    fn streams(&self) -> bool {
        true
    }

    fn submit(&mut self, tag: u64, reqs: Vec<EvalRequest>, same_device: bool) {
        Pool::submit(self, tag, reqs, same_device)
    }

    fn wait_any(&mut self) -> Option<(u64, Vec<EvalReply>)> {
        Pool::wait_any(self)
    }

    fn cancel_queued(&mut self) {
        Pool::cancel_queued(self)
    }
}
