//! A PTX interpreter: CUDA kernels, as NVRTC compiles them to PTX, run on the CPU so their
//! results can be checked without a GPU. It says whether a kernel computes the right thing under
//! CUDA's execution rules (warps, divergence, `__syncthreads`, warp shuffles, `cp.async` groups,
//! `ldmatrix`/`mma.sync` fragments); it says nothing of its speed.
//!
//! Covered: the SIMT instruction set NVRTC emits for ordinary kernels (integer, f16/bf16/f32/f64
//! arithmetic and conversions with their rounding modes, predicates, loads and stores of every
//! state space, atomics, barriers including named ones, shuffles, votes, `redux`), `cp.async`
//! with its commit/wait groups, `ldmatrix` and `mma.sync` m16n8k8/m16n8k16 (row.col, f16/bf16
//! inputs). Not covered, each refused with a one-line reason at load: `wgmma`, TMA
//! (`cp.async.bulk`), `mbarrier`, function calls, textures.
//!
//! Numerics: f32 operations round as IEEE (with PTX's directed modes); approximate functions
//! (`ex2.approx`, `rcp.approx`, ...) are computed exactly, i.e. at least as accurately as the GPU;
//! `mma` accumulates in f64.

mod exec;
mod op;
mod parse;

pub use exec::{Arg, Launch, Limits, Stats, buffer_address, run};
pub use parse::{Module, parse};

/// Parse PTX text (NVRTC's output).
pub fn load(ptx: &str) -> Result<Module, String> {
    parse::parse(ptx.trim_end_matches('\0'))
}
