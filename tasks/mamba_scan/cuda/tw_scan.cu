// Selective scan with time split over the warps of a block and channels over the lanes of a warp,
// and no block-wide barrier in the loop: one launch, every exp(delta * A) computed once, no scratch.
//
// warp_scan puts a channel's steps across the lanes of a warp: every lane reads its own steps'
// (Bm, Cm), and composing the lanes' maps costs five shuffle rounds per state and chunk plus a
// decay product kept per step for the second pass. Here a warp's lanes hold CH = 32 / G channels of
// the block, G lanes per channel and S = NS / G states per lane, and time is cut into runs of K
// steps dealt round-robin to the block's W warps (run r to warp r mod W), all for the same CH
// channels. For each of its runs a warp
//  1. copies the run's raw rows into a ring of its own (cp.async, SL runs ahead: delta and u of the
//     CH channels, Bm and Cm), so no other warp waits on its loads;
//  2. runs the K steps from a zero state, keeping each step's decay e = exp2(delta A log2 e) in
//     registers (and with XR 0 its input x = delta u Bm; XR 1 keeps delta u per step and forms x
//     again from Bm in the second pass); its map over the run is h -> P h + hl with
//     P = exp2(A log2(e) * sum delta) (one MUFU per state and run, no product kept per step);
//  3. waits for the state entering the run, handed over by the warp of run r - 1 through shared
//     memory and an mbarrier, forms the state leaving it (P h_in + hl: one FMA per state) and hands
//     that to the warp of run r + 1 at once: the only chain between warps is one FMA, a shared-memory
//     store and an mbarrier per run;
//  4. runs the steps again from the entering state (h = e h + x, one FMA) adding Cm h to its
//     partial y, sums the G partials of each (step, channel) with Dv u in its own part of shared
//     memory and stores its rows of y.
// Per step and state that is one MUFU and, beside it, the multiply for its argument, x, the two
// recurrences and y's FMA: no shuffles, no decay products. A warp's lanes read the same step, so a
// step's (Bm, Cm) row is the same few shared-memory addresses for the whole warp. Runs and warps
// proceed as a wavefront: a warp starts its next run's first pass while the hand-over passes
// through the other warps. A hand-over slot and its mbarrier phase are reused only after the
// consumer has read them: the producer's next hand-over to the same warp needs the state leaving
// that warp's run, which it forms after its wait.
//
// Any L (steps past L are zeros: exp2(0) = 1 and x = 0 leave the state unchanged; y stored only
// below L; the warp of the last run stores the final state), any D (channels past D have A = 0 and
// zero inputs and are not stored; element loads where D's rows are not aligned to the pieces).
// Tunables: NS (== N), G (lanes per channel: 2, 4, 8), W (warps per block: 4, 8, 16), K (steps per
// run: 4, 8, 16), SL (runs in a warp's ring: 2 or 3), XR (1: only the decays kept, the inputs formed
// again from Bm in the last pass: half the registers, so runs twice as long, half the hand-overs), HS
// (1, 2, 4: runs per link of the hand-over chain; the chain's warp composes the maps of the HS - 1
// runs after its own, published through shared memory and an mbarrier each), CV (1: the warp widens
// each run's Bm and Cm rows to f32 in shared memory once, after they land; without it every lane
// converts the halves it reads in both passes, and the 32 / G lanes of a warp that read the same
// state group convert the same halves: in NVRTC 13's machine code (bench/sass_census.py, --blocks)
// the loop's blocks go from 440 + 33 + 375 + 63 to 36 + 372 + 33 + 249 + 63 instructions a run at the
// defaults, 17% fewer, with no spills; 18% fewer at G 2 / K 8. Timed with LM 0 (H100, 2026-12-05,
// bench/h100-2026-12-05-scan-cv-ho-mlx.txt): 4-8% slower at G 4 (the widening and its warp barrier sit
// on every run's serial path), 4-7% faster at G 2 / K 8, whose batch-4 time it takes from 89.2 to 82.7 us
// (1.68x mamba_ssm). Widening delta and u the same way, as (delta, delta u, u) per step and channel,
// cost as many instructions as it saved and spilled: not kept), HO (1 or 2, with HS 1 and four states a
// lane: a link of the chain as one PTX sequence, link4 below, its addresses formed before the wait; 2
// polls with test_wait instead of the suspending try_wait. Without it ptxas puts the second pass's first
// multiplies, four rematerialised exponentials and the store's address arithmetic between the wait and
// the arrive: 52 instructions on that path, 4 of them MUFU; with it 10. Timed the same day: within 1% of
// HO 0 at every anchor shape, both values, so the link's own path is not what binds; default 0), YS (1: a
// group of G steps' partial y summed over the channel's G lanes by a butterfly of shuffles that also
// transposes, lane g storing step g, instead of through shared memory and a warp barrier; timed (H100,
// 2026-12-06, bench/h100-2026-12-06-scan-balance-g2-ys.txt): within 1% of YS 0 at G 4, 2% slower at G 2 /
// batch 4; default 0). Timed the same day and not kept: G 8 (blocks of 4 channels, to even out d_inner
// 1536) 1.2-1.6x slower everywhere; G 2, W 16, K 8 (one block of 16 warps an SM) 97-101 us at 1,4096,2048
// with 22% fewer instructions but 55.7% of issue slots busy, not bound by its chain (HS 4 there: the same
// time, bench/h100-2026-12-06-scan-hs-a1-k8.txt). A1 (1: a hand-over or a published map is one arrival,
// lane 0's after a warp barrier, instead of 32; timed the same day: 0.4-15% slower everywhere, default 0).
// Timed later that day and removed (H100, bench/h100-2026-12-06-scan-cluster-cv2.txt, the source as of
// commit 47ee71e): a group of channels' runs dealt over the warps of a cluster's 2 or 4 blocks on as many
// SMs, the hand-over between blocks through distributed shared memory (mapa, st.shared::cluster, a
// release-cluster arrive on the other block's mbarrier), to even out d_inner 1536's 192 blocks on 132 SMs:
// with the same warps a group (2 blocks of 4) 79.8 us there against 50.1 and 1.6-2.0x slower elsewhere;
// runs of 8 steps, twice the links that cross SMs, 2.4-3.4x; a link that crosses SMs cost about 1-1.5 us,
// and a polling wait (test_wait) instead of try_wait made it slower still (the same file, second call).
// And the next run's Bm and Cm rows widened while the current run waits for its state (off the path from
// the rows' landing to the first pass): 5-13% slower than without widening, CV 1 itself 2-8% slower at G 4.
// LM (lane order: 0, a channel's G lanes adjacent, lane = c G + g; 1, the channels adjacent, lane = g CH + c,
// so lanes 2i and 2i + 1 read the same Bm / Cm words, which shared memory returns to a pair of lanes packed),
// YP (1: a step's row of partial y padded by G floats, so the 16-byte loads that sum a channel's partials hit
// distinct banks), CF (with CV 1: 0 reads Cm as halves, once, in the second pass). Whatever LM, the partial y
// is stored channel-major (c G + g) and a hand-over slot holds lane l's states at l S, so neither the sums
// nor the link meet bank conflicts under LM 1. Nsight Compute at 1,4096,2048 (H100, 2026-12-06,
// bench/h100-2026-12-06-scan-lane-order.txt) showed why CV 1 lost at G 4: 15% fewer instructions than CV 0
// (59.5 M against 70.1 M), but the f32 rows double the bytes the loop reads from shared memory, short-scoreboard
// stalls went from 19.5 k to 69.3 k and issue slots busy from 73.6% to 59.6%. With LM 1 and YP 1 the stalls
// fall to 29.4 k, 67.0% busy, and CV 1 wins: 89.6 us at 1,4096,2048 (1.74x mamba_ssm) and 48.6 at d_inner
// 1536 (1.28x) against 93.6 / 50.2 for CV 0, LM 0, YP 0 in the same call. With that traffic gone, YS 1 (the
// partial y summed by shuffles, not through shared memory) gains too, where it was neutral before: the CUDA
// back-end's defaults are CV 1, LM 1, YP 1, YS 1 since (CF 1, HO 0), timed in two calls (H100, 2026-12-06,
// the same file): 87.5 / 87.8 us at 1,4096,2048 (1.78x / 1.77x), 17.6 / 17.7 at L 512 (1.43x / 1.42x),
// 47.1 / 47.3 at d_inner 1536 (1.31x / 1.31x), 40.4 / 40.4 at 3072 (1.44x / 1.43x), 92.1 / 92.7 at batch 4
// (1.50x / 1.49x; G 2, K 8 there: 82.2, 1.68x), against 93.3 / 94.0 us at L 4096 and 50.1 / 50.2 at d_inner
// 1536 for the old defaults in the same calls (every element of every run checked, compute-sanitizer 0
// errors). With CV 0 (halves, 8-byte loads) LM 1 is 2-3% slower; CF 0 and HO 1 are within 1-2% either way,
// SL 2 and K 8 with XR 0 slower. The MLX unit took the same defaults once timed inside MLX (below).
// DW (1: a run's delta and u rows widened once per warp to (delta, delta u) f32 pairs, read with one 8-byte
// load a step, and Dv u added where the partials are summed, instead of every lane widening its channel's
// delta and u and forming delta u and Dv u in the first pass). In NVRTC 13's machine code at the defaults the
// first pass goes from 376 to 322 instructions a run and the run from about 730 to 705 (the widening and the
// sums take back part; ptxas recomputes four exponentials), no spills. Timed (H100, 2026-12-06,
// bench/h100-2026-12-06-scan-yd.txt): 1-2% faster than DW 0 with the in-loop sums, 1-2% slower with YD 1;
// default 0. YD (with YS 1: each step's partial y kept in a register, the K / G groups summed by the
// butterfly after the loop, where they are independent and their shuffles overlap, and stored through one
// pointer stepped by G rows; Dv u added there, so the first pass no longer forms it). Nsight Compute's
// source page at the earlier defaults (bench/scan_ncu.sh SOURCE=1, bench/ncu_source.py) showed the hand-over
// wait running 0.71 times a run, so the chain did not bind, and 939 instructions a run, 383 in the second
// pass, where each group of G steps had its butterfly (the FADDs waiting on the shuffles), then a branch
// around its store with a 64-bit multiply for the address, and divergence checks (BRA.DIV, BSSY / BSYNC)
// around the next group's shuffles: about 15% of the stall samples on control and addressing. YD 1 joined
// the defaults of both units: 79.4, 79.4 and 80.0 us at 1,4096,2048 in three H100 calls on two machines
// (1.94-1.95x mamba_ssm, from 86.5 for YD 0
// in the same session), 1.43-1.95x on all five anchor shapes; inside MLX 0.91-0.99x of the CUDA back-end's
// time on MLX's GPU clock. MB (blocks per SM the register allocation must allow; 0: 16 / W): G 8 / K 8 at
// 64 registers (32 warps an SM) 150.3 us, G 4 / K 8 at 80 (24 warps) 105.2 us at 1,4096,2048: more warps do
// not pay for the per-run and per-step overheads that shorter runs and fewer states a lane multiply.
// Timed late on 2026-12-06 and removed (H100, bench/h100-2026-12-06-scan-dt.txt, the source as of commit 8e123c3):
// DT, a run's delta and delta u widened once per warp into f32 rows of K steps a channel (four steps a 16-byte
// load in the first pass, no conversions or delta u products there, the run's summed delta by shuffles in the
// widening). In NVRTC 13's machine code the first pass went from 386 to 294 instructions a run and the widening
// from 37 to 82, no spills, and it was 2.5-5.8% slower at every anchor shape (83.4 against 80.2 us at 1,4096,2048;
// 0.3-1.6% at G 2 / K 8), as DW was: the first pass's 68 MUFU a run occupy the exponential pipe for 544 cycles a warp (16 lanes a cycle
// per SM) against its 386 instructions, so instructions taken out of it free nothing, while the widening they
// move to sits on each run's serial path before it. YL (1: y's part from the run's own inputs, C . h with h run
// from zero, formed in that first pass, and the second pass only decays the entering state: hin = e hin,
// y += C . hin, two operations a state and step instead of three and no Bm; 2: Bm also read as halves in the
// first pass and no longer widened) moves work the other way, into the exponentials' shadow: the first pass
// 386 -> 466 instructions, the second 236 -> 156, sass_census's one-warp schedule of the two passes 1044 -> 932
// cycles, 128 registers, no spills (YL 2: 531 and 156, 980 cycles). Checked by the PTX interpreter (a mutant
// that skips one step's decay fails there). Timed (H100, 2026-12-07, bench/h100-2026-12-07-scan-yl-pe.txt): within
// 1% of YL 0 at every anchor shape (79.51 against 79.48 us at 1,4096,2048, 0.2-0.9% faster on the other four):
// default 0 in both units. In the same call PE, state 0's decay of two of every four steps by a polynomial on the
// FMA pipe (the first pass 386 -> 459 instructions, 68 -> 60 MUFU), was 4.4-7.5% slower at every anchor shape and is
// removed (the source as of commit f76ee49). Together these say the sentence above is wrong: if the first pass
// were bound by the exponentials' pipe, PE would have shortened it (480 cycles of that pipe a warp, not 544).
// What the time follows is the instructions a run issues in all (YL: the same 622 in the two passes, the same
// time; PE: about 9% more, 4-8% slower), with DT and DW losing because their widening sits on each run's
// serial path before the first pass. AO (1: each lane copies a run's rows from pointers of its own, stepped by
// W runs a load: its piece of the delta or u rows and its 16-byte chunks of Bm and Cm; y's rows from an offset
// stepped the same way) takes out part of what a run spends forming addresses: with the rows aligned, the run's
// path goes from 902 to 880 instructions in NVRTC 13's machine code (the copies' block from about 70 to 52, the
// stores' from 40 to 33), at 128 registers, no spills; G 2 needs K <= 8 (one piece a lane). Timed on an H100
// (2026-12-07, bench/h100-2026-12-07-scan-ao.txt, three rounds, every element checked, compute-sanitizer 0
// errors on the held-out and stress shapes): 79.8 -> 78.5 us at L = 4096 (1.98x mamba_ssm), 43.0 -> 42.3 at
// d_inner 1536, 35.8 -> 35.3 at 3072, 84.0 -> 83.8 at batch 4, 16.3 -> 16.4 at L 512: both units' default
// since.
// Measured on an H100 (2026-12-05, bench/h100-2026-12-05-scan-tw.txt; every element of every run
// checked, compute-sanitizer 0 errors), against mamba_ssm's selective-scan forward and warp_scan in the
// same call. The defaults (G 4, W 8, K 16, SL 3, XR 1): 92.5 us at 1,4096,2048 (1.67x mamba_ssm;
// warp_scan 102.0), 17.7 at L 512 (1.43x; 18.6), 49.3 at d_inner 1536 (1.24x; warp_scan's best there
// 50.6), 41.3 at 3072 (1.40x; 44.2), 95.7 at batch 4 (1.44x; 103.5; G 2 / K 8 / XR 1 88.4, 1.56x).
// What binds it is the hand-over chain: one link per run, and the chain runs through every run of the
// sequence. With K 8 and every step's input kept (XR 0: runs of 16 steps do not fit 128 registers) it
// ran at warp_scan's pace, 102.6-104.9 us at 1,4096,2048; Nsight Compute there: 71.9 M warp
// instructions issued on 67% of cycles (warp_scan 64.7 M on 62%), the warps waiting on the hand-over;
// a try_wait that suspends the thread (a 1 ms hint) instead of the poll changed nothing (104.73
// against 104.85 us). XR 1 makes the runs 16 steps long, half the links: 92.5 us. HS 2 and 4 cut the
// links further and are 4-10% slower at every anchor shape (H100, 2026-12-05, with CV and HO): composing
// the maps costs the chain's warp more than the hand-overs save. Nsight Compute at the defaults (1,4096,2048):
// 69.7 M warp instructions issued on 73% of cycles, 3.6 warps active and 1.7 eligible per scheduler, the
// stalls mostly another warp issuing and fixed-latency dependencies: the issue slots and each warp's own
// dependent chains bind, not the link.
// Once, SL 2 took 264.7 us at 1,4096,2048 with K 8 (108.5 in the next call): SL 3 is the default. Two
// designs before this one were slower and were replaced: the block's warps in lock-step (a chunk of W
// runs staged and converted for the block, the runs' maps composed by threads per (channel, state)
// between block barriers, four barriers a chunk: 114.8 us with K 8), and each warp composing the W - 1
// maps published since its own previous run instead of a chain (147.9 us: W - 1 mbarrier waits a run).
#ifndef KS_AXIS
#define KS_AXIS long long
#endif
#ifndef NS
#define NS 16
#endif
#ifndef G
#define G 4
#endif
#ifndef W
#define W 8
#endif
#ifndef K
#define K 16
#endif
#ifndef SL
#define SL 3
#endif
#ifndef XR
#define XR 1
#endif
#ifndef HS
#define HS 1
#endif
#ifndef CV
#define CV 1
#endif
#ifndef HO
#define HO 0
#endif
#ifndef YS
#define YS 1
#endif
#ifndef A1
#define A1 0
#endif
#ifndef LM
#define LM 1
#endif
#ifndef YP
#define YP 1
#endif
#ifndef CF
#define CF 1
#endif
#ifndef DW
#define DW 0
#endif
#ifndef YD
#define YD 1
#endif
#ifndef MB
#define MB 0
#endif
#ifndef YL
#define YL 0
#endif
#ifndef AO
#define AO 1
#endif
#define CH (32 / G)            // channels per block (and per warp)
#define S (NS / G)             // states per lane
#define RB (2 * CH)            // bytes per row of the CH channels' delta (or u)
#define PB (RB < 16 ? RB : 16) // bytes per cp.async piece of those rows
#define RP (RB / PB)           // pieces per row
#define HP (PB / 2)            // halves per piece
#define YR (32 + YP * G)  // floats per step of a warp's partial y (YP: padded so the sums read without bank conflicts)
#define MINB (MB ? MB : 16 / W)  // blocks per SM the register allocation must allow (16 / W: 128 registers)
#define LOG2E 1.4426950408889634f
#if NS != 8 && NS != 16
#error "NS must be 8 or 16"
#endif
#if G != 2 && G != 4 && G != 8
#error "G must be 2, 4 or 8"
#endif
#if NS % G != 0
#error "G must divide NS"
#endif
#if W != 4 && W != 8 && W != 16
#error "W must be 4, 8 or 16"
#endif
#if K != 4 && K != 8 && K != 16
#error "K must be 4, 8 or 16"
#endif
#if SL != 2 && SL != 3
#error "SL must be 2 or 3"
#endif
#if XR != 0 && XR != 1
#error "XR must be 0 or 1"
#endif
#if HS != 1 && HS != 2 && HS != 4
#error "HS must be 1, 2 or 4"
#endif
#if CV != 0 && CV != 1
#error "CV must be 0 or 1"
#endif
#if HO != 0 && HO != 1 && HO != 2
#error "HO must be 0, 1 or 2"
#endif
#if HO && (HS != 1 || NS / G != 4)
#error "HO needs HS 1 and 4 states a lane"
#endif
#if YS != 0 && YS != 1
#error "YS must be 0 or 1"
#endif
#if A1 != 0 && A1 != 1
#error "A1 must be 0 or 1"
#endif
#if LM != 0 && LM != 1
#error "LM must be 0 or 1"
#endif
#if YP != 0 && YP != 1
#error "YP must be 0 or 1"
#endif
#if CF != 0 && CF != 1
#error "CF must be 0 or 1"
#endif
#if DW != 0 && DW != 1
#error "DW must be 0 or 1"
#endif
#if YD != 0 && YD != 1
#error "YD must be 0 or 1"
#endif
#if MB != 0 && MB != 2 && MB != 3 && MB != 4
#error "MB must be 0, 2, 3 or 4"
#endif
#if YD && !YS
#error "YD needs YS"
#endif
#if YL != 0 && YL != 1 && YL != 2
#error "YL must be 0, 1 or 2"
#endif
#if YL == 2 && !CV
#error "YL 2 needs CV"
#endif
#if A1 && HO
#error "A1 needs HO 0 (HO's link arrives from every lane)"
#endif
#if YS && K % G != 0
#error "YS needs K a multiple of G"
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// PB bytes from g, or zeros when n == 0 (nothing is read then).
__device__ __forceinline__ void cp_row(void* s, const void* g, int n) {
#if PB == 16
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#elif PB == 8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
#endif
}
__device__ __forceinline__ void cp16(void* s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void mb_init(unsigned long long* m, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(m)), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned long long* m) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(m)) : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned long long* m, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_addr(m)), "r"(parity) : "memory");
    } while (!done);
}
// A hand-over or a published map: every lane's arrival completes the phase (32 arrivals), or with A1
// one lane arrives for the warp after a warp barrier (bar.warp.sync orders the other lanes' stores
// before lane 0's release-arrive), one update of the mbarrier instead of 32.
#define ARRIVALS (A1 ? 1 : 32)
__device__ __forceinline__ void hand_on(unsigned long long* m, int lane) {
#if A1
    __syncwarp();
    if (lane == 0) mb_arrive(m);
#else
    mb_arrive(m);
#endif
}
#if HO
// HO: one link of the hand-over chain as one PTX sequence: wait for the phase of mbarrier `mi`, read the
// entering state (four states at `src`), form the leaving state (p h_in + h) and store it at `dst`, arrive
// on `mo`. Every address is formed before the wait, and nothing else sits between the wait and the arrive.
__device__ __forceinline__ void link4(unsigned mi, unsigned parity, unsigned src, unsigned dst, unsigned mo,
                                      const float* p, const float* h, float* hin) {
    asm volatile(
        "{\n.reg .pred w;\n.reg .f32 o0, o1, o2, o3;\n"
        "WAIT:\n"
#if HO == 2
        "mbarrier.test_wait.parity.shared::cta.b64 w, [%4], %5;\n"
#else
        "mbarrier.try_wait.parity.shared::cta.b64 w, [%4], %5;\n"
#endif
        "@!w bra WAIT;\n"
        "ld.shared.v4.f32 {%0, %1, %2, %3}, [%6];\n"
        "fma.rn.f32 o0, %9, %0, %13;\n"
        "fma.rn.f32 o1, %10, %1, %14;\n"
        "fma.rn.f32 o2, %11, %2, %15;\n"
        "fma.rn.f32 o3, %12, %3, %16;\n"
        "st.shared.v4.f32 [%7], {o0, o1, o2, o3};\n"
        "mbarrier.arrive.shared::cta.b64 _, [%8];\n"
        "}\n"
        : "=f"(hin[0]), "=f"(hin[1]), "=f"(hin[2]), "=f"(hin[3])
        : "r"(mi), "r"(parity), "r"(src), "r"(dst), "r"(mo), "f"(p[0]), "f"(p[1]), "f"(p[2]), "f"(p[3]),
          "f"(h[0]), "f"(h[1]), "f"(h[2]), "f"(h[3])
        : "memory");
}
#endif
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("{.reg .b16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t;}" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

struct __align__(16) Run {      // one run's raw rows
    unsigned short dl[K][CH];  // delta of the CH channels
    unsigned short uu[K][CH];  // u
    unsigned short bm[K][NS];
    unsigned short cm[K][NS];
};
struct __align__(16) Smem {
    Run ring[W][SL];                // each warp's runs, SL ahead
    float ys[W][K][YR];             // each warp's partial y (channel c's state group g at c G + g)
    float hx[W][2][CH * NS];        // the state entering a warp's run, by the run's parity (lane l's S at l S)
    float mp[W][CH * NS];           // HS > 1: the map h -> P h + H of a warp's run, for the chain's warp
    float mh[W][CH * NS];
    unsigned long long mb[W];       // a hand-over to warp w completes a phase of mb[w] (ARRIVALS arrivals)
    unsigned long long mm[W];       // HS > 1: warp w's map published completes a phase of mm[w]
#if CV
    float bf[W][K][NS];             // CV: the warp's current run's Bm and (CF) Cm rows, widened once
#if CF
    float cf[W][K][NS];
#endif
#endif
#if DW
    float2 dw[W][K][CH];            // DW: the warp's current run's (delta, delta u), widened once
#endif
};
// What the launch's shared-memory expression in task.toml counts.
static_assert(sizeof(Smem) == W * (SL * K * (4 * CH + 4 * NS) + 4 * K * YR + 16 * CH * NS + 16 + CV * 4 * K * NS * (1 + CF) + DW * 8 * K * CH),
              "Smem size");

// S consecutive halves from shared memory, widened.
__device__ __forceinline__ void ld_s(const unsigned short* p, float (&v)[S]) {
#if S == 1
    v[0] = h2f(*p);
#else
    unsigned wv[S / 2];
#if S == 8
    const uint4 q = *(const uint4*)p;
    wv[0] = q.x;
    wv[1] = q.y;
    wv[2] = q.z;
    wv[3] = q.w;
#elif S == 4
    const uint2 q = *(const uint2*)p;
    wv[0] = q.x;
    wv[1] = q.y;
#else
    wv[0] = *(const unsigned*)p;
#endif
#pragma unroll
    for (int j = 0; j < S / 2; j++) {
        v[2 * j] = h2f((unsigned short)wv[j]);
        v[2 * j + 1] = h2f((unsigned short)(wv[j] >> 16));
    }
#endif
}
__device__ __forceinline__ void ld_f(const float* p, float (&v)[S]) {
#if S % 4 == 0
#pragma unroll
    for (int j = 0; j < S; j += 4) {
        const float4 q = *(const float4*)(p + j);
        v[j] = q.x;
        v[j + 1] = q.y;
        v[j + 2] = q.z;
        v[j + 3] = q.w;
    }
#elif S == 2
    const float2 q = *(const float2*)p;
    v[0] = q.x;
    v[1] = q.y;
#else
    v[0] = *p;
#endif
}
__device__ __forceinline__ void st_f(float* p, const float (&v)[S]) {
#if S % 4 == 0
#pragma unroll
    for (int j = 0; j < S; j += 4) *(float4*)(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
#elif S == 2
    *(float2*)p = make_float2(v[0], v[1]);
#else
    *p = v[0];
#endif
}

#if YS
// YS: the partial y of G consecutive steps (v[j]: step j) summed over the G lanes of a channel by a
// butterfly that also transposes: in the round over lane bit m a lane keeps the steps whose bit m
// matches its own and sends the others, so after log2(G) rounds lane g of the channel holds the
// whole sum for step g (G - 1 shuffles and adds a group, no shared memory).
__device__ __forceinline__ float xpose_sum(float (&v)[G], int g) {
#pragma unroll
    for (int m = G / 2; m >= 1; m /= 2) {
        const bool hi = (g & m) != 0;
#pragma unroll
        for (int j = 0; j < m; j++) {
            const float keep = hi ? v[j + m] : v[j];
            const float send = hi ? v[j] : v[j + m];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, LM ? m * CH : m);
        }
    }
    return v[0];
}
#endif

#if CV || DW
// CV: a run's Bm and (CF) Cm rows, K NS halves each, widened into f32 by the warp; DW: its delta and u rows
// (K CH halves each) into (delta, delta u) f32 pairs. Four consecutive halves a lane at a time (8-byte
// loads, 16-byte stores, both without bank conflicts), every load issued before the first conversion so
// their latencies overlap (the stores could alias the loads, so the compiler would not hoist them).
#if DW
static_assert(CH % 4 == 0, "DW widens four channels a lane");
#endif
__device__ __forceinline__ float4 h4f(uint2 q) {
    return make_float4(h2f((unsigned short)q.x), h2f((unsigned short)(q.x >> 16)), h2f((unsigned short)q.y),
                       h2f((unsigned short)(q.y >> 16)));
}
__device__ __forceinline__ void widen_run(const Run& rn, float* bf, float* cf, float2* dw, int lane) {
    constexpr int NB = CV ? (K * NS + 127) / 128 : 0, NC = CV && CF ? NB : 0, ND = DW ? (K * CH + 127) / 128 : 0;
    uint2 qb[NB + 1], qc[NC + 1], qd[ND + 1], qu[ND + 1];
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const int i = 4 * lane + 128 * j;
        if (K * NS % 128 == 0 || i < K * NS) {
            if (YL < 2) qb[j] = *(const uint2*)(&rn.bm[0][0] + i);
            if (NC) qc[j] = *(const uint2*)(&rn.cm[0][0] + i);
        }
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int i = 4 * lane + 128 * j;
        if (K * CH % 128 == 0 || i < K * CH) {
            qd[j] = *(const uint2*)(&rn.dl[0][0] + i);
            qu[j] = *(const uint2*)(&rn.uu[0][0] + i);
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const int i = 4 * lane + 128 * j;
        if (K * NS % 128 == 0 || i < K * NS) {
            if (YL < 2) *(float4*)(bf + i) = h4f(qb[j]);
            if (NC) *(float4*)(cf + i) = h4f(qc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int i = 4 * lane + 128 * j;
        if (K * CH % 128 == 0 || i < K * CH) {
            const float4 d = h4f(qd[j]), v = h4f(qu[j]);
            float4* o = (float4*)(dw + i);
            o[0] = make_float4(d.x, d.x * v.x, d.y, d.y * v.y);
            o[1] = make_float4(d.z, d.z * v.z, d.w, d.w * v.w);
        }
    }
}
#endif

// A run's raw rows into the warp's ring (steps from nt on and channels past D are zeros). A lane
// copies at most one piece of the delta and u rows (K RP <= 32) and one 16-byte piece of the Bm and
// Cm rows (K NS / 8 <= 32), at offsets fixed for the whole call (off: t D + HP p of its delta
// piece, tp its step, -1 without one); rows not aligned to the pieces (al false) go element by
// element. dl, uu, bm, cm point at the run's first step.
static_assert(K * RP <= 32 && K * NS / 8 <= 32, "one piece a lane");
__device__ __forceinline__ void load_run(Run& rn, const unsigned short* dl, const unsigned short* uu,
                                         const unsigned short* bm, const unsigned short* cm, long long off, int tp,
                                         bool pch, long long D, int nt, int nc, bool al, int lane) {
    if (al) {
        if (tp >= 0) {
            const bool ok = tp < nt && pch;
            cp_row(&rn.dl[0][0] + HP * lane, ok ? dl + off : dl, ok ? PB : 0);
            cp_row(&rn.uu[0][0] + HP * lane, ok ? uu + off : uu, ok ? PB : 0);
        }
    } else {
        for (int i = lane; i < K * CH; i += 32) {
            const int t = i / CH, c = i % CH;
            const bool ok = t < nt && c < nc;
            const long long x = (long long)t * D + c;
            rn.dl[t][c] = ok ? dl[x] : (unsigned short)0;
            rn.uu[t][c] = ok ? uu[x] : (unsigned short)0;
        }
    }
    if (K * NS / 8 == 32 || lane < K * NS / 8) {
        const bool ok = 8 * lane < nt * NS;
        cp16(&rn.bm[0][0] + 8 * lane, ok ? bm + 8 * lane : bm, ok ? 16 : 0);
        cp16(&rn.cm[0][0] + 8 * lane, ok ? cm + 8 * lane : cm, ok ? 16 : 0);
    }
}

#if AO
static_assert(2 * K * RP <= 32, "AO: one piece of the delta or u rows a lane (G 2 takes K <= 8)");
// AO (rows aligned): the lane's copies of a run into ring slot `rs` of its warp (`oa`, `ob`: the byte offsets of
// its delta / u piece and of its Bm chunk in a Run), from its own pointers, which then step to the warp's next
// run (W runs on). Steps from nt on arrive as zeros: a copy of source size 0 reads nothing, so the pointer
// it names (past L there) is never dereferenced.
__device__ __forceinline__ void load_run_ao(Run& rs, int nt, const unsigned short*& qa, const unsigned short*& qb,
                                            const unsigned short*& qc, int oa, int ob, int ta, bool va, bool vb,
                                            int lane, long long WKD) {
    unsigned char* const base = (unsigned char*)&rs;
    if (lane < 2 * K * RP) cp_row(base + oa, qa, va && ta < nt ? PB : 0);
    if (vb) {
        const int n = 8 * lane < nt * NS ? 16 : 0;
        cp16(base + ob, qb, n);
        cp16(base + ob + K * NS * 2, qc, n);
    }
    qa += WKD;
    qb += W * K * NS;
    qc += W * K * NS;
}
#endif

extern "C" __global__ void __launch_bounds__(32 * W, MINB) mamba_scan(
    const unsigned short* __restrict__ u, const unsigned short* __restrict__ delta, const float* __restrict__ A,
    const unsigned short* __restrict__ Bm, const unsigned short* __restrict__ Cm, const float* __restrict__ Dv,
    unsigned short* __restrict__ y, float* __restrict__ state, KS_AXIS batch_, KS_AXIS L_, KS_AXIS D_, KS_AXIS N_) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    const long long L = L_, D = D_;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    // the lane's channel in the block, its state group and first state (LM 1: lanes 2i and 2i + 1 read the
    // same Bm / Cm words; the G lanes of a channel CH apart)
    const int c = LM ? lane % CH : lane / G, g = LM ? lane / CH : lane % G, n0 = g * S;
    const int hs = lane * S;  // the lane's states in a hand-over slot or a published map (c NS + n0 with LM 0)
    const long long b = blockIdx.y;
    const long long d0 = (long long)blockIdx.x * CH;
    const int nc = (int)min((long long)CH, D - d0);
    const bool al = (D * 2) % PB == 0;  // every block's rows start on a piece boundary
    const unsigned short* dlg = delta + b * L * D + d0;
    const unsigned short* ug = u + b * L * D + d0;
    const unsigned short* bg = Bm + b * L * NS;
    const unsigned short* cg = Cm + b * L * NS;
    unsigned short* yg = y + b * L * D + d0;

    float a2[S];  // A log2(e) of the lane's states (0 past D)
#pragma unroll
    for (int s = 0; s < S; s++) a2[s] = c < nc ? A[(d0 + c) * NS + n0 + s] * LOG2E : 0.f;
    const float dvl = n0 == 0 && c < nc ? Dv[d0 + c] : 0.f;  // Dv u enters y once per channel
#if DW || YD
    // DW, YD: Dv u is added where the partials are summed: with YS by the lane that stores the step (its
    // channel's Dv), without it by the lane that sums two channels' partials (theirs)
    const float dvc = c < nc ? Dv[d0 + c] : 0.f;
    const int cs2 = 2 * (lane % (CH / 2));
    const float dv0 = cs2 < nc ? Dv[d0 + cs2] : 0.f, dv1 = cs2 + 1 < nc ? Dv[d0 + cs2 + 1] : 0.f;
#endif
    if (tid < W) {
        mb_init(&sm.mb[tid], ARRIVALS);
        mb_init(&sm.mm[tid], ARRIVALS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();  // the only block barrier: the mbarriers exist

    const int Ln = (int)L;
    const int nrun = (Ln + K - 1) / K;  // runs of the sequence; warp w takes runs w, w + W, ...
    const int mine = nrun > w ? (nrun - w + W - 1) / W : 0;
    const int tp = lane < K * RP ? lane / RP : -1;           // the lane's piece of the delta and u rows
    const long long off = (long long)(lane / RP) * D + HP * (lane % RP);
    const bool pch = HP * (lane % RP) < nc;
    const long long KD = (long long)K * D;
    const long long yoff = (long long)(lane / (CH / 2)) * D + 2 * (lane % (CH / 2));  // the lane's first y word
    const long long ystr = (long long)(32 / (CH / 2)) * D;
#if YS && YD
    const long long ylo = (long long)g * D + c, GD = (long long)G * D;  // YD: the lane's y, and G rows
#endif
#define RUN_PTRS(r) dlg + (r) * KD, ug + (r) * KD, bg + (long long)(r) * K * NS, cg + (long long)(r) * K * NS, off, tp, \
                    pch, D, min(K, Ln - (r) * K), nc, al, lane
#if AO
    // AO: each lane's copies of a run come from two or three pointers of its own, stepped by W runs a load
    // (not formed from the run's index by 64-bit multiplies): A, piece l of the run's delta rows or (l >= K RP)
    // of its u rows; B and C, the 16-byte chunk l of its Bm and Cm rows. y's rows start at element rk.
    const int pa = lane % (K * RP), ta = pa / RP;  // the lane's piece of the delta or u rows, and its step
    const bool va = lane < 2 * K * RP && HP * (pa % RP) < nc, vb = lane < K * NS / 8;
    const unsigned short* qa = (lane < K * RP ? dlg : ug) + (long long)w * KD + (long long)ta * D + HP * (pa % RP);
    const unsigned short* qb = bg + (long long)w * K * NS + 8 * lane;
    const unsigned short* qc = cg + (long long)w * K * NS + 8 * lane;
    const int oa = (lane < K * RP ? 0 : K * CH * 2) + 2 * HP * pa, ob = 2 * K * CH * 2 + 16 * lane;
    long long rk = (long long)w * KD;
    const long long WKD = W * KD;
#endif
#pragma unroll
    for (int j = 0; j < SL - 1; j++) {
#if AO
        if (j < mine) {
            if (al) load_run_ao(sm.ring[w][j], min(K, Ln - (w + j * W) * K), qa, qb, qc, oa, ob, ta, va, vb, lane, WKD);
            else load_run(sm.ring[w][j], RUN_PTRS(w + j * W));
        }
#else
        if (j < mine) load_run(sm.ring[w][j], RUN_PTRS(w + j * W));
#endif
        cp_commit();
    }
    for (int j = 0; j < mine; j++) {
        const int r = w + j * W;
#if AO
        if (j + SL - 1 < mine) {
            const int rl = r + (SL - 1) * W;
            if (al) load_run_ao(sm.ring[w][(j + SL - 1) % SL], min(K, Ln - rl * K), qa, qb, qc, oa, ob, ta, va, vb, lane, WKD);
            else load_run(sm.ring[w][(j + SL - 1) % SL], RUN_PTRS(rl));
        }
#else
        if (j + SL - 1 < mine) load_run(sm.ring[w][(j + SL - 1) % SL], RUN_PTRS(r + (SL - 1) * W));
#endif
        cp_commit();
        cp_wait<SL - 1>();  // this run's rows have landed (this lane's copies)
        __syncwarp();       // and every lane's
        const Run& rn = sm.ring[w][j % SL];
#if CV || DW
        // the run's Bm and Cm rows (CV) and its delta and u (DW) widened once for the warp, not once per lane
        // in each pass (every lane of a warp reads the same rows: 32 / G lanes converted the same halves)
#if CV && CF
        float* const cfw = &sm.cf[w][0][0];
#else
        float* const cfw = nullptr;
#endif
#if CV
        float* const bfw = &sm.bf[w][0][0];
#else
        float* const bfw = nullptr;
#endif
#if DW
        float2* const dww = &sm.dw[w][0][0];
#else
        float2* const dww = nullptr;
#endif
        widen_run(rn, bfw, cfw, dww, lane);
        __syncwarp();
#endif
#if CV
#if YL == 2
#define LD_BM(i, v) ld_s(&rn.bm[i][n0], v)  // YL 2: read once, in the first pass, as halves
#else
#define LD_BM(i, v) ld_f(&sm.bf[w][i][n0], v)
#endif
#if CF
#define LD_CM(i, v) ld_f(&sm.cf[w][i][n0], v)
#else
#define LD_CM(i, v) ld_s(&rn.cm[i][n0], v)  // read once, in the second pass: halves, half the bytes
#endif
#else
#define LD_BM(i, v) ld_s(&rn.bm[i][n0], v)
#define LD_CM(i, v) ld_s(&rn.cm[i][n0], v)
#endif

        // 2. the run from zero, keeping each step's decay and input (XR: delta u only), and Dv u
#if XR
        float e[S][K], dus[K], sk[K], h[S], sdt = 0.f;
#else
        float e[S][K], x[S][K], sk[K], h[S], sdt = 0.f;
#endif
#pragma unroll
        for (int i = 0; i < K; i++) {
#if DW
            const float2 dq = sm.dw[w][i][c];
            const float dt = dq.x, du = dq.y;
            sk[i] = 0.f;  // Dv u added with the sums
#else
            const float dt = h2f(rn.dl[i][c]), uv = h2f(rn.uu[i][c]);
            const float du = dt * uv;
            sk[i] = YD ? 0.f : dvl * uv;  // YD: Dv u added with the sums
#endif
            float bv[S];
            LD_BM(i, bv);
            sdt += dt;
#if XR
            dus[i] = du;
#pragma unroll
            for (int s = 0; s < S; s++) {
                e[s][i] = ex2(dt * a2[s]);
                const float xv = du * bv[s];
                h[s] = i == 0 ? xv : fmaf(e[s][i], h[s], xv);
            }
#else
#pragma unroll
            for (int s = 0; s < S; s++) {
                e[s][i] = ex2(dt * a2[s]);
                x[s][i] = du * bv[s];
                h[s] = i == 0 ? x[s][0] : fmaf(e[s][i], h[s], x[s][i]);
            }
#endif
#if YL
            {
                // YL: y's part from the run's own inputs, C . h with h run from zero; the second pass adds
                // C . (P_i h_in)
                float cv[S];
                LD_CM(i, cv);
#pragma unroll
                for (int s = 0; s < S; s++) sk[i] = fmaf(cv[s], h[s], sk[i]);
            }
#endif
        }

        // 3. the state entering the run, and the states leaving runs handed on. With HS > 1 only
        // every HS-th run's warp (the chain's) takes part in the chain: it composes the maps the next
        // HS - 1 runs' warps publish, hands each of them its entering state and the next chain run
        // the state leaving the last, so the chain takes one hand-over per HS runs.
        float hin[S], p[S];
#pragma unroll
        for (int s = 0; s < S; s++) p[s] = ex2(sdt * a2[s]);  // the run's decay product, before the wait
        const bool chain = r % HS == 0;  // W % HS == 0: a warp is in the chain for all its runs or none
        if (HS > 1 && !chain) {
            st_f(&sm.mp[w][hs], p);
            st_f(&sm.mh[w][hs], h);
            hand_on(&sm.mm[w], lane);  // read by the chain's warp before it hands this run its state
        }
        bool linked = false;  // HO: this run's link done as one sequence
#if HO
        if (r != 0 && r + 1 < nrun) {  // a link in the middle of the chain
            link4(smem_addr(&sm.mb[w]), (unsigned)(j & 1) ^ (w == 0), smem_addr(&sm.hx[w][(r / W) & 1][hs]),
                  smem_addr(&sm.hx[(w + 1) % W][((r + 1) / W) & 1][hs]), smem_addr(&sm.mb[(w + 1) % W]), p, h,
                  hin);
            linked = true;
        } else
#endif
        if (r == 0) {
#pragma unroll
            for (int s = 0; s < S; s++) hin[s] = 0.f;
        } else {
            mb_wait(&sm.mb[w], (unsigned)(j & 1) ^ (w == 0));  // warp 0's first wait is for run W
            ld_f(&sm.hx[w][(r / W) & 1][hs], hin);
        }
        if (chain && !linked) {
            float ho[S];  // the state leaving run r, then each later run of the group
#pragma unroll
            for (int s = 0; s < S; s++) ho[s] = fmaf(p[s], hin[s], h[s]);
            int last = r;
#pragma unroll
            for (int q = 1; q < HS; q++) {
                const int rq = r + q, wq = w + q;
                if (rq >= nrun) break;
                mb_wait(&sm.mm[wq], (unsigned)(rq / W) & 1);
                float pq[S], hq[S];
                ld_f(&sm.mp[wq][hs], pq);  // before the hand-over: warp wq reuses its map slot after it
                ld_f(&sm.mh[wq][hs], hq);
                st_f(&sm.hx[wq][(rq / W) & 1][hs], ho);
                hand_on(&sm.mb[wq], lane);
#pragma unroll
                for (int s = 0; s < S; s++) ho[s] = fmaf(pq[s], ho[s], hq[s]);
                last = rq;
            }
            if (last + 1 < nrun) {
                const int wn = (w + HS) % W;  // the next chain run, r + HS
                st_f(&sm.hx[wn][((last + 1) / W) & 1][hs], ho);
                hand_on(&sm.mb[wn], lane);  // release: the states above are visible to warp wn's acquire
            } else if (c < nc) {
#pragma unroll
                for (int s = 0; s < S; s++) state[(b * D + d0 + c) * NS + n0 + s] = ho[s];  // the last run's
            }
        }

        // 4. the run again from the entering state; Cm . h of the lane's states to y
        const int nt = min(K, Ln - r * K);
#if AO
        unsigned short* yr = yg + rk;
#else
        unsigned short* yr = yg + r * KD;
#endif
#if YS && YD
        float ya[K];  // YD: each step's partial y, summed after the loop
#elif YS
        float yv[G];  // the partials of the current group of G steps
        unsigned short* yl = yr + (long long)g * D + c;  // this lane's step of a group, its channel
#endif
#pragma unroll
        for (int i = 0; i < K; i++) {
            float cv[S];
            LD_CM(i, cv);
            float yi = sk[i];
#if YL
            // YL: hin becomes P_i h_in, the decays of the run's first i steps applied to the entering state
#pragma unroll
            for (int s = 0; s < S; s++) {
                hin[s] *= e[s][i];
                yi = fmaf(cv[s], hin[s], yi);
            }
#elif XR
            float bv[S];  // the inputs again from Bm, still in the ring
            LD_BM(i, bv);
#pragma unroll
            for (int s = 0; s < S; s++) {
                hin[s] = fmaf(e[s][i], hin[s], dus[i] * bv[s]);
                yi = fmaf(cv[s], hin[s], yi);
            }
#else
#pragma unroll
            for (int s = 0; s < S; s++) {
                hin[s] = fmaf(e[s][i], hin[s], x[s][i]);
                yi = fmaf(cv[s], hin[s], yi);
            }
#endif
#if YS && YD
            ya[i] = yi;
#elif YS
            yv[i % G] = yi;
            if (i % G == G - 1) {  // the group's sums: lane g of a channel stores step i - G + 1 + g
                float tot = xpose_sum(yv, g);
#if DW
                tot = fmaf(dvc, h2f(rn.uu[i - (G - 1) + g][c]), tot);  // zeros past the run's steps
#endif
                if (c < nc && i - (G - 1) + g < nt) yl[(long long)(i - (G - 1)) * D] = f2h(tot);
            }
#else
            sm.ys[w][i][c * G + g] = yi;  // channel-major whatever the lane order: the sums read 4 G bytes a channel
#endif
        }
#if YS && YD
        {
            // the sums of each group of G steps over the channel's G lanes: the groups are independent, so
            // their shuffles overlap; then lane g of a channel stores step q G + g of each group q, through
            // one pointer stepped by G rows (no 64-bit multiply a store)
            float tot[K / G];
#pragma unroll
            for (int q = 0; q < K / G; q++) {
                float v[G];
#pragma unroll
                for (int j = 0; j < G; j++) v[j] = ya[q * G + j];
                tot[q] = xpose_sum(v, g);
                tot[q] = fmaf(dvc, h2f(rn.uu[q * G + g][c]), tot[q]);  // Dv u (zeros past the run's steps)
            }
            if (c < nc) {
                unsigned short* yl = yr + ylo;
#pragma unroll
                for (int q = 0; q < K / G; q++, yl += GD)
                    if (q * G + g < nt) *yl = f2h(tot[q]);
            }
        }
#endif
#if !YS
        __syncwarp();
        // the G partials of two channels a lane, stored as one word where the rows are aligned and whole
        if (al && nc == CH) {
            const int c2 = 2 * (lane % (CH / 2));  // the same two channels for every q (32 is a multiple of CH / 2)
#pragma unroll
            for (int q = 0; q < (K * CH / 2 + 31) / 32; q++) {
                const int i = lane + 32 * q;
                const int t = i / (CH / 2);
                if (((K * CH / 2) % 32 != 0 && i >= K * CH / 2) || t >= nt) continue;
#if DW
                const unsigned uw = *(const unsigned*)&rn.uu[t][c2];  // the two channels' u
                float y0 = dv0 * h2f((unsigned short)uw), y1 = dv1 * h2f((unsigned short)(uw >> 16));
#else
                float y0 = 0.f, y1 = 0.f;
#endif
#pragma unroll
                for (int gg = 0; gg < G; gg++) {
                    y0 += sm.ys[w][t][c2 * G + gg];
                    y1 += sm.ys[w][t][(c2 + 1) * G + gg];
                }
                *(unsigned*)(yr + yoff + q * ystr) = (unsigned)f2h(y0) | ((unsigned)f2h(y1) << 16);
            }
        } else {
            for (int i = lane; i < nt * CH; i += 32) {
                const int t = i / CH, cc = i % CH;
                if (cc >= nc) continue;
#if DW
                float yv = Dv[d0 + cc] * h2f(rn.uu[t][cc]);
#else
                float yv = 0.f;
#endif
#pragma unroll
                for (int gg = 0; gg < G; gg++) yv += sm.ys[w][t][cc * G + gg];
                yr[(long long)t * D + cc] = f2h(yv);
            }
        }
#endif
        __syncwarp();  // ys read before the next run's partials; the ring slot free for its next load
#undef LD_BM
#undef LD_CM
#if AO
        rk += WKD;
#endif
    }
    cp_wait<0>();
}
