//! Running a kernel: a grid of blocks, one block at a time (one cluster at a time for a kernel
//! with a cluster shape, its blocks together); in a block, warps take turns; in a
//! warp, the lanes at the lowest program counter execute each instruction together (so lanes
//! that diverged reconverge where their paths meet, and a store by one lane is seen by another's
//! later load as on the GPU). Warp-collective instructions (`shfl`, `vote`, `redux`, `ldmatrix`,
//! `mma`, `bar.warp.sync`) wait for every live lane of their member mask; `bar.sync` waits for
//! the block's live threads (or its count). `cp.async` copies land only at the thread's
//! `cp.async.wait_group` that covers them, so a read before the wait sees what was there before.
//! Hopper: an mbarrier's phase completes when its arrivals and transaction bytes are in; a
//! thread's first `try_wait` of a phase still open answers false (the hardware's may, once its
//! time limit passes: a kernel must try again), and a `try_wait` or `test_wait` of that phase
//! asked again sleeps until some phase completes (a deadlock is reported, not spun on; a thread
//! that polls, then does the work its own phase waits for, is reported as one too); `wgmma.mma_async` waits for its warpgroup's 128 threads. Asynchronous
//! results land at issue, or with `Limits::late_copies` as late as they may: copies completing
//! on an mbarrier (TMA, `cp.async` + `cp.async.mbarrier.arrive`) when their barrier is waited on,
//! and a `wgmma.mma_async` is computed at the first `wgmma.wait_group` that retires its group
//! (its A registers and shared-memory operands read then) and its accumulators reach a thread's
//! registers at that thread's wait. One run misses a wait for the barrier that says a stage is
//! free, the other a wait for the one that says it is full, for a product's completion before
//! its accumulators are read, or before its operands are overwritten. Shared memory starts as
//! NaN bytes; every access is bounds- and alignment-checked.
//!
//! Clusters (`.reqnctapercluster`, up to 8 blocks; the grid a whole number of clusters): the
//! warps of all the cluster's blocks take turns as one block's do, each block with its own shared
//! memory, mbarriers, `bar.sync` barriers and `%ctaid`, so a block may wait for another's
//! hand-over. `mapa` gives another block's address of a shared variable (`.shared::cluster`
//! addresses carry the block's rank + 1 in bits 24 and up, generic ones too in the shared
//! window; 0 there is the block's own), which `.shared::cluster` and generic loads, stores and
//! atomics, and `mbarrier.arrive` / `expect_tx` on another block's mbarrier, take; a rank outside
//! the cluster, an offset past the block's shared memory, a `.shared::cta` access with such an
//! address, and an access to a block whose threads have all exited are errors.
//! `barrier.cluster.wait` waits until every thread of the cluster not exited has passed
//! `barrier.cluster.arrive`. A deadlock across the cluster's blocks is reported as one.
//! Multicast copies and `st.async` are not covered.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use half::{bf16, f16};

use crate::op::{Base, Cmp, Op, Rnd, Ty, flag, hop, mode};
use crate::parse::{AddrBase, Function, Instr, Module, Opd, Space, Special};

/// Generic addresses: window `addr >> 40`: 1 the module's `.global`/`.const` variables,
/// 2 + i buffer i, 0xF0 shared memory, 0xF1 the thread's local memory.
const WIN: u32 = 40;
/// Shared addresses of a cluster's blocks (`.shared::cluster` ones, and offsets in the generic
/// shared window): bits 24 and up hold the block's cluster rank + 1 (as `mapa` makes them), 0
/// the block's own shared memory (so its `.shared::cta` addresses are `.shared::cluster` ones).
const RANK_SHIFT: u32 = 24;
const RANK_MASK: u64 = (1 << RANK_SHIFT) - 1;
/// The portable cluster size (larger ones need a launch attribute the GPU may refuse).
const MAX_CLUSTER: u64 = 8;
const GLOBALS_WIN: u64 = 1;
const SHARED_WIN: u64 = 0xF0;
const LOCAL_WIN: u64 = 0xF1;
const MAX_SHARED: u64 = 232_448;
const MAX_LOCAL: u64 = 512 * 1024;
const MAX_GLOBALS: u64 = 256 << 20;

/// A kernel argument: a buffer's address, or a value (its low bytes, as wide as the parameter).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Buffer(usize),
    Word(u64),
}

#[derive(Debug, Clone)]
pub struct Launch {
    pub entry: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared: u32,
}

#[derive(Debug, Clone)]
pub struct Limits {
    /// Thread-instructions for the whole launch.
    pub max_steps: u64,
    pub deadline: Option<Instant>,
    /// Instructions a warp runs before the next warp's turn. The default runs each warp until it
    /// waits (at a barrier or a collective) or exits, which is how a missing `__syncthreads`
    /// between writing shared memory and reading another warp's part of it shows: the reader
    /// runs ahead and sees the NaN bytes shared memory starts with.
    pub slice: u32,
    /// Warps take turns from the last one down (a write that should wait for another warp's
    /// reads then runs first).
    pub reverse: bool,
    /// Asynchronous results land as late as they may: copies completing on an mbarrier (TMA,
    /// `cp.async` with `cp.async.mbarrier.arrive`) when their barrier is waited on (a read that
    /// does not wait sees the old bytes), `wgmma.mma_async` products at the `wgmma.wait_group`
    /// that retires them (their operands read then, their accumulators written then: a read
    /// before sees the old values). Otherwise both land at issue (a copy issued before the
    /// readers of the old bytes are done overwrites them first).
    pub late_copies: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_steps: 20_000_000_000,
            deadline: None,
            slice: u32::MAX,
            reverse: false,
            late_copies: false,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Thread-instructions executed.
    pub steps: u64,
    /// Of them, asynchronous ones whose results may land late (mbarrier operations, copies
    /// completing on an mbarrier, `wgmma`): none, and `Limits::late_copies` changes nothing.
    pub asynchronous: u64,
}

pub fn buffer_address(i: usize) -> u64 {
    (i as u64 + 2) << WIN
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum St {
    Run,
    Exited,
    /// At `bar.sync` / `bar.red` of this barrier.
    Bar(u32),
    /// At a warp-collective instruction.
    Warp,
    /// At `mbarrier.try_wait` of a phase not yet complete, since this many phases of the block's
    /// mbarriers completed: it tries again once another does.
    Spin(u64),
    /// At a warpgroup-collective instruction (`wgmma.mma_async`).
    Wg,
    /// At `barrier.cluster.wait` of a phase not yet complete.
    ClWait,
    /// At `wgmma.wait_group` (late results: the block lands the products it retires).
    WgWait,
}

/// A `wgmma.mma_async` issued and not yet landed everywhere (late results): computed at the
/// first wait that retires it, its accumulators written to each thread at that thread's wait.
#[derive(Debug, Clone)]
struct PendWg {
    /// The block's cluster rank, the warpgroup's first thread in the block, and the instruction.
    rank: usize,
    lo: usize,
    pc: u32,
    /// The issuing threads' count of committed groups at issue: the group it joins.
    group: u64,
    /// The descriptors (A from shared memory, B) as read at issue.
    desc_a: Option<u64>,
    desc_b: u64,
    /// Each thread's scale-d predicate at issue.
    keep: Vec<bool>,
    /// Per thread, the accumulators' bits once computed.
    result: Option<Vec<Vec<u32>>>,
    /// Threads (bit i: thread lo + i) whose registers have them.
    landed: u128,
}

/// An mbarrier (in shared memory, at the offset in `Mem::shared` it is keyed by).
#[derive(Debug, Clone)]
struct Mbar {
    count: u32,
    pending: u32,
    /// Transaction bytes the current phase still waits for (negative: landed before expected).
    tx: i64,
    /// Phases completed.
    phase: u64,
}

/// An asynchronous copy issued and not yet landed: it lands when a thread waits on its mbarrier
/// (or when nothing else can run), as late as the GPU may land it, so a read that does not wait
/// sees the bytes from before.
enum Pending {
    /// `cp.async.bulk.tensor` into `dst` (in a kernel with cluster addresses, a
    /// `.shared::cluster` address with its block's rank) of the box at `c`; completes its bytes
    /// on the mbarrier.
    Tma {
        bar: u64,
        dst: u64,
        tm: Tmap,
        c: [i64; 5],
        dims: usize,
    },
    /// A thread's `cp.async` copies, whose arrival (`cp.async.mbarrier.arrive`) already counted.
    Copies { bar: u64, copies: Vec<Copy> },
}

/// A tensor map's fields as `tensormap.replace` set them (unset ones are zero, as in the zeroed
/// object the fields go into); the object's bytes themselves are opaque.
#[derive(Debug, Clone, Default)]
struct Tmap {
    address: u64,
    rank: u32,
    box_dim: [u32; 5],
    global_dim: [u32; 5],
    global_stride: [u64; 5],
    element_stride: [u32; 5],
    elemtype: u32,
    interleave: u32,
    swizzle: u32,
    fill: u32,
}

struct Copy {
    /// Where it lands: an offset in `Mem::shared`.
    dst: u64,
    src: u64,
    bytes: usize,
    size: usize,
}

struct Thread {
    pc: u32,
    st: St,
    regs: Vec<u64>,
    local: Vec<u8>,
    tid: [u32; 3],
    linear: u32,
    /// The block's cluster rank and `%ctaid`.
    rank: usize,
    ctaid: [u32; 3],
    /// The `barrier.cluster` phase the thread arrived at and has not waited for yet.
    cl_arrived: Option<u64>,
    open: Vec<Copy>,
    groups: VecDeque<Vec<Copy>>,
    /// `wgmma.commit_group`s executed.
    wg_committed: u64,
    /// `wgmma.fence`s executed.
    fences: u32,
    /// Kernels with `wgmma.mma_async` only: per register, ((fences executed + 1) << 32 | PTX
    /// line) of its last write by an ordinary instruction, 0 where none wrote it since a `wgmma`
    /// did (zero, so the vector is allocated without being written). A `wgmma` reading a
    /// register stamped with the thread's current fence count reads a write no `wgmma.fence`
    /// has ordered before it.
    wr: Vec<u64>,
    /// The mbarrier (shared offset) and parity of the last `try_wait` that answered false: the
    /// thread's first `try_wait` of a phase still open answers false, as the hardware may once
    /// its time limit passes, and only a `try_wait` of the same phase again sleeps.
    told_open: Option<(u64, u64)>,
}

struct Mem<'a> {
    bufs: &'a mut [Vec<u8>],
    globals: Vec<u8>,
    /// The shared memory of every block of the cluster: block rank r's `stride` bytes at
    /// r * `stride`.
    shared: Vec<u8>,
    stride: usize,
    /// The cluster's blocks; the rank of the block whose threads run (its shared memory is the
    /// one `.shared::cta` addresses name), and where that starts in `shared`.
    nranks: usize,
    rank: usize,
    base: usize,
    /// Per rank, the block's threads not exited (a block's shared memory is gone once none is).
    live: Vec<u32>,
    /// The kernel uses cluster addresses: offsets in the generic shared window carry a rank.
    clustered: bool,
    /// `barrier.cluster`: phases completed, and arrivals at the current one.
    cl_phase: u64,
    cl_arrivals: u32,
    params: Vec<u8>,
    /// The cluster's mbarriers by offset in `shared`, and how many of their phases have completed.
    mbars: HashMap<u64, Mbar>,
    epoch: u64,
    /// Tensor maps being built in shared memory (by offset in `shared`), and those published to
    /// global memory (by generic address, for every later block).
    tmaps: HashMap<u64, Tmap>,
    gtmaps: HashMap<u64, Tmap>,
    /// Copies in flight, in issue order.
    pending: Vec<Pending>,
    /// `wgmma.mma_async` products not yet landed in every thread (late results), in issue order.
    wgq: Vec<PendWg>,
}

type R<T> = Result<T, String>;

fn sx(v: u64, bits: u32) -> i64 {
    if bits >= 64 {
        v as i64
    } else {
        ((v << (64 - bits)) as i64) >> (64 - bits)
    }
}

fn zx(v: u64, bits: u32) -> u64 {
    if bits >= 64 { v } else { v & ((1u64 << bits) - 1) }
}

fn f32of(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

fn ftz32(x: f32, on: bool) -> f32 {
    if on && x.is_subnormal() { 0.0f32.copysign(x) } else { x }
}

/// Round the exact value `s + e` (with |e| below half an ulp of `s` in f64) to f32 in `rnd`.
fn round_f32(s: f64, e: f64, rnd: Rnd) -> f32 {
    let rn = s as f32;
    if !rn.is_finite() || matches!(rnd, Rnd::Default | Rnd::Rn) {
        return rn;
    }
    let d = (s - rn as f64) + e; // exact value minus rn
    match rnd {
        Rnd::Rm if d < 0.0 => rn.next_down(),
        Rnd::Rp if d > 0.0 => rn.next_up(),
        Rnd::Rz if d != 0.0 && (d < 0.0) == (rn > 0.0) => {
            if rn > 0.0 {
                rn.next_down()
            } else {
                rn.next_up()
            }
        }
        _ => rn,
    }
}

fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

fn round_int(x: f64, rnd: Rnd) -> f64 {
    match rnd {
        Rnd::Rni | Rnd::Rn => x.round_ties_even(),
        Rnd::Rmi | Rnd::Rm => x.floor(),
        Rnd::Rpi | Rnd::Rp => x.ceil(),
        _ => x.trunc(),
    }
}

/// Read a 16-bit float of `ty` (f16 or bf16) as f32.
fn h2f(v: u64, ty: Ty) -> f32 {
    if matches!(ty, Ty::BF16 | Ty::BF16x2) {
        bf16::from_bits(v as u16).to_f32()
    } else {
        f16::from_bits(v as u16).to_f32()
    }
}

fn f2h(x: f64, ty: Ty) -> u64 {
    if matches!(ty, Ty::BF16 | Ty::BF16x2) {
        bf16::from_f64(x).to_bits() as u64
    } else {
        f16::from_f64(x).to_bits() as u64
    }
}

fn is16(ty: Ty) -> bool {
    matches!(ty, Ty::F16 | Ty::BF16)
}
fn is16x2(ty: Ty) -> bool {
    matches!(ty, Ty::F16x2 | Ty::BF16x2)
}

struct Grid<'m> {
    m: &'m Module,
    f: &'m Function,
    l: &'m Launch,
    nthreads: u32,
    steps: u64,
    asynchronous: u64,
    lim: &'m Limits,
    /// The cluster shape, the cluster running and its blocks' `%ctaid` by rank.
    cdim: [u32; 3],
    cluster_id: [u32; 3],
    ctaids: Vec<[u32; 3]>,
    /// The kernel has `wgmma.mma_async`: register writes are stamped (`Thread::wr`).
    fenced: bool,
}

impl Mem<'_> {
    /// Run the threads of the block of cluster rank `r`.
    fn at_rank(&mut self, r: usize) {
        self.rank = r;
        self.base = r * self.stride;
    }

    /// Where the shared memory of the block a cluster address `a` names starts in `shared`.
    fn cluster_block(&self, a: u64) -> R<usize> {
        match a >> RANK_SHIFT {
            0 => Ok(self.base),
            hi if hi - 1 < self.nranks as u64 => Ok((hi - 1) as usize * self.stride),
            hi => Err(format!(
                "an access to the shared memory of cluster rank {} (address {a:#x}), outside the cluster of {} block(s)",
                hi - 1,
                self.nranks
            )),
        }
    }

    /// The offset `off` in `shared` as the place a message names.
    fn shared_at(&self, off: u64) -> String {
        if self.nranks == 1 || self.stride == 0 {
            format!("byte {off} of shared memory")
        } else {
            let s = self.stride as u64;
            format!("byte {} of the shared memory of cluster rank {}", off % s, off / s)
        }
    }

    /// A remote access to shared memory at offset `off` of `shared` needs its block alive.
    fn check_live(&self, off: usize) -> R<()> {
        let r = off / self.stride;
        if r != self.rank && self.live[r] == 0 {
            return Err(format!(
                "an access to the shared memory of cluster rank {r}, whose threads have all exited (a block's shared memory is gone once it exits: a cluster barrier before the exit keeps it)"
            ));
        }
        Ok(())
    }
}

/// Run `launch` of `module` with `args` over `bufs` (device memory: the buffers the arguments
/// point into). `Err`: a one-line reason (an access out of bounds or misaligned, a deadlock, an
/// unsupported instruction, the step limit or deadline).
pub fn run(module: &Module, launch: &Launch, args: &[Arg], bufs: &mut [Vec<u8>], lim: &Limits) -> R<Stats> {
    let f = module
        .function(&launch.entry)
        .filter(|f| f.entry)
        .ok_or_else(|| format!("no kernel `{}` in the module (it has {:?})", launch.entry, module.entries()))?;
    if args.len() != f.params.len() {
        return Err(format!(
            "kernel `{}` takes {} parameters, {} given",
            f.name,
            f.params.len(),
            args.len()
        ));
    }
    let nthreads = launch.block.iter().map(|v| *v as u64).product::<u64>();
    if nthreads == 0 || nthreads > 1024 {
        return Err(format!("block {:?}: {nthreads} threads (1 to 1024)", launch.block));
    }
    if let Some(mx) = f.max_threads
        && nthreads > mx as u64
    {
        return Err(format!("block of {nthreads} threads exceeds the kernel's .maxntid {mx}"));
    }
    if launch.grid.contains(&0) {
        return Err(format!("empty grid {:?}", launch.grid));
    }
    if f.explicit_cluster && f.cluster.is_none() {
        return Err(format!(
            "kernel `{}` takes its cluster shape at launch (.explicitcluster without .reqnctapercluster), which a launch here does not give",
            f.name
        ));
    }
    let cdim = f.cluster.unwrap_or([1, 1, 1]);
    let nranks = cdim.iter().map(|v| *v as u64).product::<u64>();
    if nranks == 0 || nranks > MAX_CLUSTER {
        return Err(format!("cluster shape {cdim:?}: {nranks} blocks (1 to {MAX_CLUSTER})"));
    }
    if (0..3).any(|d| !launch.grid[d].is_multiple_of(cdim[d])) {
        return Err(format!(
            "grid {:?} is not a whole number of clusters of shape {cdim:?}",
            launch.grid
        ));
    }
    // The GPU's own limits (sm_90: 227 KB of shared memory per block, 512 KB of local memory per
    // thread) bound what a launch may ask of this process.
    let shared = module.static_shared + launch.dynamic_shared as u64;
    if shared > MAX_SHARED {
        return Err(format!("{shared} bytes of shared memory per block (at most {MAX_SHARED})"));
    }
    if f.local_bytes > MAX_LOCAL {
        return Err(format!(
            "{} bytes of local memory per thread (at most {MAX_LOCAL})",
            f.local_bytes
        ));
    }
    if module.global_bytes > MAX_GLOBALS {
        return Err(format!(
            "{} bytes of module variables (at most {MAX_GLOBALS})",
            module.global_bytes
        ));
    }
    let mut params = vec![0u8; f.param_bytes as usize];
    for (a, id) in args.iter().zip(&f.params) {
        let s = &module.symbols[*id as usize];
        let v = match a {
            Arg::Buffer(i) => {
                if *i >= bufs.len() {
                    return Err(format!("argument for `{}` names buffer {i} of {}", s.name, bufs.len()));
                }
                buffer_address(*i)
            }
            Arg::Word(w) => *w,
        };
        let n = (s.size as usize).min(8);
        params[s.addr as usize..s.addr as usize + n].copy_from_slice(&v.to_le_bytes()[..n]);
    }
    let mut globals = vec![0u8; module.global_bytes as usize];
    for s in &module.symbols {
        if matches!(s.space, Space::Global | Space::Const) && !s.init.is_empty() {
            let a = s.addr as usize;
            globals[a..a + s.init.len()].copy_from_slice(&s.init);
        }
    }
    let shared_bytes = module.static_shared as usize + launch.dynamic_shared as usize;
    let clustered = f.cluster.is_some()
        || f.instrs
            .iter()
            .any(|i| i.op.space == Space::SharedCluster || matches!(i.op.base, Base::Mapa | Base::GetCtaRank));
    let mut mem = Mem {
        bufs,
        globals,
        shared: Vec::new(),
        stride: shared_bytes,
        nranks: nranks as usize,
        rank: 0,
        base: 0,
        live: Vec::new(),
        clustered,
        cl_phase: 0,
        cl_arrivals: 0,
        params,
        mbars: HashMap::new(),
        epoch: 0,
        tmaps: HashMap::new(),
        gtmaps: HashMap::new(),
        pending: Vec::new(),
        wgq: Vec::new(),
    };
    let mut g = Grid {
        m: module,
        f,
        l: launch,
        nthreads: nthreads as u32,
        steps: 0,
        asynchronous: 0,
        lim,
        cdim,
        cluster_id: [0; 3],
        ctaids: Vec::new(),
        fenced: f.instrs.iter().any(|i| i.op.base == Base::Wgmma),
    };
    let mut pool = Vec::new();
    // Clusters one after another (without clusters, blocks), x fastest; a cluster's blocks
    // together, by rank (x fastest within the cluster).
    let [cx, cy] = [cdim[0], cdim[1]];
    for z in 0..launch.grid[2] / cdim[2] {
        for y in 0..launch.grid[1] / cy {
            for x in 0..launch.grid[0] / cx {
                g.cluster_id = [x, y, z];
                g.ctaids.clear();
                for r in 0..nranks as u32 {
                    let [rx, ry, rz] = [r % cx, (r / cx) % cy, r / (cx * cy)];
                    g.ctaids.push([x * cx + rx, y * cy + ry, z * cdim[2] + rz]);
                }
                mem.shared.clear();
                mem.shared.resize(shared_bytes * nranks as usize, 0xFF);
                mem.live.clear();
                mem.live.resize(nranks as usize, g.nthreads);
                mem.cl_phase = 0;
                mem.cl_arrivals = 0;
                mem.at_rank(0);
                mem.mbars.clear();
                mem.tmaps.clear();
                mem.pending.clear();
                mem.wgq.clear();
                g.cluster(&mut mem, &mut pool)?;
            }
        }
    }
    Ok(Stats {
        steps: g.steps,
        asynchronous: g.asynchronous,
    })
}

/// Stamp the registers an ordinary instruction writes (its first operand) with the thread's
/// fence count and the instruction's line (`Thread::wr`; nothing for kernels without `wgmma`).
fn stamp_writes(t: &mut Thread, ins: &Instr) {
    if t.wr.is_empty() || matches!(ins.op.base, Base::Wgmma | Base::WgWait) {
        return;
    }
    let stamp = (t.fences as u64 + 1) << 32 | ins.line as u64;
    match ins.args.first() {
        Some(Opd::Reg(r)) => t.wr[*r as usize] = stamp,
        Some(Opd::Vec(v)) => {
            for o in v {
                if let Opd::Reg(r) = o {
                    t.wr[*r as usize] = stamp;
                }
            }
        }
        _ => {}
    }
}

impl Grid<'_> {
    /// One cluster (without clusters, one block), its threads taken from (and put back into)
    /// `pool`: a kernel's registers are counted in the tens of thousands (NVRTC's PTX numbers
    /// every value), so a block's threads hold megabytes that the next block reuses, zeroed,
    /// instead of allocating them again. Rank r's threads are `nthreads` r onwards.
    fn cluster(&mut self, mem: &mut Mem, pool: &mut Vec<Thread>) -> R<()> {
        let b = self.l.block;
        let nt = self.nthreads as usize;
        let mut threads = std::mem::take(pool);
        if threads.is_empty() {
            threads = (0..nt * self.ctaids.len())
                .map(|k| {
                    let i = (k % nt) as u32;
                    Thread {
                        pc: 0,
                        st: St::Run,
                        regs: vec![0; self.f.nregs as usize],
                        local: vec![0; self.f.local_bytes as usize],
                        tid: [i % b[0], (i / b[0]) % b[1], i / (b[0] * b[1])],
                        linear: i,
                        rank: k / nt,
                        ctaid: self.ctaids[k / nt],
                        cl_arrived: None,
                        open: Vec::new(),
                        groups: VecDeque::new(),
                        wg_committed: 0,
                        fences: 0,
                        told_open: None,
                        wr: if self.fenced {
                            vec![0; self.f.nregs as usize]
                        } else {
                            Vec::new()
                        },
                    }
                })
                .collect();
        } else {
            for t in threads.iter_mut() {
                t.pc = 0;
                t.st = St::Run;
                t.regs.fill(0);
                t.local.fill(0);
                t.ctaid = self.ctaids[t.rank];
                t.cl_arrived = None;
                t.open.clear();
                t.groups.clear();
                t.wg_committed = 0;
                t.fences = 0;
                t.told_open = None;
                t.wr.fill(0);
            }
        }
        let r = self.run_cluster(mem, &mut threads);
        *pool = threads;
        r
    }

    /// An error of the block of cluster rank `rank` (None: of the cluster) as reported.
    fn tag(&self, rank: Option<usize>, e: String) -> String {
        let [x, y, z] = match rank {
            Some(r) => self.ctaids[r],
            None if self.ctaids.len() == 1 => self.ctaids[0],
            None => {
                let [x, y, z] = self.cluster_id;
                return format!("cluster ({x}, {y}, {z}): {e}");
            }
        };
        format!("block ({x}, {y}, {z}): {e}")
    }

    fn run_cluster(&mut self, mem: &mut Mem, threads: &mut [Thread]) -> R<()> {
        let nt = self.nthreads as usize;
        let nranks = self.ctaids.len();
        let nwarps = nt.div_ceil(32);
        // Warps of every block of the cluster take turns, rank 0's first.
        let total = nwarps * nranks;
        let mut start = 0usize;
        // bar.arrive counts per block and barrier id
        let mut arrived = vec![[0u32; 16]; nranks];
        loop {
            let mut progress = false;
            // Threads spinning on an mbarrier try again once a phase has completed since.
            for t in threads.iter_mut() {
                if let St::Spin(e) = t.st
                    && e != mem.epoch
                {
                    t.st = St::Run;
                }
            }
            for k in 0..total {
                let w = if self.lim.reverse {
                    total - 1 - (start + k) % total
                } else {
                    (start + k) % total
                };
                let r = w / nwarps;
                let lo = r * nt + (w % nwarps) * 32;
                let hi = (lo + 32).min((r + 1) * nt);
                mem.at_rank(r);
                progress |= self
                    .warp(&mut threads[lo..hi], mem, &mut arrived[r])
                    .map_err(|e| self.tag(Some(r), e))?;
            }
            start = (start + 1) % total;
            if threads.iter().all(|t| t.st == St::Exited) {
                // Copies nobody waited for still land (their bytes are the block's to lose).
                return self.land_pending(&threads[0], mem, None).map_err(|e| self.tag(None, e));
            }
            let mut released = false;
            for (r, arr) in arrived.iter_mut().enumerate() {
                released |= self
                    .release_barriers(&mut threads[r * nt..(r + 1) * nt], arr)
                    .map_err(|e| self.tag(Some(r), e))?;
            }
            if released || Self::release_cluster_barrier(threads, mem) {
                continue;
            }
            for r in 0..nranks {
                mem.at_rank(r);
                released |= self
                    .release_warpgroups(&mut threads[r * nt..(r + 1) * nt], mem, r)
                    .map_err(|e| self.tag(Some(r), e))?;
            }
            if released {
                continue;
            }
            for r in 0..nranks {
                mem.at_rank(r);
                released |= self
                    .land_wgmma(&mut threads[r * nt..(r + 1) * nt], mem, r)
                    .map_err(|e| self.tag(Some(r), e))?;
            }
            if released {
                continue;
            }
            if !progress && !mem.pending.is_empty() {
                // Nothing else can run: the copies in flight land.
                self.land_pending(&threads[0], mem, None).map_err(|e| self.tag(None, e))?;
                continue;
            }
            if !progress {
                let at = |t: &Thread| {
                    let line = self.f.instrs.get(t.pc as usize).map(|i| i.line).unwrap_or(0);
                    if nranks == 1 {
                        format!("thread {} waits at line {line} ({:?})", t.linear, t.st)
                    } else {
                        let [x, y, z] = t.ctaid;
                        format!(
                            "thread {} of block ({x}, {y}, {z}) waits at line {line} ({:?})",
                            t.linear, t.st
                        )
                    }
                };
                let live = threads.iter().filter(|t| t.st != St::Exited);
                // In a cluster, the first waiting thread of each block.
                let at: Vec<String> = if nranks == 1 {
                    live.take(4).map(at).collect()
                } else {
                    let mut seen = vec![false; nranks];
                    live.filter(|t| !std::mem::replace(&mut seen[t.rank], true)).map(at).collect()
                };
                return Err(self.tag(None, format!("deadlock: {}", at.join(", "))));
            }
        }
    }

    /// Complete the current `barrier.cluster` phase once every thread of the cluster not exited
    /// has arrived at it, releasing the threads that wait for it.
    fn release_cluster_barrier(threads: &mut [Thread], mem: &mut Mem) -> bool {
        if mem.cl_arrivals == 0 {
            return false;
        }
        let p = mem.cl_phase;
        if !threads.iter().all(|t| t.st == St::Exited || t.cl_arrived == Some(p)) {
            return false;
        }
        mem.cl_phase += 1;
        mem.cl_arrivals = 0;
        for t in threads.iter_mut() {
            if t.st == St::ClWait {
                t.st = St::Run;
                t.pc += 1;
                t.cl_arrived = None;
            }
        }
        true
    }

    /// Release every `bar.sync` whose participants have all arrived. Exited threads count as
    /// arrived at a barrier without a count.
    fn release_barriers(&mut self, threads: &mut [Thread], arrived: &mut [u32; 16]) -> R<bool> {
        let mut any = false;
        for id in 0..16u32 {
            let waiting: Vec<usize> = (0..threads.len()).filter(|i| threads[*i].st == St::Bar(id)).collect();
            if waiting.is_empty() {
                continue;
            }
            // The count of the first waiter's instruction (all must agree).
            let ins = &self.f.instrs[threads[waiting[0]].pc as usize];
            let count = match ins.args.get(1) {
                Some(o @ (Opd::Int(_) | Opd::Reg(_))) => Some(self.read(&threads[waiting[0]], o, Ty::U32, None)? as u32),
                _ => None,
            };
            let live = threads.iter().filter(|t| t.st != St::Exited).count() as u32;
            let have = waiting.len() as u32 + arrived[id as usize];
            let need = count.unwrap_or(live);
            if have < need {
                continue;
            }
            // bar.red: the reduction over the waiters' predicates.
            let red = if ins.op.mode == mode::RED {
                let pi = ins.args.len() - 1;
                let mut c = 0u64;
                let mut all = true;
                let mut anyp = false;
                for i in &waiting {
                    let p = self.read(&threads[*i], &self.f.instrs[threads[*i].pc as usize].args[pi], Ty::Pred, None)? & 1;
                    c += p;
                    all &= p == 1;
                    anyp |= p == 1;
                }
                Some(match ins.op.bop {
                    mode::POPC => c,
                    mode::AND => all as u64,
                    _ => anyp as u64,
                })
            } else {
                None
            };
            for i in waiting {
                let t = &mut threads[i];
                if let Some(v) = red {
                    let ins = &self.f.instrs[t.pc as usize];
                    if let Some(Opd::Reg(d)) = ins.args.first() {
                        t.regs[*d as usize] = v;
                    }
                }
                t.st = St::Run;
                t.pc += 1;
            }
            arrived[id as usize] = 0;
            any = true;
        }
        Ok(any)
    }

    /// Run every `wgmma.mma_async` whose warpgroup (128 threads) has all arrived at it, in the
    /// block of cluster rank `rank` (its `threads`).
    fn release_warpgroups(&mut self, threads: &mut [Thread], mem: &mut Mem, rank: usize) -> R<bool> {
        let mut any = false;
        let nt = threads.len();
        for lo in (0..nt).step_by(128) {
            let wg = &mut threads[lo..(lo + 128).min(nt)];
            let Some(first) = wg.iter().position(|t| t.st == St::Wg) else {
                continue;
            };
            let pc = wg[first].pc;
            if wg.iter().any(|t| t.st == St::Exited) || wg.len() < 128 {
                let line = self.f.instrs[pc as usize].line;
                return Err(format!(
                    "line {line}: `wgmma.mma_async` in a warpgroup whose threads are not all live (threads {}..{})",
                    lo,
                    lo + wg.len()
                ));
            }
            if !wg.iter().all(|t| t.st == St::Wg) {
                continue;
            }
            let ins = &self.f.instrs[pc as usize];
            if wg.iter().any(|t| t.pc != pc) {
                return Err(format!(
                    "line {}: `{}` reached by a warpgroup's threads at different instructions",
                    ins.line, ins.op.name
                ));
            }
            let at = |e: String| format!("line {} `{}`: {e}", ins.line, ins.op.name);
            let (desc_a, desc_b, keep) = self.wgmma_issue(wg, ins).map_err(at)?;
            Self::check_fenced(wg, ins, &keep).map_err(at)?;
            if self.lim.late_copies {
                mem.wgq.push(PendWg {
                    rank,
                    lo,
                    pc,
                    group: wg[0].wg_committed,
                    desc_a,
                    desc_b,
                    keep,
                    result: None,
                    landed: 0,
                });
            } else {
                let r = self
                    .wgmma(wg, ins, mem, desc_a, desc_b, &keep, &|ti, reg| Ok(wg[ti].regs[reg]))
                    .map_err(at)?;
                Self::wgmma_write(wg, ins, &r).map_err(at)?;
            }
            for t in wg.iter_mut() {
                t.st = St::Run;
                t.pc += 1;
            }
            any = true;
        }
        Ok(any)
    }

    /// What a `wgmma.mma_async` reads at issue: its descriptors (A's where A is in shared
    /// memory, B's) from the first thread, and each thread's scale-d predicate.
    fn wgmma_issue(&self, wg: &[Thread], ins: &Instr) -> R<(Option<u64>, u64, Vec<bool>)> {
        let a = &ins.args;
        if a.len() < 6 {
            return Err(format!("{} operands", a.len()));
        }
        let desc_a = if matches!(a[1], Opd::Vec(_)) {
            None
        } else {
            Some(self.read(&wg[0], &a[1], Ty::B64, None)?)
        };
        let desc_b = self.read(&wg[0], &a[2], Ty::B64, None)?;
        let keep = wg
            .iter()
            .map(|t| Ok(self.read(t, &a[3], Ty::Pred, None)? & 1 == 1))
            .collect::<R<Vec<bool>>>()?;
        Ok((desc_a, desc_b, keep))
    }

    /// `wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}`: D (64 x N, f32, in the 128 threads'
    /// registers as `mma.sync` lays out 16 rows per warp) = scale-d * D + A (64 x 16) B (16 x N).
    /// A from a shared-memory descriptor or from the threads' registers, B from a descriptor;
    /// descriptors with the 128-byte swizzle, K-major or (imm-trans) MN-major. Reads A's
    /// registers and the shared memory now, and D's running value through `c_of(thread,
    /// register)`; returns each thread's accumulators (bits).
    #[allow(clippy::too_many_arguments)]
    fn wgmma(
        &self,
        wg: &[Thread],
        ins: &Instr,
        mem: &Mem,
        desc_a: Option<u64>,
        desc_b: u64,
        keep: &[bool],
        c_of: &dyn Fn(usize, usize) -> R<u64>,
    ) -> R<Vec<Vec<u32>>> {
        let n = ins.op.shape[1] as usize;
        let ity = ins.op.tys[1];
        let a = &ins.args;
        let Opd::Vec(dregs) = &a[0] else {
            return Err("the accumulators are not a register list".into());
        };
        if dregs.len() != n / 2 {
            return Err(format!("{} accumulator registers, m64n{n} takes {}", dregs.len(), n / 2));
        }
        let imm = |i: usize| -> R<i64> {
            match a.get(i) {
                Some(Opd::Int(v)) => Ok(*v),
                _ => Err(format!("operand {} is not an immediate", i + 1)),
            }
        };
        let a_regs = desc_a.is_none();
        let (scale_a, scale_b) = (imm(4)?, imm(5)?);
        let (trans_a, trans_b) = if a_regs {
            if a.len() != 7 {
                return Err(format!("{} operands (7 with A in registers)", a.len()));
            }
            (0, imm(6)?)
        } else {
            if a.len() != 8 {
                return Err(format!("{} operands (8 with A in shared memory)", a.len()));
            }
            (imm(6)?, imm(7)?)
        };
        // The element (mn, k) of an operand in shared memory: `mn` indexes M (A) or N (B), `k` the
        // reduction. 128-byte swizzle: K-major rows of 128 bytes in 8-row atoms (SBO apart), or
        // MN-major (trans) 128-byte rows along MN per k, 64-element column blocks LBO apart, 8-k
        // atoms SBO apart; 16-byte chunks XOR-ed with the address's row in its 1024-byte atom. No
        // swizzle: 8 x 8 core matrices of 128 contiguous bytes (rows of 16 bytes along K, or along
        // MN where trans), LBO apart along K and SBO apart along MN.
        let elem = |desc: u64, mn: usize, k: usize, trans: i64| -> R<f64> {
            let start = (desc & 0x3FFF) << 4;
            let lbo = ((desc >> 16) & 0x3FFF) << 4;
            let sbo = ((desc >> 32) & 0x3FFF) << 4;
            let (mn, k) = (mn as u64, k as u64);
            let phys = match (desc >> 62, trans) {
                (1, t) => {
                    let logical = if t == 0 {
                        start + (mn / 8) * sbo + (mn % 8) * 128 + k * 2
                    } else {
                        start + (mn / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (mn % 64) * 2
                    };
                    logical ^ (((logical >> 7) & 7) << 4)
                }
                (0, 0) => start + (mn / 8) * sbo + (k / 8) * lbo + (mn % 8) * 16 + (k % 8) * 2,
                (0, _) => start + (k / 8) * lbo + (mn / 8) * sbo + (k % 8) * 16 + (mn % 8) * 2,
                (z, _) => {
                    return Err(format!(
                        "unsupported instruction `{}` (a descriptor with swizzle mode {z}: the 128-byte swizzle and none are modelled)",
                        ins.op.name
                    ));
                }
            };
            let (_, off) = self.locate(mem, Space::Shared, phys, 2)?;
            Ok(h2f(u16::from_le_bytes([mem.shared[off], mem.shared[off + 1]]) as u64, ity) as f64)
        };
        // A: 64 x 16.
        let mut am = vec![0f64; 64 * 16];
        if let Some(d) = desc_a {
            for row in 0..64 {
                for k in 0..16 {
                    am[row * 16 + k] = elem(d, row, k, trans_a)?;
                }
            }
        } else {
            for (ti, t) in wg.iter().enumerate() {
                let Opd::Vec(ar) = &a[1] else { unreachable!() };
                if ar.len() != 4 {
                    return Err(format!("{} A registers (4)", ar.len()));
                }
                let (w, g, q) = (ti / 32, (ti % 32) / 4, ti % 4);
                for (j, r) in ar.iter().enumerate() {
                    let v = self.read(t, r, Ty::B32, None)?;
                    let row = 16 * w + g + 8 * (j % 2);
                    let col = 2 * q + 8 * (j / 2);
                    am[row * 16 + col] = h2f(v & 0xFFFF, ity) as f64;
                    am[row * 16 + col + 1] = h2f(v >> 16 & 0xFFFF, ity) as f64;
                }
            }
        }
        // B: 16 x N.
        let mut bm = vec![0f64; 16 * n];
        for k in 0..16 {
            for col in 0..n {
                bm[k * n + col] = elem(desc_b, col, k, trans_b)?;
            }
        }
        let (sa, sb) = (if scale_a < 0 { -1.0 } else { 1.0 }, if scale_b < 0 { -1.0 } else { 1.0 });
        let mut out = Vec::with_capacity(wg.len());
        for (ti, &kept) in keep.iter().enumerate().take(wg.len()) {
            let (w, g, q) = (ti / 32, (ti % 32) / 4, ti % 4);
            let mut d = Vec::with_capacity(dregs.len());
            for (i, r) in dregs.iter().enumerate() {
                let Opd::Reg(reg) = r else {
                    return Err("an accumulator that is not a register".into());
                };
                let (j, e) = (i / 4, i % 4);
                let row = 16 * w + g + 8 * (e / 2);
                let col = 8 * j + 2 * q + e % 2;
                let mut acc = if kept {
                    f32::from_bits(c_of(ti, *reg as usize)? as u32) as f64
                } else {
                    0.0
                };
                for k in 0..16 {
                    acc += sa * am[row * 16 + k] * sb * bm[k * n + col];
                }
                d.push((acc as f32).to_bits());
            }
            out.push(d);
        }
        Ok(out)
    }

    /// The accumulators of a `wgmma.mma_async` (as `wgmma` returns them, one list per thread)
    /// into the registers of the threads given.
    fn wgmma_write(wg: &mut [Thread], ins: &Instr, r: &[Vec<u32>]) -> R<()> {
        let Opd::Vec(dregs) = &ins.args[0] else {
            return Err("the accumulators are not a register list".into());
        };
        for (t, d) in wg.iter_mut().zip(r) {
            for (o, v) in dregs.iter().zip(d) {
                Self::write(t, o, *v as u64)?;
                if let (Opd::Reg(reg), false) = (o, t.wr.is_empty()) {
                    t.wr[*reg as usize] = 0;
                }
            }
        }
        Ok(())
    }

    /// PTX requires a `wgmma.fence` between a thread's write of a register and a
    /// `wgmma.mma_async` that reads it (its accumulators where scale-d keeps them, its A
    /// fragments), bar the accumulators a chain of `wgmma`s passes along: without one the
    /// product may read the register's older value.
    fn check_fenced(wg: &[Thread], ins: &Instr, keep: &[bool]) -> R<()> {
        for (ti, t) in wg.iter().enumerate() {
            if t.wr.is_empty() {
                continue;
            }
            let mut read: Vec<(&Opd, &str)> = Vec::new();
            if let (Some(Opd::Vec(d)), true) = (ins.args.first(), keep.get(ti).copied().unwrap_or(false)) {
                read.extend(d.iter().map(|o| (o, "accumulator")));
            }
            if let Some(Opd::Vec(a)) = ins.args.get(1) {
                read.extend(a.iter().map(|o| (o, "A-fragment")));
            }
            for (o, what) in read {
                let Opd::Reg(r) = o else { continue };
                let w = t.wr[*r as usize];
                if w >> 32 == t.fences as u64 + 1 {
                    return Err(format!(
                        "thread {ti} of the warpgroup reads an {what} register written at line {} with no `wgmma.fence` since (PTX requires one between a register's write and a wgmma that reads it)",
                        w & 0xFFFF_FFFF
                    ));
                }
            }
        }
        Ok(())
    }

    /// Late results: each thread at `wgmma.wait_group N` gets the accumulators of every product
    /// of its warpgroup in a group older than its N most recent; a product is computed at the
    /// first such wait (its A registers and shared memory read then), D's running value taken
    /// from the products before it that have not reached that thread's registers yet.
    /// `threads`: the block of cluster rank `rank`.
    fn land_wgmma(&mut self, threads: &mut [Thread], mem: &mut Mem, rank: usize) -> R<bool> {
        let mut any = false;
        for i in 0..threads.len() {
            if threads[i].st != St::WgWait {
                continue;
            }
            let pc = threads[i].pc;
            let ins = &self.f.instrs[pc as usize];
            let at = |e: String| format!("line {} `{}`: {e}", ins.line, ins.op.name);
            let keep_recent = match ins.args.first() {
                Some(Opd::Int(v)) if *v >= 0 => *v as u64,
                _ => return Err(at("the group count is not an immediate".into())),
            };
            let lo = i / 128 * 128;
            let hi = (lo + 128).min(threads.len());
            let limit = threads[i].wg_committed.saturating_sub(keep_recent);
            let bit = 1u128 << (i - lo);
            for qi in 0..mem.wgq.len() {
                let p = &mem.wgq[qi];
                if p.rank != rank || p.lo != lo || p.group >= limit || p.landed & bit != 0 {
                    continue;
                }
                if p.result.is_none() {
                    let wins = &self.f.instrs[p.pc as usize];
                    let earlier = &mem.wgq[..qi];
                    // D's running value for a thread: the latest earlier product of this
                    // warpgroup computed but not yet in that thread's registers, else the register.
                    let c_of = |ti: usize, reg: usize| -> R<u64> {
                        for e in earlier.iter().rev() {
                            if e.rank != rank || e.lo != lo || e.landed & (1u128 << ti) != 0 {
                                continue;
                            }
                            let Some(res) = &e.result else { continue };
                            let Opd::Vec(ed) = &self.f.instrs[e.pc as usize].args[0] else {
                                continue;
                            };
                            if let Some(k) = ed.iter().position(|o| matches!(o, Opd::Reg(r) if *r as usize == reg)) {
                                return Ok(res[ti][k] as u64);
                            }
                        }
                        Ok(threads[lo + ti].regs[reg])
                    };
                    let r = self
                        .wgmma(&threads[lo..hi], wins, mem, p.desc_a, p.desc_b, &p.keep, &c_of)
                        .map_err(|e| format!("line {} `{}`: {e}", wins.line, wins.op.name))?;
                    mem.wgq[qi].result = Some(r);
                }
                let p = &mut mem.wgq[qi];
                let wins = &self.f.instrs[p.pc as usize];
                let res = p.result.as_ref().expect("computed above");
                Self::wgmma_write(&mut threads[i..i + 1], wins, &res[i - lo..i - lo + 1]).map_err(at)?;
                p.landed |= bit;
            }
            let full = |p: &PendWg| p.landed.count_ones() as usize == p.keep.len();
            mem.wgq.retain(|p| !full(p));
            threads[i].st = St::Run;
            threads[i].pc += 1;
            any = true;
        }
        Ok(any)
    }

    /// The offset in `Mem::shared` of an mbarrier (8 bytes of shared memory) at `addr` of
    /// `space` (`.shared::cta` or `.shared::cluster`).
    fn mbar_off(&self, mem: &Mem, space: Space, addr: u64) -> R<u64> {
        Ok(self.locate(mem, space, addr, 8)?.1 as u64)
    }

    /// The mbarrier at `addr` of `space`.
    fn mbar<'m>(&self, mem: &'m mut Mem, space: Space, addr: u64) -> R<&'m mut Mbar> {
        let off = self.mbar_off(mem, space, addr)?;
        let at = mem.shared_at(off);
        mem.mbars
            .get_mut(&off)
            .ok_or_else(|| format!("no mbarrier initialised at {at}"))
    }

    /// One arrival (and `tx` more transaction bytes) on the mbarrier at `addr` of `space`; its
    /// phase completes when every arrival and every byte is in.
    fn mbar_arrive(&self, mem: &mut Mem, space: Space, addr: u64, count: u32, tx: i64) -> R<()> {
        if mem.nranks > 1 {
            mem.check_live(self.mbar_off(mem, space, addr)? as usize)?;
        }
        let m = self.mbar(mem, space, addr)?;
        m.tx += tx;
        if count > m.pending {
            return Err(format!(
                "{count} arrival(s) on an mbarrier whose phase awaits {} (of {})",
                m.pending, m.count
            ));
        }
        m.pending -= count;
        let off = self.mbar_off(mem, space, addr)?;
        Self::mbar_settle(mem, off);
        Ok(())
    }

    /// Complete the phase of the mbarrier at shared offset `off` if nothing is awaited.
    fn mbar_settle(mem: &mut Mem, off: u64) {
        if let Some(m) = mem.mbars.get_mut(&off)
            && m.pending == 0
            && m.tx == 0
        {
            m.phase += 1;
            m.pending = m.count;
            mem.epoch += 1;
        }
    }

    /// `cp.async.bulk.tensor`: the box at the coordinates from global memory into shared memory
    /// (elements outside the tensor as zeros, rows of 128 bytes swizzled), then the bytes
    /// completed on the mbarrier.
    fn tma_issue(&self, t: &Thread, ins: &Instr, mem: &mut Mem) -> R<()> {
        let a = &ins.args;
        let dims = ins.op.shape[0] as usize;
        let dst = self.address(t, &a[0])?;
        let Opd::Vec(mc) = &a[1] else {
            return Err("expected [map, {coordinates}]".into());
        };
        let (Some(mo), Some(Opd::Vec(cs))) = (mc.first(), mc.get(1)) else {
            return Err("expected [map, {coordinates}]".into());
        };
        let map_at = self.address(t, mo)?;
        let bar = self.address(t, &a[2])?;
        let tm = mem
            .gtmaps
            .get(&map_at)
            .cloned()
            .ok_or_else(|| format!("no tensor map at {map_at:#x} (tensormap.cp_fenceproxy puts one there)"))?;
        if cs.len() != dims || tm.rank as usize + 1 != dims {
            return Err(format!(
                "{} coordinates for a {dims}-d copy of a map of rank {}",
                cs.len(),
                tm.rank + 1
            ));
        }
        let esize: u64 = match tm.elemtype {
            0 => 1,
            1 | 6 | 10 => 2,
            2 | 3 | 7 | 8 | 9 => 4,
            4 | 5 => 8,
            e => {
                return Err(format!(
                    "unsupported instruction `{}` (tensor map element type {e})",
                    ins.op.name
                ));
            }
        };
        if tm.interleave != 0 || tm.fill != 0 || (0..dims).any(|d| tm.element_stride[d] != 1) {
            return Err(format!(
                "unsupported instruction `{}` (tensor maps without interleave, with zero fill and element strides of 1 are modelled)",
                ins.op.name
            ));
        }
        if let Some(d) = (0..dims).find(|d| !(1..=256).contains(&tm.box_dim[*d])) {
            // The GPU refuses such a map (boxDim is 1 to 256 in every dimension).
            return Err(format!(
                "a tensor map whose box is {} elements in dimension {d} (1 to 256)",
                tm.box_dim[d]
            ));
        }
        let row_bytes = tm.box_dim[0] as u64 * esize;
        match tm.swizzle {
            0 => {}
            3 if row_bytes == 128 => {}
            z => {
                return Err(format!(
                    "unsupported instruction `{}` (tensor map swizzle mode {z} with rows of {row_bytes} bytes: none, or 128 bytes with 128-byte rows, are modelled)",
                    ins.op.name
                ));
            }
        }
        let mut c = [0i64; 5];
        for (d, o) in cs.iter().enumerate() {
            c[d] = self.read(t, o, Ty::S32, None)? as u32 as i32 as i64;
        }
        // Faults at issue, as on the GPU: the barrier, and the box's extent in shared memory
        // (both `.shared::cluster` addresses: the block's own, or in a kernel with cluster
        // addresses another's of the cluster).
        let sp = Self::tma_space(mem);
        let bar = self.mbar_off(mem, sp, bar)?;
        if !mem.mbars.contains_key(&bar) {
            return Err(format!("no mbarrier initialised at {}", mem.shared_at(bar)));
        }
        let nbox: u64 = (0..dims).map(|d| tm.box_dim[d] as u64).product();
        self.locate(mem, sp, dst, 16)?;
        self.locate(mem, sp, (dst + nbox * esize).saturating_sub(16).max(dst), 16)?;
        // The destination with its block's rank, for it lands while any block's threads run.
        let dst = if sp == Space::SharedCluster && dst >> RANK_SHIFT == 0 {
            dst | (mem.rank as u64 + 1) << RANK_SHIFT
        } else {
            dst
        };
        // `.multicast::cluster`: the same box at the same offset of every block of the mask, each
        // completing the mbarrier at the same offset of its own shared memory.
        let mut lands = vec![(bar, dst)];
        if ins.op.flags & hop::MULTICAST != 0 {
            if !mem.clustered {
                return Err("a multicast tensor copy in a kernel without a cluster".into());
            }
            let o = a.get(3).ok_or("a multicast tensor copy without its block mask")?;
            let mask = self.read(t, o, Ty::U16, None)? & 0xffff;
            if mask == 0 || mask >> mem.nranks != 0 {
                return Err(format!(
                    "a multicast tensor copy to blocks {mask:#06x} of a cluster of {} block(s)",
                    mem.nranks
                ));
            }
            let (db, bb) = (dst & RANK_MASK, bar as usize % mem.stride.max(1));
            lands.clear();
            for r in (0..mem.nranks).filter(|r| mask >> r & 1 != 0) {
                let b = (r * mem.stride + bb) as u64;
                if !mem.mbars.contains_key(&b) {
                    return Err(format!("no mbarrier initialised at {}", mem.shared_at(b)));
                }
                if mem.live[r] == 0 {
                    return Err(format!(
                        "a multicast tensor copy into cluster rank {r}, whose threads have all exited"
                    ));
                }
                lands.push((b, db | (r as u64 + 1) << RANK_SHIFT));
            }
        }
        for (bar, dst) in lands {
            if self.lim.late_copies {
                mem.pending.push(Pending::Tma {
                    bar,
                    dst,
                    tm: tm.clone(),
                    c,
                    dims,
                });
            } else {
                self.tma_land(t, mem, bar, dst, &tm, &c, dims)?;
            }
        }
        Ok(())
    }

    /// The space of a tensor copy's destination and mbarrier addresses.
    fn tma_space(mem: &Mem) -> Space {
        if mem.clustered { Space::SharedCluster } else { Space::Shared }
    }

    /// Land the copies in flight: those completing on the mbarrier at offset `bar`, or all.
    fn land_pending(&self, t: &Thread, mem: &mut Mem, bar: Option<u64>) -> R<()> {
        let all = std::mem::take(&mut mem.pending);
        let (now, keep): (Vec<Pending>, Vec<Pending>) = all.into_iter().partition(|p| {
            let b = match p {
                Pending::Tma { bar, .. } | Pending::Copies { bar, .. } => *bar,
            };
            bar.is_none_or(|x| x == b)
        });
        mem.pending = keep;
        for p in now {
            match p {
                Pending::Tma { bar, dst, tm, c, dims } => self.tma_land(t, mem, bar, dst, &tm, &c, dims)?,
                Pending::Copies { copies, .. } => {
                    let mut scratch = Thread {
                        pc: 0,
                        st: St::Run,
                        regs: Vec::new(),
                        local: Vec::new(),
                        tid: [0; 3],
                        linear: 0,
                        rank: 0,
                        ctaid: [0; 3],
                        cl_arrived: None,
                        open: Vec::new(),
                        groups: VecDeque::new(),
                        wg_committed: 0,
                        fences: 0,
                        wr: Vec::new(),
                        told_open: None,
                    };
                    land(copies, &mut scratch, mem)?;
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn tma_land(&self, t: &Thread, mem: &mut Mem, bar: u64, dst: u64, tm: &Tmap, c: &[i64; 5], dims: usize) -> R<()> {
        let esize: u64 = match tm.elemtype {
            0 => 1,
            1 | 6 | 10 => 2,
            2 | 3 | 7 | 8 | 9 => 4,
            _ => 8,
        };
        let row_bytes = tm.box_dim[0] as u64 * esize;
        let nbox: u64 = (0..dims).map(|d| tm.box_dim[d] as u64).product();
        let rows = nbox / tm.box_dim[0].max(1) as u64;
        for r in 0..rows {
            // The row's coordinates in dimensions 1.. (dimension 1 fastest).
            let mut idx = [0i64; 5];
            let mut rest = r;
            for d in 1..dims {
                idx[d] = c[d] + (rest % tm.box_dim[d] as u64) as i64;
                rest /= tm.box_dim[d] as u64;
            }
            let inside_row = (1..dims).all(|d| idx[d] >= 0 && idx[d] < tm.global_dim[d] as i64);
            for e in 0..tm.box_dim[0] as u64 {
                let x = c[0] + e as i64;
                let logical = dst + r * row_bytes + e * esize;
                let phys = if tm.swizzle == 3 {
                    logical ^ (((logical >> 7) & 7) << 4)
                } else {
                    logical
                };
                let v = if inside_row && x >= 0 && x < tm.global_dim[0] as i64 {
                    let mut g = tm.address.wrapping_add(x as u64 * esize);
                    for (i, stride) in idx[1..dims].iter().zip(&tm.global_stride) {
                        g = g.wrapping_add(*i as u64 * stride);
                    }
                    self.load(t, mem, Space::Global, g, esize as usize)?
                } else {
                    0
                };
                let (_, off) = self.locate(mem, Self::tma_space(mem), phys, esize as usize)?;
                mem.shared[off..off + esize as usize].copy_from_slice(&v.to_le_bytes()[..esize as usize]);
            }
        }
        let at = mem.shared_at(bar);
        let m = mem
            .mbars
            .get_mut(&bar)
            .ok_or_else(|| format!("no mbarrier initialised at {at}"))?;
        m.tx -= (nbox * esize) as i64;
        Self::mbar_settle(mem, bar);
        Ok(())
    }

    /// Run one warp for up to a slice of instructions. Returns whether anything ran.
    fn warp(&mut self, lanes: &mut [Thread], mem: &mut Mem, arrived: &mut [u32; 16]) -> R<bool> {
        let mut progress = false;
        let mut group: Vec<usize> = Vec::with_capacity(32);
        for _ in 0..self.lim.slice {
            let Some(pc) = lanes.iter().filter(|t| t.st == St::Run).map(|t| t.pc).min() else {
                break;
            };
            group.clear();
            group.extend((0..lanes.len()).filter(|i| lanes[*i].st == St::Run && lanes[*i].pc == pc));
            let Some(ins) = self.f.instrs.get(pc as usize) else {
                // Falling off the end: the thread exits.
                for i in &group {
                    self.exit(&mut lanes[*i], mem)?;
                }
                progress = true;
                continue;
            };
            self.steps += group.len() as u64;
            if matches!(
                ins.op.base,
                Base::Mbar | Base::Tma | Base::CpAsyncMbar | Base::Wgmma | Base::WgCommit | Base::WgWait
            ) {
                self.asynchronous += group.len() as u64;
            }
            if self.steps > self.lim.max_steps {
                return Err(format!(
                    "stopped after {} thread-instructions (the step limit)",
                    self.lim.max_steps
                ));
            }
            if self.steps & 0xF_FFFF < group.len() as u64
                && let Some(d) = self.lim.deadline
                && Instant::now() > d
            {
                return Err(format!("stopped at the time limit after {} thread-instructions", self.steps));
            }
            progress = true;
            if ins.op.base == Base::Wgmma {
                // A warpgroup collective: its lanes wait for the other warps of their warpgroup.
                for i in &group {
                    if self.guard(&lanes[*i], ins)? {
                        lanes[*i].st = St::Wg;
                    } else {
                        lanes[*i].pc += 1;
                    }
                }
                continue;
            }
            if is_collective(&ins.op) {
                // Lanes whose guard is false skip it.
                let mut arriving = Vec::new();
                for i in &group {
                    if self.guard(&lanes[*i], ins)? {
                        arriving.push(*i);
                    } else {
                        lanes[*i].pc += 1;
                    }
                }
                for i in &arriving {
                    lanes[*i].st = St::Warp;
                    stamp_writes(&mut lanes[*i], ins);
                }
                self.try_collective(lanes, mem)?;
                continue;
            }
            for i in group.iter().copied() {
                let t = &mut lanes[i];
                if !self.guard(t, ins)? {
                    t.pc += 1;
                    continue;
                }
                self.exec(t, ins, mem, arrived)
                    .map_err(|e| format!("line {} `{}`: {e}", ins.line, ins.op.name))?;
                stamp_writes(t, ins);
            }
        }
        Ok(progress)
    }

    fn guard(&self, t: &Thread, ins: &Instr) -> R<bool> {
        Ok(match ins.guard {
            None => true,
            Some((r, neg)) => (t.regs[r as usize] & 1 == 1) != neg,
        })
    }

    fn exit(&self, t: &mut Thread, mem: &mut Mem) -> R<()> {
        // Copies never waited for still land (the GPU completes them); a read before the wait
        // has already seen the old bytes.
        while let Some(g) = t.groups.pop_front() {
            land(g, t, mem)?;
        }
        let open = std::mem::take(&mut t.open);
        land(open, t, mem)?;
        t.st = St::Exited;
        mem.live[t.rank] -= 1;
        Ok(())
    }

    /// Execute the collective the waiting lanes are at, once every live lane of its mask waits.
    fn try_collective(&mut self, lanes: &mut [Thread], mem: &mut Mem) -> R<()> {
        let waiting: Vec<usize> = (0..lanes.len()).filter(|i| lanes[*i].st == St::Warp).collect();
        let Some(&first) = waiting.first() else {
            return Ok(());
        };
        let ins = &self.f.instrs[lanes[first].pc as usize];
        let full: u32 = if lanes.len() == 32 {
            u32::MAX
        } else {
            (1u32 << lanes.len()) - 1
        };
        let mask = match ins.op.base {
            Base::Ldmatrix | Base::Mma => full,
            _ => match ins.args.last() {
                Some(o @ (Opd::Int(_) | Opd::Reg(_))) => self.read(&lanes[first], o, Ty::B32, None)? as u32 & full,
                _ => full,
            },
        };
        let live = (0..lanes.len()).filter(|i| mask >> i & 1 == 1 && lanes[*i].st != St::Exited);
        let ready = live.clone().all(|i| lanes[i].st == St::Warp);
        if !ready {
            return Ok(());
        }
        let members: Vec<usize> = live.collect();
        let pc = lanes[first].pc;
        if members.iter().any(|i| lanes[*i].pc != pc) && matches!(ins.op.base, Base::Ldmatrix | Base::Mma) {
            return Err(format!(
                "line {}: `{}` reached by lanes at different instructions",
                ins.line, ins.op.name
            ));
        }
        let r = self.collective(lanes, &members, mask, mem);
        r.map_err(|e| format!("line {} `{}`: {e}", ins.line, ins.op.name))?;
        for i in members {
            lanes[i].st = St::Run;
            lanes[i].pc += 1;
        }
        // Lanes waiting outside this mask wait on.
        Ok(())
    }

    fn collective(&mut self, lanes: &mut [Thread], members: &[usize], mask: u32, mem: &mut Mem) -> R<()> {
        let ins0 = &self.f.instrs[lanes[members[0]].pc as usize];
        match ins0.op.base {
            Base::BarWarp => Ok(()),
            Base::Shfl => {
                // Every lane's source value first, then the results.
                let mut vals = [0xFFFF_FFFFu64; 32];
                for i in members {
                    let ins = &self.f.instrs[lanes[*i].pc as usize];
                    vals[*i] = self.read(&lanes[*i], &ins.args[1], Ty::B32, None)?;
                }
                for i in members {
                    let ins = &self.f.instrs[lanes[*i].pc as usize];
                    let t = &lanes[*i];
                    let b = self.read(t, &ins.args[2], Ty::U32, None)? as u32;
                    let c = self.read(t, &ins.args[3], Ty::U32, None)? as u32;
                    let lane = *i as u32;
                    let seg = (c >> 8) & 0x1f;
                    let clamp = c & 0x1f;
                    let max_lane = (lane & seg) | (clamp & !seg);
                    let min_lane = lane & seg;
                    let (j, ok) = match ins.op.mode {
                        mode::UP => {
                            let j = lane as i64 - b as i64;
                            (j, j >= max_lane as i64)
                        }
                        mode::DOWN => {
                            let j = lane as i64 + b as i64;
                            (j, j <= max_lane as i64)
                        }
                        mode::BFLY => {
                            let j = (lane ^ b) as i64;
                            (j, j <= max_lane as i64)
                        }
                        _ => {
                            let j = (min_lane | (b & 0x1f & !seg)) as i64;
                            (j, j <= max_lane as i64)
                        }
                    };
                    let src = if ok { j as usize } else { *i };
                    let v = if src < lanes.len() && mask >> src & 1 == 1 {
                        vals[src]
                    } else {
                        0xFFFF_FFFF
                    };
                    let (d, p) = match &ins.args[0] {
                        Opd::Pair(d, p) => (Some(*d), Some(*p)),
                        Opd::Reg(d) => (Some(*d), None),
                        _ => (None, None),
                    };
                    let t = &mut lanes[*i];
                    if let Some(d) = d {
                        t.regs[d as usize] = v;
                    }
                    if let Some(p) = p {
                        t.regs[p as usize] = ok as u64;
                    }
                }
                Ok(())
            }
            Base::Vote | Base::Redux => {
                let mut preds = 0u32;
                let mut vals = Vec::new();
                for i in members {
                    let ins = &self.f.instrs[lanes[*i].pc as usize];
                    let ty = if ins.op.base == Base::Vote { Ty::Pred } else { ins.op.ty };
                    let v = self.read(&lanes[*i], &ins.args[1], ty, None)?;
                    if v & 1 == 1 {
                        preds |= 1 << i;
                    }
                    vals.push(v);
                }
                let op = &ins0.op;
                let result: u64 = if op.base == Base::Vote {
                    match op.mode {
                        mode::ALL => (preds == mask_of(members)) as u64,
                        mode::ANY => (preds != 0) as u64,
                        mode::UNI => (preds == 0 || preds == mask_of(members)) as u64,
                        _ => preds as u64,
                    }
                } else {
                    let signed = op.ty.signed();
                    let it = vals.iter().map(|v| *v as u32);
                    match op.mode {
                        mode::ADD => it.fold(0u32, |a, b| a.wrapping_add(b)) as u64,
                        mode::MIN if signed => it.map(|v| v as i32).min().unwrap_or(0) as u32 as u64,
                        mode::MAX if signed => it.map(|v| v as i32).max().unwrap_or(0) as u32 as u64,
                        mode::MIN => it.min().unwrap_or(0) as u64,
                        mode::MAX => it.max().unwrap_or(0) as u64,
                        mode::AND => it.fold(u32::MAX, |a, b| a & b) as u64,
                        mode::OR => it.fold(0, |a, b| a | b) as u64,
                        mode::XOR => it.fold(0, |a, b| a ^ b) as u64,
                        _ => return Err("unsupported redux operation".into()),
                    }
                };
                for i in members {
                    let ins = &self.f.instrs[lanes[*i].pc as usize];
                    if let Opd::Reg(d) = ins.args[0] {
                        lanes[*i].regs[d as usize] = result;
                    }
                }
                Ok(())
            }
            Base::Ldmatrix => self.ldmatrix(lanes, members, mem),
            Base::Mma => self.mma(lanes, members),
            _ => Err("not a collective".into()),
        }
    }

    fn ldmatrix(&mut self, lanes: &mut [Thread], members: &[usize], mem: &mut Mem) -> R<()> {
        let ins = &self.f.instrs[lanes[members[0]].pc as usize];
        let n = ins.op.shape[0].max(1) as usize;
        let trans = ins.op.flags & flag::TRANS != 0;
        let space = if ins.op.space == Space::Generic {
            Space::Generic
        } else {
            Space::Shared
        };
        let mut rows = [0u64; 32];
        for i in members {
            rows[*i] = self.address(&lanes[*i], &ins.args[1])?;
        }
        if members.len() < 32 {
            return Err("ldmatrix needs all 32 lanes".into());
        }
        let mut out = [[0u64; 4]; 32];
        for m in 0..n {
            for (t, o) in out.iter_mut().enumerate() {
                let (a0, a1) = if trans {
                    let r0 = rows[8 * m + 2 * (t % 4)];
                    let r1 = rows[8 * m + 2 * (t % 4) + 1];
                    (r0 + 2 * (t / 4) as u64, r1 + 2 * (t / 4) as u64)
                } else {
                    let r = rows[8 * m + t / 4];
                    (r + 4 * (t % 4) as u64, r + 4 * (t % 4) as u64 + 2)
                };
                let lo = self.load(&lanes[t], mem, space, a0, 2)?;
                let hi = self.load(&lanes[t], mem, space, a1, 2)?;
                o[m] = lo | hi << 16;
            }
        }
        for i in members {
            let Opd::Vec(d) = &ins.args[0] else {
                return Err("ldmatrix needs a vector destination".into());
            };
            for (m, r) in d.iter().enumerate().take(n) {
                if let Opd::Reg(r) = r {
                    lanes[*i].regs[*r as usize] = out[*i][m];
                }
            }
        }
        Ok(())
    }

    fn mma(&mut self, lanes: &mut [Thread], members: &[usize]) -> R<()> {
        let ins = &self.f.instrs[lanes[members[0]].pc as usize];
        if members.len() < 32 {
            return Err("mma.sync needs all 32 lanes".into());
        }
        let [m, n, k] = ins.op.shape;
        let tys = &ins.op.tys;
        if tys.len() != 4 || !(is16(tys[1]) || tys[1] == Ty::TF32) || tys[1] != tys[2] {
            return Err("unsupported mma types (f16, bf16 or tf32 inputs)".into());
        }
        let tf32 = tys[1] == Ty::TF32;
        let shape_ok = m == 16 && n == 8 && if tf32 { k == 4 || k == 8 } else { k == 8 || k == 16 };
        if !shape_ok {
            return Err(format!("unsupported mma shape m{m}n{n}k{k} for {:?}", tys[1]));
        }
        let (dty, aty, cty) = (tys[0], tys[1], tys[3]);
        let k = k as usize;
        let mut a = vec![[0f32; 16]; 16];
        let mut b = vec![[0f32; 8]; 16];
        let mut c = [[0f32; 8]; 16];
        let vecs = |o: &Opd| -> R<Vec<u32>> {
            match o {
                Opd::Vec(v) => v
                    .iter()
                    .map(|x| match x {
                        Opd::Reg(r) => Ok(*r),
                        _ => Err("mma operands must be registers".to_string()),
                    })
                    .collect(),
                _ => Err("mma operands must be vectors".into()),
            }
        };
        let (dv, av, bv, cv) = (
            vecs(&ins.args[0])?,
            vecs(&ins.args[1])?,
            vecs(&ins.args[2])?,
            vecs(&ins.args[3])?,
        );
        // Registers per operand, from the PTX ISA's fragment tables.
        let (na, nb) = match (tf32, k) {
            (true, 4) => (2, 1),
            (true, _) => (4, 2),
            (false, 8) => (2, 1),
            (false, _) => (4, 2),
        };
        let nc = if cty == Ty::F32 { 4 } else { 2 };
        let nd = if dty == Ty::F32 { 4 } else { 2 };
        if av.len() != na || bv.len() != nb || cv.len() != nc || dv.len() != nd {
            return Err(format!(
                "mma operands of {}, {}, {} and {} registers (this shape takes {nd}, {na}, {nb}, {nc})",
                dv.len(),
                av.len(),
                bv.len(),
                cv.len()
            ));
        }
        for (lane, t) in lanes.iter().enumerate() {
            let g = lane / 4;
            let q = lane % 4;
            if tf32 {
                // One element per register; the low 13 mantissa bits are ignored.
                let tf = |v: u64| f32::from_bits(v as u32 & 0xFFFF_E000);
                for (ri, r) in av.iter().enumerate() {
                    a[g + 8 * (ri % 2)][q + 4 * (ri / 2)] = tf(t.regs[*r as usize]);
                }
                for (ri, r) in bv.iter().enumerate() {
                    b[q + 4 * ri][g] = tf(t.regs[*r as usize]);
                }
            } else {
                for (ri, r) in av.iter().enumerate() {
                    let v = t.regs[*r as usize];
                    let row = g + 8 * (ri % 2);
                    let col = 2 * q + 8 * (ri / 2);
                    a[row][col] = h2f(v, aty);
                    a[row][col + 1] = h2f(v >> 16, aty);
                }
                for (ri, r) in bv.iter().enumerate() {
                    let v = t.regs[*r as usize];
                    let row = 2 * q + 8 * ri;
                    b[row][g] = h2f(v, aty);
                    b[row + 1][g] = h2f(v >> 16, aty);
                }
            }
            if cty == Ty::F32 {
                for (ri, r) in cv.iter().enumerate() {
                    c[g + 8 * (ri / 2)][2 * q + ri % 2] = f32of(t.regs[*r as usize]);
                }
            } else {
                for (ri, r) in cv.iter().enumerate() {
                    let v = t.regs[*r as usize];
                    c[g + 8 * ri][2 * q] = h2f(v, cty);
                    c[g + 8 * ri][2 * q + 1] = h2f(v >> 16, cty);
                }
            }
        }
        let mut d = [[0f64; 8]; 16];
        for (i, row) in d.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                let mut s = c[i][j] as f64;
                for kk in 0..k {
                    s += a[i][kk] as f64 * b[kk][j] as f64;
                }
                *x = s;
            }
        }
        for (lane, t) in lanes.iter_mut().enumerate() {
            let g = lane / 4;
            let q = lane % 4;
            if dty == Ty::F32 {
                for (ri, r) in dv.iter().enumerate() {
                    t.regs[*r as usize] = (d[g + 8 * (ri / 2)][2 * q + ri % 2] as f32).to_bits() as u64;
                }
            } else {
                for (ri, r) in dv.iter().enumerate() {
                    let lo = f2h(d[g + 8 * ri][2 * q], dty);
                    let hi = f2h(d[g + 8 * ri][2 * q + 1], dty);
                    t.regs[*r as usize] = lo | hi << 16;
                }
            }
        }
        Ok(())
    }

    fn special(&self, t: &Thread, s: Special) -> u64 {
        let b = self.l.block;
        let lane = t.linear % 32;
        match s {
            Special::Tid(d) => t.tid[d as usize] as u64,
            Special::Ntid(d) => b[d as usize] as u64,
            Special::Ctaid(d) => t.ctaid[d as usize] as u64,
            Special::Nctaid(d) => self.l.grid[d as usize] as u64,
            Special::LaneId => lane as u64,
            Special::WarpId => (t.linear / 32) as u64,
            Special::NWarpId => self.nthreads.div_ceil(32) as u64,
            Special::SmId | Special::GridId => 0,
            Special::NSmId => 1,
            Special::LaneMask(k) => {
                let bit = 1u64 << lane;
                (match k {
                    0 => bit,
                    1 => (bit << 1) - 1,
                    2 => bit - 1,
                    3 => !(bit - 1),
                    _ => !((bit << 1) - 1),
                }) & 0xFFFF_FFFF
            }
            Special::Clock | Special::Clock64 | Special::GlobalTimer => self.steps,
            Special::DynSmem => self.l.dynamic_shared as u64,
            Special::TotalSmem => self.m.static_shared + self.l.dynamic_shared as u64,
            Special::ClusterCtaRank => t.rank as u64,
            Special::ClusterNCtaRank => self.ctaids.len() as u64,
            Special::ClusterId(d) => (t.ctaid[d as usize] / self.cdim[d as usize]) as u64,
            Special::NClusterId(d) => (self.l.grid[d as usize] / self.cdim[d as usize]) as u64,
            Special::ClusterCtaid(d) => (t.ctaid[d as usize] % self.cdim[d as usize]) as u64,
            Special::ClusterNCtaid(d) => self.cdim[d as usize] as u64,
            Special::IsExplicitCluster => (self.f.explicit_cluster || self.f.cluster.is_some()) as u64,
        }
    }

    fn sym_addr(&self, s: u32) -> u64 {
        let sym = &self.m.symbols[s as usize];
        match sym.space {
            Space::Global | Space::Const => (GLOBALS_WIN << WIN) + sym.addr,
            _ => sym.addr,
        }
    }

    /// An operand's bits for type `ty` (a literal converted to it).
    fn read(&self, t: &Thread, o: &Opd, ty: Ty, _m: Option<&Mem>) -> R<u64> {
        Ok(match o {
            Opd::Reg(r) => t.regs[*r as usize],
            Opd::NotReg(r) => (t.regs[*r as usize] & 1) ^ 1,
            Opd::Int(v) => match ty {
                Ty::F32 => (*v as f32).to_bits() as u64,
                Ty::F64 => (*v as f64).to_bits(),
                Ty::F16 | Ty::BF16 => f2h(*v as f64, ty),
                _ => *v as u64,
            },
            Opd::F32(b) => match ty {
                Ty::F64 => (f32::from_bits(*b) as f64).to_bits(),
                Ty::F16 | Ty::BF16 => f2h(f32::from_bits(*b) as f64, ty),
                _ => *b as u64,
            },
            Opd::F64(b) => match ty {
                Ty::F32 => (f64::from_bits(*b) as f32).to_bits() as u64,
                Ty::F16 | Ty::BF16 => f2h(f64::from_bits(*b), ty),
                _ => *b,
            },
            Opd::Special(s) => self.special(t, *s),
            Opd::Sym(s) => self.sym_addr(*s),
            Opd::Addr(..) => self.address(t, o)?,
            Opd::Vec(v) => {
                // Packing: `mov.b32 %r, {%h0, %h1}`.
                let w = ty.bits() / v.len().max(1) as u32;
                let mut acc = 0u64;
                for (i, x) in v.iter().enumerate() {
                    acc |= zx(self.read(t, x, Ty::None, None)?, w) << (w * i as u32);
                }
                acc
            }
            Opd::Sink => 0,
            Opd::Pair(..) | Opd::Label(_) => return Err("unexpected operand".into()),
        })
    }

    fn address(&self, t: &Thread, o: &Opd) -> R<u64> {
        match o {
            Opd::Addr(b, off) => {
                let base = match b {
                    AddrBase::None => 0,
                    AddrBase::Reg(r) => t.regs[*r as usize],
                    AddrBase::Sym(s) => self.sym_addr(*s),
                };
                Ok(base.wrapping_add(*off as u64))
            }
            Opd::Reg(r) => Ok(t.regs[*r as usize]),
            _ => Err("expected an address".into()),
        }
    }

    fn write(t: &mut Thread, o: &Opd, v: u64) -> R<()> {
        match o {
            Opd::Reg(r) => t.regs[*r as usize] = v,
            Opd::Sink => {}
            _ => return Err("the destination is not a register".into()),
        }
        Ok(())
    }

    /// Where `addr` of `space` lives: (region, offset). Region 0: globals, 1: shared (every
    /// block's of the cluster), 2: local, 3: params, 4 + i: buffer i.
    fn locate(&self, mem: &Mem, space: Space, addr: u64, n: usize) -> R<(usize, usize)> {
        // The region, where the memory addressed starts in it, the offset there and its size.
        let (region, start, off, len) = match space {
            Space::Shared => (1usize, mem.base, addr, mem.stride),
            Space::SharedCluster => (1, mem.cluster_block(addr)?, addr & RANK_MASK, mem.stride),
            Space::Param => (3, 0, addr, mem.params.len()),
            Space::Local => (2, 0, addr, self.f.local_bytes as usize),
            Space::Global | Space::Const | Space::Generic => {
                let w = addr >> WIN;
                let off = addr & ((1u64 << WIN) - 1);
                match w {
                    GLOBALS_WIN => (0, 0, off, mem.globals.len()),
                    SHARED_WIN if space == Space::Generic => {
                        if mem.clustered {
                            (1, mem.cluster_block(off)?, off & RANK_MASK, mem.stride)
                        } else {
                            (1, mem.base, off, mem.stride)
                        }
                    }
                    LOCAL_WIN if space == Space::Generic => (2, 0, off, self.f.local_bytes as usize),
                    w if w >= 2 && ((w - 2) as usize) < mem.bufs.len() => {
                        let i = (w - 2) as usize;
                        (4 + i, 0, off, mem.bufs[i].len())
                    }
                    _ => return Err(format!("access to {addr:#x}, which is no memory of the launch")),
                }
            }
        };
        if !(off as usize).is_multiple_of(n) || off.checked_add(n as u64).is_none_or(|e| e > len as u64) {
            return Err(Self::bad_access(mem, space, addr, region, start, off, len, n));
        }
        Ok((region, start + off as usize))
    }

    /// Why an access `locate` refuses is out of bounds or misaligned.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn bad_access(mem: &Mem, space: Space, addr: u64, region: usize, start: usize, off: u64, len: usize, n: usize) -> String {
        if space == Space::Shared && mem.clustered && addr >> RANK_SHIFT != 0 {
            return format!(
                "{n}-byte .shared::cta access at {addr:#x}, a .shared::cluster address of cluster rank {} (mapa's addresses take .shared::cluster or generic accesses)",
                (addr >> RANK_SHIFT) - 1
            );
        }
        let what = match region {
            0 => "the module's variables".to_string(),
            1 if start != mem.base => format!("the shared memory of cluster rank {}", start / mem.stride.max(1)),
            1 => "shared memory".to_string(),
            2 => "local memory".to_string(),
            3 => "the parameters".to_string(),
            i => format!("buffer {}", i - 4),
        };
        if !(off as usize).is_multiple_of(n) {
            format!("misaligned {n}-byte access at byte {off} of {what}")
        } else {
            format!("{n}-byte access at byte {off} of {what}, which has {len} bytes")
        }
    }

    fn load(&self, t: &Thread, mem: &Mem, space: Space, addr: u64, n: usize) -> R<u64> {
        let (r, off) = self.locate(mem, space, addr, n)?;
        let src: &[u8] = match r {
            0 => &mem.globals,
            1 => {
                if mem.nranks > 1 {
                    mem.check_live(off)?;
                }
                &mem.shared
            }
            2 => &t.local,
            3 => &mem.params,
            i => &mem.bufs[i - 4],
        };
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&src[off..off + n]);
        Ok(u64::from_le_bytes(b))
    }

    fn store(&self, t: &mut Thread, mem: &mut Mem, space: Space, addr: u64, n: usize, v: u64) -> R<()> {
        let (r, off) = self.locate(mem, space, addr, n)?;
        let dst: &mut [u8] = match r {
            0 => &mut mem.globals,
            1 => {
                if mem.nranks > 1 {
                    mem.check_live(off)?;
                }
                &mut mem.shared
            }
            2 => &mut t.local,
            3 => return Err("a store to the parameters".into()),
            i => &mut mem.bufs[i - 4],
        };
        dst[off..off + n].copy_from_slice(&v.to_le_bytes()[..n]);
        Ok(())
    }

    fn exec(&mut self, t: &mut Thread, ins: &Instr, mem: &mut Mem, arrived: &mut [u32; 16]) -> R<()> {
        let op = &ins.op;
        let a = &ins.args;
        let arg = |i: usize| -> R<&Opd> { a.get(i).ok_or_else(|| format!("operand {} missing", i + 1)) };
        let mut next = t.pc + 1;
        match op.base {
            Base::Bra => {
                let Opd::Label(l) = arg(0)? else {
                    return Err("an indirect branch".into());
                };
                next = *l;
            }
            Base::Ret | Base::Exit => {
                self.exit(t, mem)?;
                return Ok(());
            }
            Base::Nop => {}
            Base::WgFence => t.fences += 1,
            Base::WgCommit => t.wg_committed += 1,
            Base::WgWait => {
                if self.lim.late_copies {
                    t.st = St::WgWait;
                    return Ok(());
                }
            }
            Base::Unsupported => {
                return Err(crate::op::decode_op(&op.name)
                    .err()
                    .unwrap_or_else(|| format!("unsupported instruction `{}`", op.name)));
            }
            Base::Bar => {
                let id = self.read(t, arg(0)?, Ty::U32, None)? as u32;
                if id >= 16 {
                    return Err(format!("barrier {id} (0 to 15)"));
                }
                if op.mode == mode::ARRIVE {
                    arrived[id as usize] += 1;
                } else {
                    t.st = St::Bar(id);
                    return Ok(());
                }
            }
            Base::Mov => {
                let v = self.read(t, arg(1)?, op.ty, None)?;
                match arg(0)? {
                    Opd::Vec(d) => {
                        let w = op.ty.bits() / d.len().max(1) as u32;
                        for (i, x) in d.iter().enumerate() {
                            Self::write(t, x, zx(v >> (w * i as u32), w))?;
                        }
                    }
                    d => Self::write(t, d, v)?,
                }
            }
            Base::Ld => {
                let addr = self.address(t, arg(1)?)?;
                let n = op.ty.bytes();
                let dsts: Vec<Opd> = match arg(0)? {
                    Opd::Vec(v) => v.clone(),
                    d => vec![d.clone()],
                };
                for (i, d) in dsts.iter().enumerate() {
                    let raw = self.load(t, mem, op.space, addr + (i * n) as u64, n)?;
                    let v = if op.ty.signed() { sx(raw, op.ty.bits()) as u64 } else { raw };
                    Self::write(t, d, v)?;
                }
            }
            Base::St => {
                let addr = self.address(t, arg(0)?)?;
                let n = op.ty.bytes();
                let srcs: Vec<Opd> = match arg(1)? {
                    Opd::Vec(v) => v.clone(),
                    s => vec![s.clone()],
                };
                for (i, s) in srcs.iter().enumerate() {
                    let v = self.read(t, s, op.ty, None)?;
                    self.store(t, mem, op.space, addr + (i * n) as u64, n, v)?;
                }
            }
            Base::Cvta => {
                let v = self.read(t, arg(1)?, Ty::U64, None)?;
                let base = match op.space {
                    Space::Shared | Space::SharedCluster => SHARED_WIN << WIN,
                    Space::Local => LOCAL_WIN << WIN,
                    _ => 0,
                };
                let r = if op.flags & flag::TO != 0 {
                    if base != 0 && v >> WIN == base >> WIN { v - base } else { v }
                } else {
                    v + base
                };
                Self::write(t, arg(0)?, zx(r, op.ty.bits()))?;
            }
            Base::CpAsync => {
                let dst = self.address(t, arg(0)?)?;
                let src = self.address(t, arg(1)?)?;
                let size = self.read(t, arg(2)?, Ty::U32, None)? as usize;
                let bytes = match a.get(3) {
                    Some(o @ (Opd::Int(_) | Opd::Reg(_))) => self.read(t, o, Ty::U32, None)? as usize,
                    _ => size,
                };
                if !matches!(size, 4 | 8 | 16) {
                    return Err(format!("cp.async of {size} bytes"));
                }
                // Check both ends now, as the GPU faults at issue.
                let dst = self.locate(mem, Space::Shared, dst, size)?.1 as u64;
                if bytes > 0 {
                    self.locate(mem, Space::Global, src, bytes.min(size).next_power_of_two())?;
                }
                t.open.push(Copy {
                    dst,
                    src,
                    bytes: bytes.min(size),
                    size,
                });
            }
            Base::CpAsyncCommit => {
                let g = std::mem::take(&mut t.open);
                t.groups.push_back(g);
            }
            Base::CpAsyncWait | Base::CpAsyncWaitAll => {
                let keep = if op.base == Base::CpAsyncWait {
                    self.read(t, arg(0)?, Ty::U32, None)? as usize
                } else {
                    let g = std::mem::take(&mut t.open);
                    t.groups.push_back(g);
                    0
                };
                while t.groups.len() > keep {
                    let g = t.groups.pop_front().unwrap_or_default();
                    land(g, t, mem)?;
                }
            }
            Base::Atom | Base::Red => {
                let (ai, vi) = if op.base == Base::Atom { (1, 2) } else { (0, 1) };
                let addr = self.address(t, arg(ai)?)?;
                let ty = op.ty;
                let n = ty.bytes();
                let old = self.load(t, mem, op.space, addr, n)?;
                let b = self.read(t, arg(vi)?, ty, None)?;
                let bits = ty.bits();
                let new = match op.mode {
                    mode::ADD => match ty {
                        Ty::F32 => (f32of(old) + f32of(b)).to_bits() as u64,
                        Ty::F64 => (f64::from_bits(old) + f64::from_bits(b)).to_bits(),
                        Ty::F16 | Ty::BF16 => f2h(h2f(old, ty) as f64 + h2f(b, ty) as f64, ty),
                        Ty::F16x2 | Ty::BF16x2 => {
                            f2h(h2f(old, ty) as f64 + h2f(b, ty) as f64, ty)
                                | f2h(h2f(old >> 16, ty) as f64 + h2f(b >> 16, ty) as f64, ty) << 16
                        }
                        _ => old.wrapping_add(b),
                    },
                    mode::MIN if ty.signed() => sx(old, bits).min(sx(b, bits)) as u64,
                    mode::MAX if ty.signed() => sx(old, bits).max(sx(b, bits)) as u64,
                    mode::MIN => zx(old, bits).min(zx(b, bits)),
                    mode::MAX => zx(old, bits).max(zx(b, bits)),
                    mode::AND => old & b,
                    mode::OR => old | b,
                    mode::XOR => old ^ b,
                    mode::EXCH => b,
                    mode::CAS => {
                        let c = self.read(t, arg(3)?, ty, None)?;
                        if zx(old, bits) == zx(b, bits) { c } else { old }
                    }
                    mode::INC => {
                        if zx(old, bits) >= zx(b, bits) {
                            0
                        } else {
                            old + 1
                        }
                    }
                    mode::DEC => {
                        if zx(old, bits) == 0 || zx(old, bits) > zx(b, bits) {
                            b
                        } else {
                            old - 1
                        }
                    }
                    _ => return Err("unsupported atomic operation".into()),
                };
                self.store(t, mem, op.space, addr, n, zx(new, bits))?;
                if op.base == Base::Atom {
                    Self::write(t, arg(0)?, old)?;
                }
            }
            Base::Setp | Base::Set => {
                let ty = if op.base == Base::Set { op.ty2 } else { op.ty };
                let x = self.read(t, arg(1)?, ty, None)?;
                let y = self.read(t, arg(2)?, ty, None)?;
                let mut r = compare(op.cmp, ty, x, y)?;
                let mut nr = !r;
                if op.bop != mode::NONE {
                    let c = self.read(t, arg(3)?, Ty::Pred, None)? & 1 == 1;
                    let comb = |v: bool| match op.bop {
                        mode::AND => v && c,
                        mode::OR => v || c,
                        _ => v ^ c,
                    };
                    r = comb(r);
                    nr = comb(nr);
                }
                match arg(0)? {
                    Opd::Pair(p, q) => {
                        t.regs[*p as usize] = r as u64;
                        t.regs[*q as usize] = nr as u64;
                    }
                    d if op.base == Base::Setp => Self::write(t, d, r as u64)?,
                    d => {
                        let v = match op.ty {
                            Ty::F32 => {
                                if r {
                                    1f32.to_bits() as u64
                                } else {
                                    0
                                }
                            }
                            dt => {
                                if r {
                                    zx(u64::MAX, dt.bits())
                                } else {
                                    0
                                }
                            }
                        };
                        Self::write(t, d, v)?;
                    }
                }
            }
            Base::Selp => {
                let x = self.read(t, arg(1)?, op.ty, None)?;
                let y = self.read(t, arg(2)?, op.ty, None)?;
                let c = self.read(t, arg(3)?, Ty::Pred, None)? & 1 == 1;
                Self::write(t, arg(0)?, if c { x } else { y })?;
            }
            Base::Cvt if is16x2(op.ty) => {
                // `cvt.rn.f16x2.f32 d, a, b`: a in the upper half.
                let x = self.read(t, arg(1)?, op.ty2, None)?;
                let y = self.read(t, arg(2)?, op.ty2, None)?;
                let (x, y) = (fval(x, op.ty2), fval(y, op.ty2));
                let x = if op.flags & flag::RELU != 0 { relu(x) } else { x };
                let y = if op.flags & flag::RELU != 0 { relu(y) } else { y };
                Self::write(t, arg(0)?, f2h(x, op.ty) << 16 | f2h(y, op.ty))?;
            }
            Base::Cvt => {
                let v = self.read(t, arg(1)?, op.ty2, None)?;
                let r = convert(op, v)?;
                Self::write(t, arg(0)?, r)?;
            }
            Base::Prmt => {
                let x = self.read(t, arg(1)?, Ty::B32, None)? as u32;
                let y = self.read(t, arg(2)?, Ty::B32, None)? as u32;
                let s = self.read(t, arg(3)?, Ty::B32, None)? as u32;
                let bytes = ((y as u64) << 32 | x as u64).to_le_bytes();
                let mut r = 0u32;
                for i in 0..4 {
                    let sel = (s >> (4 * i)) & 0xF;
                    let mut byte = bytes[(sel & 7) as usize];
                    if sel & 8 != 0 {
                        byte = if byte & 0x80 != 0 { 0xFF } else { 0 };
                    }
                    r |= (byte as u32) << (8 * i);
                }
                Self::write(t, arg(0)?, r as u64)?;
            }
            Base::Ldmatrix | Base::Mma | Base::Shfl | Base::Vote | Base::Redux | Base::BarWarp | Base::Wgmma => {
                return Err("a collective outside the warp scheduler".into());
            }
            Base::Mbar => {
                let at = if matches!(op.mode, hop::MB_INIT | hop::MB_EXPECT_TX | hop::MB_INVAL) {
                    0
                } else {
                    1
                };
                let addr = self.address(t, arg(at)?)?;
                // `.shared::cta`, or `.shared::cluster` for arrivals on another block's.
                let sp = op.space;
                match op.mode {
                    hop::MB_INIT => {
                        let count = self.read(t, arg(1)?, Ty::U32, None)? as u32;
                        if count == 0 {
                            return Err("an mbarrier initialised with a count of 0".into());
                        }
                        let off = self.mbar_off(mem, sp, addr)?;
                        mem.mbars.insert(
                            off,
                            Mbar {
                                count,
                                pending: count,
                                tx: 0,
                                phase: 0,
                            },
                        );
                    }
                    hop::MB_INVAL => {
                        let off = self.mbar_off(mem, sp, addr)?;
                        mem.mbars.remove(&off);
                    }
                    hop::MB_EXPECT_TX => {
                        let tx = self.read(t, arg(1)?, Ty::U32, None)? as i64;
                        self.mbar_arrive(mem, sp, addr, 0, tx)?;
                    }
                    hop::MB_ARRIVE | hop::MB_ARRIVE_TX => {
                        let (count, tx) = if op.mode == hop::MB_ARRIVE_TX {
                            (1, self.read(t, arg(2)?, Ty::U32, None)? as i64)
                        } else {
                            match a.get(2) {
                                Some(o) => (self.read(t, o, Ty::U32, None)? as u32, 0),
                                None => (1, 0),
                            }
                        };
                        // The state token: the phase arrived on.
                        let phase = self.mbar(mem, sp, addr)?.phase;
                        self.mbar_arrive(mem, sp, addr, count, tx)?;
                        Self::write(t, arg(0)?, phase)?;
                    }
                    _ => {
                        // try_wait / test_wait.parity: whether the phase of that parity is over
                        // (the current phase's parity is the count of completed ones mod 2).
                        let parity = self.read(t, arg(2)?, Ty::U32, None)? & 1;
                        // What is in flight on this barrier lands before the answer.
                        let bar = self.mbar_off(mem, sp, addr)?;
                        self.land_pending(t, mem, Some(bar))?;
                        let done = (self.mbar(mem, sp, addr)?.phase & 1) != parity;
                        if done {
                            t.told_open = None;
                        } else {
                            // The first try of an open phase answers false (a kernel that takes
                            // one try for the phase's end reads too early); a try again sleeps:
                            // nothing it could see changes before some phase completes. So does
                            // a test_wait asked again (a polling loop, which would otherwise
                            // spin here).
                            if t.told_open == Some((bar, parity)) {
                                t.st = St::Spin(mem.epoch);
                                return Ok(());
                            }
                            t.told_open = Some((bar, parity));
                        }
                        Self::write(t, arg(0)?, done as u64)?;
                    }
                }
            }
            Base::CpAsyncMbar => {
                // The arrival follows the thread's earlier copies: they are in flight on this
                // barrier (landing when it is waited on) and the arrival counts now.
                let addr = self.address(t, arg(0)?)?;
                let bar = self.mbar_off(mem, Space::Shared, addr)?;
                let mut copies: Vec<Copy> = t.groups.drain(..).flatten().collect();
                copies.append(&mut t.open);
                if self.lim.late_copies {
                    mem.pending.push(Pending::Copies { bar, copies });
                } else {
                    land(copies, t, mem)?;
                }
                // Without .noinc the pending count goes up by one first: no net change.
                let count = if op.flags & hop::NOINC != 0 { 1 } else { 0 };
                self.mbar_arrive(mem, Space::Shared, addr, count, 0)?;
            }
            Base::Tma => self.tma_issue(t, ins, mem)?,
            Base::Mapa | Base::GetCtaRank => {
                // `.shared::cluster` addresses, or generic ones in the shared window.
                let a0 = self.read(t, arg(1)?, Ty::U64, None)?;
                let generic = op.space == Space::Generic;
                let a = if generic {
                    if a0 >> WIN != SHARED_WIN {
                        return Err(format!("{a0:#x} is no shared-memory address"));
                    }
                    a0 & ((1u64 << WIN) - 1)
                } else {
                    a0
                };
                let n = mem.nranks;
                let v = if op.base == Base::GetCtaRank {
                    (mem.cluster_block(a)? / mem.stride.max(1)) as u64
                } else {
                    let r = self.read(t, arg(2)?, Ty::U32, None)? as u32 as u64;
                    if r >= n as u64 {
                        return Err(format!("mapa to cluster rank {r}, outside the cluster of {n} block(s)"));
                    }
                    let d = (r + 1) << RANK_SHIFT | (a & RANK_MASK);
                    if generic { SHARED_WIN << WIN | d } else { d }
                };
                Self::write(t, arg(0)?, zx(v, op.ty.bits()))?;
            }
            Base::ClusterBar => {
                if op.mode == mode::ARRIVE {
                    if t.cl_arrived.is_some() {
                        return Err("a second barrier.cluster.arrive before the barrier.cluster.wait of the first".into());
                    }
                    t.cl_arrived = Some(mem.cl_phase);
                    mem.cl_arrivals += 1;
                } else {
                    match t.cl_arrived {
                        None => return Err("barrier.cluster.wait without a barrier.cluster.arrive before it".into()),
                        Some(p) if p < mem.cl_phase => t.cl_arrived = None,
                        Some(_) => {
                            t.st = St::ClWait;
                            return Ok(());
                        }
                    }
                }
            }
            Base::TmapReplace => {
                let addr = self.address(t, arg(0)?)?;
                let off = self.locate(mem, Space::Shared, addr, 128)?.1 as u64;
                let ordinal = matches!(
                    op.mode,
                    hop::TM_BOX_DIM | hop::TM_GLOBAL_DIM | hop::TM_GLOBAL_STRIDE | hop::TM_ELEMENT_STRIDE
                );
                let ord = if ordinal {
                    self.read(t, arg(1)?, Ty::U32, None)? as usize
                } else {
                    0
                };
                if ord >= 5 {
                    return Err(format!("tensor map ordinal {ord} (0 to 4)"));
                }
                let v = self.read(t, arg(if ordinal { 2 } else { 1 })?, Ty::B64, None)?;
                let m = mem.tmaps.entry(off).or_default();
                match op.mode {
                    hop::TM_GLOBAL_ADDRESS => m.address = v,
                    hop::TM_RANK => m.rank = v as u32,
                    hop::TM_BOX_DIM => m.box_dim[ord] = v as u32,
                    hop::TM_GLOBAL_DIM => m.global_dim[ord] = v as u32,
                    hop::TM_GLOBAL_STRIDE => m.global_stride[ord] = v,
                    hop::TM_ELEMENT_STRIDE => m.element_stride[ord] = v as u32,
                    hop::TM_ELEMTYPE => m.elemtype = v as u32,
                    hop::TM_INTERLEAVE => m.interleave = v as u32,
                    hop::TM_SWIZZLE => m.swizzle = v as u32,
                    _ => m.fill = v as u32,
                }
            }
            Base::TmapCp => {
                let g = self.address(t, arg(0)?)?;
                let sa = self.address(t, arg(1)?)?;
                let off = self.locate(mem, Space::Shared, sa, 128)?.1 as u64;
                for i in 0..16 {
                    let v = self.load(t, mem, Space::Shared, sa + 8 * i, 8)?;
                    self.store(t, mem, Space::Global, g + 8 * i, 8, v)?;
                }
                let tm = mem.tmaps.get(&off).cloned().unwrap_or_default();
                mem.gtmaps.insert(g, tm);
            }
            Base::Activemask => {
                // The lanes running this instruction together are not known here; the warp's
                // live lanes are what compilers use it for.
                Self::write(t, arg(0)?, 0xFFFF_FFFF)?;
            }
            _ => {
                let v = self.arith(t, ins)?;
                Self::write(t, arg(0)?, v)?;
            }
        }
        t.pc = next;
        Ok(())
    }

    /// Arithmetic, logic, shifts and math functions: one result.
    fn arith(&self, t: &Thread, ins: &Instr) -> R<u64> {
        let op = &ins.op;
        let a = &ins.args;
        let ty = op.ty;
        let get = |i: usize, ty: Ty| -> R<u64> {
            let o = a.get(i).ok_or_else(|| format!("operand {} missing", i + 1))?;
            self.read(t, o, ty, None)
        };
        let bits = ty.bits();
        let ftz = op.flags & flag::FTZ != 0;
        let sat = op.flags & flag::SAT != 0;
        let base = op.base;
        // Packed halves: lane-wise over the two 16-bit values.
        if is16x2(ty) && !matches!(base, Base::And | Base::Or | Base::Xor | Base::Not | Base::Mov) {
            let half_ty = if ty == Ty::F16x2 { Ty::F16 } else { Ty::BF16 };
            let n = (a.len() - 1).min(3);
            let mut out = 0u64;
            for h in 0..2 {
                let mut xs = [0f64; 3];
                for (i, x) in xs.iter_mut().enumerate().take(n) {
                    let v = get(i + 1, ty)? >> (16 * h);
                    *x = h2f(v, half_ty) as f64;
                }
                let r = float_op(op, &xs[..n], half_ty)?;
                out |= f2h(r, half_ty) << (16 * h);
            }
            return Ok(out);
        }
        if ty.float() {
            let n = (a.len() - 1).min(3);
            let mut xs = [0f64; 3];
            let mut raw = [0u64; 3];
            for i in 0..n.min(3) {
                raw[i] = get(i + 1, ty)?;
                xs[i] = match ty {
                    Ty::F32 => ftz32(f32of(raw[i]), ftz) as f64,
                    Ty::F64 => f64::from_bits(raw[i]),
                    _ => h2f(raw[i], ty) as f64,
                };
            }
            // Sign operations work on the bits (they keep NaN payloads).
            match base {
                Base::Neg => return Ok(raw[0] ^ (1u64 << (bits - 1))),
                Base::Abs => return Ok(raw[0] & !(1u64 << (bits - 1))),
                _ => {}
            }
            if ty == Ty::F32 {
                let r = f32_op(op, &xs[..n])?;
                let r = ftz32(r, ftz);
                let r = if sat { sat01(r as f64) as f32 } else { r };
                return Ok(r.to_bits() as u64);
            }
            let r = float_op(op, &xs[..n], ty)?;
            let r = if sat { sat01(r) } else { r };
            return Ok(match ty {
                Ty::F64 => r.to_bits(),
                _ => f2h(r, ty),
            });
        }
        // Integers and bits.
        let s = ty.signed();
        let ival = |v: u64| -> i128 { if s { sx(v, bits) as i128 } else { zx(v, bits) as i128 } };
        let wide = op.flags & flag::WIDE != 0;
        let hi = op.flags & flag::HI != 0;
        let out_bits = if wide { bits * 2 } else { bits };
        let r: i128 = match base {
            Base::Add | Base::Sub => {
                let (x, y) = (ival(get(1, ty)?), ival(get(2, ty)?));
                let r = if base == Base::Add { x + y } else { x - y };
                if sat && s {
                    r.clamp(-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
                } else {
                    r
                }
            }
            Base::Mul | Base::Mad | Base::Mul24 | Base::Mad24 => {
                let (mut x, mut y) = (ival(get(1, ty)?), ival(get(2, ty)?));
                if matches!(base, Base::Mul24 | Base::Mad24) {
                    let k = |v: i128| {
                        if s {
                            sx(v as u64, 24) as i128
                        } else {
                            zx(v as u64, 24) as i128
                        }
                    };
                    x = k(x);
                    y = k(y);
                }
                let p = x * y;
                let p = if hi {
                    if bits == 64 {
                        // the high 64 bits of the 128-bit product
                        if s { p >> 64 } else { ((p as u128) >> 64) as i128 }
                    } else {
                        p >> bits
                    }
                } else {
                    p
                };
                if matches!(base, Base::Mad | Base::Mad24) {
                    let cty = if wide {
                        match ty {
                            Ty::S32 => Ty::S64,
                            Ty::U32 => Ty::U64,
                            Ty::S16 => Ty::S32,
                            _ => Ty::U32,
                        }
                    } else {
                        ty
                    };
                    let c = get(3, cty)?;
                    let c = if cty.signed() {
                        sx(c, cty.bits()) as i128
                    } else {
                        zx(c, cty.bits()) as i128
                    };
                    let r = p.wrapping_add(c);
                    if sat && s {
                        r.clamp(i32::MIN as i128, i32::MAX as i128)
                    } else {
                        r
                    }
                } else {
                    p
                }
            }
            Base::Div | Base::Rem => {
                let (x, y) = (ival(get(1, ty)?), ival(get(2, ty)?));
                if y == 0 {
                    -1
                } else if base == Base::Div {
                    x / y
                } else {
                    x % y
                }
            }
            Base::Abs => ival(get(1, ty)?).abs(),
            Base::Neg => -ival(get(1, ty)?),
            Base::Min => ival(get(1, ty)?).min(ival(get(2, ty)?)),
            Base::Max => ival(get(1, ty)?).max(ival(get(2, ty)?)),
            Base::And => (get(1, ty)? & get(2, ty)?) as i128,
            Base::Or => (get(1, ty)? | get(2, ty)?) as i128,
            Base::Xor => (get(1, ty)? ^ get(2, ty)?) as i128,
            Base::Not => (!get(1, ty)?) as i128,
            Base::CNot => (zx(get(1, ty)?, bits) == 0) as i128,
            Base::Shl | Base::Shr => {
                let x = ival(get(1, ty)?);
                let n = get(2, Ty::U32)? as u32 as u64;
                if base == Base::Shl {
                    if n >= bits as u64 { 0 } else { ((x as u128) << n) as i128 }
                } else if n >= bits as u64 {
                    if s && x < 0 { -1 } else { 0 }
                } else {
                    x >> n
                }
            }
            Base::Shf => {
                let lo = get(1, Ty::B32)? as u32 as u64;
                let hi2 = get(2, Ty::B32)? as u32 as u64;
                let c = get(3, Ty::U32)? as u32;
                let n = if op.flags & flag::CLAMP != 0 { c.min(32) } else { c & 31 } as u64;
                let both = hi2 << 32 | lo;
                if op.flags & flag::SHIFT != 0 {
                    (((both << n) >> 32) & 0xFFFF_FFFF) as i128
                } else {
                    ((both >> n) & 0xFFFF_FFFF) as i128
                }
            }
            Base::Popc => (zx(get(1, ty)?, bits).count_ones()) as i128,
            Base::Clz => {
                let v = zx(get(1, ty)?, bits);
                (v.leading_zeros() - (64 - bits)) as i128
            }
            Base::Brev => (zx(get(1, ty)?, bits).reverse_bits() >> (64 - bits)) as i128,
            Base::Bfe => {
                let x = get(1, ty)?;
                let pos = get(2, Ty::U32)? as u32 & 0xFF;
                let len = get(3, Ty::U32)? as u32 & 0xFF;
                let x = zx(x, bits);
                let sbit = if s && len > 0 {
                    let at = (pos + len - 1).min(bits - 1);
                    (x >> at) & 1
                } else {
                    0
                };
                let mut r = 0u64;
                for i in 0..bits {
                    let bit = if i < len && pos + i < bits {
                        (x >> (pos + i)) & 1
                    } else if s {
                        sbit
                    } else {
                        0
                    };
                    r |= bit << i;
                }
                r as i128
            }
            Base::Bfi => {
                let f = zx(get(1, ty)?, bits);
                let b = zx(get(2, ty)?, bits);
                let pos = get(3, Ty::U32)? as u32 & 0xFF;
                let len = get(4, Ty::U32)? as u32 & 0xFF;
                let mut r = b;
                for i in 0..len {
                    if pos + i >= bits {
                        break;
                    }
                    r = (r & !(1 << (pos + i))) | (((f >> i) & 1) << (pos + i));
                }
                r as i128
            }
            Base::Sad => {
                let (x, y, z) = (ival(get(1, ty)?), ival(get(2, ty)?), ival(get(3, ty)?));
                (x - y).abs() + z
            }
            _ => return Err(format!("unsupported instruction for type {ty:?}")),
        };
        Ok(zx(r as u64, out_bits))
    }
}

fn mask_of(members: &[usize]) -> u32 {
    members.iter().fold(0u32, |m, i| m | 1 << i)
}

fn is_collective(op: &Op) -> bool {
    matches!(
        op.base,
        Base::Shfl | Base::Vote | Base::Redux | Base::Ldmatrix | Base::Mma | Base::BarWarp
    )
}

fn land(g: Vec<Copy>, t: &mut Thread, mem: &mut Mem) -> R<()> {
    let _ = t;
    for c in g {
        let mut buf = [0u8; 16];
        if c.bytes > 0 {
            let w = c.src >> WIN;
            let off = (c.src & ((1u64 << WIN) - 1)) as usize;
            let src: &[u8] = if w == GLOBALS_WIN {
                &mem.globals
            } else {
                mem.bufs
                    .get((w.wrapping_sub(2)) as usize)
                    .ok_or_else(|| format!("cp.async from {:#x}, which is no memory of the launch", c.src))?
            };
            let end = off + c.bytes;
            if end > src.len() {
                return Err(format!(
                    "cp.async reads past the end of a buffer (byte {end} of {})",
                    src.len()
                ));
            }
            buf[..c.bytes].copy_from_slice(&src[off..end]);
        }
        let d = c.dst as usize;
        if d + c.size > mem.shared.len() {
            return Err(format!(
                "cp.async writes past shared memory (byte {} of {})",
                d + c.size,
                mem.shared.len()
            ));
        }
        mem.shared[d..d + c.size].copy_from_slice(&buf[..c.size]);
    }
    Ok(())
}

/// `.relu`: negatives to zero, NaN stays NaN.
fn relu(x: f64) -> f64 {
    if x.is_nan() { x } else { x.max(0.0) }
}

fn sat01(x: f64) -> f64 {
    if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) }
}

/// f32 arithmetic with PTX's rounding modifiers.
fn f32_op(op: &Op, x: &[f64]) -> R<f32> {
    let f = |i: usize| x[i] as f32;
    let rnd = op.rnd;
    let directed = matches!(rnd, Rnd::Rz | Rnd::Rm | Rnd::Rp);
    Ok(match op.base {
        Base::Add | Base::Sub => {
            let y = if op.base == Base::Sub { -x[1] } else { x[1] };
            if directed {
                let (s, e) = two_sum(x[0], y);
                round_f32(s, e, rnd)
            } else {
                (x[0] + y) as f32 // exact in f64, one rounding
            }
        }
        Base::Mul => {
            if directed {
                round_f32(x[0] * x[1], 0.0, rnd)
            } else {
                f(0) * f(1)
            }
        }
        Base::Fma | Base::Mad => {
            if directed {
                let (s, e) = two_sum(x[0] * x[1], x[2]);
                round_f32(s, e, rnd)
            } else {
                f(0).mul_add(f(1), f(2))
            }
        }
        Base::Div => {
            if directed {
                let q = x[0] / x[1];
                round_f32(q, 0.0, rnd)
            } else {
                f(0) / f(1)
            }
        }
        Base::Min => {
            if op.flags & flag::NAN != 0 && (x[0].is_nan() || x[1].is_nan()) {
                f32::NAN
            } else {
                f(0).min(f(1))
            }
        }
        Base::Max => {
            if op.flags & flag::NAN != 0 && (x[0].is_nan() || x[1].is_nan()) {
                f32::NAN
            } else {
                f(0).max(f(1))
            }
        }
        Base::Ex2 => f(0).exp2(),
        Base::Lg2 => f(0).log2(),
        Base::Rcp => 1.0 / f(0),
        Base::Sqrt => f(0).sqrt(),
        Base::Rsqrt => 1.0 / f(0).sqrt(),
        Base::Sin => f(0).sin(),
        Base::Cos => f(0).cos(),
        Base::Tanh => f(0).tanh(),
        Base::Copysign => f(1).copysign(f(0)),
        _ => return Err(format!("unsupported f32 instruction `{}`", op.name)),
    })
}

/// f64 and 16-bit float arithmetic, in f64 (16-bit results are rounded once by the caller).
fn float_op(op: &Op, x: &[f64], ty: Ty) -> R<f64> {
    let _ = ty;
    Ok(match op.base {
        Base::Add => x[0] + x[1],
        Base::Sub => x[0] - x[1],
        Base::Mul => x[0] * x[1],
        Base::Fma | Base::Mad => {
            let r = x[0].mul_add(x[1], x[2]);
            if op.flags & flag::RELU != 0 { relu(r) } else { r }
        }
        Base::Div => x[0] / x[1],
        Base::Neg => -x[0],
        Base::Abs => x[0].abs(),
        Base::Min => {
            if op.flags & flag::NAN != 0 && (x[0].is_nan() || x[1].is_nan()) {
                f64::NAN
            } else {
                x[0].min(x[1])
            }
        }
        Base::Max => {
            if op.flags & flag::NAN != 0 && (x[0].is_nan() || x[1].is_nan()) {
                f64::NAN
            } else {
                x[0].max(x[1])
            }
        }
        Base::Ex2 => x[0].exp2(),
        Base::Lg2 => x[0].log2(),
        Base::Rcp => 1.0 / x[0],
        Base::Sqrt => x[0].sqrt(),
        Base::Rsqrt => 1.0 / x[0].sqrt(),
        Base::Sin => x[0].sin(),
        Base::Cos => x[0].cos(),
        Base::Tanh => x[0].tanh(),
        Base::Copysign => x[1].copysign(x[0]),
        _ => return Err(format!("unsupported float instruction `{}`", op.name)),
    })
}

fn fval(v: u64, ty: Ty) -> f64 {
    match ty {
        Ty::F32 | Ty::TF32 => f32of(v) as f64,
        Ty::F64 => f64::from_bits(v),
        _ => h2f(v, ty) as f64,
    }
}

fn compare(c: Cmp, ty: Ty, x: u64, y: u64) -> R<bool> {
    if ty.float() {
        let (a, b) = (fval(x, ty), fval(y, ty));
        let un = a.is_nan() || b.is_nan();
        return Ok(match c {
            Cmp::Eq => a == b,
            Cmp::Ne => !un && a != b,
            Cmp::Lt => a < b,
            Cmp::Le => a <= b,
            Cmp::Gt => a > b,
            Cmp::Ge => a >= b,
            Cmp::Equ => un || a == b,
            Cmp::Neu => un || a != b,
            Cmp::Ltu => un || a < b,
            Cmp::Leu => un || a <= b,
            Cmp::Gtu => un || a > b,
            Cmp::Geu => un || a >= b,
            Cmp::Num => !un,
            Cmp::Nan => un,
            _ => return Err(format!("comparison {c:?} on a float")),
        });
    }
    let bits = ty.bits();
    let (su, sv) = (sx(x, bits), sx(y, bits));
    let (uu, uv) = (zx(x, bits), zx(y, bits));
    let signed = ty.signed();
    Ok(match c {
        Cmp::Eq => uu == uv,
        Cmp::Ne => uu != uv,
        Cmp::Lt if signed => su < sv,
        Cmp::Le if signed => su <= sv,
        Cmp::Gt if signed => su > sv,
        Cmp::Ge if signed => su >= sv,
        Cmp::Lt | Cmp::Lo => uu < uv,
        Cmp::Le | Cmp::Ls => uu <= uv,
        Cmp::Gt | Cmp::Hi => uu > uv,
        Cmp::Ge | Cmp::Hs => uu >= uv,
        _ => return Err(format!("comparison {c:?} on an integer")),
    })
}

fn int_range(ty: Ty) -> (i128, i128) {
    let b = ty.bits();
    if ty.signed() {
        (-(1i128 << (b - 1)), (1i128 << (b - 1)) - 1)
    } else {
        (0, (1i128 << b) - 1)
    }
}

/// `cvt.<rnd>.<dst>.<src>`.
fn convert(op: &Op, v: u64) -> R<u64> {
    let (dt, st) = (op.ty, op.ty2);
    let sat = op.flags & flag::SAT != 0;
    let ftz = op.flags & flag::FTZ != 0;
    if st == Ty::None {
        return Err("cvt needs two types".into());
    }
    if !dt.float() && !st.float() {
        let x: i128 = if st.signed() {
            sx(v, st.bits()) as i128
        } else {
            zx(v, st.bits()) as i128
        };
        let x = if sat {
            let (lo, hi) = int_range(dt);
            x.clamp(lo, hi)
        } else {
            x
        };
        return Ok(zx(x as u64, dt.bits()));
    }
    if st.float() && !dt.float() {
        let x = fval(v, st);
        let x = if st == Ty::F32 && ftz {
            ftz32(x as f32, true) as f64
        } else {
            x
        };
        if x.is_nan() {
            return Ok(0);
        }
        let r = round_int(x, op.rnd);
        let (lo, hi) = int_range(dt);
        let r = (r.clamp(lo as f64, hi as f64)) as i128;
        return Ok(zx(r as u64, dt.bits()));
    }
    if !st.float() {
        let x: f64 = if st.signed() {
            sx(v, st.bits()) as f64
        } else {
            zx(v, st.bits()) as f64
        };
        // 64-bit integers may not be exact in f64: convert directly.
        let r = match dt {
            Ty::F32 => {
                let f = if st.bits() == 64 {
                    if st.signed() { sx(v, 64) as f32 } else { v as f32 }
                } else {
                    x as f32
                };
                return Ok(f.to_bits() as u64);
            }
            Ty::F64 => {
                let f = if st.bits() == 64 {
                    if st.signed() { sx(v, 64) as f64 } else { v as f64 }
                } else {
                    x
                };
                return Ok(f.to_bits());
            }
            _ => x,
        };
        return Ok(f2h(r, dt));
    }
    // float to float
    if is16x2(dt) {
        return Err("cvt to a packed pair takes two operands".into());
    }
    let x = fval(v, st);
    let x = if st == Ty::F32 && ftz {
        ftz32(x as f32, true) as f64
    } else {
        x
    };
    let x = if matches!(op.rnd, Rnd::Rni | Rnd::Rzi | Rnd::Rmi | Rnd::Rpi) {
        round_int(x, op.rnd)
    } else {
        x
    };
    let x = if sat { sat01(x) } else { x };
    Ok(match dt {
        Ty::TF32 => {
            // 10 mantissa bits kept, nearest with ties away (rna), in an f32 container.
            let b = (x as f32).to_bits();
            if !(x as f32).is_finite() {
                b as u64
            } else {
                (b.wrapping_add(0x1000) & 0xFFFF_E000) as u64
            }
        }
        Ty::F32 => {
            let r = if matches!(op.rnd, Rnd::Rz | Rnd::Rm | Rnd::Rp) {
                round_f32(x, 0.0, op.rnd)
            } else {
                x as f32
            };
            ftz32(r, ftz).to_bits() as u64
        }
        Ty::F64 => x.to_bits(),
        _ => {
            if matches!(op.rnd, Rnd::Rz) && dt == Ty::F16 {
                // toward zero: truncate the nearest when it rounded away
                let n = f16::from_f64(x);
                let back = n.to_f64();
                if back.abs() > x.abs() && x.is_finite() {
                    let b = n.to_bits();
                    (b - 1) as u64
                } else {
                    b16(n)
                }
            } else {
                f2h(x, dt)
            }
        }
    })
}

fn b16(h: f16) -> u64 {
    h.to_bits() as u64
}
