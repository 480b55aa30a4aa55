//! The interpreter on hand-written PTX: results that must come out right, and kernels that must
//! be caught (a missing barrier, a read before its cp.async wait, an access out of bounds or
//! misaligned, a deadlock, an endless loop, an instruction it does not model).

use ksearch_ptx::{Arg, Launch, Limits, load, run};

const HEAD: &str = ".version 8.0\n.target sm_90\n.address_size 64\n";

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn launch(entry: &str, grid: u32, block: u32) -> Launch {
    Launch {
        entry: entry.into(),
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        dynamic_shared: 0,
    }
}

const VADD: &str = r#"
.visible .entry vadd(
	.param .u64 vadd_param_0,
	.param .u64 vadd_param_1,
	.param .u64 vadd_param_2,
	.param .u64 vadd_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<5>;
	.reg .f32 	%f<4>;
	.reg .b64 	%rd<11>;

	ld.param.u64 	%rd1, [vadd_param_0];
	ld.param.u64 	%rd2, [vadd_param_1];
	ld.param.u64 	%rd3, [vadd_param_2];
	ld.param.u64 	%rd4, [vadd_param_3];
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mad.lo.s32 	%r4, %r1, %r2, %r3;
	cvt.s64.s32 	%rd5, %r4;
	setp.ge.s64 	%p1, %rd5, %rd4;
	GUARD
	cvta.to.global.u64 	%rd6, %rd1;
	mul.wide.s32 	%rd7, %r4, 4;
	add.s64 	%rd8, %rd6, %rd7;
	ld.global.f32 	%f1, [%rd8];
	cvta.to.global.u64 	%rd9, %rd2;
	add.s64 	%rd10, %rd9, %rd7;
	ld.global.f32 	%f2, [%rd10];
	add.f32 	%f3, %f1, %f2;
	cvta.to.global.u64 	%rd9, %rd3;
	add.s64 	%rd10, %rd9, %rd7;
	st.global.f32 	[%rd10], %f3;
$L__BB0_2:
	ret;
}
"#;

fn vadd(guard: &str, n: usize) -> Result<Vec<f32>, String> {
    let m = load(&format!("{HEAD}{}", VADD.replace("GUARD", guard))).unwrap();
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| 0.5 * i as f32).collect();
    let mut bufs = vec![f32s(&a), f32s(&b), vec![0xFF; 4 * n]];
    let args = [Arg::Buffer(0), Arg::Buffer(1), Arg::Buffer(2), Arg::Word(n as u64)];
    run(
        &m,
        &launch("vadd", n.div_ceil(32) as u32, 32),
        &args,
        &mut bufs,
        &Limits::default(),
    )?;
    Ok(floats(&bufs[2]))
}

#[test]
fn a_guarded_ragged_vector_add_is_exact() {
    let out = vadd("@%p1 bra 	$L__BB0_2;", 100).unwrap();
    for (i, x) in out.iter().enumerate() {
        assert_eq!(*x, 1.5 * i as f32, "element {i}");
    }
}

#[test]
fn an_unguarded_tail_is_an_out_of_bounds_access() {
    let e = vadd("", 100).unwrap_err();
    assert!(e.contains("4-byte access at byte 400") && e.contains("400 bytes"), "{e}");
}

const BSUM: &str = r#"
.visible .entry bsum(.param .u64 p0, .param .u64 p1)
{
	.reg .pred %p<3>;
	.reg .b32 %r<10>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<8>;
	.shared .align 4 .b8 buf[256];
	ld.param.u64 %rd1, [p0];
	ld.param.u64 %rd2, [p1];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.f32 %f1, [%rd4];
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	st.shared.f32 [%r4], %f1;
	BARRIER
	setp.ne.s32 %p1, %r1, 0;
	@%p1 bra DONE;
	mov.f32 %f2, 0f00000000;
	mov.u32 %r5, 0;
LOOP:
	shl.b32 %r6, %r5, 2;
	add.s32 %r7, %r2, %r6;
	ld.shared.f32 %f3, [%r7];
	add.f32 %f2, %f2, %f3;
	add.s32 %r5, %r5, 1;
	setp.lt.u32 %p2, %r5, 64;
	@%p2 bra LOOP;
	st.global.f32 [%rd2], %f2;
DONE:
	ret;
}
"#;

fn bsum(barrier: &str) -> f32 {
    let m = load(&format!("{HEAD}{}", BSUM.replace("BARRIER", barrier))).unwrap();
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut bufs = vec![f32s(&x), vec![0; 4]];
    run(
        &m,
        &launch("bsum", 1, 64),
        &[Arg::Buffer(0), Arg::Buffer(1)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
    floats(&bufs[1])[0]
}

#[test]
fn a_block_sum_needs_its_barrier() {
    assert_eq!(bsum("bar.sync 0;"), 2016.0);
    // Without it, thread 0 reads the second warp's slots before that warp wrote them: shared
    // memory starts as NaN bytes.
    assert!(bsum("").is_nan());
}

#[test]
fn warp_shuffles_reduce_and_scan() {
    let src = format!(
        "{HEAD}{}",
        r#"
.visible .entry wsum(.param .u64 p0, .param .u64 p1, .param .u64 p2)
{
	.reg .b32 %r<8>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<9>;
	.reg .pred %p<2>;
	ld.param.u64 %rd1, [p0];
	ld.param.u64 %rd2, [p1];
	ld.param.u64 %rd7, [p2];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.f32 %f1, [%rd4];
	mov.b32 %r2, %f1;
	shfl.sync.up.b32 %r5|%p1, %r2, 1, 0, -1;
	selp.b32 %r6, %r5, 0, %p1;
	add.s64 %rd8, %rd7, %rd3;
	st.global.u32 [%rd8], %r6;
	shfl.sync.bfly.b32 %r3, %r2, 16, 31, -1;
	mov.b32 %f2, %r3;
	add.f32 %f1, %f1, %f2;
	mov.b32 %r2, %f1;
	shfl.sync.bfly.b32 %r3, %r2, 8, 31, -1;
	mov.b32 %f2, %r3;
	add.f32 %f1, %f1, %f2;
	mov.b32 %r2, %f1;
	shfl.sync.bfly.b32 %r3, %r2, 4, 31, -1;
	mov.b32 %f2, %r3;
	add.f32 %f1, %f1, %f2;
	mov.b32 %r2, %f1;
	shfl.sync.bfly.b32 %r3, %r2, 2, 31, -1;
	mov.b32 %f2, %r3;
	add.f32 %f1, %f1, %f2;
	mov.b32 %r2, %f1;
	shfl.sync.bfly.b32 %r3, %r2, 1, 31, -1;
	mov.b32 %f2, %r3;
	add.f32 %f1, %f1, %f2;
	add.s64 %rd5, %rd2, %rd3;
	st.global.f32 [%rd5], %f1;
	ret;
}
"#
    );
    let m = load(&src).unwrap();
    let x: Vec<f32> = (0..32).map(|i| (i * i) as f32).collect();
    let mut bufs = vec![f32s(&x), vec![0; 128], vec![0; 128]];
    run(
        &m,
        &launch("wsum", 1, 32),
        &[Arg::Buffer(0), Arg::Buffer(1), Arg::Buffer(2)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
    let total: f32 = x.iter().sum();
    assert!(floats(&bufs[1]).iter().all(|v| *v == total), "{:?}", floats(&bufs[1]));
    let up = floats(&bufs[2]);
    assert_eq!(up[0], 0.0, "lane 0 has no lane below: the predicate is false");
    for i in 1..32 {
        assert_eq!(up[i], x[i - 1], "lane {i} reads lane {}", i - 1);
    }
}

fn cp_async(wait: &str) -> Vec<u8> {
    let src = format!(
        "{HEAD}{}",
        r#"
.visible .entry cpa(.param .u64 p0, .param .u64 p1)
{
	.reg .b32 %r<6>;
	.reg .b64 %rd<8>;
	.shared .align 16 .b8 tile[512];
	ld.param.u64 %rd1, [p0];
	ld.param.u64 %rd2, [p1];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 16;
	add.s64 %rd4, %rd1, %rd3;
	mov.u32 %r2, tile;
	shl.b32 %r3, %r1, 4;
	add.s32 %r4, %r2, %r3;
	cp.async.cg.shared.global [%r4], [%rd4], 16;
	cp.async.commit_group;
	WAIT
	ld.shared.v4.u32 {%r1, %r2, %r3, %r5}, [%r4];
	add.s64 %rd5, %rd2, %rd3;
	st.global.v4.u32 [%rd5], {%r1, %r2, %r3, %r5};
	ret;
}
"#
        .replace("WAIT", wait)
    );
    let m = load(&src).unwrap();
    let x: Vec<u8> = (0..512).map(|i| i as u8).collect();
    let mut bufs = vec![x, vec![0; 512]];
    run(
        &m,
        &launch("cpa", 1, 32),
        &[Arg::Buffer(0), Arg::Buffer(1)],
        &mut bufs,
        &Limits::default(),
    )
    .unwrap();
    bufs.swap_remove(1)
}

#[test]
fn cp_async_lands_at_its_wait() {
    let want: Vec<u8> = (0..512).map(|i| i as u8).collect();
    assert_eq!(cp_async("cp.async.wait_group 0;"), want);
    assert_eq!(cp_async("cp.async.wait_all;"), want);
    // Read before the wait: what shared memory held before (NaN bytes).
    assert!(cp_async("").iter().all(|b| *b == 0xFF));
}

fn one_thread(body: &str, regs: &str) -> Result<(), String> {
    let src = format!("{HEAD}.visible .entry k(.param .u64 p0)\n{{\n{regs}\n\tld.param.u64 %rd1, [p0];\n{body}\n\tret;\n}}\n");
    let m = load(&src)?;
    let mut bufs = vec![vec![0u8; 64]];
    let lim = Limits {
        max_steps: 100_000,
        ..Default::default()
    };
    run(&m, &launch("k", 1, 32), &[Arg::Buffer(0)], &mut bufs, &lim).map(|_| ())
}

#[test]
fn faults_and_hangs_are_reported_in_one_line() {
    let regs = "\t.reg .b64 %rd<4>;\n\t.reg .f32 %f<2>;\n\t.reg .pred %p<2>;";
    let e = one_thread("\tld.global.f32 %f1, [%rd1+2];", regs).unwrap_err();
    assert!(e.contains("misaligned 4-byte access at byte 2"), "{e}");
    let e = one_thread("\tld.global.f32 %f1, [%rd1+-4];", regs).unwrap_err();
    assert!(e.contains("no memory of the launch") || e.contains("bytes"), "{e}");
    let e = one_thread("LOOP:\n\tbra LOOP;", regs).unwrap_err();
    assert!(e.contains("step limit"), "{e}");
    // A barrier waiting for 64 threads in a block of 32.
    let e = one_thread("\tbar.sync 0, 64;", regs).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
    let e = one_thread("\ttcgen05.fence::after_thread_sync;", regs).unwrap_err();
    assert!(
        e.contains("unsupported instruction `tcgen05.fence::after_thread_sync`"),
        "{e}"
    );
    // Inline assembly is not checked by NVRTC for a virtual architecture: malformed operands
    // are refused, never a panic.
    let e = one_thread("\tshfl.sync.bfly.b32 %rd2, %rd3;", regs).unwrap_err();
    assert!(e.contains("needs 5 operands, has 2"), "{e}");
    let e = one_thread("\tbra NOWHERE;", regs).unwrap_err();
    assert!(e.contains("unknown label NOWHERE"), "{e}");
    assert!(!e.contains('\n'));
}

#[test]
fn an_unsupported_instruction_is_refused_only_where_a_thread_reaches_it() {
    let regs = "\t.reg .b64 %rd<4>;\n\t.reg .b32 %r<4>;\n\t.reg .pred %p<2>;";
    // A branch no thread takes holds instructions outside the model (Blackwell's tcgen05, a
    // remote store completing on an mbarrier, a TMA copy with an L2 cache hint, braces and an
    // address among its operands): the kernel runs, and its store lands.
    let body = "\tmov.u32 %r1, 7;\n\tsetp.eq.u32 %p1, %r1, 7;\n\t@%p1 bra DONE;\n\
                \ttcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r1], 32;\n\
                \tst.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%r1], %r2, [%r1];\n\
                \tcp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%r1], [%rd2, {%r2, %r3}], [%r1], %rd3;\n\
                DONE:\n\tst.global.u32 [%rd1], %r1;";
    one_thread(body, regs).unwrap();
    // Where a thread reaches one, the run stops there with the line and the reason.
    let body = "\tmov.u32 %r1, 7;\n\tsetp.eq.u32 %p1, %r1, 8;\n\t@%p1 bra DONE;\n\
                \ttcgen05.fence::before_thread_sync;\nDONE:\n\tret;";
    let e = one_thread(body, regs).unwrap_err();
    assert!(
        e.contains("`tcgen05.fence::before_thread_sync`: unsupported instruction `tcgen05.fence::before_thread_sync` ("),
        "{e}"
    );
    assert!(e.contains("line "), "{e}");
}

#[test]
fn conversions_round_as_ptx_says() {
    let src = format!(
        "{HEAD}{}",
        r#"
.visible .entry cv(.param .u64 p0)
{
	.reg .b16 %rs<4>;
	.reg .b32 %r<8>;
	.reg .f32 %f<8>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p0];
	mov.f32 %f1, 0f3FC00000;
	cvt.rni.s32.f32 %r1, %f1;
	st.global.u32 [%rd1], %r1;
	mov.f32 %f2, 0fC0200000;
	cvt.rmi.s32.f32 %r2, %f2;
	st.global.u32 [%rd1+4], %r2;
	cvt.rzi.s32.f32 %r3, %f2;
	st.global.u32 [%rd1+8], %r3;
	mov.f32 %f3, 0f4F800000;
	cvt.rzi.sat.s32.f32 %r4, %f3;
	st.global.u32 [%rd1+12], %r4;
	mov.f32 %f4, 0f3DCCCCCD;
	cvt.rn.f16.f32 %rs1, %f4;
	st.global.u16 [%rd1+16], %rs1;
	mov.f32 %f5, 0f3F800000;
	mov.f32 %f6, 0f33800001;
	fma.rm.f32 %f7, %f5, %f6, %f5;
	st.global.f32 [%rd1+20], %f7;
	fma.rp.f32 %f7, %f5, %f6, %f5;
	st.global.f32 [%rd1+24], %f7;
	mov.b32 %r5, 0x01020304;
	mov.b32 %r6, 0x05060708;
	prmt.b32 %r7, %r5, %r6, 0x3210;
	st.global.u32 [%rd1+28], %r7;
	prmt.b32 %r7, %r5, %r6, 0x4567;
	st.global.u32 [%rd1+32], %r7;
	ret;
}
"#
    );
    let m = load(&src).unwrap();
    let mut bufs = vec![vec![0u8; 64]];
    run(&m, &launch("cv", 1, 1), &[Arg::Buffer(0)], &mut bufs, &Limits::default()).unwrap();
    let b = &bufs[0];
    let i32at = |o: usize| i32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let f32at = |o: usize| f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    assert_eq!(i32at(0), 2, "1.5 to nearest even");
    assert_eq!(i32at(4), -3, "-2.5 toward -inf");
    assert_eq!(i32at(8), -2, "-2.5 toward zero");
    assert_eq!(i32at(12), i32::MAX, "2^32 saturates");
    assert_eq!(u16::from_le_bytes([b[16], b[17]]), half::f16::from_f32(0.1).to_bits());
    // 1 + 2^-24(1 + 2^-23): between 1 and the next f32 up.
    assert_eq!(f32at(20), 1.0);
    assert_eq!(f32at(24), 1.0f32.next_up());
    assert_eq!(i32at(28) as u32, 0x01020304);
    assert_eq!(i32at(32) as u32, 0x08070605, "bytes 7, 6, 5, 4 of (b, a)");
}

/// 64 threads: thread 0 initialises an mbarrier for `count` arrivals, each thread arrives, then
/// spins on phase 0 (try_wait.parity) and writes 1.
fn mbar_kernel(count: u32) -> Result<Vec<f32>, String> {
    let body = "\tmbarrier.arrive.shared::cta.b64 _, [%r2];
\tmov.u32 %r4, 0;
WAIT:
\tmbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], %r4;
\t@!%p2 bra WAIT;";
    mbar_kernel_with(count, body, false)
}

/// 64 threads: thread 0 initialises an mbarrier (`%r2`) for `count` arrivals; after a block
/// barrier every thread runs `body`, then writes 1.
fn mbar_kernel_with(count: u32, body: &str, reverse: bool) -> Result<Vec<f32>, String> {
    let src = format!(
        r#"{HEAD}
.visible .entry k(.param .u64 p0)
{{
	.shared .align 8 .b8 bar[8];
	.reg .pred %p<3>;
	.reg .b32 %r<6>;
	.reg .f32 %f<2>;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [p0];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	setp.ne.s32 %p1, %r1, 0;
	@%p1 bra AFTER;
	mov.u32 %r3, {count};
	mbarrier.init.shared::cta.b64 [%r2], %r3;
AFTER:
	bar.sync 0;
{body}
	cvta.to.global.u64 %rd2, %rd1;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	mov.f32 %f1, 0f3F800000;
	st.global.f32 [%rd4], %f1;
	ret;
}}
"#
    );
    let m = load(&src)?;
    let mut bufs = vec![vec![0u8; 64 * 4]];
    let lim = Limits {
        reverse,
        ..Limits::default()
    };
    run(&m, &launch("k", 1, 64), &[Arg::Buffer(0)], &mut bufs, &lim)?;
    Ok(floats(&bufs[0]))
}

/// Every thread takes one `try_wait` of the open phase 0 (no retry) before its own arrival, and
/// writes 1 only where the try said the phase was over.
#[test]
fn a_first_try_wait_of_an_open_phase_answers_false() {
    let body = "\tmov.u32 %r4, 0;
\tmbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], %r4;
\tmbarrier.arrive.shared::cta.b64 _, [%r2];
\t@!%p2 ret;";
    // As the hardware may once its time limit passes: a kernel that takes one try for the
    // phase's end reads what the phase guards too early, and the interpreter shows it (a try that
    // slept instead would leave every thread waiting for arrivals that never come).
    for reverse in [false, true] {
        assert_eq!(
            mbar_kernel_with(64, body, reverse).unwrap(),
            vec![0.0; 64],
            "reverse {reverse}"
        );
    }
}

/// 64 threads: warp 1 arrives on an mbarrier for 32 arrivals, warp 0 polls it with test_wait
/// (never suspending) until the phase is over; every thread then writes 1.
#[test]
fn a_test_wait_poll_ends_when_the_phase_completes() {
    let body = "\tsetp.lt.u32 %p1, %r1, 32;
\t@%p1 bra POLL;
\tmbarrier.arrive.shared::cta.b64 _, [%r2];
\tbra DONE;
POLL:
\tmov.u32 %r4, 0;
\tmbarrier.test_wait.parity.shared::cta.b64 %p2, [%r2], %r4;
\t@!%p2 bra POLL;
DONE:";
    for reverse in [false, true] {
        assert_eq!(
            mbar_kernel_with(32, body, reverse).unwrap(),
            vec![1.0; 64],
            "reverse {reverse}"
        );
    }
}

#[test]
fn an_mbarrier_phase_completes_on_its_last_arrival_and_a_short_one_is_a_deadlock() {
    // Every thread's arrival completes phase 0: every waiter gets through.
    assert_eq!(mbar_kernel(64).unwrap(), vec![1.0; 64]);
    // One arrival short: the waiters spin on a phase that never completes, reported as a
    // deadlock (not a hang).
    let e = mbar_kernel(65).unwrap_err();
    assert!(e.contains("deadlock") && e.contains("Spin"), "{e}");
    // Twice the arrivals a phase awaits: phases 0 and 1 complete, and parity 0 now names phase
    // 2, which never does (as on the GPU, a waiter two phases behind waits on).
    let e = mbar_kernel(32).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
}
