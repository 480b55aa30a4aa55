//! ksearch-eval: running candidates. The worker protocol (JSON lines, see `docs/protocol.md`),
//! the worker loop, the supervisor that spawns workers with time and memory limits, and the
//! back-ends (`cpu`, `cuda`; `mlx` lives in `python/ksearch_mlx`).

pub mod common;
pub mod cpu;
pub mod cuda;
pub mod judge;
pub mod mlx_cuda;
pub mod pool;
pub mod sandbox;
pub mod scrub;
pub mod supervisor;
pub mod task_ref;
pub mod worker;

pub use pool::Pool;
pub use supervisor::{Launcher, Limits, Supervisor, WorkerSpec};

use ksearch_core::protocol::{EvalReply, EvalRequest};

/// A back-end evaluates candidates inside a worker process. It may crash or hang on a bad
/// candidate: the supervisor, in another process, deals with that.
pub trait Backend {
    /// Which back-end this is (its spelling goes into the worker's hello).
    fn backend(&self) -> ksearch_core::Backend;
    /// Human-readable device name (used to detect the hardware profile).
    fn device(&self) -> String;
    /// Compile, check and time. `progress` reports stages ("compiled", "workload 1/3") so the
    /// supervisor can apply the right time-out.
    fn eval(&mut self, req: &EvalRequest, progress: &mut dyn FnMut(&str)) -> EvalReply;
    /// How candidate code is contained on this back-end (printed in the run header).
    fn isolation(&self) -> Option<String> {
        None
    }
    /// Which clock times candidate calls (printed in the run header).
    fn clock(&self) -> Option<String> {
        None
    }
}
