//! Thread-block clusters, on CUDA kernels compiled by NVRTC: distributed shared memory (`mapa`,
//! `.shared::cluster` loads and stores, generic addresses from `__cluster_map_shared_rank`),
//! `barrier.cluster`, arrivals on another block's mbarrier, the cluster's special registers, and
//! the faults a cluster adds (a rank outside the cluster, a block's shared memory used after it
//! exited, a deadlock across blocks, a grid that is no whole number of clusters).
//!
//! NVRTC (`libnvrtc.so.13`, on `LD_LIBRARY_PATH`) is loaded at run time; without it the tests are
//! skipped, unless `KSEARCH_REQUIRE_NVRTC=1`, where they fail.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use ksearch_ptx::{Arg, Launch, Limits, Module, load, run};

unsafe extern "C" {
    fn dlopen(name: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
}

/// `dlopen`'s flag: resolve every symbol now.
const RTLD_NOW: c_int = 2;

type Prog = *mut c_void;
type Create =
    unsafe extern "C" fn(*mut Prog, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
type Compile = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type Size = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type Text = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type Destroy = unsafe extern "C" fn(*mut Prog) -> c_int;

/// The NVRTC entry points these tests call.
struct Nvrtc {
    create: Create,
    compile: Compile,
    log_size: Size,
    log: Text,
    ptx_size: Size,
    ptx: Text,
    destroy: Destroy,
}

fn nvrtc() -> Option<&'static Nvrtc> {
    static N: std::sync::OnceLock<Option<Nvrtc>> = std::sync::OnceLock::new();
    N.get_or_init(|| {
        // SAFETY: opening a shared library and looking up functions whose C signatures the
        // fields above declare (NVRTC's API).
        unsafe {
            let h = dlopen(c"libnvrtc.so.13".as_ptr(), RTLD_NOW);
            if h.is_null() {
                return None;
            }
            let f = |name: &CStr| {
                let p = dlsym(h, name.as_ptr());
                assert!(!p.is_null(), "libnvrtc.so.13 has no {name:?}");
                p
            };
            Some(Nvrtc {
                create: std::mem::transmute::<*mut c_void, Create>(f(c"nvrtcCreateProgram")),
                compile: std::mem::transmute::<*mut c_void, Compile>(f(c"nvrtcCompileProgram")),
                log_size: std::mem::transmute::<*mut c_void, Size>(f(c"nvrtcGetProgramLogSize")),
                log: std::mem::transmute::<*mut c_void, Text>(f(c"nvrtcGetProgramLog")),
                ptx_size: std::mem::transmute::<*mut c_void, Size>(f(c"nvrtcGetPTXSize")),
                ptx: std::mem::transmute::<*mut c_void, Text>(f(c"nvrtcGetPTX")),
                destroy: std::mem::transmute::<*mut c_void, Destroy>(f(c"nvrtcDestroyProgram")),
            })
        }
    })
    .as_ref()
}

/// Whether NVRTC is here (as the other crates' NVRTC tests decide).
fn nvrtc_here() -> bool {
    if nvrtc().is_some() {
        return true;
    }
    assert!(
        std::env::var("KSEARCH_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "KSEARCH_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded"
    );
    eprintln!("skipped: no NVRTC (libnvrtc.so.13)");
    false
}

/// `src` compiled for compute_90 and parsed.
fn compile(src: &str) -> Module {
    let n = nvrtc().expect("NVRTC");
    let src = CString::new(src).unwrap();
    let opts = [c"--gpu-architecture=compute_90", c"--std=c++17"];
    let opts: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: NVRTC's API as documented: the program is created, compiled, read and destroyed
    // here; every buffer is as large as NVRTC says.
    let (ok, log, ptx) = unsafe {
        let mut p: Prog = std::ptr::null_mut();
        assert_eq!(
            (n.create)(&mut p, src.as_ptr(), c"k.cu".as_ptr(), 0, std::ptr::null(), std::ptr::null()),
            0
        );
        let ok = (n.compile)(p, opts.len() as c_int, opts.as_ptr()) == 0;
        let mut size = 0usize;
        (n.log_size)(p, &mut size);
        let mut log = vec![0u8; size.max(1)];
        (n.log)(p, log.as_mut_ptr() as *mut c_char);
        let mut ptx = Vec::new();
        if ok {
            (n.ptx_size)(p, &mut size);
            ptx = vec![0u8; size.max(1)];
            (n.ptx)(p, ptx.as_mut_ptr() as *mut c_char);
        }
        (n.destroy)(&mut p);
        let text = |b: Vec<u8>| String::from_utf8_lossy(&b).trim_end_matches('\0').to_string();
        (ok, text(log), text(ptx))
    };
    assert!(ok, "NVRTC: {log}");
    load(&ptx).unwrap_or_else(|e| panic!("{e}\n{ptx}"))
}

/// Inline-PTX helpers the kernels share.
const PRELUDE: &str = r#"
__device__ __forceinline__ unsigned ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned nctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned sa(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// The shared::cluster address of the variable at shared::cta address `a` in block `rank`.
__device__ __forceinline__ unsigned mapa(unsigned a, unsigned rank) {
    unsigned d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(rank));
    return d;
}
__device__ __forceinline__ void st_cluster(unsigned a, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_cluster(unsigned a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void mb_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// An arrival on the mbarrier at shared::cluster address `a` (another block's).
__device__ __forceinline__ void mb_arrive_remote(unsigned a) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(a) : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned long long* b, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(sa(b)), "r"(parity) : "memory");
    } while (!done);
}
"#;

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn launch(entry: &str, grid: [u32; 3], block: u32) -> Launch {
    Launch {
        entry: entry.into(),
        grid,
        block: [block, 1, 1],
        dynamic_shared: 0,
    }
}

/// Each block of a 2-block cluster writes its values into the other's shared memory (`mapa`
/// and `st.shared::cluster`, one thread a vector of four through `st.shared::cluster.v4.f32`),
/// adds one into it (`atom.shared::cluster`), and after `barrier.cluster` reads what it was
/// given: with its own `.shared` loads, and the peer's copy of what it gave with
/// `ld.shared::cluster`. The second kernel does the same with generic addresses
/// (`__cluster_map_shared_rank`, `__cluster_query_shared_rank`) and 48 of 64 threads (the
/// others exit at once: an exited thread counts as arrived at the cluster barrier).
const EXCHANGE: &str = r#"
extern "C" __global__ void __cluster_dims__(2, 1, 1) exchange(float* out) {
    __shared__ float buf[64];
    __shared__ alignas(16) float quad[4];
    __shared__ unsigned count;
    const unsigned r = ctarank(), peer = r ^ 1, t = threadIdx.x;
    if (t == 0) count = 0;
    cluster_sync();
    st_cluster(mapa(sa(&buf[t]), peer), 1000.0f * blockIdx.x + t);
    if (t == 0) {
        const unsigned q = mapa(sa(quad), peer);
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
            :: "r"(q), "f"(1.0f + r), "f"(2.0f + r), "f"(3.0f + r), "f"(4.0f + r) : "memory");
    }
    unsigned old;
    asm volatile("atom.shared::cluster.add.u32 %0, [%1], 1;" : "=r"(old) : "r"(mapa(sa(&count), peer)) : "memory");
    cluster_sync();
    out[blockIdx.x * 128 + t] = buf[t];
    out[blockIdx.x * 128 + 64 + t] = ld_cluster(mapa(sa(&buf[t]), peer));
    if (t < 4) out[512 + blockIdx.x * 8 + t] = quad[t];
    if (t == 0) out[512 + blockIdx.x * 8 + 4] = (float)count;
    cluster_sync();
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) exchange_generic(float* out) {
    __shared__ float buf[64];
    const unsigned r = __clusterRelativeBlockRank(), t = threadIdx.x;
    if (t >= 48) return;
    float* peer = (float*)__cluster_map_shared_rank(buf, r ^ 1);
    peer[t] = 1000.0f * blockIdx.x + t + 0.5f;
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
    out[blockIdx.x * 64 + t] = buf[t] + 10000.0f * __cluster_query_shared_rank(peer);
    __cluster_barrier_arrive_relaxed();
    __cluster_barrier_wait();
}
"#;

#[test]
fn blocks_of_a_cluster_exchange_through_distributed_shared_memory() {
    if !nvrtc_here() {
        return;
    }
    let m = compile(&format!("{PRELUDE}{EXCHANGE}"));
    // Four blocks: two clusters of two.
    for lim in [
        Limits::default(),
        Limits {
            reverse: true,
            slice: 3,
            ..Limits::default()
        },
    ] {
        let mut bufs = vec![vec![0u8; 4 * (512 + 32)]];
        run(&m, &launch("exchange", [4, 1, 1], 64), &[Arg::Buffer(0)], &mut bufs, &lim).unwrap();
        let out = floats(&bufs[0]);
        for b in 0..4usize {
            let peer = b ^ 1;
            for t in 0..64usize {
                assert_eq!(out[b * 128 + t], 1000.0 * peer as f32 + t as f32, "block {b} thread {t}");
                assert_eq!(out[b * 128 + 64 + t], 1000.0 * b as f32 + t as f32, "block {b} thread {t}");
            }
            let quad: Vec<f32> = (1..=4).map(|i| i as f32 + (peer % 2) as f32).collect();
            assert_eq!(&out[512 + b * 8..512 + b * 8 + 4], &quad[..], "block {b}");
            assert_eq!(out[512 + b * 8 + 4], 64.0, "block {b}");
        }
    }
    let mut bufs = vec![vec![0u8; 4 * 4 * 64]];
    run(
        &m,
        &launch("exchange_generic", [4, 1, 1], 64),
        &[Arg::Buffer(0)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
    let out = floats(&bufs[0]);
    for b in 0..4usize {
        for t in 0..48usize {
            let want = 1000.0 * (b ^ 1) as f32 + t as f32 + 0.5 + 10000.0 * ((b ^ 1) % 2) as f32;
            assert_eq!(out[b * 64 + t], want, "block {b} thread {t}");
        }
    }
}

/// A value handed back and forth between the two blocks of a cluster, one warp each: the sender
/// stores it into the receiver's shared memory and arrives on the receiver's mbarrier (an
/// arrival on another block's mbarrier); the receiver waits for the phase by parity, doubles it
/// and adds one, and sends it back the next round.
const PINGPONG: &str = r#"
extern "C" __global__ void __cluster_dims__(2, 1, 1) pingpong(float* out, int rounds) {
    __shared__ float box[32];
    __shared__ alignas(8) unsigned long long bar;
    const unsigned r = ctarank(), peer = r ^ 1, lane = threadIdx.x;
    if (lane == 0) mb_init(&bar, 1);
    cluster_sync();
    float v = lane + 100.0f * blockIdx.x;
    unsigned got = 0;
    for (int i = 0; i < rounds; i++) {
        if ((unsigned)(i & 1) == r) {
            __syncwarp();
            st_cluster(mapa(sa(&box[lane]), peer), v);
            __syncwarp();
            if (lane == 0) mb_arrive_remote(mapa(sa(&bar), peer));
        } else {
            mb_wait(&bar, got & 1);
            got++;
            v = 2.0f * box[lane] + 1.0f;
        }
    }
    out[blockIdx.x * 32 + lane] = v;
    cluster_sync();
}
"#;

#[test]
fn a_value_is_handed_between_blocks_through_remote_mbarrier_arrivals() {
    if !nvrtc_here() {
        return;
    }
    let m = compile(&format!("{PRELUDE}{PINGPONG}"));
    let rounds = 7;
    // What each block ends with.
    let mut want = vec![0f32; 4 * 32];
    for c in 0..2 {
        for lane in 0..32 {
            let mut v = [0, 1].map(|r| lane as f32 + 100.0 * (2 * c + r) as f32);
            for i in 0..rounds {
                let s = i & 1;
                v[s ^ 1] = 2.0 * v[s] + 1.0;
            }
            want[(2 * c) * 32 + lane] = v[0];
            want[(2 * c + 1) * 32 + lane] = v[1];
        }
    }
    for lim in [
        Limits::default(),
        Limits {
            reverse: true,
            late_copies: true,
            ..Limits::default()
        },
        Limits {
            slice: 1,
            ..Limits::default()
        },
    ] {
        let mut bufs = vec![vec![0u8; 4 * 4 * 32]];
        let args = [Arg::Buffer(0), Arg::Word(rounds as u64)];
        let st = run(&m, &launch("pingpong", [4, 1, 1], 32), &args, &mut bufs, &lim).unwrap();
        assert!(st.asynchronous > 0);
        assert_eq!(floats(&bufs[0]), want, "{lim:?}");
    }
}

/// Block 1 waits on an mbarrier nobody arrives on (mode 0), or on a cluster barrier block 0
/// never reaches as block 0 waits on that mbarrier (mode 1): a deadlock across the cluster,
/// reported (not a hang).
const STUCK: &str = r#"
extern "C" __global__ void __cluster_dims__(2, 1, 1) stuck(float* out, int mode) {
    __shared__ alignas(8) unsigned long long bar;
    const unsigned r = ctarank();
    if (threadIdx.x == 0) mb_init(&bar, 1);
    cluster_sync();
    if (mode == 0) {
        if (r == 1) mb_wait(&bar, 0);
    } else if (r == 0) {
        mb_wait(&bar, 0);
    }
    cluster_sync();
    out[blockIdx.x * 32 + threadIdx.x] = 1.0f;
}
"#;

#[test]
fn a_deadlock_across_the_blocks_of_a_cluster_is_reported() {
    if !nvrtc_here() {
        return;
    }
    let m = compile(&format!("{PRELUDE}{STUCK}"));
    for (mode, want) in [(0, "thread 0 of block (1, 0, 0)"), (1, "thread 0 of block (0, 0, 0)")] {
        let mut bufs = vec![vec![0u8; 4 * 2 * 32]];
        let args = [Arg::Buffer(0), Arg::Word(mode)];
        let e = run(&m, &launch("stuck", [2, 1, 1], 32), &args, &mut bufs, &Limits::default()).unwrap_err();
        assert!(e.starts_with("cluster (0, 0, 0): deadlock: "), "{e}");
        assert!(e.contains(want) && e.contains("Spin"), "{e}");
        if mode == 1 {
            assert!(e.contains("ClWait"), "{e}");
        }
        assert!(!e.contains('\n'), "{e}");
    }
    // A grid that is no whole number of clusters is refused, as the GPU refuses the launch.
    let mut bufs = vec![vec![0u8; 4 * 3 * 32]];
    let e = run(
        &m,
        &launch("stuck", [3, 1, 1], 32),
        &[Arg::Buffer(0), Arg::Word(0)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap_err();
    assert!(
        e.contains("grid [3, 1, 1] is not a whole number of clusters of shape [2, 1, 1]"),
        "{e}"
    );
}

/// Faults of distributed shared memory, by `mode`: 0 `mapa` to a rank outside the cluster, 1 a
/// store past the end of the peer's shared memory, 2 an address naming rank 4 of a 2-block
/// cluster, 3 a `.shared::cta` load of a `mapa` result, 4 a store into the peer's shared memory
/// after the peer exited (it arrived on this block's mbarrier, then exited: no cluster barrier
/// kept it), 5 a remote arrival on an address that holds no mbarrier.
const FAULTS: &str = r#"
extern "C" __global__ void __cluster_dims__(2, 1, 1) faults(float* out, int mode) {
    __shared__ float buf[64];
    __shared__ alignas(8) unsigned long long bar;
    const unsigned r = ctarank(), peer = r ^ 1, t = threadIdx.x;
    if (t == 0) mb_init(&bar, 1);
    cluster_sync();
    const unsigned a = sa(&buf[t]);
    if (mode == 0) st_cluster(mapa(a, nctarank() + t), 1.0f);
    if (mode == 1) st_cluster(mapa(a, peer) + 4096, 1.0f);
    if (mode == 2) st_cluster(a | (5u << 24), 1.0f);
    if (mode == 3) {
        float v;
        asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(mapa(a, peer)));
        out[t] = v;
    }
    if (mode == 4) {
        if (r == 1) {
            if (t == 0) mb_arrive_remote(mapa(sa(&bar), 0));
            return;
        }
        mb_wait(&bar, 0);
        st_cluster(mapa(a, peer), 1.0f);
    }
    if (mode == 5 && r == 0 && t == 0) mb_arrive_remote(mapa(a, peer));
    cluster_sync();
    out[blockIdx.x * 64 + t] = buf[t];
}
"#;

#[test]
fn distributed_shared_memory_faults_are_one_line_errors() {
    if !nvrtc_here() {
        return;
    }
    let m = compile(&format!("{PRELUDE}{FAULTS}"));
    for (mode, want) in [
        (0, "`mapa.shared::cluster.u32`: mapa to cluster rank "),
        (1, "of the shared memory of cluster rank 1, which has 264 bytes"),
        (2, "outside the cluster of 2 block(s)"),
        (3, "4-byte .shared::cta access at 0x20000"),
        (3, "a .shared::cluster address of cluster rank 1"),
        (4, "the shared memory of cluster rank 1, whose threads have all exited"),
        (5, "of the shared memory of cluster rank 1"),
    ] {
        let mut bufs = vec![vec![0u8; 4 * 2 * 64]];
        let args = [Arg::Buffer(0), Arg::Word(mode)];
        let e = run(&m, &launch("faults", [2, 1, 1], 64), &args, &mut bufs, &Limits::default()).unwrap_err();
        assert!(e.starts_with("block (0, 0, 0): line "), "mode {mode}: {e}");
        assert!(e.contains(want) && !e.contains('\n'), "mode {mode}: {e}");
    }
    // Without a fault the same kernel runs.
    let mut bufs = vec![vec![0u8; 4 * 2 * 64]];
    run(
        &m,
        &launch("faults", [2, 1, 1], 64),
        &[Arg::Buffer(0), Arg::Word(9)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
}

/// The cluster's special registers in a grid of 4 x 2 blocks in clusters of 2 x 2.
const SPECIALS: &str = r#"
extern "C" __global__ void __cluster_dims__(2, 2, 1) specials(unsigned* out) {
    if (threadIdx.x != 0) return;
    unsigned v[13];
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(v[0]));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(v[1]));
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(v[2]));
    asm("mov.u32 %0, %%clusterid.y;" : "=r"(v[3]));
    asm("mov.u32 %0, %%nclusterid.x;" : "=r"(v[4]));
    asm("mov.u32 %0, %%nclusterid.y;" : "=r"(v[5]));
    asm("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(v[6]));
    asm("mov.u32 %0, %%cluster_ctaid.y;" : "=r"(v[7]));
    asm("mov.u32 %0, %%cluster_nctaid.x;" : "=r"(v[8]));
    asm("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(v[9]));
    asm("{\n\t.reg .pred p;\n\tmov.pred p, %%is_explicit_cluster;\n\tselp.u32 %0, 1, 0, p;\n}" : "=r"(v[10]));
    v[11] = blockIdx.x;
    v[12] = blockIdx.y;
    const unsigned b = blockIdx.y * gridDim.x + blockIdx.x;
    for (int i = 0; i < 13; i++) out[b * 16 + i] = v[i];
}
"#;

#[test]
fn cluster_special_registers_name_the_block_in_its_cluster() {
    if !nvrtc_here() {
        return;
    }
    let m = compile(SPECIALS);
    let mut bufs = vec![vec![0xFFu8; 4 * 16 * 8]];
    run(
        &m,
        &launch("specials", [4, 2, 1], 32),
        &[Arg::Buffer(0)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
    let out = words(&bufs[0]);
    for y in 0..2u32 {
        for x in 0..4u32 {
            let b = (y * 4 + x) as usize;
            let (cx, cy) = (x % 2, y % 2);
            let want = [cx + 2 * cy, 4, x / 2, y / 2, 2, 1, cx, cy, 2, 2, 1, x, y];
            assert_eq!(&out[b * 16..b * 16 + 13], &want[..], "block ({x}, {y})");
        }
    }
}

/// Hand-written PTX (no NVRTC needed): a cluster of 2 given in the one-number form, `mapa` of
/// `var+imm`, generic `mapa.u64` and `getctarank`, `cvta.to.shared::cluster`, and a
/// `.shared::cluster` and a generic store into the peer's shared memory.
const PTX_PEER: &str = r#"
.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 p0)
SHAPE
{
	.shared .align 4 .b8 buf[64];
	.reg .pred %p<2>;
	.reg .b32 %r<12>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<10>;
	ld.param.u64 %rd1, [p0];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %cluster_ctarank;
	xor.b32 %r3, %r2, 1;
	mapa.shared::cluster.u32 %r4, buf+4, %r3;
	getctarank.shared::cluster.u32 %r5, buf+4;
	getctarank.shared::cluster.u32 %r6, %r4;
	mov.u64 %rd2, buf;
	cvta.shared.u64 %rd3, %rd2;
	mapa.u64 %rd4, %rd3, %r3;
	getctarank.u64 %r7, %rd4;
	cvta.to.shared::cluster.u64 %rd5, %rd4;
	cvt.u32.u64 %r8, %rd5;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra SYNC;
	cvt.rn.f32.u32 %f1, %r2;
	st.shared::cluster.f32 [%r4], %f1;
	add.f32 %f2, %f1, 0f41200000;
	st.f32 [%rd4+8], %f2;
SYNC:
	ARRIVE
	barrier.cluster.wait;
	@%p1 bra DONE;
	mov.u32 %r9, %ctaid.x;
	mul.wide.u32 %rd6, %r9, 32;
	add.s64 %rd7, %rd1, %rd6;
	ld.shared.u32 %r10, [buf+4];
	st.global.u32 [%rd7], %r10;
	ld.shared.u32 %r10, [buf+8];
	st.global.u32 [%rd7+4], %r10;
	st.global.u32 [%rd7+8], %r5;
	st.global.u32 [%rd7+12], %r6;
	st.global.u32 [%rd7+16], %r7;
	st.global.u32 [%rd7+20], %r8;
	st.global.u32 [%rd7+24], %r4;
DONE:
	ret;
}
"#;

fn ptx_peer(shape: &str, arrive: &str, grid: u32) -> Result<Vec<u32>, String> {
    let m = load(&PTX_PEER.replace("SHAPE", shape).replace("ARRIVE", arrive))?;
    let mut bufs = vec![vec![0u8; 32 * grid as usize]];
    run(
        &m,
        &launch("k", [grid, 1, 1], 64),
        &[Arg::Buffer(0)],
        &mut bufs,
        &Limits::default(),
    )?;
    Ok(words(&bufs[0]))
}

#[test]
fn hand_written_cluster_ptx_maps_addresses_between_blocks() {
    let arrive = "barrier.cluster.arrive.relaxed.aligned;";
    let out = ptx_peer(".reqnctapercluster 2", arrive, 4).unwrap();
    for b in 0..4u32 {
        let (me, peer) = (b % 2, (b % 2) ^ 1);
        let want = [
            (peer as f32).to_bits(),
            (peer as f32 + 10.0).to_bits(),
            me,
            peer,
            peer,
            (peer + 1) << 24,
            ((peer + 1) << 24) + 4,
        ];
        assert_eq!(&out[b as usize * 8..b as usize * 8 + 7], &want[..], "block {b}");
    }
    // Launches the GPU refuses.
    let e = ptx_peer(".reqnctapercluster 16, 1, 1", arrive, 16).unwrap_err();
    assert!(e.contains("cluster shape [16, 1, 1]: 16 blocks (1 to 8)"), "{e}");
    let e = ptx_peer(".explicitcluster", arrive, 4).unwrap_err();
    assert!(e.contains("takes its cluster shape at launch"), "{e}");
    // A cluster barrier waited on without an arrival, or arrived at twice before the wait.
    let e = ptx_peer(".reqnctapercluster 2", "", 4).unwrap_err();
    assert!(
        e.contains("barrier.cluster.wait without a barrier.cluster.arrive before it"),
        "{e}"
    );
    let e = ptx_peer(
        ".reqnctapercluster 2",
        "barrier.cluster.arrive;\n\tbarrier.cluster.arrive;",
        4,
    )
    .unwrap_err();
    assert!(e.contains("a second barrier.cluster.arrive"), "{e}");
    // Without a cluster shape the launch is a grid of clusters of one block: rank 0, and its
    // peer (rank 1) is outside.
    let e = ptx_peer("", arrive, 4).unwrap_err();
    assert!(e.contains("mapa to cluster rank 1, outside the cluster of 1 block(s)"), "{e}");
}
