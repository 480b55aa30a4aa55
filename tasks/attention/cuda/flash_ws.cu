// FlashAttention forward on Hopper with warp specialisation (wgmma, setmaxnreg: sm_90a): the
// design of flash_wgmma.cu (same tile layouts, descriptors, online softmax, masks and argument
// order) with the work split by role, after the FlashAttention-3 paper (Shah et al., 2024): one
// block per (128 query rows, batch*head) of three warpgroups (384 threads).
//  - Warpgroup 0, the producer (setmaxnreg.dec to PREG registers): copies Q and the K/V tiles into
//    shared memory with 16-byte cp.async (the 128-byte swizzled layout wgmma reads), a ring of
//    STAGES buffers: it waits on a stage's `empty` mbarrier, issues the tile and arms the stage's
//    `full` mbarrier with cp.async.mbarrier.arrive.noinc (each producer thread arrives when its
//    copies have landed); a consumer that sees `full` fences the async proxy before its wgmma
//    reads (as flash_wgmma's MBAR=1 does).
//  - Warpgroups 1 and 2, the consumers (setmaxnreg.inc to CREG registers), 64 query rows each: S =
//    Q K^T (wgmma, both operands in shared memory), online exp2 softmax in registers, O += P V
//    (P from registers, V read transposed); the PV product of tile t-1 is in flight with the S of
//    tile t and overlaps the softmax of tile t; a warp arrives on a stage's `empty` barrier once
//    its last wgmma on it has completed. No load instruction in the consumers' loop.
//  - PP=1, ping-pong: the two consumers take turns to issue their matrix products (named barriers
//    1 and 2, 256 threads), so one warpgroup's softmax runs while the other's products occupy the
//    tensor cores.
// Any L (tail tiles zero-filled by cp.async src-size 0, keys past L masked to -inf, rows past L
// not stored), grouped-query heads (query head h reads key/value head h / (H / Hkv)), causal
// (tiles past the diagonal skipped), HD 64, 96 (laid out as 128 columns) or 128.
// Persistent: the grid is min(work items, CTAS) blocks (the task's BAL 1: without the mask ceil(items /
// ceil(items / CTAS)), the same rounds with no block a round short); where the items outnumber the blocks, each
// block strides over (head, 128-row query block) items, under the causal mask over pairs of them
// (work_item below). At CTAS = the
// SM count every SM keeps one block for the whole call and the producer loads the next item's Q
// and K/V tiles while the consumers finish the last tiles of this one and store its output (Q's
// buffer is handed back by an mbarrier once both consumers' last S products have completed).
// Where ptxas waits for the PV product in flight (bench/sass_census.py --waits): in NVRTC 13's machine code
// the wait for the PV product of tile t - 1 comes before any of tile t's exponentials (the PTX has it after
// the softmax; ptxas hoists it to the top of the block after the masking branch), so a warpgroup's softmax
// overlaps the other's products, not its own. MS (the rest of the iteration twice, for masked and plain
// tiles, and a warp barrier before that wait) put the wait after all 66 exponentials and was 4-12% slower
// wherever the tiles run; QR (Q's fragment in registers as the S products' A operand) on top of it slower
// still (H100, 2026-12-06, bench/h100-2026-12-06-attention-ms-pvss.txt): neither kept.
// A split tail (SK: the items left after the whole rounds cut along their key tiles into a range a block,
// partial results merged through a workspace by the warp that lands an item's last piece) was built, checked
// by the PTX interpreter and the GPU stress suite, and timed 4-8% slower on every shape, causal ones where it
// cut nothing included (H100, 2026-12-06, bench/h100-2026-12-06-softmax-diag-sk.txt): not kept.
// Tunables: HD (== D), BLOCK_N (keys per tile: 64, 128, 160, 176 or 192), STAGES (K/V buffers: 2-4, as
// shared memory allows), KVS (K and V of a stage released apart), PP (ping-pong: 0 or 1), CTAS (blocks: the GPU's SM count, 132 on an H100/H200
// SXM; a value above the items gives one item per block, the launch of the kernel before it was
// persistent); PREG / CREG (registers of producer / consumers) are fixed, 24 / 240 (as FlashAttention-3
// gives its two consumer warpgroups; ptxas allocates each role's branch within its setmaxnreg). With the
// earlier 48 / 224 NVRTC 13's build at the defaults spilled 4 bytes (8 in MLX's [B, L, H, D] build), 24 / 240
// none; the cp.async producer (TMA 0) spills 16 and MC 1 4. Timed on an H100 (2026-12-06, two calls,
// bench/h100-2026-12-06-cuda-anchors.txt): 0.4-0.9% faster at the anchor shapes (424.7-424.9 against
// 426.8-428.0 us at 4,32,2048,128), up to 3.3% on the held-out shapes, slower nowhere beyond 0.3%;
// 40 / 232 was 0.2-1.1% slower than 48 / 224.
// QO_LHD=1 (not a tunable: it moves the task's q and o): q and o in [B, L, H, D] storage (element
// (b, h, l, d) at ((b L + l) H + h) D + d), k and v as always; for a caller that holds them so,
// such as mlx-lm, whose RoPE leaves q in [B, L, H, D] and whose o_proj reads o that way
// (python/ksearch_mlx/export_llama.py).
// Measured on the H200 (2026-12-04, bench/cuda_dev.py, CUDA events, L2 flushed, every element
// checked; cuDNN SDPA in the same process; bench/h200-2026-12-04-persistent-attention.txt),
// defaults, with the non-persistent version of the same morning (one block per item, grid
// (L/128, B*H), heavy blocks first; bench/h200-2026-12-04-flash-ws.txt) in brackets:
//   4,32,32,2048,128        481.1 us  cuDNN 445.4  0.93x  (489.7, 0.94x)
//   4,32,32,2048,128 causal 278.3 us  cuDNN 275.5  0.99x  (301.8, 0.94x)
//   1,32,8,4096,128 causal  247.2 us  cuDNN 275.6  1.11x  (274.8, 1.00x)
//   1,32,8,2048,128 causal   74.9 us  cuDNN  85.8  1.14x  (92.1, 0.94x)
// and 0.94-1.30x of cuDNN on the task's held-out shapes with L > 1, L = 1 7.4 us (torch SDPA 23.0).
// Inside MLX (the worker's GPU clock, same day) the kernel runs as fast as here (478.6-483.3 us at
// 4,32,8,2048,128) and is 0.90x of mx.fast.scaled_dot_product_attention there (434.5 us: MLX's
// cuDNN graph is faster than torch's), 0.96x causal, 0.91-2.03x on the held-out shapes.
// TMA=1 (a tunable, the CUDA back-end's default: H200, 2026-12-05, 6% / 5% faster than the cp.async
// build at 4,32,2048,128 without / with the causal mask, bench/h200-2026-12-05-attention-tma.txt; slower
// at L = 1, where building the maps is most of a block's work): the producer loads with the tensor-memory
// accelerator instead of cp.async. One producer warp builds the three tensor maps (Q, K, V) on the
// device at the block's start, from zeroed shared memory and tensormap.replace of every field (the
// kernel gets plain pointers from both back-ends, so no map can be encoded on the host), copies
// them to a slot of its own in module-scope global memory (tensormap.cp_fenceproxy, then an acquire
// fence);
// one thread then issues each tile as 64-column boxes (cp.async.bulk.tensor, 128-byte swizzle: the
// layout chunk_off describes) that complete the stage's full mbarrier by bytes (armed with
// arrive.expect_tx; one arrival per phase); rows past L and the columns past HD = 96 arrive as
// zeros (out-of-bounds fill), and the consumers need no proxy fence (the copies are async-proxy
// writes). A block takes its slot from a ring of 1024 by an atomic ticket, so two blocks share one
// only if 1024 blocks of the build start during one's life: at one block per SM (its shared
// memory), at most 132 run at once on an H200, whatever the launches and streams.
// BLOCK_N 160 / 176 and KVS=1 (H200, 2026-12-05, bench/h200-2026-12-05-attention-blockn.txt; correct on
// the stress suite with TMA and cp.async loads): at HD 128 shared memory holds only 2 stages of such tiles,
// and with a stage's K and V freed together after its PV product the consumers starved (543 us at
// 4,32,2048,128 against 449). KVS=1 gives K and V their own full / empty barriers: K is freed once the
// S products have read it and reloaded a tile before the stage's V is free (474 us), but the second
// barrier per tile costs the defaults 3%, and no wider tile beats BLOCK_N 128 with 3 stages at the anchor
// shapes. On short ragged shapes the wide tiles cut the tile count (513 keys: 3 tiles of 176, 5 of 128):
// 5,16,1,513,128 runs 43.6 us with 176 / 2 stages / KVS (1.06x cuDNN; 50.0 at the defaults), 3,32,32,777,64
// 61.2 with 160 (1.10x; 65.8). Inside MLX, through the MLX worker's judge, the same two shapes go from
// 0.93x / 0.98x of mx.fast.scaled_dot_product_attention to 1.09x / 1.10x
// (bench/h200-2026-12-05-mlx-attention-blockn.txt).
// BLOCK_N 192 (2 stages, KVS 1; wgmma m64n192k16): H100, 2026-12-06 (bench/h100-2026-12-06-wgmma-blockn192.txt,
// two calls against the defaults, stress suite first): without the mask at L = 16384 3.7% faster in one call
// (3340 against 3469 us) and 0.4% in the other, at 8192 2.9% faster and 2.8% slower, at 4,32,2048,128 even
// and 1.4% slower (11 tiles pad 64 keys); 2.6-3.7% slower under the mask. Within the calls' spread of 128:
// the defaults stay, a search may take it. Built as a third wide width chosen at run time (with a narrow PV
// product for the partial tile) it lost everywhere.
// SMALL_L (a tunable: 0, 1, 8 or 32): a call with L <= SMALL_L skips the tiles (small_rows below: a warp a
// query row, keys four at a time); L = 1 took 12.1 us through the tiled path (H200, 2026-12-05), all fixed
// cost. WIDE=1 (a tunable): a call without the causal mask takes 176- or 160-key tiles (2 stages, KVS 1: the
// configurations above, faster at 5,16,1,513,128 and 3,32,32,777,64) where that width pads L to at most 90%
// of the keys BLOCK_N pads it to; the tiled body is a template of (key-tile width, stages, KVS) instantiated
// for each, and the launch's shared memory covers the largest. Both are checked by the PTX interpreter
// (`ksearch kb emulate`, which runs the wgmma / TMA / mbarrier path too) and compile for sm_90a. Timed on
// an H100 (2026-12-05, bench/h100-2026-12-05-scan-cq-attention.txt: stress suite first, then every element
// of every timed run checked), WIDE 1 with SMALL_L 1 takes L = 1 from 13.6 to 5.4 us (torch SDPA 8.4),
// 5,16,1,513,128 from 51.0 to 45.0 (cuDNN 46.8) and 3,32,32,777,64 to 61.4 (cuDNN 65.1), the anchor shapes
// unchanged: both are the CUDA back-end's defaults. Inside MLX (H100, 2026-12-05,
// bench/h100-2026-12-05-emu-smalll-mlx.txt, the MLX worker's judge) they take L = 1 to 1.37x of MLX's SDPA
// (0.56x on the tiled path), 5,16,1,513,128 to 1.05x and 3,32,32,777,64 to 1.07x: the MLX unit's defaults too.
// With both 0 the PTX was byte for byte the build measured before they existed.
// EMU (a tunable: 0-3): the exponentials of EMU of every 8 n8 key chunks of the softmax computed on the FMA
// and integer pipes (ex2_fma below: Cody-Waite rounding, a degree-3 polynomial, the exponent added as an
// integer), the rest on MUFU, after FlashAttention-4's software exp2. MUFU gives 16 results a cycle per SM,
// so a consumer thread's 64 exponentials of a 128-key tile hold its sub-partition's MUFU for 512 cycles,
// most of a warp's softmax: in NVRTC 13's machine code (bench/sass_census.py) the softmax block's one-warp
// schedule is 769 cycles at EMU 0, 749 at EMU 1 and 2, 793 at 3 (each software exponential is seven or
// eight instructions the warp issues itself). Checked by the PTX interpreter (masked keys, ragged tails,
// both units). Slower on an H100 (2026-12-05, bench/h100-2026-12-05-emu-smalll-mlx.txt): 467-481 us (EMU 1)
// and 484-493 (EMU 2) against 454 at 4,32,2048,128 without the mask; the shorter schedule did not turn
// into time. The default stays 0 (whose build was byte for byte the one measured before EMU existed).
// DA=1 (a tunable): each k-step's wgmma descriptor is the tile's first plus a constant instead of being
// built from its address; the same descriptors. In NVRTC 13's machine code the block that issues a tile's
// S and PV products (between a consumer's softmax and its next turn) goes from 128 instructions and a
// 314-cycle one-warp schedule to 83 and 252. Checked by the PTX interpreter; no faster on an H100
// (2026-12-05: 449.1 against 449.2 us at 4,32,2048,128, 235.0 against 235.2 at 1,32,8,4096 causal): default 0.
// RS=1 (not a tunable: correct on the H200, 2026-12-05, but no faster than without it): a warp moves its rows' running maxima only
// where a tile's maximum exceeds one by more than 8 (log2 units), as FlashAttention-4 does on
// Blackwell; otherwise it skips the rescale of its output accumulators (HDP / 2 multiplies a thread
// and tile) and its probabilities reach at most 2^8.
// OV=1 (a tunable, both units' default since 2026-12-06): the output is stored 16 bytes a lane after a 4 x 4
// transpose of words over each quad (quad_transpose: two shfl.xor rounds), so a quad writes 64 whole bytes of a
// row. With OV=0 each thread stores a 4-byte word per 8-column chunk, the quad 16 bytes of a row at a time,
// and every 32-byte sector of o reaches L2 in two halves: Nsight Compute (H100, 2026-12-06,
// bench/h100-2026-12-06-attention-ov.txt) counted 4.08 M L2 write sectors against cuDNN's 2.10 M at
// 4,32,2048,128 (its output bytes: 2.10 M sectors), an L1 hit rate of 83% (cuDNN: 0, stores by TMA) and six
// times cuDNN's MIO-throttle stalls. Same call, builds alternated three times, every element checked (H100):
//   4,32,32,2048,128        451.4 -> 429.4 us  cuDNN 428.5  0.95x -> 1.00x
//   4,32,32,2048,128 causal 266.7 -> 247.9 us  cuDNN 272.2  1.02x -> 1.10x
//   1,32,8,4096,128 causal  236.0 -> 225.6 us  cuDNN 262.2  1.11x -> 1.16x
// and 1.12-1.29x of cuDNN on the held-out shapes with L > 1 (from 1.04-1.17x). Inside MLX (the MLX worker's
// judge on the GPU clock, same session): 1.002x of mx.fast.scaled_dot_product_attention at 4,32,2048,128 and
// 1.087x causal (0.949x / 1.004x at OV 0 in the same call), 1.21-1.38x on the held-out shapes.
// MC=1 (a tunable, timed slower: default 0): clusters of two blocks (__cluster_dims__, the grid rounded up
// to even). Without the causal mask the blocks of cluster b take items 2 i and 2 i + 1, two query blocks
// that mostly share a key/value head; where they do, each loads the 64-column half of every K and V tile
// of its rank into both blocks with one multicast TMA copy, so a tile leaves L2 once for 256 query rows
// instead of 128. A stage is then refilled only once both blocks' consumers are done with it: a consumer
// warp arrives on its own block's empty barrier and, through mapa, on the other's (16 arrivals a phase; 2
// on its own where the pair loads apart), and both blocks meet at a cluster barrier after initialising
// their barriers and before leaving. Nsight Compute (H100, 2026-12-06, bench/h100-2026-12-06-attention-ov.txt)
// counted 44% more L2 read sectors for this kernel than for cuDNN's at 4,32,2048,128 for the same DRAM
// bytes; FlashAttention-3 multicasts K and V across a cluster of two at head size 128 without the mask.
// Checked by the PTX interpreter, which runs the multicast copies (both units, shared and apart pairs,
// head sizes 64 / 96 / 128, under the mask too); a build whose blocks skip the last cluster barrier or
// load the same half twice fails there. Timed (H100, 2026-12-06, bench/h100-2026-12-06-attention-mc.txt,
// against MC 0 in the same call): 453.0 against 434.5 us at 4,32,2048,128, 264.6 against 249.8 causal,
// 3-8% slower on the ragged shapes. A build with the clusters but no shared tiles took 444.5: the
// cluster launch and its barriers cost about 2%, and the lock-step of the two blocks' stages costs more
// than the L2 reads it saves. The kernel is not limited by L2 here.
// SO=1 (a tunable, timed slower: default 0): a turn issues S of tile t, then scales the output accumulators by
// tile t - 1's softmax factors while S runs, then issues tile t - 1's PV product, so the 64 multiplies leave
// the path from a warpgroup's products landing to its next turn (with SO 0 they sit on it, after the softmax).
// Nsight Compute's source page (H100, 2026-12-07, bench/h100-2026-12-07c-attention-so.txt) puts 44% of the
// stall samples in the softmax block and its wait for the PV product and 19% in the turn's issue block, with
// the tensor pipe busy 72.5% of the cycles; if the consumers' path between their products bounded the kernel,
// taking work off it would show. It did not: 431.1 against 427.9 us at 4,32,2048,128 (three rounds each,
// every element checked, the stress suite passed), 0.7-1.0% slower on the other shapes but two
// (0.9% faster at 3,32,32,777,64, even at 5,16,1,513,128). With SO 0 the machine code is the
// one measured before SO existed. Checked by the PTX interpreter (both units; a build that scales after
// issuing the PV product fails there).
// FlashAttention-3's Hopper main loop takes this order only above head size 128 (RescaleOBeforeGemm in
// mainloop_fwd_sm90_tma_gmma_ws.hpp).
// PM=1 (a tunable, both units' default since 2026-12-07): past an item's first tile the softmax's exponentials run
// against the running row maxima at once, the tile's maxima formed beside them in MUFU's shadow, instead of after a
// max reduction (70 FMNMX and two shuffle rounds ahead of the first MUFU). A warp none of whose rows grew its
// maximum by more than 8 (log2 units) keeps its maxima (P at most 2^8: f16 holds it, the sums are f32) and skips
// the output's rescale; otherwise it moves its maxima and scales P, its sums and the output by 2^(old - new), and
// where some row jumped by more than 120 (P could overflow) it forms its rows of S again from q and k in global memory (a
// rolled scalar loop: a wgmma is the warpgroup's, and the tile's buffers may already hold the next ones) and runs
// the plain softmax. PM 2 and 3 take those two paths at every growth of a maximum: the PTX interpreter runs all
// three on both units, and a build whose scaling path leaves P unscaled or whose recomputation reads the wrong row
// fails there. In NVRTC 13's code the loop's softmax block is 277 instructions and a 639-cycle one-warp schedule
// against 381 and 773 (bench/sass_census.py --blocks), and the wait for the PV product now follows the
// exponentials. Only the 128-key tiles take it (KV 0): with the wide tiles (K and V released apart) it spilled
// and was 10% slower at 5,16,1,513,128. H100, 2026-12-07 (bench/h100-2026-12-07g-attention-pm.txt; three alternating
// passes, every element checked, stress suites first; the build timed there also applied PM to the wide tiles):
//   4,32,32,2048,128        428.9 -> 408.6 us  cuDNN 434.0  1.012x -> 1.062x (BAL 1 on top: 406.9, 1.066x)
//   4,32,32,2048,128 causal 248.2 -> 241.9 us  cuDNN 275.7  1.111x -> 1.140x
//   1,32,8,4096,128 causal  225.3 -> 212.8 us  cuDNN 266.3  1.182x -> 1.251x
// and within 1% or faster on the held-out shapes with 128-key tiles. Inside MLX, through the MLX worker's judge in
// the next call: 394.8 us against MLX's SDPA's 433.1 at 4,32,2048,128 (1.097x; the defaults 1.003x), 1.165x causal
// (1.092x), 1.097x with 8 key/value heads.
// f16 data handled as raw 16-bit words; no headers needed.
#ifndef HD
#define HD 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef PP
#define PP 1
#endif
#ifndef QO_LHD
#define QO_LHD 0
#endif
#ifndef TMA
#define TMA 0
#endif
#ifndef TMA_MIN
#define TMA_MIN 0
#endif
#ifndef RS
#define RS 0
#endif
#ifndef KVS
#define KVS 0
#endif
#ifndef SMALL_L
#define SMALL_L 0
#endif
#ifndef WIDE
#define WIDE 0
#endif
#if WIDE != 0 && WIDE != 1
#error "WIDE must be 0 or 1"
#endif
#if KVS != 0 && KVS != 1
#error "KVS must be 0 or 1"
#endif
#ifndef EMU
#define EMU 0
#endif
#ifndef DA
#define DA 0
#endif
#ifndef OV
#define OV 1
#endif
#ifndef MC
#define MC 0
#endif
#ifndef SO
#define SO 0
#endif
#if SO != 0 && SO != 1
#error "SO must be 0 or 1"
#endif
#if MC != 0 && MC != 1
#error "MC must be 0 or 1"
#endif
#if MC && !TMA
#error "MC needs TMA"
#endif
#if OV != 0 && OV != 1
#error "OV must be 0 or 1"
#endif
#if DA != 0 && DA != 1
#error "DA must be 0 or 1"
#endif
#if EMU < 0 || EMU > 3
#error "EMU must be 0, 1, 2 or 3"
#endif
#ifndef PREG
#define PREG 24
#endif
#ifndef CREG
#define CREG 240
#endif
// setmaxnreg.inc takes registers only from what the block holds (168 a thread at launch under
// __launch_bounds__(384, 1)) and what setmaxnreg.dec gave back: a consumer that asks for more waits
// forever (seen: PREG 32 with CREG 240 hung).
#if PREG + 2 * CREG > 3 * 168 || PREG % 8 || CREG % 8
#error "PREG + 2 * CREG must be at most 504, each a multiple of 8"
#endif
#define SWZ 1
#define NWG 2                // consumer warpgroups
#define BLOCK_M (64 * NWG)   // query rows per block
#define NT (128 * (NWG + 1)) // threads per block
#define PT 128               // producer threads
#define HDP ((HD + 63) / 64 * 64)  // columns of the shared-memory tiles and of the PV product
#define TILE_B (BN * HDP * 2)  // bytes of a K or V tile of the tiled body
#define Q_BYTES (BLOCK_M * HDP * 2)
#if STAGES < 2
#error "STAGES must be at least 2"
#endif
#if (BLOCK_N != 64 && BLOCK_N != 128 && BLOCK_N != 160 && BLOCK_N != 176 && BLOCK_N != 192) || (HD != 64 && HD != 96 && HD != 128)
#error "BLOCK_N must be 64, 128, 160, 176 or 192, HD 64, 96 or 128"
#endif

// The axes' type: `long long` for the CUDA back-end's ABI; MLX passes integer scalars as 32-bit
// `int`, so the mlx-cuda back-end compiles this file with -DKS_AXIS=int (docs/task-format.md).
#ifndef KS_AXIS
#define KS_AXIS long long
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(unsigned s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
}
// 16 bytes, or 16 zero bytes when n == 0 (nothing is read from g then).
__device__ __forceinline__ void cp16z(unsigned s, const void* g, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Generic-proxy writes (cp.async) made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Named barriers among the two consumer warpgroups (ids 1 and 2; 0 is __syncthreads).
template <int ID> __device__ __forceinline__ void nbar_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(ID) : "memory"); }
template <int ID> __device__ __forceinline__ void nbar_arrive() { asm volatile("bar.arrive %0, 256;\n" ::"n"(ID) : "memory"); }
// Pin register values at this point of the instruction stream (accumulators of asynchronous wgmma).
template <int N> __device__ __forceinline__ void pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
// PM (1; 2 and 3 checks of its two slower paths, taken at any growth of a row maximum): the softmax against the
// running maxima first (see softmax below).
#ifndef PM
#define PM 0
#endif
#define PM_JUMP (PM >= 2 ? 0.f : 8.f)
// A warp's accumulator fragment of N n8 chunks (x[4c + e]: row r0 for e < 2, r0 + 8 otherwise) scaled by a0 / a1.
template <int N> __device__ __forceinline__ void scale_rows(float* x, float a0, float a1) {
#pragma unroll
    for (int c = 0; c < N; c++) {
        x[4 * c] *= a0;
        x[4 * c + 1] *= a0;
        x[4 * c + 2] *= a1;
        x[4 * c + 3] *= a1;
    }
}
// OV: x[e] of quad lane l (qd) is word (l, e) of a 4 x 4 block; afterwards x[e] is word (e, l).
__device__ __forceinline__ void quad_transpose(unsigned* x, int qd) {
    const bool odd = qd & 1, hi = qd & 2;
    unsigned r0 = __shfl_xor_sync(0xffffffff, odd ? x[0] : x[1], 1);
    unsigned r1 = __shfl_xor_sync(0xffffffff, odd ? x[2] : x[3], 1);
    if (odd) {
        x[0] = r0;
        x[2] = r1;
    } else {
        x[1] = r0;
        x[3] = r1;
    }
    r0 = __shfl_xor_sync(0xffffffff, hi ? x[0] : x[2], 2);
    r1 = __shfl_xor_sync(0xffffffff, hi ? x[1] : x[3], 2);
    if (hi) {
        x[0] = r0;
        x[1] = r1;
    } else {
        x[2] = r0;
        x[3] = r1;
    }
}
// 2^x for x <= 0 on the FMA and integer pipes instead of MUFU (EMU): x clamped at -125 (masked keys'
// -inf give 2^-125, 0 in f16 and nothing in an f32 row sum), n = round(x) from the low mantissa bits of
// x + 1.5 * 2^23, 2^(x - n) by a degree-3 polynomial on [-0.5, 0.5] (relative error 7.5e-5, fitted here for
// relative error; below f16's rounding of P), n added to its exponent. Seven or eight instructions, no MUFU.
__device__ __forceinline__ float ex2_fma(float x) {
    x = fmaxf(x, -125.f);
    const float j = __fadd_rn(x, 12582912.f);
    const float f = __fsub_rn(x, __fsub_rn(j, 12582912.f));
    const float p = fmaf(fmaf(fmaf(0.05517151206731796f, f, 0.24261097609996796f), f, 0.6932609677314758f), f,
                         0.9999280571937561f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(j) << 23));
}
// The softmax's exponentials of n8 chunk cc: EMU chunks of every 8 on the FMA pipe, the rest on MUFU.
// KS_DIAG_SOFTMAX (a timing diagnostic, not a tunable: its output is wrong; bench/attention_ab.sh with
// DEFS_B and KS_TIME_WRONG=1): 1, each exponential replaced by its argument (no MUFU); 2, no softmax at all
// (P is S rounded to f16, the output never rescaled). What the softmax costs a tile, beside the products:
// H100, 2026-12-06 (bench/h100-2026-12-06-softmax-diag-sk.txt), 4,32,2048,128 without the mask 409.6 us with 1
// and 362.9 with 2 against 436.0-436.2 at the defaults (6.1% and 16.8% less; causal shapes 15-17% less with 2).
// KS_DIAG_PVSS (a timing diagnostic, not a tunable: its output is wrong): 1, the PV products take their A
// operand from shared memory (Q's buffer) instead of P in registers, P still computed and kept live:
// what the register-operand products cost beside the softmax. H100, 2026-12-06
// (bench/h100-2026-12-06-attention-ms-pvss.txt): 429.6 against 424.5 us at 4,32,2048,128 without the mask,
// 357.8 against 357.2 with KS_DIAG_SOFTMAX=2 as well: no faster, so P through shared memory would not pay.
#ifndef KS_DIAG_PVSS
#define KS_DIAG_PVSS 0
#endif
#ifndef KS_DIAG_SOFTMAX
#define KS_DIAG_SOFTMAX 0
#endif
#if KS_DIAG_SOFTMAX == 1
#define EX2C(cc, x) (x)
#else
#define EX2C(cc, x) ((cc) % 8 < EMU ? ex2_fma(x) : ex2(x))
#endif

__device__ __forceinline__ void mbar_init(unsigned a, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
// Arrive once every cp.async this thread issued so far has completed (the arrival is counted in
// the barrier's expected count: .noinc).
__device__ __forceinline__ void mbar_arrive_cp(unsigned a) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ bool mbar_try(unsigned a, unsigned parity) {
    unsigned ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(a), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned a, unsigned parity) {
    while (!mbar_try(a, parity)) {
    }
}
#if MC
// MC: the two blocks of a cluster (one SM each). Every thread of both at the cluster's barrier.
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// `n` arrivals on this block's mbarrier at `a`.
__device__ __forceinline__ void mbar_arrive_n(unsigned a, unsigned n) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(n) : "memory");
}
// One arrival on the mbarrier at the same offset `a` in the shared memory of cluster rank `rank`, with
// the default semantics (release at CTA scope), as CUTLASS's cluster pipelines arrive: what it orders is
// this warp's reads of a stage (its wgmma products, already waited for) before the other block's next
// copy into it. Release and acquire at cluster scope made MC 29% slower than MC 0 (584 against 427 us
// at 4,32,2048,128, H100, 2026-12-06): each arrival paid a cluster-wide fence.
__device__ __forceinline__ void mbar_arrive_at(unsigned a, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(r) : "memory");
}
#endif

#if TMA
// ---- tensor maps built on the device (TMA=1) ----
#define TM_SLOTS 1024
__device__ __align__(128) unsigned char ks_tmaps[TM_SLOTS * 3 * 128];
__device__ unsigned long long ks_tm_ticket;  // blocks started so far: block i's maps live in slot i % TM_SLOTS
// Arrive on the barrier and add `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbar_expect_tx(unsigned a, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(bytes) : "memory");
}
// Fields of the map at shared address m (zeroed before): ordinal 0 is the innermost dimension;
// strides are in bytes (dimension i + 1's at ordinal i).
template <int ORD> __device__ __forceinline__ void tm_dim(unsigned m, unsigned box, unsigned dim) {
    asm volatile("tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], %1, %2;\n" ::"r"(m), "n"(ORD), "r"(box) : "memory");
    asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], %1, %2;\n" ::"r"(m), "n"(ORD), "r"(dim) : "memory");
    asm volatile("tensormap.replace.tile.element_stride.shared::cta.b1024.b32 [%0], %1, 1;\n" ::"r"(m), "n"(ORD) : "memory");
}
template <int ORD> __device__ __forceinline__ void tm_stride(unsigned m, unsigned long long bytes) {
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ <= 6
    bytes >>= 4;  // ptxas of PTX ISA 8.5 and older takes the stride in 16-byte units (Triton works around the same)
#endif
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], %1, %2;\n" ::"r"(m), "n"(ORD), "l"(bytes) : "memory");
}
// The fields every map here shares: 16-bit elements, no interleave, 128-byte swizzle, zero fill.
template <int RANK> __device__ __forceinline__ void tm_common(unsigned m, const void* base) {
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n" ::"r"(m), "l"(base) : "memory");
    asm volatile("tensormap.replace.tile.rank.shared::cta.b1024.b32 [%0], %1;\n" ::"r"(m), "n"(RANK - 1) : "memory");
    asm volatile("tensormap.replace.tile.elemtype.shared::cta.b1024.b32 [%0], 1;\n" ::"r"(m) : "memory");
    asm volatile("tensormap.replace.tile.interleave_layout.shared::cta.b1024.b32 [%0], 0;\n" ::"r"(m) : "memory");
    asm volatile("tensormap.replace.tile.swizzle_mode.shared::cta.b1024.b32 [%0], 3;\n" ::"r"(m) : "memory");
    asm volatile("tensormap.replace.tile.fill_mode.shared::cta.b1024.b32 [%0], 0;\n" ::"r"(m) : "memory");
}
// The whole warp: copy the map at shared m to global g, release it to the tensor-map proxy and
// acquire it there (the commit / wait pair after the acquire as Triton emits it).
__device__ __forceinline__ void tm_publish(const unsigned char* g, unsigned m) {
    asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;\n" ::"l"(g), "r"(m) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(g) : "memory");
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void tma3(unsigned dst, const unsigned char* map, int c0, int c1, int c2, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma4(unsigned dst, const unsigned char* map, int c0, int c1, int c2, int c3, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
#if MC
// MC: the box into both blocks of the cluster, each at `dst` of its shared memory, each completing
// its own mbarrier at `bar`.
__device__ __forceinline__ void tma3_mc(unsigned dst, const unsigned char* map, int c0, int c1, int c2, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"((unsigned short)3) : "memory");
}
#endif
#endif

// Shared-memory matrix descriptor: start address, leading-dimension byte offset, stride-dimension
// byte offset (all >> 4), 128-byte swizzle (1 in bits 62-63).
__device__ __forceinline__ unsigned long long mdesc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | ((unsigned long long)SWZ << 62);
}

// Byte offset of the 16-byte chunk j (columns 8j..8j+7) of row r in a ROWS x HDP tile: HDP / 64
// column blocks of ROWS rows of 128 bytes (1024-byte atoms of 8 rows), chunk j % 8 of row r at slot
// (j % 8) ^ (r % 8).
template <int ROWS> __device__ __forceinline__ unsigned chunk_off(int r, int j) {
    return (j >> 3) * (ROWS * 128) + r * 128 + (((j & 7) ^ (r & 7)) << 4);
}

// Copy a ROWS x HD tile (global row stride `gs` elements: HD, or H * HD for Q in [B, L, H, D]
// storage) into the layout above with 16-byte cp.async by the
// PT producer threads; rows from `valid` on are zero-filled (nothing past them is read). FULL:
// every row is valid (the plain copy). A thread keeps one chunk column j = tid % (HDP / 8) (idle
// when j >= HD / 8: HD = 96) and every RPI-th row, so its shared and global addresses are a base
// plus constant offsets (the swizzle term (j ^ row) % 8 does not change from row to row + RPI).
#define CPT (HDP / 8)
#define RPI (PT / CPT)
template <int ROWS, bool FULL>
__device__ __forceinline__ void load_tile(unsigned dst, const unsigned short* src, int valid, int tid, long long gs = HD) {
    static_assert(ROWS % RPI == 0 && RPI % 8 == 0, "rows must divide evenly over the producer threads");
    const int row0 = tid / CPT, j = tid % CPT;
    if (HD % 64 != 0 && j >= HD / 8) return;
    const unsigned sd = dst + chunk_off<ROWS>(row0, j);
    const unsigned short* g = src + row0 * gs + j * 8;
#pragma unroll
    for (int i = 0; i < ROWS / RPI; i++) {
        if (FULL) {
            cp16(sd + i * RPI * 128, g + i * RPI * gs);
        } else {
            // src-size 0 past `valid`: zero-filled, nothing read (the address is not selected, so it
            // stays a base plus a constant offset).
            cp16z(sd + i * RPI * 128, g + i * RPI * gs, row0 + i * RPI < valid ? 16 : 0);
        }
    }
}
// ---- generated wrappers: S = Q K^T (both operands K-major in shared memory), O += P V (P from
// registers, V MN-major in shared memory: imm-trans-b = 1). Accumulators f32, scale-d for S.
__device__ __forceinline__ void wgmma_ss_n64(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(sd));
}

__device__ __forceinline__ void wgmma_ss_n128(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(sd));
}
// KS_DIAG_PVSS: O += A V with A from shared memory (V MN-major: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_ss_n128_tb(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(sd));
}
__device__ __forceinline__ void wgmma_ss_n160(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, %80, %81, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
                 : "l"(da), "l"(db), "r"(sd));
}
__device__ __forceinline__ void wgmma_ss_n176(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
                 : "l"(da), "l"(db), "r"(sd));
}
__device__ __forceinline__ void wgmma_ss_n192(float* d, unsigned long long da, unsigned long long db, int sd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                 : "l"(da), "l"(db), "r"(sd));
}

__device__ __forceinline__ void wgmma_rs_n64_tb(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_rs_n128_tb(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}


// Descriptors: K-major Q and K (LBO unused, SBO 1024 between 8-row atoms; a k-step moves 32 bytes
// inside the 128-byte rows, a 64-column block moves ROWS * 128), MN-major V (LBO BLOCK_N * 128
// between 64-column blocks of the head dimension, SBO 1024 between 8-key groups; a k-step of 16
// keys moves 2048).
#define KM_LBO 16
#define KM_SBO 1024
#define MN_LBO (BN * 128)  // BN: the tiled body's key-tile width (a template parameter)
#define MN_SBO 1024
#define Q_KSTEP(kk) (((kk) >> 2) * (BLOCK_M * 128) + ((kk) & 3) * 32)
#define K_KSTEP(kk) (((kk) >> 2) * (BN * 128) + ((kk) & 3) * 32)
#define V_KSTEP(kk) ((kk) * 2048)
#define Q_WG(c) ((c) * 64 * 128)

// S = Q K^T of one k-step for a key tile of N columns (N a constant: the other branches fold away).
template <int N> __device__ __forceinline__ void wgmma_s(float* d, unsigned long long da, unsigned long long db, int sd) {
    if (N == 192) wgmma_ss_n192(d, da, db, sd);
    else if (N == 176) wgmma_ss_n176(d, da, db, sd);
    else if (N == 160) wgmma_ss_n160(d, da, db, sd);
    else if (N == 128) wgmma_ss_n128(d, da, db, sd);
    else wgmma_ss_n64(d, da, db, sd);
}
#if HDP == 128
#define WGMMA_O wgmma_rs_n128_tb
#else
#define WGMMA_O wgmma_rs_n64_tb
#endif

// Work items: (batch*head, 128-row query block), numbered head by head so that blocks running at
// the same time read the same K/V (L2 reuse); under the causal mask a head's blocks are ordered
// heaviest, lightest, second heaviest, second lightest, ... Where the items outnumber the blocks,
// under the causal mask a block takes them two at a time (a pair: a heavy and a light block, nM + 1
// key tiles together, so every pair costs about the same and a static stride balances the SMs),
// without it one at a time (every item costs the same), and strides over them by gridDim.x: with one
// block per SM it is persistent, the producer
// loading the next item's Q and K/V tiles while the consumers finish the last tiles and store the
// output of this one.
// Offset (elements) of row l of query head bh = b * H + h in q and o: [B, H, L, D] storage, or
// [B, L, H, D] with QO_LHD.
__device__ __forceinline__ long long qo_row(int bh, int l, int H, long long L) {
    if (QO_LHD) return (((long long)(bh / H) * L + l) * H + bh % H) * HD;
    return ((long long)bh * L + l) * HD;
}

// ---- calls with L <= SMALL_L (one query row, a few rows) ----
// There the main path is all fixed cost: a 128-row tile, mbarriers and (TMA) three tensor maps a
// block for one row. Instead each warp takes whole query rows (of all heads and batches, strided
// over every warp of the grid), a lane EPL = HD / 32 columns: q . k by a butterfly sum, online
// exp2 softmax in f32, o = sum p v. No shared memory, no barrier.
#define EPL (HD / 32)
__device__ __forceinline__ float h2f(unsigned short u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
}
// Eight f16 values of a 16-byte-aligned chunk of global memory as f32 (PM's recomputation of S).
__device__ __forceinline__ void ld_chunk(float* f, const unsigned short* p) {
    unsigned u[4];
    asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "l"(p) : "memory");
#pragma unroll
    for (int e = 0; e < 4; e++) {
        f[2 * e] = h2f((unsigned short)(u[e] & 0xffffu));
        f[2 * e + 1] = h2f((unsigned short)(u[e] >> 16));
    }
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short u;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(u) : "f"(f));
    return u;
}
__device__ __forceinline__ void small_rows(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                           const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                                           int B, int H, int Hkv, int L, int causal) {
    const int lane = threadIdx.x & 31, grp = H / Hkv;
    const long long rows = (long long)B * H * L;
    const long long nw = (long long)gridDim.x * (NT / 32);
    const float sc = rsqrtf((float)HD) * 1.4426950408889634f;  // 1/sqrt(D), in log2 units
#pragma unroll 1
    for (long long r = (long long)blockIdx.x * (NT / 32) + (threadIdx.x >> 5); r < rows; r += nw) {
        const int bh = (int)(r / L), l = (int)(r - (long long)bh * L);
        const long long kv0 = ((long long)(bh / H) * Hkv + (bh % H) / grp) * L * HD + lane * EPL;
        const unsigned short* qr = q + qo_row(bh, l, H, L) + lane * EPL;
        float qf[EPL], acc[EPL];
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            qf[e] = h2f(qr[e]) * sc;
            acc[e] = 0.f;
        }
        float m = -INFINITY, sum = 0.f;
        const int nk = causal ? l + 1 : L;
        // Keys four at a time: their loads in flight together, their sums' shuffle rounds interleaved.
#pragma unroll 1
        for (int j0 = 0; j0 < nk; j0 += 4) {
            float kf[4][EPL], vf[4][EPL], d[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const bool in = j0 + u < nk;
                const long long at = kv0 + (long long)(j0 + u) * HD;
#pragma unroll
                for (int e = 0; e < EPL; e++) {
                    kf[u][e] = in ? h2f(k[at + e]) : 0.f;
                    vf[u][e] = in ? h2f(v[at + e]) : 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                d[u] = 0.f;
#pragma unroll
                for (int e = 0; e < EPL; e++) d[u] += qf[e] * kf[u][e];
            }
#pragma unroll
            for (int x = 16; x > 0; x >>= 1) {
#pragma unroll
                for (int u = 0; u < 4; u++) d[u] += __shfl_xor_sync(0xffffffff, d[u], x);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (j0 + u >= nk) break;
                const float mn = fmaxf(m, d[u]), a = ex2(m - mn), p = ex2(d[u] - mn);
                m = mn;
                sum = sum * a + p;
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[e] = acc[e] * a + p * vf[u][e];
            }
        }
        const float inv = 1.f / sum;
        unsigned short* orow = o + qo_row(bh, l, H, L) + lane * EPL;
#pragma unroll
        for (int e = 0; e < EPL; e++) orow[e] = f2h(acc[e] * inv);
    }
}

__device__ __forceinline__ void work_item(int w, int nM, int causal, int& bh, int& mb) {
    bh = w / nM;
    const int j = w - bh * nM;
    mb = causal ? ((j & 1) ? (j >> 1) : nM - 1 - (j >> 1)) : j;
}

// The tiled path: key tiles of BN columns, a ring of ST stages, K and V of a stage released apart
// (KV = 1) or together.
template <int BN, int ST, int KV, bool TM>
__device__ __forceinline__ void attn_tiled(const unsigned short* __restrict__ q,
                                                              const unsigned short* __restrict__ k,
                                                              const unsigned short* __restrict__ v,
                                                              unsigned short* __restrict__ o, KS_AXIS B, KS_AXIS H,
                                                              KS_AXIS Hkv, KS_AXIS L, KS_AXIS D, KS_AXIS causal) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    const unsigned sKV = sQ + Q_BYTES;  // stage s: K at sKV + 2 * s * TILE_B, V at + TILE_B
    // full[s] at sBar + 8s: the stage's tiles have landed (PT producer arrivals; the full barrier of
    // an item's first tile covers its Q too); empty[s] at sBar + 8 (ST + s): every consumer warp
    // is done reading the stage (8); qempty at sBar + 16 ST: every consumer warp's last S product
    // of the item has completed, so Q may be overwritten (8).
    // KV=1: K and V of a stage have barriers of their own (full / empty at sBar + 8s / + 8 (ST + s)
    // for K, the same from sBV on for V), so a stage's K is reloaded once the S products have read
    // it, a tile before its V is free.
    const unsigned sBar = sKV + 2 * ST * TILE_B;
    const unsigned sQe = sBar + 16 * ST;
    const unsigned sBV = sQe + 8;
    // Barriers of tile T's K (or K and V) and of its V.
    auto fullK = [&](int T) { return sBar + 8 * (T % ST); };
    auto emptyK = [&](int T) { return sBar + 8 * (ST + T % ST); };
    auto fullV = [&](int T) { return KV ? sBV + 8 * (T % ST) : fullK(T); };
    auto emptyV = [&](int T) { return KV ? sBV + 8 * (ST + T % ST) : emptyK(T); };
    const int tid = threadIdx.x, wg = tid >> 7;
    const int Ln = (int)L, Hn = (int)H, grp = (int)(H / Hkv), cz = causal ? 1 : 0;
    const int nM = (Ln + BLOCK_M - 1) / BLOCK_M;
    const int items = (int)(B * H) * nM;
    // Items two at a time only under the causal mask (a heavy and a light one) and where the grid
    // cannot hold them all at once (one wave needs no balancing, and a pair would double the latency
    // of a small call). Without the mask every item costs the same, and pairs would only coarsen the
    // stride: 384 items on 132 blocks are 3 rounds one at a time, 4 in pairs (H100, 2026-12-05,
    // bench/h100-2026-12-05-attention-pairs.txt: 4,32,8,300,128 36.7 -> 30.7 us, 8,16,16,520,64 46.6 ->
    // 40.2, 3,32,8,650,128 81.3 -> 70.0; shapes whose items divide evenly unchanged).
    // (KS_PAIRS_ALWAYS, not a tunable: pairs without the mask too, as before, for timing the two.)
#ifdef KS_PAIRS_ALWAYS
    const int per = items > (int)gridDim.x ? 2 : 1, groups = (items + per - 1) / per;
#else
    const int per = cz && items > (int)gridDim.x ? 2 : 1, groups = (items + per - 1) / per;
#endif
    const int ntk = (Ln + BN - 1) / BN;  // key tiles; the last one may be partial
    // Key tiles of the query block starting at row m0.
    auto tiles = [&](int m0) { return cz ? min(ntk, (m0 + BLOCK_M + BN - 1) / BN) : ntk; };
    // MC, without the mask: the blocks of a cluster (2 b, 2 b + 1) take items 2 i and 2 i + 1, with as
    // many tiles each; where the two read the same key/value head each loads half of every K and V tile
    // (the 64-column box of its rank) into both blocks, so a tile leaves L2 once for two query blocks.
    // A stage is then reloaded only once both blocks' consumers are done with it: each consumer warp
    // arrives on its own block's empty barrier and on the other's (16 arrivals a phase; 2 on its own
    // where the pair loads apart). Under the mask each block goes its own way.
    constexpr bool MCT = MC && TM && KV == 0 && HDP == 128;
    const bool mcx = MCT && !cz;
    const int rank = blockIdx.x & 1;
    auto kv_head = [&](int w) {
        int bh, mb;
        work_item(w, nM, cz, bh, mb);
        return (bh / Hn) * (int)Hkv + (bh % Hn) / grp;
    };
    auto shared_pair = [&](int w) { return mcx && (w ^ 1) < items && kv_head(w) == kv_head(w ^ 1); };
    if (tid == 0) {
        for (int st = 0; st < ST; st++) {
            mbar_init(sBar + 8 * st, TM ? 1 : PT);
            mbar_init(sBar + 8 * (ST + st), 4 * NWG * (mcx ? 2 : 1));
            if (KV) {
                mbar_init(sBV + 8 * st, TM ? 1 : PT);
                mbar_init(sBV + 8 * (ST + st), 4 * NWG);
            }
        }
        mbar_init(sQe, 4 * NWG);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#if MC
    cl_sync();  // both blocks' barriers exist before either copies into the other or arrives there
#else
    __syncthreads();
#endif

    if (wg == 0) {
        // ---- producer ----
        setmaxnreg_dec<PREG>();
        bool issuer = true;  // MC: the producer's other threads wait at the cluster's last barrier
#if TMA
        const unsigned char* gTm = nullptr;
        if constexpr (TM) {
#if MC
            if (tid >= 32) issuer = false;
            if (issuer) {
#else
            if (tid >= 32) return;  // one warp builds the maps, one thread issues the copies
#endif
            const unsigned sTm = sBar + 256;  // the three maps' shared copies, 128 bytes each
            unsigned slot = 0;
            if (tid == 0) slot = (unsigned)(atomicAdd(&ks_tm_ticket, 1ull) % TM_SLOTS);  // lands while the maps are built
            // Zero the three maps (384 bytes) before any field is set.
            asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(sTm + 8 * tid), "r"(0u) : "memory");
            if (tid < 16) asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(sTm + 256 + 8 * tid), "r"(0u) : "memory");
            __syncwarp();
            if (tid == 0) {
                const unsigned sk = sTm + 128, sv = sTm + 256;
                // K and V: [B * Hkv, L, HD] as dimensions (HD, L, B * Hkv), boxes of 64 columns x BN keys.
                tm_common<3>(sk, k);
                tm_common<3>(sv, v);
                tm_dim<0>(sk, 64, (unsigned)HD);
                tm_dim<0>(sv, 64, (unsigned)HD);
                tm_dim<1>(sk, BN, (unsigned)Ln);
                tm_dim<1>(sv, BN, (unsigned)Ln);
                tm_dim<2>(sk, 1, (unsigned)(B * Hkv));
                tm_dim<2>(sv, 1, (unsigned)(B * Hkv));
                tm_stride<0>(sk, 2ull * HD);
                tm_stride<0>(sv, 2ull * HD);
                tm_stride<1>(sk, 2ull * HD * Ln);
                tm_stride<1>(sv, 2ull * HD * Ln);
#if QO_LHD
                // Q: [B, L, H, HD] as (HD, H, L, B), boxes of 64 columns x 1 head x BLOCK_M rows.
                tm_common<4>(sTm, q);
                tm_dim<0>(sTm, 64, (unsigned)HD);
                tm_dim<1>(sTm, 1, (unsigned)Hn);
                tm_dim<2>(sTm, BLOCK_M, (unsigned)Ln);
                tm_dim<3>(sTm, 1, (unsigned)B);
                tm_stride<0>(sTm, 2ull * HD);
                tm_stride<1>(sTm, 2ull * HD * Hn);
                tm_stride<2>(sTm, 2ull * HD * Hn * Ln);
#else
                // Q: [B * H, L, HD] as (HD, L, B * H), boxes of 64 columns x BLOCK_M rows.
                tm_common<3>(sTm, q);
                tm_dim<0>(sTm, 64, (unsigned)HD);
                tm_dim<1>(sTm, BLOCK_M, (unsigned)Ln);
                tm_dim<2>(sTm, 1, (unsigned)(B * Hn));
                tm_stride<0>(sTm, 2ull * HD);
                tm_stride<1>(sTm, 2ull * HD * Ln);
#endif
            }
            __syncwarp();  // lane 0's fields before the warp's copy
            gTm = ks_tmaps + __shfl_sync(0xffffffff, slot, 0) * (3 * 128);
            tm_publish(gTm, sTm);
            tm_publish(gTm + 128, sTm + 128);
            tm_publish(gTm + 256, sTm + 256);
#if MC
            if (tid != 0) issuer = false;
            }
#else
            if (tid != 0) return;
#endif
        }
#endif
        int T = 0, n = 0;  // tiles and items this block has loaded
        if (issuer)
        for (int p = blockIdx.x; p < groups; p += gridDim.x) {
            const int wend = min(per * p + per, items);
#pragma unroll 1
            for (int w = per * p; w < wend; w++, n++) {
                int bh, mb;
                work_item(w, nM, cz, bh, mb);
                const int m0 = mb * BLOCK_M, nt = tiles(m0);
                const long long kvh = (long long)(bh / Hn) * Hkv + (bh % Hn) / grp;  // key/value head
                const bool mce = shared_pair(w);  // MC: this block loads its half of each tile into both
                if (n > 0) mbar_wait(sQe, (n - 1) & 1);  // the previous item's S products are done
                const unsigned short* Kg = k + kvh * L * HD;
                const unsigned short* Vg = v + kvh * L * HD;
                // Q's copies complete the full barrier of the item's first tile too.
                if constexpr (!TM)
                    load_tile<BLOCK_M, false>(sQ, q + qo_row(bh, m0, Hn, L), Ln - m0, tid, QO_LHD ? (long long)Hn * HD : HD);
#pragma unroll 1
                for (int t = 0; t < nt; t++, T++) {
                    const int st = T % ST;
                    const unsigned ph = (T / ST - 1) & 1;  // the phase of the stage's previous tile
                    if (T >= ST) mbar_wait(emptyK(T), ph);  // MC: both blocks' consumers where mcx
                    const unsigned dst = sKV + 2 * st * TILE_B;
#if TMA
                    if constexpr (TM) {
                        // Every box lands whole (out-of-bounds elements as zeros), so the bytes are
                        // fixed; Q's boxes complete the full barrier of the item's first tile too.
                        const unsigned fb = fullK(T), fv = fullV(T);
                        mbar_expect_tx(fb, (KV ? 1 : 2) * TILE_B + (t == 0 ? Q_BYTES : 0));
                        if (t == 0) {
#pragma unroll
                            for (int jb = 0; jb < HDP / 64; jb++) {
#if QO_LHD
                                tma4(sQ + jb * BLOCK_M * 128, gTm, 64 * jb, bh % Hn, m0, bh / Hn, fb);
#else
                                tma3(sQ + jb * BLOCK_M * 128, gTm, 64 * jb, m0, bh, fb);
#endif
                            }
                        }
#pragma unroll
                        for (int jb = 0; jb < HDP / 64; jb++) {
#if MC
                            if (mce) {
                                if (jb == rank) tma3_mc(dst + jb * BN * 128, gTm + 128, 64 * jb, t * BN, (int)kvh, fb);
                                continue;
                            }
#endif
                            tma3(dst + jb * BN * 128, gTm + 128, 64 * jb, t * BN, (int)kvh, fb);
                        }
                        if (KV) {
                            if (T >= ST) mbar_wait(emptyV(T), ph);
                            mbar_expect_tx(fv, TILE_B);
                        }
#pragma unroll
                        for (int jb = 0; jb < HDP / 64; jb++) {
#if MC
                            if (mce) {
                                if (jb == rank) tma3_mc(dst + TILE_B + jb * BN * 128, gTm + 256, 64 * jb, t * BN, (int)kvh, fv);
                                continue;
                            }
#endif
                            tma3(dst + TILE_B + jb * BN * 128, gTm + 256, 64 * jb, t * BN, (int)kvh, fv);
                        }
                    } else
#endif
                    {
                        const long long off = (long long)t * BN * HD;
                        const int kv = min(BN, Ln - t * BN);
                        if (kv == BN) load_tile<BN, true>(dst, Kg + off, kv, tid);
                        else load_tile<BN, false>(dst, Kg + off, kv, tid);
                        if (KV) {
                            mbar_arrive_cp(fullK(T));  // arrives once this thread's copies so far have landed
                            if (T >= ST) mbar_wait(emptyV(T), ph);
                        }
                        if (kv == BN) load_tile<BN, true>(dst + TILE_B, Vg + off, kv, tid);
                        else load_tile<BN, false>(dst + TILE_B, Vg + off, kv, tid);
                        mbar_arrive_cp(fullV(T));
                    }
                }
            }
        }
        if constexpr (!TM) cp_wait_all();  // nothing of this block in flight when the producer exits
    } else {
        // ---- consumers: warpgroup c owns query rows m0 + 64c .. m0 + 64c + 63 of each item ----
        setmaxnreg_inc<CREG>();
        const int c = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, qd = lane & 3;
        const float sl2 = 1.4426950408889634f / sqrtf((float)HD);
        const unsigned qbase = sQ + Q_WG(c);
        float oacc[HDP / 2];
        float s[BN / 2];
        unsigned pprev[BN / 4];
        unsigned psink = 0u;  // KS_DIAG_PVSS
#pragma unroll
        for (int i = 0; i < BN / 4; i++) pprev[i] = 0u;
        float mrow0 = 0.f, mrow1 = 0.f, lrow0 = 0.f, lrow1 = 0.f, al0 = 1.f, al1 = 1.f;
        bool resc = true;  // RS: some row of the warp moved its running maximum (oacc is rescaled)
        int wrow0 = 0, r0 = 0, ibh = 0;  // the item's first query row of this warpgroup, this thread's rows r0, r0 + 8

        // Tile T (counted over the block's items) has landed in its stage.
        auto wait_tile = [&](int T) {
            mbar_wait(fullK(T), (T / ST) & 1);
            if (!TM) fence_proxy_async();  // cp.async writes are the generic proxy's; TMA's the async proxy's
        };
        // Tile T's V has landed (KV; otherwise it came with K).
        auto wait_v = [&](int T) {
            if (KV) {
                mbar_wait(fullV(T), (T / ST) & 1);
                if (!TM) fence_proxy_async();
            }
        };
        // This warp's S product of tile T has completed: its K may be overwritten (KV).
        auto release_k = [&](int T) {
            if (KV && lane == 0) mbar_arrive(emptyK(T));
        };
        // This warp is done with tile T (its PV product has completed). MC: on both blocks' barriers
        // where the item's pair shares its tiles (mce), twice on its own where it loads apart.
        bool mce = false;
        auto release = [&](int T) {
            if (lane == 0) {
#if MC
                if (mce) {
                    mbar_arrive(emptyV(T));
                    mbar_arrive_at(emptyV(T), rank ^ 1);
                } else if (mcx) {
                    mbar_arrive_n(emptyV(T), 2);
                } else
#endif
                    mbar_arrive(emptyV(T));
            }
        };
        // Ping-pong: warpgroup c issues its products only on its turn (barrier 1 + c), then hands
        // the turn to the other one (barrier 2 - c). Every issue point of both warpgroups is
        // matched: nt + 1 each per item; warpgroup 1 opened the first turn and skips its very last
        // hand-over.
        auto turn_begin = [&]() {
#if PP
            if (c == 0) nbar_sync<1>(); else nbar_sync<2>();
#endif
        };
        auto turn_end = [&](bool last) {
#if PP
            if (c == 0) nbar_arrive<2>(); else if (!last) nbar_arrive<1>();
#endif
        };
#if DA
        // Each k-step's descriptor as the tile's first plus the step's offset >> 4 (shared addresses
        // stay below 2^18, so the start field never carries into the next).
        const unsigned long long qd0 = mdesc(qbase, KM_LBO, KM_SBO);
        auto issue_s = [&](int T) {
            const unsigned long long kd0 = mdesc(sKV + 2 * (T % ST) * TILE_B, KM_LBO, KM_SBO);
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
                wgmma_s<BN>(s, qd0 + (Q_KSTEP(kk) >> 4), kd0 + (K_KSTEP(kk) >> 4), kk);
            wg_commit();
        };
        auto issue_pv = [&](int T) {
            const unsigned long long vd0 = mdesc(sKV + 2 * (T % ST) * TILE_B + TILE_B, MN_LBO, MN_SBO);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) WGMMA_O(oacc, pprev + 4 * kk, vd0 + (V_KSTEP(kk) >> 4));
            wg_commit();
        };
#else
        auto issue_s = [&](int T) {
            const unsigned kb = sKV + 2 * (T % ST) * TILE_B;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
                wgmma_s<BN>(s, mdesc(qbase + Q_KSTEP(kk), KM_LBO, KM_SBO), mdesc(kb + K_KSTEP(kk), KM_LBO, KM_SBO), kk);
            wg_commit();
        };
        auto issue_pv = [&](int T) {
            const unsigned vb = sKV + 2 * (T % ST) * TILE_B + TILE_B;
#if KS_DIAG_PVSS
            if constexpr (BN == 128 && HDP == 128) {
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++)
                    wgmma_ss_n128_tb(oacc, mdesc(qbase + Q_KSTEP(kk), KM_LBO, KM_SBO), mdesc(vb + V_KSTEP(kk), MN_LBO, MN_SBO), 1);
                wg_commit();
                // P stays live in the machine code (ptxas drops dead products, S's too): folded into a
                // word stored only where it takes a value it never takes.
#pragma unroll
                for (int i = 0; i < BN / 4; i++) psink ^= pprev[i];
                return;
            }
#endif
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) WGMMA_O(oacc, pprev + 4 * kk, mdesc(vb + V_KSTEP(kk), MN_LBO, MN_SBO));
            wg_commit();
        };
#endif
        auto softmax = [&](int t) {
#if KS_DIAG_SOFTMAX == 2
            al0 = al1 = 1.f;
            return;
#endif
            const int n0 = t * BN;
            // s[4c + e]: row r0 + 8 * (e >> 1), key n0 + 8c + 2qd + (e & 1). Keys from lim0 (row r0)
            // and lim1 (row r0 + 8) on are masked: past the diagonal, past L.
            const bool diag = cz && n0 + BN - 1 > wrow0 + 16 * warp;
            auto mask_s = [&]() {
                const int lim0 = diag ? min(r0 + 1, Ln) : Ln, lim1 = diag ? min(r0 + 9, Ln) : Ln;
#pragma unroll
                for (int cc = 0; cc < BN / 8; cc++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[4 * cc + e] = n0 + 8 * cc + 2 * qd + (e & 1) < ((e >> 1) ? lim1 : lim0) ? s[4 * cc + e] : -INFINITY;
            };
            if (diag || n0 + BN > Ln) mask_s();
            // n8 chunk cc's probabilities against maxima m0 (row r0) and m1 (row r0 + 8), in S's registers, and
            // their sums.
            auto exp_chunk = [&](int cc, float m0, float m1, float& l0, float& l1) {
                s[4 * cc] = EX2C(cc, fmaf(s[4 * cc], sl2, -m0));
                s[4 * cc + 1] = EX2C(cc, fmaf(s[4 * cc + 1], sl2, -m0));
                s[4 * cc + 2] = EX2C(cc, fmaf(s[4 * cc + 2], sl2, -m1));
                s[4 * cc + 3] = EX2C(cc, fmaf(s[4 * cc + 3], sl2, -m1));
                l0 += s[4 * cc] + s[4 * cc + 1];
                l1 += s[4 * cc + 2] + s[4 * cc + 3];
            };
#if PM
            // PM: past an item's first tile, the exponentials start at once against the running maxima (P in
            // S's registers, as below) while the tile's maxima are formed beside them, so no max reduction
            // stands ahead of the first MUFU. Where no row of the warp moved its maximum by more than PM_JUMP
            // (log2 units) that is the tile's softmax: P at most 2^PM_JUMP, the output not rescaled. Otherwise
            // the warp moves its maxima and scales P, its sums and (later) the output by 2^(old - new); where
            // some row jumped by more than 120 (P could overflow; PM 3 takes this path at every growth, as its
            // check) the warp forms its rows of the tile's S again from q and k and takes the plain path.
            if (!KV && t > 0) {
                float mx0 = -INFINITY, mx1 = -INFINITY, ls0 = 0.f, ls1 = 0.f;
#pragma unroll
                for (int cc = 0; cc < BN / 8; cc++) {
                    mx0 = fmaxf(mx0, fmaxf(s[4 * cc], s[4 * cc + 1]));
                    mx1 = fmaxf(mx1, fmaxf(s[4 * cc + 2], s[4 * cc + 3]));
                    exp_chunk(cc, mrow0, mrow1, ls0, ls1);
                }
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
                resc = __any_sync(0xffffffff, mx0 * sl2 > mrow0 + PM_JUMP || mx1 * sl2 > mrow1 + PM_JUMP);
                if (!resc) {
                    al0 = al1 = 1.f;
                    lrow0 += ls0;
                    lrow1 += ls1;
                    return;
                }
                // P stays finite (at most 2^120, its sums below 2^127, on MUFU or EMU's polynomial alike) unless
                // some row jumped by more than 120.
                if (!__any_sync(0xffffffff, PM == 3 || mx0 * sl2 > mrow0 + 120.f || mx1 * sl2 > mrow1 + 120.f)) {
                    const float mn0 = fmaxf(mrow0, mx0 * sl2), mn1 = fmaxf(mrow1, mx1 * sl2);
                    al0 = ex2(mrow0 - mn0);
                    al1 = ex2(mrow1 - mn1);
                    mrow0 = mn0;
                    mrow1 = mn1;
                    scale_rows<BN / 8>(s, al0, al1);
                    lrow0 = lrow0 * al0 + ls0 * al0;
                    lrow1 = lrow1 * al1 + ls1 * al1;
                    return;
                }
                // A jump past 120: this warp forms its rows of the tile's S again from q and k in global
                // memory (the tile's buffers may already hold others), 16 bytes of a row at a time, f16
                // products summed in f32 (a wgmma is the warpgroup's; only this warp is here). Rows and
                // keys past L read row L - 1 (their S is not used: rows are not stored, keys are masked).
                const long long kvh = (long long)(ibh / Hn) * Hkv + (ibh % Hn) / grp;
                const unsigned short* qa = q + qo_row(ibh, min(r0, Ln - 1), Hn, L);
                const unsigned short* qb = q + qo_row(ibh, min(r0 + 8, Ln - 1), Hn, L);
                // A rolled loop over the key chunks (the path is rare; an unrolled one doubled the CUBIN, which
                // MLX copies and hashes at every call): each chunk's four values enter at S's end as the rest
                // move down four places, so after BN / 8 chunks chunk cc's sit at 4 cc.
#pragma unroll 1
                for (int cc = 0; cc < BN / 8; cc++) {
                    const int n = n0 + 8 * cc + 2 * qd;
                    const unsigned short* k0 = k + (kvh * L + min(n, Ln - 1)) * HD;
                    const unsigned short* k1 = k + (kvh * L + min(n + 1, Ln - 1)) * HD;
                    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 1
                    for (int j = 0; j < HD / 8; j++) {
                        float x[8], y[8], kf[8];
                        ld_chunk(x, qa + 8 * j);
                        ld_chunk(y, qb + 8 * j);
                        ld_chunk(kf, k0 + 8 * j);
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            a0 = fmaf(x[e], kf[e], a0);
                            a2 = fmaf(y[e], kf[e], a2);
                        }
                        ld_chunk(kf, k1 + 8 * j);
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            a1 = fmaf(x[e], kf[e], a1);
                            a3 = fmaf(y[e], kf[e], a3);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < BN / 2 - 4; i++) s[i] = s[i + 4];
                    s[BN / 2 - 4] = a0;
                    s[BN / 2 - 3] = a1;
                    s[BN / 2 - 2] = a2;
                    s[BN / 2 - 1] = a3;
                }
                if (diag || n0 + BN > Ln) mask_s();
            }
#endif
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int cc = 0; cc < BN / 8; cc++) {
                mx0 = fmaxf(mx0, fmaxf(s[4 * cc], s[4 * cc + 1]));
                mx1 = fmaxf(mx1, fmaxf(s[4 * cc + 2], s[4 * cc + 3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
            // Tile 0 holds key 0, visible to every row: the running maxima are finite from then on.
#if RS
            // The running maxima move only where a row's tile maximum exceeds it by more than 8 (log2
            // units) in some row of the warp; otherwise the warp keeps its maxima, its probabilities
            // stay below 2^8 (f16 holds them; the sums are f32) and the rescale of oacc is skipped.
            resc = __any_sync(0xffffffff, mx0 * sl2 > mrow0 + 8.f || mx1 * sl2 > mrow1 + 8.f);
            const float mn0 = resc ? fmaxf(mrow0, mx0 * sl2) : mrow0, mn1 = resc ? fmaxf(mrow1, mx1 * sl2) : mrow1;
            al0 = resc ? ex2(mrow0 - mn0) : 1.f;
            al1 = resc ? ex2(mrow1 - mn1) : 1.f;
#else
            const float mn0 = fmaxf(mrow0, mx0 * sl2), mn1 = fmaxf(mrow1, mx1 * sl2);
            al0 = ex2(mrow0 - mn0);
            al1 = ex2(mrow1 - mn1);
#endif
            mrow0 = mn0;
            mrow1 = mn1;
            float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
            for (int cc = 0; cc < BN / 8; cc++) {
                exp_chunk(cc, mn0, mn1, ls0, ls1);
            }
            lrow0 = lrow0 * al0 + ls0;
            lrow1 = lrow1 * al1 + ls1;
        };
        // The output accumulators scaled by the last softmax's factors (where some row moved its maximum).
        auto rescale = [&]() {
            if (!(RS || PM) || resc) scale_rows<HDP / 8>(oacc, al0, al1);
        };
        // P as wgmma A fragments: k-step kk covers keys 16kk..16kk+15 (n8 chunks 2kk, 2kk+1).
        auto pack_p = [&]() {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                pprev[4 * kk] = pack2(s[8 * kk], s[8 * kk + 1]);
                pprev[4 * kk + 1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
                pprev[4 * kk + 2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
                pprev[4 * kk + 3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
            }
        };
        // The warp's last S product of the item has completed: Q may be overwritten.
        auto release_q = [&]() {
            if (lane == 0) mbar_arrive(sQe);
        };

#if PP
        if (c == 1) nbar_arrive<1>();  // warpgroup 0 takes the first turn
#endif
        int T0 = 0;  // the block's tiles before this item
        for (int p = blockIdx.x; p < groups; p += gridDim.x) {
            const int wend = min(per * p + per, items);
            const bool last_group = p + (int)gridDim.x >= groups;
#pragma unroll 1
            for (int w = per * p; w < wend; w++) {
                int bh, mb;
                work_item(w, nM, cz, bh, mb);
                const int m0 = mb * BLOCK_M, nt = tiles(m0);
                mce = shared_pair(w);
                wrow0 = m0 + 64 * c;
                r0 = wrow0 + 16 * warp + g;
                ibh = bh;
                mrow0 = -INFINITY;
                mrow1 = -INFINITY;
                lrow0 = 0.f;
                lrow1 = 0.f;
#pragma unroll
                for (int i = 0; i < HDP / 2; i++) oacc[i] = 0.f;

                wait_tile(T0);
                turn_begin();
                wg_fence();
                issue_s(T0);
                turn_end(false);
                wg_wait<0>();
                pin<BN / 2>(s);
                release_k(T0);
                if (nt == 1) release_q();
                softmax(0);
                pack_p();
#pragma unroll 1
                for (int t = 1; t < nt; t++) {
                    wait_tile(T0 + t);
                    wait_v(T0 + t - 1);
                    pin<HDP / 2>(oacc);
                    pin<BN / 4>(pprev);
                    turn_begin();
                    wg_fence();
                    issue_s(T0 + t);       // S of tile t ...
#if SO
                    // SO: the rescale by tile t - 1's factors runs while S of tile t is on the tensor cores
                    rescale();
                    pin<HDP / 2>(oacc);
                    wg_fence();
#endif
                    issue_pv(T0 + t - 1);  // ... and the PV product of tile t - 1, both in flight
                    turn_end(false);
                    wg_wait<1>();  // S has landed
                    pin<BN / 2>(s);
                    release_k(T0 + t);
                    if (t == nt - 1) release_q();
                    softmax(t);
                    wg_wait<0>();  // the PV product of tile t - 1 has landed in oacc
                    pin<HDP / 2>(oacc);
                    release(T0 + t - 1);
                    if (!SO) rescale();
                    pack_p();
                }
                wait_v(T0 + nt - 1);
                if (SO) rescale();
                pin<HDP / 2>(oacc);
                pin<BN / 4>(pprev);
                turn_begin();
                wg_fence();
                issue_pv(T0 + nt - 1);
                turn_end(last_group && w + 1 == wend);
                wg_wait<0>();
                pin<HDP / 2>(oacc);
                release(T0 + nt - 1);
                T0 += nt;
#if KS_DIAG_PVSS
                if (psink == 0x12345679u) o[0] = 0;
#endif
                lrow0 += __shfl_xor_sync(0xffffffff, lrow0, 1);
                lrow0 += __shfl_xor_sync(0xffffffff, lrow0, 2);
                lrow1 += __shfl_xor_sync(0xffffffff, lrow1, 1);
                lrow1 += __shfl_xor_sync(0xffffffff, lrow1, 2);
                const float i0 = 1.f / lrow0, i1 = 1.f / lrow1;
                const long long ors = QO_LHD ? (long long)Hn * HD : HD;  // output row stride
                const bool ok0 = r0 < Ln, ok1 = r0 + 8 < Ln;
#if OV
                // OV: the quad's four lanes hold 8 adjacent columns of a row per n8 chunk j (a word each);
                // a 4 x 4 transpose of words over the quad (two shfl.xor rounds) gives each lane the 8
                // columns of chunk 4 jg + qd, stored as one 16-byte word: a quad writes 64 whole bytes of
                // a row, where one 4-byte store a chunk left every 32-byte sector written in two halves.
                unsigned short* const o0 = o + qo_row(bh, r0, Hn, L);
#pragma unroll
                for (int jg = 0; jg < HD / 32; jg++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float ih = h ? i1 : i0;
                        unsigned x[4];
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            x[e] = pack2(oacc[4 * (4 * jg + e) + 2 * h] * ih, oacc[4 * (4 * jg + e) + 2 * h + 1] * ih);
                        quad_transpose(x, qd);
                        if (h ? ok1 : ok0)
                            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(o0 + h * ors * 8 + 32 * jg + 8 * qd),
                                         "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
                    }
                }
#else
#pragma unroll
                for (int j = 0; j < HD / 8; j++) {
                    if (ok0) *(unsigned*)(o + qo_row(bh, r0, Hn, L) + j * 8 + 2 * qd) = pack2(oacc[4 * j] * i0, oacc[4 * j + 1] * i0);
                    if (ok1) *(unsigned*)(o + qo_row(bh, r0, Hn, L) + ors * 8 + j * 8 + 2 * qd) = pack2(oacc[4 * j + 2] * i1, oacc[4 * j + 3] * i1);
                }
#endif
            }
        }
    }
#if MC
    // Neither block leaves while the other may still arrive on its barriers (its consumers' last
    // releases); every copy into it has landed, for its own consumers waited for each.
    cl_sync();
#endif
}

// The tiled path with its loads on TMA (TM) or cp.async. TMA_MIN > 0 (with TMA): a call whose blocks
// have fewer than TMA_MIN key tiles each takes cp.async, whose producer starts loading at once, where
// TMA's first load waits for the block's tensor maps to be built and published (at L = 1 that was
// 12.1 us against 7.3, H200): the per-tile gain does not pay for the maps over a few tiles. H100,
// 2026-12-05 (bench/h100-2026-12-05-attention-tma-min.txt): TMA_MIN 16 took 2,32,32,140,128 from 15.3 to
// 13.0 us (cuDNN 13.5) and 4,32,8,24,128 causal from 11.3 to 8.3 (cuDNN 9.7), but with both paths in the
// build the TMA path of long calls ran 1-2.5% slower (457.8 -> 469.2 us at 4,32,2048,128): default 0.
template <int BN, int ST, int KV>
__device__ __forceinline__ void tiled(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                      const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                                      KS_AXIS B, KS_AXIS H, KS_AXIS Hkv, KS_AXIS L, KS_AXIS D, KS_AXIS causal) {
#if TMA && TMA_MIN > 0
    // Key tiles per block: items (128-row query blocks) per block times their tiles of BN keys, half
    // of them under the mask.
    const long long nM = (L + BLOCK_M - 1) / BLOCK_M, items = B * H * nM;
    const long long per = (items + gridDim.x - 1) / gridDim.x, ntk = (L + BN - 1) / BN;
    if (per * (causal ? (ntk + 1) / 2 : ntk) < TMA_MIN) {
        attn_tiled<BN, ST, KV, false>(q, k, v, o, B, H, Hkv, L, D, causal);
        return;
    }
#endif
    attn_tiled<BN, ST, KV, TMA != 0>(q, k, v, o, B, H, Hkv, L, D, causal);
}

#if MC
#define KS_CLUSTER __cluster_dims__(2, 1, 1)
#else
#define KS_CLUSTER
#endif
extern "C" __global__ void KS_CLUSTER __launch_bounds__(NT, 1) attention(const unsigned short* __restrict__ q,
                                                              const unsigned short* __restrict__ k,
                                                              const unsigned short* __restrict__ v,
                                                              unsigned short* __restrict__ o, KS_AXIS B, KS_AXIS H,
                                                              KS_AXIS Hkv, KS_AXIS L, KS_AXIS D, KS_AXIS causal) {
#if SMALL_L > 0
    if (L <= SMALL_L) {
        small_rows(q, k, v, o, (int)B, (int)H, (int)Hkv, (int)L, causal ? 1 : 0);
        return;
    }
#endif
#if WIDE
    // Without the mask, the width of 160 or 176 keys that pads L least, where it pads at most 90% of
    // what BLOCK_N pads (wide tiles cost about 4% a key at whole tiles: 2 stages, two barriers a tile).
    if (!causal) {
        const long long p160 = (L + 159) / 160 * 160, p176 = (L + 175) / 176 * 176;
        const long long pb = (L + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
        if (min(p160, p176) * 10 < pb * 9) {
            if (p176 <= p160) tiled<176, 2, 1>(q, k, v, o, B, H, Hkv, L, D, causal);
            else tiled<160, 2, 1>(q, k, v, o, B, H, Hkv, L, D, causal);
            return;
        }
    }
#endif
    tiled<BLOCK_N, STAGES, KVS>(q, k, v, o, B, H, Hkv, L, D, causal);
}
