//! Opcodes and their modifiers, decoded once per instruction.

use crate::parse::Space;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    None,
    B8,
    U8,
    S8,
    B16,
    U16,
    S16,
    F16,
    BF16,
    B32,
    U32,
    S32,
    F32,
    F16x2,
    BF16x2,
    /// TensorFloat-32: an f32 whose low 13 mantissa bits `mma` ignores.
    TF32,
    B64,
    U64,
    S64,
    F64,
    Pred,
}

impl Ty {
    pub fn bits(self) -> u32 {
        match self {
            Ty::None => 64,
            Ty::B8 | Ty::U8 | Ty::S8 => 8,
            Ty::B16 | Ty::U16 | Ty::S16 | Ty::F16 | Ty::BF16 => 16,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 | Ty::F16x2 | Ty::BF16x2 | Ty::TF32 => 32,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 64,
            Ty::Pred => 1,
        }
    }
    pub fn bytes(self) -> usize {
        (self.bits() as usize).div_ceil(8)
    }
    pub fn signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }
    pub fn float(self) -> bool {
        matches!(
            self,
            Ty::F16 | Ty::BF16 | Ty::F32 | Ty::F64 | Ty::F16x2 | Ty::BF16x2 | Ty::TF32
        )
    }
    fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "b8" => Ty::B8,
            "u8" => Ty::U8,
            "s8" => Ty::S8,
            "b16" => Ty::B16,
            "u16" => Ty::U16,
            "s16" => Ty::S16,
            "f16" => Ty::F16,
            "bf16" => Ty::BF16,
            "b32" => Ty::B32,
            "u32" => Ty::U32,
            "s32" => Ty::S32,
            "f32" => Ty::F32,
            "f16x2" => Ty::F16x2,
            "bf16x2" => Ty::BF16x2,
            "tf32" => Ty::TF32,
            "b64" => Ty::B64,
            "u64" => Ty::U64,
            "s64" => Ty::S64,
            "f64" => Ty::F64,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Add,
    Sub,
    Mul,
    Mad,
    Fma,
    Div,
    Rem,
    Abs,
    Neg,
    Min,
    Max,
    And,
    Or,
    Xor,
    Not,
    CNot,
    Shl,
    Shr,
    /// Funnel shift.
    Shf,
    Selp,
    Setp,
    Set,
    Cvt,
    Cvta,
    Mov,
    Ld,
    St,
    Bra,
    Ret,
    Exit,
    /// `bar.sync` / `barrier.sync` / `bar.arrive` / `bar.red`.
    Bar,
    BarWarp,
    /// Fences, prefetches and hints: nothing to do in a sequentially consistent interpreter.
    Nop,
    Shfl,
    Vote,
    Activemask,
    Redux,
    Ex2,
    Lg2,
    Rcp,
    Sqrt,
    Rsqrt,
    Sin,
    Cos,
    Tanh,
    Prmt,
    Bfe,
    Bfi,
    Popc,
    Clz,
    Brev,
    Atom,
    Red,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    CpAsyncWaitAll,
    Ldmatrix,
    Mma,
    Copysign,
    Mul24,
    Mad24,
    Sad,
    /// `mbarrier.*` on a shared-memory barrier (mode: hop::MB_*).
    Mbar,
    /// `cp.async.mbarrier.arrive[.noinc]`: arrive once the thread's earlier `cp.async` copies land.
    CpAsyncMbar,
    /// `cp.async.bulk.tensor.<n>d` global to shared, completing on an mbarrier (shape[0] = n).
    Tma,
    /// `tensormap.replace.tile.<field>` (mode: hop::TM_*).
    TmapReplace,
    /// `tensormap.cp_fenceproxy`: a tensor map from shared to global memory.
    TmapCp,
    /// `wgmma.mma_async` (shape m, n, k; tys: D, A, B), a warpgroup collective.
    Wgmma,
    /// `wgmma.fence`: orders the thread's earlier register writes before the `wgmma.mma_async`
    /// that read those registers (its accumulators or A fragments).
    WgFence,
    /// `wgmma.commit_group`: the thread's `wgmma.mma_async` since the last one become a group.
    WgCommit,
    /// `wgmma.wait_group N`: every group of the thread's but the N most recent has completed.
    WgWait,
    /// `mapa[.shared::cluster].{u32,u64} d, a, rank`: the address of `a` in the shared memory of
    /// the cluster's block `rank` (space: SharedCluster, or Generic for generic addresses).
    Mapa,
    /// `getctarank[.shared::cluster].{u32,u64} d, a`: the cluster rank of the block whose shared
    /// memory `a` is in.
    GetCtaRank,
    /// `barrier.cluster.arrive` (mode::ARRIVE) / `barrier.cluster.wait` (mode::SYNC).
    ClusterBar,
    /// An instruction outside the interpreted subset (`st.async`, tcgen05, `call`, ...): parsed
    /// past, refused when a thread reaches it, so a kernel whose other branches use such
    /// instructions still runs the branches that do not.
    Unsupported,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    None,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Lo,
    Ls,
    Hi,
    Hs,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rnd {
    /// The instruction's default.
    Default,
    Rn,
    Rz,
    Rm,
    Rp,
    /// Nearest, ties away from zero (`cvt.rna.tf32.f32`).
    Rna,
    Rni,
    Rzi,
    Rmi,
    Rpi,
}

/// What `mode` means depends on the base: shuffle kind, vote kind, atomic/reduction operation,
/// `bar` flavour, boolean combination of `setp`.
pub mod mode {
    pub const NONE: u8 = 0;
    // shfl
    pub const UP: u8 = 1;
    pub const DOWN: u8 = 2;
    pub const BFLY: u8 = 3;
    pub const IDX: u8 = 4;
    // vote
    pub const ALL: u8 = 1;
    pub const ANY: u8 = 2;
    pub const UNI: u8 = 3;
    pub const BALLOT: u8 = 4;
    // atom / red / redux / bar.red / setp's combination
    pub const ADD: u8 = 1;
    pub const MIN: u8 = 2;
    pub const MAX: u8 = 3;
    pub const AND: u8 = 4;
    pub const OR: u8 = 5;
    pub const XOR: u8 = 6;
    pub const EXCH: u8 = 7;
    pub const CAS: u8 = 8;
    pub const INC: u8 = 9;
    pub const DEC: u8 = 10;
    pub const POPC: u8 = 11;
    // bar
    pub const SYNC: u8 = 1;
    pub const ARRIVE: u8 = 2;
    pub const RED: u8 = 3;
}

/// Hopper's asynchronous instructions: modes of `mbarrier.*` and fields of `tensormap.replace`.
pub mod hop {
    pub const MB_INIT: u8 = 1;
    pub const MB_ARRIVE: u8 = 2;
    /// `arrive.expect_tx`: add the transaction bytes, then arrive.
    pub const MB_ARRIVE_TX: u8 = 3;
    pub const MB_EXPECT_TX: u8 = 4;
    pub const MB_TRY_WAIT: u8 = 5;
    pub const MB_TEST_WAIT: u8 = 6;
    pub const MB_INVAL: u8 = 7;
    pub const TM_GLOBAL_ADDRESS: u8 = 1;
    pub const TM_RANK: u8 = 2;
    pub const TM_BOX_DIM: u8 = 3;
    pub const TM_GLOBAL_DIM: u8 = 4;
    pub const TM_GLOBAL_STRIDE: u8 = 5;
    pub const TM_ELEMENT_STRIDE: u8 = 6;
    pub const TM_ELEMTYPE: u8 = 7;
    pub const TM_INTERLEAVE: u8 = 8;
    pub const TM_SWIZZLE: u8 = 9;
    pub const TM_FILL: u8 = 10;
    /// `cp.async.mbarrier.arrive.noinc` (flags of CpAsyncMbar).
    pub const NOINC: u32 = 1;
    /// `.multicast::cluster` (flags of Tma): the box lands in every block of a mask (the fourth
    /// operand), each at the same offset and on the mbarrier at the same offset.
    pub const MULTICAST: u32 = 2;
}

pub mod flag {
    pub const HI: u32 = 1;
    pub const LO: u32 = 2;
    pub const WIDE: u32 = 4;
    pub const FTZ: u32 = 8;
    pub const SAT: u32 = 16;
    pub const APPROX: u32 = 32;
    pub const TRANS: u32 = 64;
    /// `cvta.to.*` (generic to a space) rather than `cvta.*` (a space to generic).
    pub const TO: u32 = 256;
    pub const ROW_A: u32 = 512;
    pub const COL_B: u32 = 1024;
    pub const RELU: u32 = 2048;
    pub const SHIFT: u32 = 4096;
    pub const NAN: u32 = 8192;
    pub const CLAMP: u32 = 32768;
}

#[derive(Debug, Clone)]
pub struct Op {
    pub base: Base,
    /// The first type modifier (the destination's where there are two).
    pub ty: Ty,
    /// The second type modifier (`cvt`'s source, `set`'s operands, ...).
    pub ty2: Ty,
    /// Every type modifier in order (`mma` has four).
    pub tys: Vec<Ty>,
    pub cmp: Cmp,
    pub rnd: Rnd,
    pub space: Space,
    pub vec: u8,
    pub mode: u8,
    /// `setp`'s combination with a third predicate (mode::AND / OR / XOR).
    pub bop: u8,
    pub flags: u32,
    /// `mma` m, n, k; `ldmatrix` matrices (x1, x2, x4) in `shape[0]`.
    pub shape: [u16; 3],
    pub name: String,
}

fn cmp_of(s: &str) -> Option<Cmp> {
    Some(match s {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" => Cmp::Lt,
        "le" => Cmp::Le,
        "gt" => Cmp::Gt,
        "ge" => Cmp::Ge,
        "lo" => Cmp::Lo,
        "ls" => Cmp::Ls,
        "hi" => Cmp::Hi,
        "hs" => Cmp::Hs,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

fn op_mode(s: &str) -> Option<u8> {
    Some(match s {
        "add" => mode::ADD,
        "min" => mode::MIN,
        "max" => mode::MAX,
        "and" => mode::AND,
        "or" => mode::OR,
        "xor" => mode::XOR,
        "exch" => mode::EXCH,
        "cas" => mode::CAS,
        "inc" => mode::INC,
        "dec" => mode::DEC,
        "popc" => mode::POPC,
        _ => return None,
    })
}

/// Modifiers that change nothing in an interpreter that runs threads one at a time with
/// sequentially consistent memory: cache hints, memory orderings and scopes, `.aligned`.
fn harmless(s: &str) -> bool {
    matches!(
        s,
        "nc" | "ca"
            | "cg"
            | "cs"
            | "lu"
            | "cv"
            | "wb"
            | "wt"
            | "volatile"
            | "relaxed"
            | "acquire"
            | "release"
            | "acq_rel"
            | "sc"
            | "weak"
            | "cta"
            | "gpu"
            | "sys"
            | "cluster"
            | "aligned"
            | "sync"
            | "uni"
            | "full"
            | "noftz"
            | "async"
    ) || s.starts_with("L1::")
        || s.starts_with("L2::")
        || s.starts_with("level::")
}

/// Decode `base.mod.mod...`.
/// An instruction outside the interpreted subset, named as written (`decode_op(name)` says why);
/// also the blank every decoded instruction starts from.
pub fn unsupported(name: &str) -> Op {
    Op {
        base: Base::Unsupported,
        ty: Ty::None,
        ty2: Ty::None,
        tys: Vec::new(),
        cmp: Cmp::None,
        rnd: Rnd::Default,
        space: Space::Generic,
        vec: 1,
        mode: mode::NONE,
        bop: mode::NONE,
        flags: 0,
        shape: [0; 3],
        name: name.to_string(),
    }
}

/// Hopper's asynchronous and cluster instructions the interpreter runs (None: not one of their
/// families). Their variants outside what it models (cache hints, im2col, phases by state token,
/// swizzles other than 128 bytes are checked at run time) are refused here.
fn decode_hopper(name: &str) -> Result<Option<Op>, String> {
    let p: Vec<&str> = name.split('.').collect();
    let has = |m: &str| p.contains(&m);
    let refuse = |why: &str| Err(format!("unsupported instruction `{name}` ({why})"));
    let mk = |base: Base| {
        let mut o = unsupported(name);
        o.base = base;
        o
    };
    let op = match (p[0], p.get(1).copied(), p.get(2).copied()) {
        ("setmaxnreg", ..) => mk(Base::Nop),
        ("wgmma", Some("fence"), _) => mk(Base::WgFence),
        ("wgmma", Some("commit_group"), _) => mk(Base::WgCommit),
        ("wgmma", Some("wait_group"), _) => mk(Base::WgWait),
        ("wgmma", Some("mma_async"), _) => {
            let mut o = mk(Base::Wgmma);
            for m in &p[2..] {
                if let Some(t) = Ty::parse(m) {
                    o.tys.push(t);
                } else if m.starts_with('m') && m.contains('n') && m.contains('k') {
                    let v: Vec<u16> = m[1..].split(['n', 'k']).map(|x| x.parse().unwrap_or(0)).collect();
                    if v.len() == 3 {
                        o.shape = [v[0], v[1], v[2]];
                    }
                } else if !matches!(*m, "sync" | "aligned") {
                    return refuse("a wgmma modifier the interpreter does not model");
                }
            }
            let n = o.shape[1];
            if o.shape[0] != 64 || o.shape[2] != 16 || n == 0 || n > 256 || n % 8 != 0 {
                return refuse("wgmma shapes m64nNk16 only");
            }
            if !(o.tys.len() == 3 && o.tys[0] == Ty::F32 && o.tys[1] == o.tys[2] && matches!(o.tys[1], Ty::F16 | Ty::BF16)) {
                return refuse("wgmma with f16 or bf16 inputs and f32 accumulators only");
            }
            o
        }
        ("mapa" | "getctarank", ..) => {
            let mut o = mk(if p[0] == "mapa" { Base::Mapa } else { Base::GetCtaRank });
            for m in &p[1..] {
                match *m {
                    "shared::cluster" => o.space = Space::SharedCluster,
                    "u32" => o.ty = Ty::U32,
                    "u64" => o.ty = Ty::U64,
                    _ => return refuse("a modifier the interpreter does not model"),
                }
            }
            if o.ty == Ty::None {
                return refuse("a type .u32 or .u64 is required");
            }
            o
        }
        ("barrier", Some("cluster"), what) => {
            let mut o = mk(Base::ClusterBar);
            o.mode = match what {
                Some("arrive") => mode::ARRIVE,
                Some("wait") => mode::SYNC,
                _ => return refuse("barrier.cluster.arrive and barrier.cluster.wait only"),
            };
            if p[3..]
                .iter()
                .any(|m| !matches!(*m, "release" | "relaxed" | "acquire" | "aligned"))
            {
                return refuse("a modifier the interpreter does not model");
            }
            o
        }
        ("mbarrier", Some(what), _) => {
            if !(has("shared::cta") || has("shared") || has("shared::cluster")) || !has("b64") {
                return refuse("mbarriers in shared memory (.shared, .shared::cta, .shared::cluster) only");
            }
            // Another block's mbarrier (a shared::cluster address) takes arrivals and transaction
            // counts; a block initialises and waits on its own.
            let remote_ok = matches!(what, "arrive" | "expect_tx");
            if has("shared::cluster") && !remote_ok {
                return refuse("mbarrier init, inval and waits on the block's own shared memory only (.shared::cta)");
            }
            let mut o = mk(Base::Mbar);
            o.space = if has("shared::cluster") {
                Space::SharedCluster
            } else {
                Space::Shared
            };
            o.mode = match what {
                "init" => hop::MB_INIT,
                "arrive" if has("expect_tx") => hop::MB_ARRIVE_TX,
                "arrive" if !has("noComplete") => hop::MB_ARRIVE,
                "expect_tx" => hop::MB_EXPECT_TX,
                "try_wait" if has("parity") => hop::MB_TRY_WAIT,
                "test_wait" if has("parity") => hop::MB_TEST_WAIT,
                "inval" => hop::MB_INVAL,
                _ => return refuse("mbarrier init, arrive[.expect_tx], expect_tx, try_wait/test_wait.parity and inval only"),
            };
            o
        }
        ("cp", Some("async"), Some("mbarrier")) => {
            let mut o = mk(Base::CpAsyncMbar);
            if has("noinc") {
                o.flags |= hop::NOINC;
            }
            o
        }
        ("cp", Some("async"), Some("bulk")) => match p.get(3).copied() {
            Some("commit_group" | "wait_group") => mk(Base::Nop),
            Some("tensor") => {
                let dims = p.get(4).and_then(|d| d.strip_suffix('d')).and_then(|d| d.parse::<u16>().ok());
                let Some(dims @ 1..=5) = dims else {
                    return refuse("tensor copies of 1 to 5 dimensions");
                };
                if !(has("shared::cluster") && has("global") && has("tile") && has("mbarrier::complete_tx::bytes"))
                    || has("L2::cache_hint")
                {
                    return refuse("tiled tensor loads to shared memory completing on an mbarrier only");
                }
                let mut o = mk(Base::Tma);
                o.shape[0] = dims;
                if has("multicast::cluster") {
                    o.flags |= hop::MULTICAST;
                }
                o
            }
            _ => return refuse("bulk copies other than tensor loads"),
        },
        ("tensormap", Some("replace"), Some("tile")) => {
            let mut o = mk(Base::TmapReplace);
            o.mode = match p.get(3).copied() {
                Some("global_address") => hop::TM_GLOBAL_ADDRESS,
                Some("rank") => hop::TM_RANK,
                Some("box_dim") => hop::TM_BOX_DIM,
                Some("global_dim") => hop::TM_GLOBAL_DIM,
                Some("global_stride") => hop::TM_GLOBAL_STRIDE,
                Some("element_stride") => hop::TM_ELEMENT_STRIDE,
                Some("elemtype") => hop::TM_ELEMTYPE,
                Some("interleave_layout") => hop::TM_INTERLEAVE,
                Some("swizzle_mode") => hop::TM_SWIZZLE,
                Some("fill_mode") => hop::TM_FILL,
                _ => return refuse("a tensor-map field the interpreter does not model"),
            };
            if !has("shared::cta") {
                return refuse("tensor maps replaced in shared memory only");
            }
            o
        }
        ("tensormap", Some("cp_fenceproxy"), _) => {
            if !(has("global") && has("shared::cta")) {
                return refuse("tensor maps copied from shared to global memory only");
            }
            mk(Base::TmapCp)
        }
        _ => return Ok(None),
    };
    Ok(Some(op))
}

pub fn decode_op(name: &str) -> Result<Op, String> {
    if let Some(op) = decode_hopper(name)? {
        return Ok(op);
    }
    let mut parts = name.split('.');
    let b = parts.next().unwrap_or("");
    let mut rest: Vec<&str> = parts.collect();
    let base = match b {
        "add" => Base::Add,
        "sub" => Base::Sub,
        "mul" => Base::Mul,
        "mad" => Base::Mad,
        "fma" => Base::Fma,
        "div" => Base::Div,
        "rem" => Base::Rem,
        "abs" => Base::Abs,
        "neg" => Base::Neg,
        "min" => Base::Min,
        "max" => Base::Max,
        "and" => Base::And,
        "or" => Base::Or,
        "xor" => Base::Xor,
        "not" => Base::Not,
        "cnot" => Base::CNot,
        "shl" => Base::Shl,
        "shf" => Base::Shf,
        "shr" => Base::Shr,
        "selp" => Base::Selp,
        "setp" => Base::Setp,
        "set" => Base::Set,
        "cvt" => Base::Cvt,
        "cvta" => Base::Cvta,
        "mov" => Base::Mov,
        "ld" | "ldu" => Base::Ld,
        "st" => Base::St,
        "bra" | "brx" => Base::Bra,
        "ret" => Base::Ret,
        "exit" => Base::Exit,
        "bar" | "barrier" => {
            if rest.first() == Some(&"warp") {
                rest.remove(0);
                Base::BarWarp
            } else {
                Base::Bar
            }
        }
        "membar" | "fence" | "prefetch" | "prefetchu" | "griddepcontrol" | "discard" | "applypriority" | "createpolicy"
        | "nanosleep" | "pmevent" => Base::Nop,
        "shfl" => Base::Shfl,
        "vote" => Base::Vote,
        "activemask" => Base::Activemask,
        "redux" => Base::Redux,
        "ex2" => Base::Ex2,
        "lg2" => Base::Lg2,
        "rcp" => Base::Rcp,
        "sqrt" => Base::Sqrt,
        "rsqrt" => Base::Rsqrt,
        "sin" => Base::Sin,
        "cos" => Base::Cos,
        "tanh" => Base::Tanh,
        "prmt" => Base::Prmt,
        "bfe" => Base::Bfe,
        "bfi" => Base::Bfi,
        "popc" => Base::Popc,
        "clz" => Base::Clz,
        "brev" => Base::Brev,
        "atom" => Base::Atom,
        "red" => Base::Red,
        "cp" => {
            if rest.first() != Some(&"async") {
                return Err(format!("unsupported instruction `{name}`"));
            }
            rest.remove(0);
            let b = match rest.first().copied() {
                Some("commit_group") => Base::CpAsyncCommit,
                Some("wait_group") => Base::CpAsyncWait,
                Some("wait_all") => Base::CpAsyncWaitAll,
                Some("bulk") | Some("mbarrier") => {
                    return Err(format!(
                        "unsupported instruction `{name}` (TMA and mbarrier-completed copies are not interpreted)"
                    ));
                }
                _ => Base::CpAsync,
            };
            if b != Base::CpAsync {
                rest.remove(0);
            }
            b
        }
        "ldmatrix" => Base::Ldmatrix,
        "mma" => Base::Mma,
        "copysign" => Base::Copysign,
        "mul24" => Base::Mul24,
        "mad24" => Base::Mad24,
        "sad" => Base::Sad,
        _ => {
            return Err(format!(
                "unsupported instruction `{name}` (the interpreter covers the SIMT subset, mma.sync, ldmatrix, mbarriers, TMA tensor loads (multicast too), wgmma and clusters; not st.async, tcgen05 or calls)"
            ));
        }
    };
    let mut op = Op {
        base,
        ..unsupported(name)
    };
    let mut layouts = 0;
    for m in rest {
        if let Some(t) = Ty::parse(m) {
            op.tys.push(t);
            if op.ty == Ty::None {
                op.ty = t;
            } else if op.ty2 == Ty::None {
                op.ty2 = t;
            }
            continue;
        }
        match (base, m) {
            (_, "rn") => op.rnd = Rnd::Rn,
            (_, "rz") => op.rnd = Rnd::Rz,
            (_, "rm") => op.rnd = Rnd::Rm,
            (_, "rp") => op.rnd = Rnd::Rp,
            (_, "rni") => op.rnd = Rnd::Rni,
            (_, "rna") => op.rnd = Rnd::Rna,
            (_, "rzi") => op.rnd = Rnd::Rzi,
            (_, "rmi") => op.rnd = Rnd::Rmi,
            (_, "rpi") => op.rnd = Rnd::Rpi,
            (_, "ftz") => op.flags |= flag::FTZ,
            (_, "sat" | "satfinite") => op.flags |= flag::SAT,
            (_, "approx") => op.flags |= flag::APPROX,
            (_, "hi") => op.flags |= flag::HI,
            (_, "lo") => op.flags |= flag::LO,
            (_, "wide") => op.flags |= flag::WIDE,
            (_, "cc") => return Err(format!("unsupported carry modifier in `{name}`")),
            (Base::Cvta, "to") => op.flags |= flag::TO,
            (Base::Ldmatrix, "trans") => op.flags |= flag::TRANS,
            (Base::Ldmatrix, "x1") => op.shape[0] = 1,
            (Base::Ldmatrix, "x2") => op.shape[0] = 2,
            (Base::Ldmatrix, "x4") => op.shape[0] = 4,
            (Base::Ldmatrix, "m8n8") => {}
            (Base::Mma, "row" | "col") => {
                // The first layout is A's, the second B's.
                if layouts == 0 && m == "row" {
                    op.flags |= flag::ROW_A;
                }
                if layouts == 1 && m == "col" {
                    op.flags |= flag::COL_B;
                }
                layouts += 1;
            }
            (Base::Mma, s) if s.starts_with('m') && s.contains('n') && s.contains('k') => {
                let p: Vec<u16> = s[1..].split(['n', 'k']).map(|x| x.parse().unwrap_or(0)).collect();
                if p.len() == 3 {
                    op.shape = [p[0], p[1], p[2]];
                }
            }
            (Base::Shfl, "up") => op.mode = mode::UP,
            (Base::Shfl, "down") => op.mode = mode::DOWN,
            (Base::Shfl, "bfly") => op.mode = mode::BFLY,
            (Base::Shfl, "idx") => op.mode = mode::IDX,
            (Base::Vote, "all") => op.mode = mode::ALL,
            (Base::Vote, "any") => op.mode = mode::ANY,
            (Base::Vote, "uni") => op.mode = mode::UNI,
            (Base::Vote, "ballot") => op.mode = mode::BALLOT,
            (Base::Bar, "sync") => op.mode = mode::SYNC,
            (Base::Bar, "arrive") => op.mode = mode::ARRIVE,
            (Base::Bar, "red") => op.mode = mode::RED,
            (Base::Bar, "popc" | "and" | "or") => op.bop = op_mode(m).unwrap_or(0),
            (Base::Atom | Base::Red | Base::Redux, s) if op_mode(s).is_some() => op.mode = op_mode(s).unwrap_or(0),
            (Base::Setp | Base::Set, "and" | "or" | "xor") => op.bop = op_mode(m).unwrap_or(0),
            (Base::Setp | Base::Set, s) if cmp_of(s).is_some() => op.cmp = cmp_of(s).unwrap_or(Cmp::None),
            (Base::Min | Base::Max, "NaN") => op.flags |= flag::NAN,
            (Base::Min | Base::Max, "xorsign" | "abs") => return Err(format!("unsupported modifier in `{name}`")),
            (Base::Shf, "l") => op.flags |= flag::SHIFT,
            (Base::Shf, "r") => {}
            (Base::Shf, "wrap") => {}
            (Base::Shf, "clamp") => op.flags |= flag::CLAMP,
            (_, "global") => op.space = Space::Global,
            (_, "shared" | "shared::cta") => op.space = Space::Shared,
            (Base::Ld | Base::St | Base::Atom | Base::Red | Base::Cvta, "shared::cluster") => op.space = Space::SharedCluster,
            (_, "local") => op.space = Space::Local,
            (_, "param") => op.space = Space::Param,
            (_, "const") => op.space = Space::Const,
            (_, "v2") => op.vec = 2,
            (_, "v4") => op.vec = 4,
            (_, "v8") => op.vec = 8,
            (Base::Bfe | Base::Bfi | Base::Prmt, "f4e" | "b4e" | "rc8" | "ecl" | "ecr" | "rc16") => {
                return Err(format!("unsupported prmt mode in `{name}`"));
            }
            (Base::Mad | Base::Fma | Base::Cvt, "relu") => op.flags |= flag::RELU,
            (_, s) if harmless(s) => {}
            // Fences and hints have no effect here, whatever their flavour.
            (Base::Nop, _) => {}
            _ => return Err(format!("unsupported modifier `.{m}` in `{name}`")),
        }
    }
    if matches!(base, Base::Mma) && !(op.flags & flag::ROW_A != 0 && op.flags & flag::COL_B != 0) {
        return Err(format!("unsupported layout in `{name}` (only .row.col)"));
    }
    Ok(op)
}

/// The fewest operands an instruction takes (the interpreter reads no further than this without
/// checking).
pub fn min_operands(op: &Op) -> usize {
    match op.base {
        Base::Ret
        | Base::Exit
        | Base::Nop
        | Base::CpAsyncCommit
        | Base::CpAsyncWaitAll
        | Base::WgFence
        | Base::WgCommit
        | Base::ClusterBar
        | Base::Unsupported => 0,
        Base::GetCtaRank => 2,
        Base::Mapa => 3,
        Base::WgWait => 1,
        Base::CpAsyncMbar => 1,
        Base::Mbar if matches!(op.mode, hop::MB_INVAL) => 1,
        Base::Mbar if matches!(op.mode, hop::MB_INIT | hop::MB_ARRIVE | hop::MB_EXPECT_TX) => 2,
        Base::Mbar => 3,
        Base::TmapReplace => 2,
        Base::TmapCp | Base::Tma => 3,
        Base::Wgmma => 6,
        Base::Bra | Base::Bar | Base::BarWarp | Base::CpAsyncWait | Base::Activemask => 1,
        Base::Mov | Base::Ld | Base::St | Base::Cvta | Base::Ldmatrix | Base::Red => 2,
        Base::Cvt if matches!(op.ty, Ty::F16x2 | Ty::BF16x2) => 3,
        Base::Cvt => 2,
        Base::Abs
        | Base::Neg
        | Base::Not
        | Base::CNot
        | Base::Popc
        | Base::Clz
        | Base::Brev
        | Base::Ex2
        | Base::Lg2
        | Base::Rcp
        | Base::Sqrt
        | Base::Rsqrt
        | Base::Sin
        | Base::Cos
        | Base::Tanh => 2,
        Base::Setp | Base::Set if op.bop != mode::NONE => 4,
        Base::Atom if op.mode == mode::CAS => 4,
        Base::Add
        | Base::Sub
        | Base::Mul
        | Base::Div
        | Base::Rem
        | Base::Min
        | Base::Max
        | Base::And
        | Base::Or
        | Base::Xor
        | Base::Shl
        | Base::Shr
        | Base::Copysign
        | Base::Mul24
        | Base::Setp
        | Base::Set
        | Base::Atom
        | Base::CpAsync
        | Base::Vote
        | Base::Redux => 3,
        Base::Mad | Base::Fma | Base::Selp | Base::Prmt | Base::Shf | Base::Bfe | Base::Sad | Base::Mad24 | Base::Mma => 4,
        Base::Shfl | Base::Bfi => 5,
    }
}
