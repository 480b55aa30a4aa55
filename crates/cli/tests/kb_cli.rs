//! `ksearch kb` end to end, through the real binary.

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn kb_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kb")
}

fn ksearch() -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.env("KSEARCH_KB", kb_dir());
    c
}

/// `ksearch kb emulate TASK --backend BACKEND --kernel KERNEL` on the repository's tasks.
fn emulate(task: &str, backend: &str, kernel: &str) -> Command {
    let mut c = ksearch();
    c.arg("--tasks-dir")
        .arg(tasks_dir())
        .args(["kb", "emulate", task, "--backend", backend, "--kernel", kernel]);
    c
}

fn out(c: &mut Command) -> (i32, String, String) {
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn show_m3_max() {
    let (code, stdout, _) = out(ksearch().args(["kb", "show", "m3-max"]));
    assert_eq!(code, 0);
    assert!(stdout.contains("Apple M3 Max"), "{stdout}");
    assert!(stdout.contains("mem_bandwidth_gbs") && stdout.contains("400"), "{stdout}");
    assert!(
        stdout.contains("shared_per_block_kb") && stdout.contains("Metal Feature Set Tables"),
        "{stdout}"
    );
    assert!(!stdout.contains("no source"), "{stdout}");
}

#[test]
fn show_unknown_profile_is_a_usage_error() {
    let (code, _, stderr) = out(ksearch().args(["kb", "show", "m7-giga"]));
    assert_eq!(code, 2);
    assert!(
        stderr.contains("unknown profile `m7-giga`") && stderr.lines().count() == 1,
        "{stderr}"
    );
}

#[test]
fn map_shfl_xor_to_metal() {
    let (code, stdout, _) = out(ksearch().args(["kb", "map", "__shfl_xor_sync", "--to", "metal"]));
    assert_eq!(code, 0);
    assert!(stdout.starts_with("__shfl_xor_sync -> simd_shuffle_xor"), "{stdout}");
    assert!(stdout.contains("no member-mask argument"), "{stdout}");
    let (code, stdout, _) = out(ksearch().args(["kb", "map", "simd_sum", "--to", "cuda"]));
    assert_eq!(code, 0);
    // A float reduction never answers the integer-only intrinsic; its domain is stated.
    assert!(stdout.starts_with("simd_sum -> warp_reduce_sum\n"), "{stdout}");
    assert!(stdout.contains("  types: float, half, int, uint"), "{stdout}");
    assert!(
        stdout.contains("  __reduce_add_sync: 32-bit integers (int, unsigned) only"),
        "{stdout}"
    );
    // Every answer states its type domain.
    for q in ["__syncthreads", "atomicMax", "__expf", "simd_max"] {
        let to = if q.starts_with("simd") { "cuda" } else { "metal" };
        let (code, stdout, _) = out(ksearch().args(["kb", "map", q, "--to", to]));
        assert_eq!(code, 0, "{q}");
        assert!(
            stdout.lines().nth(1).is_some_and(|l| l.starts_with("  types: ")),
            "{q}: {stdout}"
        );
    }
}

#[test]
fn profiles_and_patterns_list() {
    let (code, stdout, _) = out(ksearch().args(["kb", "profiles"]));
    assert_eq!(code, 0);
    assert!(stdout.contains("h100") && stdout.contains("m1-max") && stdout.contains("cpu"));
    let (code, stdout, _) = out(ksearch().args(["kb", "patterns"]));
    assert_eq!(code, 0);
    assert!(stdout.contains("flash-attention-2") && stdout.contains("exp2-softmax"));
}

#[test]
fn check_rejects_40k_threadgroup_and_accepts_a_valid_kernel() {
    let bad = kb_dir().join("examples/reject/threadgroup-40k.metal");
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--target", "m3-max"]).arg(&bad));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("rule apple.threadgroup-32k: threadgroup memory 40960 B exceeds 32768 B on m3-max (line 13)"),
        "{stdout}"
    );
    let good = kb_dir().join("examples/softmax_rows.metal");
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--target", "m3-max"]).arg(&good));
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains("accepted"), "{stdout}");
}

#[test]
fn check_with_syntax_and_mlx_body() {
    if ksearch_kb::find_cxx().is_none() {
        eprintln!("warning: no C++ compiler, --syntax skipped");
        return;
    }
    let good = kb_dir().join("examples/softmax_rows.metal");
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--syntax", "--target", "m1-max"]).arg(&good));
    assert_eq!(code, 0, "{stdout}");
    let body = kb_dir().join("examples/scale_body.metal");
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--syntax"]).arg(&body));
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains("mlx-metal"), "{stdout}");
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.metal");
    std::fs::write(
        &broken,
        "// inputs: inp:f32\n// outputs: out:f32\nuint i = thread_position_in_grid.x;\nif (i >= 4) return;\nout[i] = nope[i];\n",
    )
    .unwrap();
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--syntax"]).arg(&broken));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("rule metal.syntax") && stdout.contains("nope"), "{stdout}");
}

#[test]
fn check_cuda_dialect_and_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("k.cu");
    std::fs::write(&f, "__global__ void k(float* y) { y[0] = simd_sum(y[0]); }\n").unwrap();
    let (code, stdout, _) = out(ksearch().args(["kb", "check", "--target", "h100"]).arg(&f));
    assert_eq!(code, 1);
    assert!(
        stdout.contains("rule cuda.metal-identifier: `simd_sum` is Metal, not CUDA"),
        "{stdout}"
    );
    let (code, _, stderr) = out(ksearch().args(["kb", "check", "--target", "nope"]).arg(&f));
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown profile"), "{stderr}");
}

/// A copy of the knowledge base to break.
fn kb_copy(to: &Path) {
    for sub in ["", "profiles", "patterns", "templates"] {
        std::fs::create_dir_all(to.join(sub)).unwrap();
        for e in std::fs::read_dir(kb_dir().join(sub)).unwrap().filter_map(|e| e.ok()) {
            if e.path().is_file() {
                std::fs::copy(e.path(), to.join(sub).join(e.file_name())).unwrap();
            }
        }
    }
}

#[test]
fn an_unknown_back_end_in_a_profile_is_a_one_line_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("kb");
    kb_copy(&k);
    let (code, _, _) = out(ksearch().env("KSEARCH_KB", &k).args(["kb", "profiles"]));
    assert_eq!(code, 0, "the copy loads");
    let f = k.join("profiles/h200.toml");
    let text = std::fs::read_to_string(&f).unwrap();
    let broken = text.replacen(r#"backends = ["cuda", "mlx-cuda"]"#, r#"backends = ["cuda", "rocm"]"#, 1);
    assert_ne!(broken, text);
    std::fs::write(&f, broken).unwrap();
    let (code, stdout, stderr) = out(ksearch().env("KSEARCH_KB", &k).args(["kb", "profiles"]));
    assert_eq!(code, 2, "{stdout}");
    assert!(
        stderr.contains("h200.toml:") && stderr.contains("`rocm`") && stderr.lines().count() == 1,
        "{stderr}"
    );
}

#[test]
fn an_unknown_dialect_or_language_flag_is_a_one_line_usage_error() {
    let (code, _, stderr) = out(ksearch().args(["kb", "map", "__syncthreads", "--to", "rocm"]));
    assert_eq!(code, 2);
    assert!(
        stderr.contains("unknown dialect `rocm`") && stderr.contains("metal or cuda") && stderr.lines().count() == 1,
        "{stderr}"
    );
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("k.cu");
    std::fs::write(&f, "__global__ void k(float* y) { y[0] = 1.0f; }\n").unwrap();
    let (code, _, stderr) = out(ksearch().args(["kb", "check", "--lang", "hip"]).arg(&f));
    assert_eq!(code, 2);
    assert!(
        stderr.contains("unknown language `hip`") && stderr.contains("mlx-cuda") && stderr.lines().count() == 1,
        "{stderr}"
    );
}

fn tasks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks")
}

#[test]
fn emulate_runs_a_task_metal_kernel_on_the_cpu_and_checks_it() {
    // The repository's kernel: every element within tolerance, exit 0.
    let (code, stdout, stderr) = out(ksearch().arg("--tasks-dir").arg(tasks_dir()).args([
        "kb",
        "emulate",
        "softmax",
        "--kernel",
        "block_row",
        "-D",
        "THREADS=128",
        "--workload",
        "rows=3,cols=520",
    ]));
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.starts_with("ok   block_row [ONLINE=1,THREADS=128,VEC=4] on cols=520,rows=3: `y` 1560 elements ok"),
        "{stdout}"
    );
    // A body of one's own in the kernel's place: it forgets the last column (wrong values
    // stay poisoned), exit 1 with the count; one that writes past its output is a fault.
    let dir = tempfile::tempdir().unwrap();
    let lazy = dir.path().join("lazy.metal");
    std::fs::write(
        &lazy,
        "const uint r = threadgroup_position_in_grid.x, t = thread_position_in_threadgroup.x;\n\
         if (t == 0) {\n  float m = -INFINITY, s = 0.0f;\n\
         for (int c = 0; c < cols; c++) m = max(m, x[r * cols + c]);\n\
         for (int c = 0; c < cols; c++) s += exp(x[r * cols + c] - m);\n\
         for (int c = 0; c + 1 < cols; c++) y[r * cols + c] = exp(x[r * cols + c] - m) / s;\n}\n",
    )
    .unwrap();
    let (code, stdout, _) = out(ksearch()
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .args(["kb", "emulate", "softmax", "--workload", "rows=4,cols=100", "--file"])
        .arg(&lazy));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("FAIL seed [] on cols=100,rows=4: `y` 0 mismatched, 4 unwritten"),
        "{stdout}"
    );
    let oob = dir.path().join("oob.metal");
    std::fs::write(&oob, "y[thread_position_in_grid.x * 64] = 0.0f;\n").unwrap();
    let (code, stdout, _) = out(ksearch()
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .args(["kb", "emulate", "softmax", "--workload", "rows=4,cols=100", "--file"])
        .arg(&oob));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("metal-emu: memory fault"), "{stdout}");
    // A whole Metal file: buffers bound by name, launched as told.
    let example = kb_dir().join("examples/softmax_rows.metal");
    let (code, stdout, _) = out(ksearch()
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .args([
            "kb",
            "emulate",
            "softmax",
            "--workload",
            "rows=5,cols=777",
            "--grid",
            "rows * 256, 1, 1",
            "--threadgroup",
            "256,1,1",
            "--file",
        ])
        .arg(&example));
    assert_eq!(code, 0, "{stdout}");
    assert!(
        stdout.starts_with("ok   softmax_rows.metal on cols=777,rows=5: `y` 3885 elements ok"),
        "{stdout}"
    );
    let (code, _, stderr) = out(ksearch()
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .args(["kb", "emulate", "softmax", "--file"])
        .arg(&example));
    assert_eq!(code, 2);
    assert!(stderr.contains("needs --grid and --threadgroup"), "{stderr}");
    // Usage errors: one line, exit 2.
    for (args, want) in [
        (
            vec!["kb", "emulate", "softmax", "--kernel", "nope"],
            "no mlx-metal kernel `nope` (known: seed, block_row)",
        ),
        (
            vec!["kb", "emulate", "softmax", "--workload", "rows=3"],
            "gives no value for axis `cols`",
        ),
        (
            vec!["kb", "emulate", "softmax", "--kernel", "block_row", "-D", "WARPS=2"],
            "has no tunable `WARPS`",
        ),
        (vec!["kb", "emulate", "nosuchtask"], "nosuchtask"),
    ] {
        let (code, _, stderr) = out(ksearch().arg("--tasks-dir").arg(tasks_dir()).args(&args));
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(want) && stderr.lines().count() == 1, "{args:?}: {stderr}");
    }
}

/// The kernels with at least one `ok` line in `kb emulate`'s output.
fn passed_kernels(stdout: &str) -> std::collections::BTreeSet<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with("ok   "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect()
}

/// Whether NVRTC is here (scripts/test.sh exports where it installed it and requires it).
fn nvrtc_here() -> bool {
    let inc = std::env::var("KSEARCH_CUDA_INCLUDE").unwrap_or_default();
    let ok = !inc.is_empty() && Path::new(&inc).join("cuda_fp16.h").exists();
    if !ok {
        assert!(
            std::env::var("KSEARCH_REQUIRE_NVRTC").is_err(),
            "KSEARCH_REQUIRE_NVRTC is set but KSEARCH_CUDA_INCLUDE names no CUDA headers"
        );
        eprintln!("skipping: NVRTC is not installed (scripts/test.sh installs it)");
    }
    ok
}

#[test]
fn emulate_runs_every_cuda_kernel_of_every_task_through_the_ptx_interpreter() {
    if !nvrtc_here() {
        return;
    }
    // Every kernel at its defaults on the task's `emulate` workloads: every element checked,
    // the wgmma / TMA / mbarrier kernels of attention included.
    for (task, kernels) in [
        ("softmax", 2),
        ("rmsnorm", 2),
        ("mamba_step", 2),
        ("mamba_scan", 8),
        ("attention", 5),
    ] {
        let (code, stdout, stderr) =
            out(ksearch()
                .arg("--tasks-dir")
                .arg(tasks_dir())
                .args(["kb", "emulate", task, "--backend", "cuda"]));
        assert_eq!(code, 0, "{task}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, "), "{task}: {stdout}");
        let names = passed_kernels(&stdout);
        assert_eq!(names.len(), kernels, "{task}: {stdout}");
        assert!(!stdout.contains("FAIL"), "{stdout}");
        if task == "mamba_scan" {
            // The MLX twins: the same units built as MLX's worker builds them (32-bit axes),
            // their arguments as MLX passes them; MLX bodies are MLX's compiler's.
            let (code, stdout, stderr) =
                out(ksearch()
                    .arg("--tasks-dir")
                    .arg(tasks_dir())
                    .args(["kb", "emulate", task, "--backend", "mlx-cuda"]));
            assert_eq!(code, 0, "{stdout}{stderr}");
            let units = passed_kernels(&stdout);
            assert_eq!(units.len(), 4, "{stdout}");
            assert!(stdout.contains("skip seed") && stdout.contains("an MLX body"), "{stdout}");
        }
        if task == "attention" {
            // The Hopper kernels (wgmma, TMA, mbarriers) run too, nothing skipped.
            assert!(names.contains("flash_ws") && names.contains("flash_wgmma"), "{stdout}");
            assert!(stdout.contains(": 0 failed, 0 skipped"), "{stdout}");
        }
    }
}

#[test]
fn emulate_runs_flash_ws_short_calls_beside_its_wgmma_path() {
    if !nvrtc_here() {
        return;
    }
    // flash_ws's SMALL_L path (a warp a query row, no tiles) beside its tiled wgmma path: calls
    // with L <= SMALL_L take the first, L = 33 the second, each checked element by element, on
    // both units (64-bit axes for the CUDA back-end, 32-bit as MLX passes them).
    for backend in ["cuda", "mlx-cuda"] {
        let (code, stdout, stderr) = out(ksearch()
            .arg("--tasks-dir")
            .arg(tasks_dir())
            .args(["kb", "emulate", "attention", "--backend", backend, "--kernel", "flash_ws"])
            .args(["-D", "SMALL_L=32"])
            .args(["--workload", "B=3,H=4,Hkv=1,L=1,D=128,causal=1"])
            .args(["--workload", "B=2,H=4,Hkv=2,L=9,D=64,causal=1"])
            .args(["--workload", "B=1,H=6,Hkv=3,L=32,D=96,causal=0"])
            .args(["--workload", "B=1,H=2,Hkv=2,L=33,D=128,causal=0"]));
        assert_eq!(code, 0, "{backend}: {stdout}{stderr}");
        assert_eq!(
            stdout.lines().filter(|l| l.starts_with("ok   flash_ws")).count(),
            4,
            "{backend}: {stdout}"
        );
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{backend}: {stdout}");
    }
}

/// `kb emulate` of flash_ws on `backend` with `defines` (NAME=VALUE) on `workloads`, from `file` in
/// place of the kernel's source where one is given.
fn emulate_flash_ws(
    backend: &str,
    defines: &[&str],
    workloads: &[&str],
    file: Option<&std::path::Path>,
) -> (i32, String, String) {
    let mut cmd = emulate("attention", backend, "flash_ws");
    for d in defines {
        cmd.args(["-D", d]);
    }
    for w in workloads {
        cmd.args(["--workload", w]);
    }
    if let Some(f) = file {
        cmd.arg("--file").arg(f);
    }
    out(&mut cmd)
}

/// flash_ws.cu with `from` (which must be in it) replaced by `to`, written as `dir`/`name`.
fn flash_ws_mutant(dir: &std::path::Path, name: &str, from: &str, to: &str) -> std::path::PathBuf {
    let src = std::fs::read_to_string(tasks_dir().join("attention/cuda/flash_ws.cu")).unwrap();
    assert!(src.contains(from), "flash_ws.cu changed: {from}");
    let path = dir.join(name);
    std::fs::write(&path, src.replace(from, to)).unwrap();
    path
}

#[test]
fn emulate_runs_flash_ws_with_software_exponentials_and_catches_a_broken_one() {
    if !nvrtc_here() {
        return;
    }
    // EMU=3: 3 of every 8 key chunks' exponentials by the polynomial, on both units, under the
    // causal mask (keys past the diagonal are -inf) and on a ragged tail.
    let wl = ["B=1,H=2,Hkv=1,L=200,D=128,causal=1", "B=1,H=2,Hkv=2,L=130,D=64,causal=0"];
    for backend in ["cuda", "mlx-cuda"] {
        let (code, stdout, stderr) = emulate_flash_ws(backend, &["EMU=3"], &wl, None);
        assert_eq!(code, 0, "{backend}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{backend}: {stdout}");
    }
    // Without the clamp that keeps 2^x of a masked key a normal number: its exponent wraps.
    let dir = tempfile::tempdir().unwrap();
    let broken = flash_ws_mutant(dir.path(), "noclamp.cu", "x = fmaxf(x, -125.f);", "");
    let (code, stdout, _) = emulate_flash_ws("cuda", &["EMU=3"], &wl, Some(&broken));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL flash_ws") && l.contains("causal=1")),
        "{stdout}"
    );
}

#[test]
fn emulate_runs_flash_ws_output_stores_both_ways_and_catches_a_broken_transpose() {
    if !nvrtc_here() {
        return;
    }
    // OV 1 (the default): the quad's output words transposed by two shuffle rounds, 16-byte stores;
    // OV 0: a 4-byte store per chunk. Head sizes 64 and 96 (three groups of four chunks), rows past L
    // not stored (L 77: the second query block's rows from 77 on).
    let wl = ["B=1,H=2,Hkv=1,L=77,D=96,causal=1", "B=1,H=2,Hkv=2,L=130,D=64,causal=0"];
    for ov in ["OV=0", "OV=1"] {
        let (code, stdout, stderr) = emulate_flash_ws("cuda", &[ov], &wl, None);
        assert_eq!(code, 0, "{ov}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{ov}: {stdout}");
    }
    // The transpose's second round exchanging with the wrong lane: columns land in the wrong place.
    let dir = tempfile::tempdir().unwrap();
    let broken = flash_ws_mutant(dir.path(), "transpose.cu", "hi ? x[1] : x[3], 2);", "hi ? x[1] : x[3], 1);");
    let (code, stdout, _) = emulate_flash_ws("cuda", &["OV=1"], &wl, Some(&broken));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAIL flash_ws"), "{stdout}");
}

#[test]
fn emulate_runs_flash_ws_cluster_multicast_and_catches_a_wrong_box_or_an_early_exit() {
    if !nvrtc_here() {
        return;
    }
    // MC 1: clusters of two blocks; without the mask a pair of query blocks of one key/value head
    // shares every K and V tile (each block multicasts its half), across heads too where grouped
    // heads share one (L 384: three blocks a head); head size 64 and the causal mask load apart.
    let defs = ["MC=1", "WIDE=0"];
    let wl = [
        "B=1,H=4,Hkv=2,L=384,D=128,causal=0",
        "B=1,H=3,Hkv=3,L=300,D=96,causal=0",
        "B=1,H=4,Hkv=2,L=300,D=128,causal=1",
        "B=1,H=2,Hkv=2,L=130,D=64,causal=0",
    ];
    for backend in ["cuda", "mlx-cuda"] {
        let (code, stdout, stderr) = emulate_flash_ws(backend, &defs, &wl, None);
        assert_eq!(code, 0, "{backend}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{backend}: {stdout}");
    }
    let dir = tempfile::tempdir().unwrap();
    // Both blocks multicasting the first 64 columns of K: the second half is never loaded.
    let half = "if (jb == rank) tma3_mc(dst + jb * BN * 128, gTm + 128";
    let wrong = flash_ws_mutant(dir.path(), "box.cu", half, &half.replace("jb == rank", "jb == 0"));
    let (code, stdout, _) = emulate_flash_ws("cuda", &defs, &wl, Some(&wrong));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("FAIL flash_ws") && stdout.contains("L=384"), "{stdout}");
    // Without the last cluster barrier a block leaves while the other still arrives on its barriers.
    let last = "    // releases); every copy into it has landed, for its own consumers waited for each.\n    cl_sync();";
    let early = flash_ws_mutant(dir.path(), "early.cu", last, "");
    let (code, stdout, _) = emulate_flash_ws("cuda", &defs, &wl, Some(&early));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("whose threads have all exited"), "{stdout}");
}

#[test]
fn emulate_runs_flash_ws_rescaling_beside_the_s_product_and_catches_it_after_pv() {
    if !nvrtc_here() {
        return;
    }
    // SO 1: a turn issues S of tile t, scales the output by tile t - 1's factors while S runs, then
    // issues tile t - 1's PV product; the last tile's scale comes before the last PV product. Under
    // the causal mask, ragged, head sizes 64 / 96 / 128, one tile (L 77) and many (L 600).
    let wl = [
        "B=1,H=2,Hkv=1,L=300,D=128,causal=1",
        "B=1,H=2,Hkv=2,L=600,D=64,causal=0",
        "B=1,H=2,Hkv=1,L=77,D=96,causal=0",
    ];
    for backend in ["cuda", "mlx-cuda"] {
        let (code, stdout, stderr) = emulate_flash_ws(backend, &["SO=1"], &wl, None);
        assert_eq!(code, 0, "{backend}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{backend}: {stdout}");
    }
    // The scale issued after the PV product it should precede: tile t - 1's probabilities scaled by
    // its own factors (and O read while that product is in flight).
    let src = std::fs::read_to_string(tasks_dir().join("attention/cuda/flash_ws.cu")).unwrap();
    let scale =
        "                    rescale();\n                    pin<HDP / 2>(oacc);\n                    wg_fence();\n#endif\n";
    let pv = "                    issue_pv(T0 + t - 1);  // ... and the PV product of tile t - 1, both in flight\n";
    let from = format!("{scale}{pv}");
    assert!(src.contains(&from), "flash_ws.cu changed: {from}");
    let to = format!("#endif\n{pv}                    if (SO) rescale();\n");
    let dir = tempfile::tempdir().unwrap();
    let late = dir.path().join("late.cu");
    std::fs::write(&late, src.replace(&from, &to)).unwrap();
    let (code, stdout, _) = emulate_flash_ws("cuda", &["SO=1"], &wl[..2], Some(&late));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAIL flash_ws"), "{stdout}");
}

#[test]
fn emulate_runs_flash_ws_softmax_against_running_maxima_and_both_redo_paths() {
    if !nvrtc_here() {
        return;
    }
    // PM 1: past an item's first tile the exponentials run against the running maxima; PM 2 moves the
    // maxima and scales P at any growth, PM 3 forms S again from q and k at any growth (the paths a
    // jump of more than 8, or one that overflows P, takes). Both units, the causal mask, ragged
    // tails, head sizes 64 / 96 / 128, grouped heads, and a wide-tile call (L 300 without the mask: 176-key tiles
    // with K and V released apart, which keep the plain softmax).
    let wl = [
        "B=1,H=2,Hkv=1,L=300,D=128,causal=0",
        "B=1,H=2,Hkv=1,L=400,D=128,causal=1",
        "B=1,H=3,Hkv=1,L=520,D=96,causal=1",
        "B=1,H=2,Hkv=2,L=200,D=64,causal=0",
    ];
    // EMU 2 with PM 2: the polynomial exponentials on the scaling path too.
    for (backend, defs, n) in [
        ("cuda", &["PM=1"][..], 4),
        ("cuda", &["PM=2"][..], 4),
        ("cuda", &["PM=3"][..], 4),
        ("cuda", &["PM=2", "EMU=2"][..], 2),
        ("mlx-cuda", &["PM=1"][..], 2),
        ("mlx-cuda", &["PM=3"][..], 2),
    ] {
        let (code, stdout, stderr) = emulate_flash_ws(backend, defs, &wl[..n], None);
        assert_eq!(code, 0, "{backend} {defs:?}: {stdout}{stderr}");
        assert!(stdout.contains(": 0 failed, 0 skipped"), "{backend} {defs:?}: {stdout}");
    }
    let dir = tempfile::tempdir().unwrap();
    // The scaling path leaving P as the stale maxima gave it (its sums and the output still scaled).
    let scale = "                    scale_rows<BN / 8>(s, al0, al1);\n";
    let unscaled = flash_ws_mutant(dir.path(), "unscaled.cu", scale, "");
    let (code, stdout, _) = emulate_flash_ws("cuda", &["PM=2"], &wl[1..2], Some(&unscaled));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAIL flash_ws"), "{stdout}");
    // The recomputation reading the first row twice instead of rows r0 and r0 + 8.
    let row = "q + qo_row(ibh, min(r0 + 8, Ln - 1), Hn, L);";
    let wrong = flash_ws_mutant(dir.path(), "row.cu", row, "q + qo_row(ibh, min(r0, Ln - 1), Hn, L);");
    let (code, stdout, _) = emulate_flash_ws("cuda", &["PM=3"], &wl[1..2], Some(&wrong));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAIL flash_ws"), "{stdout}");
}

#[test]
fn emulate_catches_a_wgmma_kernel_reading_its_accumulators_before_their_wait_or_fence() {
    if !nvrtc_here() {
        return;
    }
    // flash_ws reading S before the wait that retires its product, or rescaling O while the PV
    // product is in flight: right on the run where products land at issue, wrong where they land
    // at their wait. 600 keys are five tiles, so the loop where both overlap runs.
    let src = std::fs::read_to_string(tasks_dir().join("attention/cuda/flash_ws.cu")).unwrap();
    let s_wait = "wg_wait<1>();  // S has landed";
    let pv_wait = "wg_wait<0>();  // the PV product of tile t - 1 has landed in oacc";
    let dir = tempfile::tempdir().unwrap();
    for (name, from, to) in [("early-s", s_wait, "wg_wait<2>();"), ("early-pv", pv_wait, "wg_wait<1>();")] {
        assert!(src.contains(from), "flash_ws.cu changed: {from}");
        let file = dir.path().join(format!("{name}.cu"));
        std::fs::write(&file, src.replace(from, to)).unwrap();
        let (code, stdout, _) = out(emulate("attention", "cuda", "flash_ws")
            .args(["--workload", "B=1,H=2,Hkv=1,L=600,D=64,causal=0"])
            .arg("--file")
            .arg(&file));
        assert_eq!(code, 1, "{name}: {stdout}");
        assert!(
            stdout.starts_with("FAIL flash_ws")
                && stdout.contains("mismatched")
                && stdout.contains("(with results landing late and warps in reverse)"),
            "{name}: {stdout}"
        );
    }
    // Without the wgmma.fence between O's rescale (and P's packing) and the products that read
    // them: PTX leaves such a product free to read the registers' older values.
    let fenced = "turn_begin();\n                    wg_fence();\n                    issue_s(T0 + t);";
    assert!(src.contains(fenced), "flash_ws.cu changed: {fenced}");
    let file = dir.path().join("nofence.cu");
    std::fs::write(
        &file,
        src.replace(fenced, "turn_begin();\n                    issue_s(T0 + t);"),
    )
    .unwrap();
    let (code, stdout, _) = out(emulate("attention", "cuda", "flash_ws")
        .args(["--workload", "B=1,H=2,Hkv=1,L=600,D=64,causal=0"])
        .arg("--file")
        .arg(&file));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.starts_with("FAIL flash_ws") && stdout.contains("with no `wgmma.fence` since"),
        "{stdout}"
    );
}

#[test]
fn emulate_catches_a_hopper_kernel_missing_a_barrier_wait_or_its_swizzle() {
    if !nvrtc_here() {
        return;
    }
    // flash_ws with one of its mbarrier waits taken out, or its cp.async layout without the
    // 128-byte swizzle its wgmma descriptors read: each fails, where the kernel as shipped
    // passes. 600 keys are 5 tiles through a ring of 3 stages, so the producer refills stages.
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(tasks_dir().join("attention/cuda/flash_ws.cu")).unwrap();
    let full = "mbar_wait(fullK(T), (T / ST) & 1);";
    let empty = "if (T >= ST) mbar_wait(emptyK(T), ph);";
    let swz = "(((j & 7) ^ (r & 7)) << 4)";
    for s in [full, empty, swz] {
        assert!(src.contains(s), "flash_ws.cu changed: {s}");
    }
    let cases = [
        ("shipped", src.clone(), "1", true),
        ("no-full-wait", src.replace(full, "(void)0;"), "1", false),
        ("no-empty-wait", src.replace(empty, "(void)0;"), "1", false),
        ("no-empty-wait-cp", src.replace(empty, "(void)0;"), "0", false),
        ("no-swizzle-cp", src.replace(swz, "((j & 7) << 4)"), "0", false),
    ];
    for (name, text, tma, passes) in cases {
        let file = dir.path().join(format!("{name}.cu"));
        std::fs::write(&file, text).unwrap();
        let (code, stdout, stderr) = out(ksearch()
            .arg("--tasks-dir")
            .arg(tasks_dir())
            .args(["kb", "emulate", "attention", "--backend", "cuda", "--kernel", "flash_ws"])
            .args(["-D", &format!("TMA={tma}")])
            .args(["--workload", "B=1,H=2,Hkv=1,L=600,D=64,causal=0", "--file"])
            .arg(&file));
        if passes {
            assert_eq!(code, 0, "{name}: {stdout}{stderr}");
            // One workload, both landings: a kernel with mbarriers runs twice on it.
            assert!(
                stdout.starts_with("ok   flash_ws") && stdout.contains("(with results landing at issue and late)"),
                "{name}: {stdout}"
            );
        } else {
            assert_eq!(code, 1, "{name}: {stdout}{stderr}");
            assert!(stdout.starts_with("FAIL flash_ws"), "{name}: {stdout}");
        }
    }
}

#[test]
fn emulate_catches_a_cuda_kernel_that_reads_before_its_copies_land_or_its_barrier() {
    if !nvrtc_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(tasks_dir().join("mamba_scan/cuda/warp_scan.cu")).unwrap();
    // The selective scan without its cp.async wait: the chunk is read before it lands.
    let wait = "asm volatile(\"cp.async.wait_group 0;\\n\" ::: \"memory\");";
    assert!(src.contains(wait), "warp_scan.cu changed");
    let nowait = dir.path().join("nowait.cu");
    std::fs::write(&nowait, src.replace(wait, "")).unwrap();
    // Without the barrier between the conversion and the compute.
    let sync = "__syncthreads();  // converted; raw and yt free";
    assert!(src.contains(sync), "warp_scan.cu changed");
    let nosync = dir.path().join("nosync.cu");
    std::fs::write(&nosync, src.replace(sync, "")).unwrap();
    for (file, want) in [(&nowait, "NaN of 7200"), (&nosync, "NaN of 7200")] {
        let (code, stdout, _) = out(ksearch()
            .arg("--tasks-dir")
            .arg(tasks_dir())
            .args([
                "kb",
                "emulate",
                "mamba_scan",
                "--backend",
                "cuda",
                "--kernel",
                "warp_scan",
                "--workload",
                "batch=1,L=300,D=24,N=16",
                "--file",
            ])
            .arg(file));
        assert_eq!(code, 1, "{file:?}: {stdout}");
        assert!(
            stdout.starts_with("FAIL warp_scan") && stdout.contains(want),
            "{file:?}: {stdout}"
        );
    }
    // The softmax seed writing one element past its row: the last row's write leaves y.
    let seed = std::fs::read_to_string(tasks_dir().join("softmax/cuda/naive.cu")).unwrap();
    let tail = "for (long long c = threadIdx.x; c < cols; c += NT) yr[c] =";
    assert!(seed.contains(tail), "naive.cu changed");
    let oob = dir.path().join("oob.cu");
    std::fs::write(
        &oob,
        seed.replace(tail, "for (long long c = threadIdx.x; c <= cols; c += NT) yr[c] ="),
    )
    .unwrap();
    let (code, stdout, _) = out(ksearch()
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .args([
            "kb",
            "emulate",
            "softmax",
            "--backend",
            "cuda",
            "--workload",
            "rows=3,cols=512",
            "--file",
        ])
        .arg(&oob));
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("FAIL seed [] on cols=512,rows=3: launch `softmax`: block (2, 0, 0): line")
            && stdout.contains("4-byte access at byte 6144 of `x`, which has 6144 bytes"),
        "{stdout}"
    );
}

#[test]
fn emulate_refuses_a_value_outside_a_tunables_list_and_a_request_that_checks_nothing() {
    // A value the task does not list: refused before anything is built (exit 2, one line).
    let (code, stdout, stderr) = out(emulate("mamba_scan", "cuda", "warp_scan").args(["-D", "K=5"]));
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(
        stderr.contains("kernel `warp_scan`: K=5 is not one of its values (4, 8, 16; task `mamba_scan`)"),
        "{stderr}"
    );
    assert!(stdout.is_empty(), "{stdout}");
    // Every run refused by a constraint: each skip names it, and nothing checked is no pass.
    let (code, stdout, stderr) =
        out(emulate("attention", "cuda", "flash_ws").args(["--workload", "B=1,H=3,Hkv=2,L=10,D=64,causal=0"]));
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stdout.contains("not admitted: `H % Hkv == 0` does not hold"), "{stdout}");
    assert!(stderr.contains("nothing was checked"), "{stderr}");
}

#[test]
fn emulate_runs_warp_scan_with_cm_folded_in_and_catches_a_lost_handoff() {
    if !nvrtc_here() {
        return;
    }
    // CQ=1 at K 16 (the 128-register build it is for) on three chunks of 512 steps and a ragged
    // tail, with 13 channels (a partial block): every element of y and the final state checked.
    let run = |file: Option<&std::path::Path>| {
        let mut cmd = emulate("mamba_scan", "cuda", "warp_scan");
        cmd.args([
            "-D",
            "CQ=1",
            "-D",
            "K=16",
            "-D",
            "RT=1",
            "--workload",
            "batch=1,L=1100,D=13,N=16",
        ]);
        if let Some(f) = file {
            cmd.arg("--file").arg(f);
        }
        out(&mut cmd)
    };
    let (code, stdout, stderr) = run(None);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.starts_with("ok   warp_scan") && stdout.contains("CQ=1"), "{stdout}");
    // Lane 0 forgetting the state entering the chunk: wrong from the second chunk on.
    let src = std::fs::read_to_string(tasks_dir().join("mamba_scan/cuda/warp_scan.cu")).unwrap();
    let handoff = "if (lane == 0) hin = hc;";
    assert!(src.contains(handoff), "warp_scan.cu changed");
    let dir = tempfile::tempdir().unwrap();
    let lost = dir.path().join("lost.cu");
    std::fs::write(&lost, src.replace(handoff, "if (lane == 0) hin = 0.f;")).unwrap();
    let (code, stdout, _) = run(Some(&lost));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAIL warp_scan"), "{stdout}");
}

#[test]
fn emulate_runs_tw_scan_and_catches_a_hand_over_read_early_or_on_the_wrong_phase() {
    if !nvrtc_here() {
        return;
    }
    // tw_scan's warps hand the state over run by run through shared memory and an mbarrier (no
    // block barrier): 19 runs of 16 steps over 8 warps with a ragged tail, so a warp waits on both
    // phases of its mbarrier; with HS 4 the chain's warps also wait on the maps of the runs after
    // theirs; with CV 1 both passes read the run's Bm and Cm rows the warp widened once; with HO 1
    // a link is one PTX sequence (wait, read, FMA, store, arrive); HO 2 polls with test_wait; with
    // YS 1 a group of G steps' partial y is summed and transposed by shuffles (G 2 leaves the
    // second block 8 of its 16 channels); with A1 1 lane 0 alone arrives for its warp. The
    // defaults read f32 rows (CV 1) with the channels adjacent in the warp (LM 1: the partial y is
    // stored channel-major all the same, and a hand-over slot is indexed by lane) and padded y rows
    // (YP 1), its partial y summed by shuffles (YS 1); LM 0 / YP 0, CF 0 (Cm read as halves) and
    // YS 0 (the partials through shared memory) are the other values. DW 1 widens a run's delta and
    // u once per warp and adds Dv u where the partials are summed (G 2 leaves a partial block); YD 1
    // keeps every step's partial y and sums and stores the groups after the second pass. YL 1 forms
    // y's part from the run's own inputs in the first pass and only decays the entering state in the
    // second; YL 2 also reads Bm as halves there. AO 1 copies a run's rows from pointers each lane
    // steps by W runs a load.
    let run = |defs: &[&str], file: Option<&std::path::Path>| {
        let mut cmd = emulate("mamba_scan", "cuda", "tw_scan");
        for d in defs {
            cmd.args(["-D", d]);
        }
        cmd.args(["--workload", "batch=1,L=300,D=24,N=16"]);
        if let Some(f) = file {
            cmd.arg("--file").arg(f);
        }
        out(&mut cmd)
    };
    for defs in [
        &["HS=1"][..],
        &["HS=4"],
        &["HS=1", "CV=1"],
        &["HS=4", "CV=1"],
        &["HO=1"],
        &["HO=1", "CV=1"],
        &["HO=2"],
        &["YS=1"],
        &["YS=1", "G=2", "K=8"],
        &["YS=1", "G=8", "K=8", "CV=1"],
        &["A1=1"],
        &["A1=1", "HS=4", "G=2", "K=8"],
        &["CV=0", "LM=0", "YP=0"],
        &["CV=0", "LM=1"],
        &["CF=0"],
        &["CF=0", "G=2", "K=8", "LM=0"],
        &["LM=1", "YS=1", "HS=4"],
        &["YS=0", "YD=0"],
        &["YS=0", "YD=0", "CF=0", "HO=1"],
        &["DW=1"],
        &["DW=1", "YS=0", "YD=0"],
        &["DW=1", "CV=0", "G=2", "K=8", "LM=0", "YP=0", "YS=0", "YD=0"],
        &["YD=0"],
        &["YD=0", "DW=1"],
        &["YD=1", "DW=0"],
        &["YD=1", "DW=1"],
        &["YD=1", "DW=1", "G=2", "K=8", "LM=0"],
        &["YD=1", "DW=1", "G=8", "K=8", "CV=0"],
        &["YL=1"],
        &["YL=2"],
        &["YL=1", "G=2", "K=8", "LM=0"],
        &["YL=1", "HS=4", "XR=0", "K=8"],
        &["YL=2", "YS=0", "YD=0", "CF=0"],
        &["AO=1"],
        &["AO=1", "YL=1", "SL=2"],
        &["AO=1", "G=2", "K=8", "HS=4"],
    ] {
        let (code, stdout, stderr) = run(defs, None);
        assert_eq!(code, 0, "{defs:?}: {stdout}{stderr}");
        assert!(
            stdout.starts_with("ok   tw_scan") && defs.iter().all(|d| stdout.contains(d)),
            "{stdout}"
        );
    }
    let src = std::fs::read_to_string(tasks_dir().join("mamba_scan/cuda/tw_scan.cu")).unwrap();
    let wait = "mb_wait(&sm.mb[w], (unsigned)(j & 1) ^ (w == 0));";
    let map_wait = "mb_wait(&sm.mm[wq], (unsigned)(rq / W) & 1);";
    let widen_cm = "if (NC) qc[j] = *(const uint2*)(&rn.cm[0][0] + i);";
    let yd_dv = "tot[q] = fmaf(dvc, h2f(rn.uu[q * G + g][c]), tot[q]);";
    let retry = r#""@!w bra WAIT;\n""#;
    let keep = "const float keep = hi ? v[j + m] : v[j];";
    let elect = "if (lane == 0) mb_arrive(m);";
    let ys_store = "sm.ys[w][i][c * G + g] = yi;";
    let slot_read = "ld_f(&sm.hx[w][(r / W) & 1][hs], hin);";
    let dv_sum = "float y0 = dv0 * h2f((unsigned short)uw), y1 = dv1 * h2f((unsigned short)(uw >> 16));";
    let yl_decay = "hin[s] *= e[s][i];";
    let ao_step = "qb += W * K * NS;";
    assert!(
        src.contains(wait)
            && src.contains(map_wait)
            && src.contains(widen_cm)
            && src.contains(retry)
            && src.contains(keep)
            && src.contains(elect)
            && src.contains(ys_store)
            && src.contains(slot_read)
            && src.contains(dv_sum)
            && src.contains(yd_dv)
            && src.contains(yl_decay)
            && src.contains(ao_step),
        "tw_scan.cu changed"
    );
    let dir = tempfile::tempdir().unwrap();
    // The entering state read without waiting for it: poison reaches y.
    let early = dir.path().join("early.cu");
    std::fs::write(&early, src.replace(wait, "")).unwrap();
    // Warp 0 waiting on the phase before its first hand-over: it never completes.
    let phase = dir.path().join("phase.cu");
    std::fs::write(&phase, src.replace(wait, "mb_wait(&sm.mb[w], (unsigned)(j & 1));")).unwrap();
    // The chain's warp reading a later run's map without waiting for it.
    let map = dir.path().join("map.cu");
    std::fs::write(&map, src.replace(map_wait, "")).unwrap();
    // HO's link taking one try_wait for the phase's end: the first try of an open phase answers
    // false, as the GPU's may.
    let once = dir.path().join("once.cu");
    std::fs::write(&once, src.replace(retry, "")).unwrap();
    // A1 with every lane arriving on an mbarrier that expects one arrival a phase.
    let all = dir.path().join("all.cu");
    std::fs::write(&all, src.replace(elect, "mb_arrive(m);")).unwrap();
    for (defs, file) in [
        (&["HS=1"][..], &early),
        (&["HS=1"], &phase),
        (&["HS=4"], &map),
        (&["HO=1"], &once),
        (&["A1=1"], &all),
    ] {
        let (code, stdout, _) = run(defs, Some(file));
        assert_eq!(code, 1, "{file:?}: {stdout}");
        assert!(
            stdout.starts_with("FAIL tw_scan") && (stdout.contains("NaN of 7200") || stdout.contains("deadlock")),
            "{file:?}: {stdout}"
        );
    }
    // CV 1 with the Cm rows widened from the Bm rows: y is wrong, the final state is not.
    let cm = dir.path().join("cm.cu");
    std::fs::write(
        &cm,
        src.replace(widen_cm, "if (NC) qc[j] = *(const uint2*)(&rn.bm[0][0] + i);"),
    )
    .unwrap();
    // YD 1 (Dv u added with the sums) with each group's Dv u taken from the group's first step for
    // every lane: y is wrong.
    let yd_step = dir.path().join("yd_step.cu");
    std::fs::write(
        &yd_step,
        src.replace(yd_dv, "tot[q] = fmaf(dvc, h2f(rn.uu[q * G][c]), tot[q]);"),
    )
    .unwrap();
    // YS 1 with a lane keeping the steps it should send: each sum mixes two steps' partials.
    let swap = dir.path().join("swap.cu");
    std::fs::write(&swap, src.replace(keep, "const float keep = hi ? v[j] : v[j + m];")).unwrap();
    // LM 1 with the partial y stored by lane (the sums read it channel-major): y mixes channels.
    let by_lane = dir.path().join("by_lane.cu");
    std::fs::write(&by_lane, src.replace(ys_store, "sm.ys[w][i][lane] = yi;")).unwrap();
    // LM 1 with the entering state read from the slot of (channel, state group) while the warp
    // before stored it by lane: another lane's state enters the run.
    let slot = dir.path().join("slot.cu");
    std::fs::write(
        &slot,
        src.replace(slot_read, "ld_f(&sm.hx[w][(r / W) & 1][c * NS + n0], hin);"),
    )
    .unwrap();
    // DW 1 with Dv u left out of the two channels' sums: y misses its skip term.
    let no_dv = dir.path().join("no_dv.cu");
    std::fs::write(&no_dv, src.replace(dv_sum, "float y0 = 0.f, y1 = 0.f;")).unwrap();
    // YL 1 with the second pass's last step left undecayed: the entering state's share of y is off
    // at every run's last step.
    let yl_last = dir.path().join("yl_last.cu");
    std::fs::write(&yl_last, src.replace(yl_decay, "hin[s] *= (i == K - 1 ? 1.f : e[s][i]);")).unwrap();
    // AO 1 with the Bm pointer stepped one run instead of W: from a warp's second run on, its inputs
    // come from another run's Bm rows.
    let ao_bm = dir.path().join("ao_bm.cu");
    std::fs::write(&ao_bm, src.replace(ao_step, "qb += K * NS;")).unwrap();
    for (defs, file) in [
        (&["YL=1"][..], &yl_last),
        (&["AO=1"], &ao_bm),
        (&["CV=1"], &cm),
        (&["DW=1", "YS=0", "YD=0"], &no_dv),
        (&["YD=1", "DW=0"], &yd_step),
        (&["YS=1"], &swap),
        (&["LM=1", "YS=0", "YD=0"], &by_lane),
        (&["LM=1"], &slot),
    ] {
        let (code, stdout, _) = run(defs, Some(file));
        assert_eq!(code, 1, "{file:?}: {stdout}");
        assert!(
            stdout.starts_with("FAIL tw_scan") && stdout.contains("`y`"),
            "{file:?}: {stdout}"
        );
    }
}

#[test]
fn emulate_runs_flash_ws_blocks_striding_over_more_items_than_blocks_and_catches_skipped_ones() {
    if !nvrtc_here() {
        return;
    }
    // 128 items (64 heads x 2 query blocks) on CTAS = 114 blocks: some blocks take a second item
    // (one at a time without the mask, a heavy and a light one under it). The task's emulate
    // workloads all fit one wave, so this is the path they leave out. On both units: MLX's grid
    // counts threads, so its unit runs 114 blocks too, not 114 x 384 (before that was read right,
    // the MLX unit's blocks never strode and the broken build below passed there).
    let src = std::fs::read_to_string(tasks_dir().join("attention/cuda/flash_ws.cu")).unwrap();
    let stride = "for (int p = blockIdx.x; p < groups; p += gridDim.x)";
    assert_eq!(src.matches(stride).count(), 2, "flash_ws.cu changed");
    let dir = tempfile::tempdir().unwrap();
    let skip = dir.path().join("skip.cu");
    // Producer and consumers striding by twice the grid: every block's second item is never
    // computed, its rows left as the poison.
    std::fs::write(
        &skip,
        src.replace(stride, "for (int p = blockIdx.x; p < groups; p += 2 * gridDim.x)"),
    )
    .unwrap();
    let entry = "    const int tid = threadIdx.x, wg = tid >> 7;";
    assert_eq!(src.matches(entry).count(), 1, "flash_ws.cu changed");
    let first64 = dir.path().join("first64.cu");
    std::fs::write(
        &first64,
        src.replace(entry, &format!("    if (blockIdx.x >= 64) return;\n{entry}")),
    )
    .unwrap();
    // BAL=1: without the mask ceil(128 / ceil(128 / 114)) = 64 blocks, every one of them with two items.
    for (backend, bal) in [
        ("cuda", "BAL=0"),
        ("mlx-cuda", "BAL=0"),
        ("cuda", "BAL=1"),
        ("mlx-cuda", "BAL=1"),
    ] {
        let run = |file: Option<&std::path::Path>| {
            let mut cmd = emulate("attention", backend, "flash_ws");
            cmd.args(["-D", "CTAS=114", "-D", bal]);
            for w in ["B=1,H=64,Hkv=16,L=129,D=64,causal=0", "B=1,H=64,Hkv=16,L=129,D=64,causal=1"] {
                cmd.args(["--workload", w]);
            }
            if let Some(f) = file {
                cmd.arg("--file").arg(f);
            }
            out(&mut cmd)
        };
        let (code, stdout, stderr) = run(None);
        assert_eq!(code, 0, "{backend} {bal}: {stdout}{stderr}");
        let ok = stdout.lines().filter(|l| l.starts_with("ok   flash_ws")).count();
        assert_eq!(ok, 2, "{backend} {bal}: {stdout}");
        let (code, stdout, _) = run(Some(&skip));
        assert_eq!(code, 1, "{backend} {bal}: {stdout}");
        assert!(stdout.starts_with("FAIL flash_ws"), "{backend} {bal}: {stdout}");
        if bal == "BAL=1" {
            // Every block of the balanced grid has a second item: the unmasked run fails too.
            let unmasked = stdout.lines().find(|l| l.contains("causal=0")).unwrap_or("");
            assert!(unmasked.starts_with("FAIL"), "{backend} {bal}: {stdout}");
        }
        // A build whose blocks from 64 on do nothing: right only on a grid of at most 64 blocks,
        // which BAL=1 gives the unmasked call and BAL=0 (114 blocks) does not.
        let mut cmd = emulate("attention", backend, "flash_ws");
        cmd.args([
            "-D",
            "CTAS=114",
            "-D",
            bal,
            "--workload",
            "B=1,H=64,Hkv=16,L=129,D=64,causal=0",
        ]);
        let (code, stdout, _) = out(cmd.arg("--file").arg(&first64));
        assert_eq!(code, if bal == "BAL=1" { 0 } else { 1 }, "{backend} {bal}: {stdout}");
    }
}

#[test]
fn emulate_each_value_runs_every_tunable_value_of_the_scan_and_attention_kernels() {
    if !nvrtc_here() {
        return;
    }
    // Every value the search may pick, each alone beside the defaults, on ragged multi-chunk
    // shapes: K 16 with CB 6 or 12 (rounds that do not divide a chunk), RT, P2, SP, BF, MW, CQ;
    // tw_scan's G, W, K and SL.
    // flash_ws: every tile width, stage count, KVS, TMA 0 / 1, PP, CTAS, WIDE, SMALL_L, EMU and DA value.
    for (task, kernel, at_least) in [
        ("mamba_scan", "warp_scan", 48),
        ("mamba_scan", "tw_scan", 20),
        ("attention", "flash", 16),
        ("attention", "flash_ws", 40),
    ] {
        let (code, stdout, stderr) = out(ksearch().arg("--tasks-dir").arg(tasks_dir()).args([
            "kb",
            "emulate",
            task,
            "--backend",
            "cuda",
            "--kernel",
            kernel,
            "--each-value",
        ]));
        assert_eq!(code, 0, "{stdout}{stderr}");
        let ok = stdout.lines().filter(|l| l.starts_with("ok   ")).count();
        assert!(ok >= at_least, "{ok} runs: {stdout}");
        assert!(!stdout.contains("FAIL"), "{stdout}");
    }
}
