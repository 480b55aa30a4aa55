//! A PTX interpreter: CUDA kernels, as NVRTC compiles them to PTX, run on the CPU so their
//! results can be checked without a GPU. It says whether a kernel computes the right thing under
//! CUDA's execution rules (warps, divergence, `__syncthreads`, warp shuffles, `cp.async` groups,
//! `ldmatrix`/`mma.sync` fragments); it says nothing of its speed.
//!
//! Covered: the SIMT instruction set NVRTC emits for ordinary kernels (integer, f16/bf16/f32/f64
//! arithmetic and conversions with their rounding modes, predicates, loads and stores of every
//! state space, atomics, barriers including named ones, shuffles, votes, `redux`), `cp.async`
//! with its commit/wait groups, `ldmatrix` and `mma.sync` m16n8k8/m16n8k16 (row.col, f16/bf16
//! inputs); Hopper's `mbarrier` (init, arrive with transaction bytes, try/test_wait by parity),
//! `cp.async.mbarrier.arrive`, tiled TMA tensor loads (`cp.async.bulk.tensor`) through tensor
//! maps built with `tensormap.replace` and published with `tensormap.cp_fenceproxy`, and
//! `wgmma.mma_async` m64nNk16 (f16 / bf16 in, f32 accumulators; 128-byte swizzled or plain
//! descriptors; A from shared memory or registers) with `wgmma.commit_group` / `wait_group`
//! (with `Limits::late_copies` a product lands only at the wait that retires it); thread-block
//! clusters (`.reqnctapercluster`: the cluster's blocks run together, each with its own shared
//! memory, reaching the others' through `mapa` and `.shared::cluster` or generic accesses, with
//! `barrier.cluster`, arrivals on another block's mbarrier, TMA copies multicast into several of
//! its blocks, and the `%cluster_*` registers). Not covered: `st.async`, cache hints, Blackwell's
//! `tcgen05`, function calls, textures; such an
//! instruction is parsed past and refused with a one-line reason when a thread reaches it.
//!
//! Numerics: f32 operations round as IEEE (with PTX's directed modes); approximate functions
//! (`ex2.approx`, `rcp.approx`, ...) are computed exactly, i.e. at least as accurately as the GPU;
//! `mma` accumulates in f64.

pub mod exec;
mod op;
mod parse;

pub use exec::{Arg, Launch, Limits, Stats, buffer_address};

/// Run `launch` (see [`exec::run`]); a fault of the interpreter itself is an error too, never a
/// panic of the caller (PTX from inline assembly is not checked by NVRTC for a virtual
/// architecture, so the interpreter sees whatever a kernel's author wrote).
pub fn run(module: &Module, launch: &Launch, args: &[Arg], bufs: &mut [Vec<u8>], lim: &Limits) -> Result<Stats, String> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exec::run(module, launch, args, bufs, lim)));
    r.unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("the interpreter cannot run this PTX ({what})"))
    })
}
pub use parse::{Module, parse};

/// Parse PTX text (NVRTC's output).
pub fn load(ptx: &str) -> Result<Module, String> {
    parse::parse(ptx.trim_end_matches('\0'))
}
