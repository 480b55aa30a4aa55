//! ksearch-core: the data of a kernel search — tasks, candidates, the worker protocol, the
//! world-model tree and the selection policy. No files beyond task loading, no processes, no HTTP.

pub mod backend;
pub mod data;
pub mod expr;
pub mod mlx;
pub mod policy;
pub mod protocol;
pub mod reference;
pub mod task;
pub mod tree;

pub use backend::{Backend, UnknownBackend};
pub use protocol::{Candidate, EvalReply, EvalRequest, Failure, FailureClass, Lang, Reply, Request};
pub use task::{DType, KernelSpec, Task, Workload};
pub use tree::{Action, Assessment, Impact, Node, NodeStatus, Tree};
