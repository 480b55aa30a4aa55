//! A pool of workers: several requests evaluated at once, one per worker.

use ksearch_core::protocol::{EvalReply, EvalRequest, FailureClass};

use crate::supervisor::Supervisor;

/// One supervisor per device; evaluates several requests at once, one per worker.
pub struct Pool {
    pub workers: Vec<Supervisor>,
}

impl Pool {
    pub fn new(workers: Vec<Supervisor>) -> Pool {
        Pool { workers }
    }
    pub fn len(&self) -> usize {
        self.workers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
    /// Evaluate `reqs` (at most one per worker at a time), replies in request order.
    pub fn eval_many(&mut self, reqs: &[EvalRequest]) -> Vec<EvalReply> {
        let mut out: Vec<Option<EvalReply>> = vec![None; reqs.len()];
        for (chunk_i, chunk) in reqs.chunks(self.workers.len().max(1)).enumerate() {
            let base = chunk_i * self.workers.len().max(1);
            std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .workers
                    .iter_mut()
                    .zip(chunk)
                    .map(|(w, r)| s.spawn(move || w.eval(r)))
                    .collect();
                for (i, h) in handles.into_iter().enumerate() {
                    out[base + i] =
                        Some(h.join().unwrap_or_else(|_| {
                            EvalReply::failed(chunk[i].id, FailureClass::Infra, "supervisor thread panicked")
                        }));
                }
            });
        }
        out.into_iter().map(|r| r.unwrap_or_default()).collect()
    }
}
