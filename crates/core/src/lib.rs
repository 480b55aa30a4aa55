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

/// The most bytes a source or task file may have.
pub const MAX_SOURCE_BYTES: u64 = 8 << 20;

/// A text file's contents, read only if it is a regular file of at most `MAX_SOURCE_BYTES`
/// (a device or a pipe named as a kernel would be read without end).
pub fn read_source(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut s = String::new();
    f.take(MAX_SOURCE_BYTES + 1).read_to_string(&mut s)?;
    if s.len() as u64 > MAX_SOURCE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("larger than {} MiB", MAX_SOURCE_BYTES >> 20),
        ));
    }
    Ok(s)
}
pub use protocol::{Candidate, EvalReply, EvalRequest, Failure, FailureClass, Lang, Reply, Request};
pub use task::{DType, KernelSpec, Task, Workload};
pub use tree::{Action, Assessment, Impact, Node, NodeStatus, Tree};
