//! The Metal executor: what it does with Metal's rules (small bodies written here), and every
//! Metal kernel of every task run on the task's `emulate` workloads, in its default
//! configuration and with each other tunable value, every output element checked against the
//! task's reference.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use ksearch_kb::{
    BodySig, EmuBuffer, EmuLaunch, emulate_configs, emulate_file, emulate_kernel, emulate_workloads, find_cxx, metal_run,
};

const LIMIT: Duration = Duration::from_secs(120);

fn need_cxx() {
    assert!(find_cxx().is_some(), "these tests need a C++ compiler (g++ or clang++)");
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Run `body` (inputs `x: f32`, output `y: f32`, n elements each) on a grid of `grid` threads in
/// threadgroups of `tg`; y comes back (or the executor's reason).
fn run(body: &str, x: &[f32], n_out: usize, grid: u32, tg: u32) -> Result<Vec<f32>, String> {
    need_cxx();
    let sig = BodySig::from_comments("// inputs: x:f32\n// outputs: y:f32\n").unwrap();
    let mut bufs = vec![
        EmuBuffer {
            name: "x".into(),
            shape: vec![x.len()],
            bytes: bytes(x),
        },
        EmuBuffer {
            name: "y".into(),
            shape: vec![n_out],
            bytes: bytes(&vec![f32::NAN; n_out]),
        },
    ];
    let launch = EmuLaunch {
        entry: "body".into(),
        grid: [grid, 1, 1],
        threadgroup: [tg, 1, 1],
    };
    metal_run(body, &sig, &[launch], &mut bufs, LIMIT)?;
    Ok(f32s(&bufs[1].bytes))
}

#[test]
fn simd_functions_barriers_and_threadgroup_memory_follow_metal() {
    // 64 threads in threadgroups of 64: two SIMD-groups. Each thread writes: its sum over the
    // SIMD-group, the xor-1 neighbour's value, an exclusive prefix sum, and the value another
    // SIMD-group put in threadgroup memory before the barrier.
    let body = r#"
threadgroup float t[64];
const uint i = thread_position_in_grid.x;
const uint l = thread_index_in_simdgroup;
const float v = x[i];
t[i] = v * 2.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
y[4 * i] = simd_sum(v);
y[4 * i + 1] = simd_shuffle_xor(v, ushort(1));
y[4 * i + 2] = simd_prefix_exclusive_sum(v);
y[4 * i + 3] = t[(i + 32) % 64] + float(l == 0 ? 1000 : 0);
"#;
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let y = run(body, &x, 256, 64, 64).unwrap();
    for i in 0..64usize {
        let sg = i / 32;
        let lo = (sg * 32) as f32;
        let sum: f32 = (0..32).map(|k| lo + k as f32).sum();
        assert_eq!(y[4 * i], sum, "simd_sum at {i}");
        assert_eq!(y[4 * i + 1], (i ^ 1) as f32, "shuffle_xor at {i}");
        let pre: f32 = (sg * 32..i).map(|k| k as f32).sum();
        assert_eq!(y[4 * i + 2], pre, "prefix at {i}");
        let other = 2.0 * ((i + 32) % 64) as f32 + if i % 32 == 0 { 1000.0 } else { 0.0 };
        assert_eq!(y[4 * i + 3], other, "threadgroup memory at {i}");
    }
}

#[test]
fn a_partial_threadgroup_at_the_grid_edge_has_its_own_size() {
    // 100 threads in threadgroups of 64: the second has 36, and its last SIMD-group 4 lanes.
    let body = r#"
const uint i = thread_position_in_grid.x;
y[2 * i] = float(threads_per_threadgroup.x);
y[2 * i + 1] = simd_sum(1.0f);
"#;
    let y = run(body, &[0.0], 200, 100, 64).unwrap();
    for i in 0..100usize {
        let (size, lanes) = if i < 64 {
            (64.0, 32.0)
        } else if i < 96 {
            (36.0, 32.0)
        } else {
            (36.0, 4.0)
        };
        assert_eq!((y[2 * i], y[2 * i + 1]), (size, lanes), "thread {i}");
    }
}

#[test]
fn threadgroup_memory_starts_as_nan_and_half_rounds_to_nearest_even() {
    let body = r#"
threadgroup float t[4];
const uint i = thread_position_in_grid.x;
if (i == 0) {
    y[0] = t[3];                       // never written: NaN, as the GPU does not clear it
    y[1] = float(half(x[0]));          // 1 + 2^-11 rounds to even: 1
    y[2] = float(half(x[1]));          // 1 + 3 * 2^-11 rounds up: 1 + 2^-9
    y[3] = float(half(x[2]));          // past 65504: inf
}
"#;
    let x = [1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 70000.0];
    let y = run(body, &x, 4, 32, 32).unwrap();
    assert!(y[0].is_nan());
    assert_eq!(y[1], 1.0);
    assert_eq!(y[2], 1.0 + 2f32.powi(-9));
    assert!(y[3].is_infinite());
}

#[test]
fn mlx_utilities_and_input_shapes_are_what_mlx_passes() {
    // x_shape / x_strides / x_ndim as MLX passes them (row-major, contiguous), and elem_to_loc.
    let body = r#"
const uint i = thread_position_in_grid.x;
y[i] = x[elem_to_loc(i, x_shape, x_strides, x_ndim)] + float(x_shape[0] * 100 + x_ndim);
"#;
    let x: Vec<f32> = (0..5).map(|i| i as f32).collect();
    let y = run(body, &x, 5, 5, 32).unwrap();
    assert_eq!(y, vec![501.0, 502.0, 503.0, 504.0, 505.0]);
}

#[test]
fn swizzles_and_vector_comparisons_work_both_ways() {
    let body = r#"
if (thread_position_in_grid.x == 0) {
    float4 v = float4(x[0], x[1], x[2], x[3]);
    const float2 a = v.xy + v.wz;            // (1 + 4, 2 + 3)
    v.zw = a;                                // v = (1, 2, 5, 5)
    v.xy += float2(10.0f);                   // v = (11, 12, 5, 5)
    const float3 c = v.bgr;                  // (5, 12, 11)
    y[0] = a.x; y[1] = a.y;
    y[2] = v.x; y[3] = v.y; y[4] = v.z; y[5] = v.w;
    y[6] = c.x; y[7] = c.y; y[8] = c.z;
    y[9] = all(v.xy > 10.0f) && !any(v.zw == float2(0.0f)) ? 1.0f : 0.0f;
    const uint2 m = uint2(7, 12) % 5u;       // (2, 2)
    y[10] = float(m.x + (m.y << 1));        // 6
}
"#;
    let y = run(body, &[1.0, 2.0, 3.0, 4.0], 11, 32, 32).unwrap();
    assert_eq!(y, vec![5.0, 5.0, 11.0, 12.0, 5.0, 5.0, 5.0, 12.0, 11.0, 1.0, 6.0]);
}

#[test]
fn divergent_lanes_take_their_simd_group_calls_one_path_after_the_other() {
    // Odd lanes sum x[1] over the odd lanes, even lanes take the maximum of x[i] over the even
    // ones: each call has only its path's lanes, as on the GPU.
    let body = "const uint i = thread_position_in_grid.x;\nif (i % 2) y[i] = simd_sum(x[1]);\nelse y[i] = simd_max(x[i]);\n";
    let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
    let y = run(body, &x, 32, 32, 32).unwrap();
    for (i, v) in y.iter().enumerate() {
        assert_eq!(*v, if i % 2 == 1 { 16.0 } else { 30.0 }, "lane {i}");
    }
    // One lane waits at a barrier while the rest of its SIMD-group sums: the sum has 31 lanes,
    // the other SIMD-group's 32, and the barrier completes once the others have returned.
    let body = "const uint i = thread_position_in_grid.x;\nif (i == 0) threadgroup_barrier(mem_flags::mem_threadgroup);\nelse y[i] = simd_sum(x[0]);\n";
    let y = run(body, &[1.0], 64, 64, 64).unwrap();
    assert!(y[0].is_nan());
    assert!(
        y[1..32].iter().all(|v| *v == 31.0) && y[32..].iter().all(|v| *v == 32.0),
        "{y:?}"
    );
}

#[test]
fn metal_rule_breaks_are_reported_not_hidden() {
    // a kernel that does not finish in time
    need_cxx();
    let sig = BodySig::from_comments("// inputs: x:f32\n// outputs: y:f32\n").unwrap();
    let mut bufs = vec![
        EmuBuffer {
            name: "x".into(),
            shape: vec![1],
            bytes: bytes(&[1.0]),
        },
        EmuBuffer {
            name: "y".into(),
            shape: vec![1],
            bytes: bytes(&[0.0]),
        },
    ];
    let launch = EmuLaunch {
        entry: "body".into(),
        grid: [1, 1, 1],
        threadgroup: [1, 1, 1],
    };
    let spin = "for (ulong k = 0; k < 400000000000ul; k++) y[0] += x[0];\n";
    let e = metal_run(spin, &sig, &[launch], &mut bufs, Duration::from_secs(2)).unwrap_err();
    assert!(e.contains("ran past 2 s"), "{e}");
    // more threadgroup memory than an Apple GPU has
    let big = "threadgroup float t[9000];\nt[thread_position_in_grid.x] = 1.0f;\ny[0] = t[0];\n";
    let e = run(big, &[1.0], 1, 32, 32).unwrap_err();
    assert!(e.contains("32 KB"), "{e}");
    // a write far past the output's end
    let oob = "y[thread_position_in_grid.x * 4096] = 1.0f;\n";
    let e = run(oob, &[1.0], 16, 32, 32).unwrap_err();
    assert!(e.contains("memory fault"), "{e}");
    // a body that does not compile is the compiler's diagnostics
    let e = run("y[0] = undeclared;\n", &[1.0], 1, 1, 1).unwrap_err();
    assert!(e.contains("undeclared"), "{e}");
}

#[test]
fn every_task_metal_kernel_computes_its_reference() {
    need_cxx();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks");
    let tasks = ksearch_core::task::load_all(&root).unwrap();
    let mut jobs = Vec::new();
    for task in &tasks {
        let Some(b) = task.backend(ksearch_core::Backend::MlxMetal) else {
            continue;
        };
        let workloads = emulate_workloads(task, ksearch_core::Backend::MlxMetal);
        assert!(!workloads.is_empty(), "task `{}` has no workloads to emulate", task.name);
        for k in std::iter::once(&b.seed).chain(&b.kernels) {
            for c in emulate_configs(k, &workloads) {
                for w in &workloads {
                    jobs.push((task, k, c.clone(), w.clone()));
                }
            }
        }
    }
    // Builds and runs spread over the machine's cores.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(8);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((task, k, c, w)) = jobs.get(i) else { break };
                    let r = emulate_kernel(task, k, c, w, 0x5eed ^ i as u64, LIMIT);
                    results.lock().unwrap().push((i, r));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    let (mut ran, mut skipped, mut bad) = (0, 0, Vec::new());
    for (i, r) in results {
        let (task, k, c, w) = &jobs[i];
        let what = format!(
            "{} {} {:?} on {:?}",
            task.name,
            if k.name.is_empty() { "seed" } else { &k.name },
            c,
            w
        );
        match r {
            Ok(None) => skipped += 1,
            Ok(Some(o)) if o.passed() => ran += 1,
            Ok(Some(o)) => bad.push(format!("{what}: {}", o.summary())),
            Err(e) => bad.push(format!("{what}: {e}")),
        }
    }
    eprintln!("emulated {ran} runs ({skipped} configurations not admitted by their workload)");
    assert!(ran > 0);
    assert!(
        bad.is_empty(),
        "{} of {} runs failed:\n{}",
        bad.len(),
        ran + bad.len(),
        bad.join("\n")
    );
}

#[test]
fn a_whole_metal_file_runs_with_its_buffers_bound_by_name() {
    need_cxx();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let task = ksearch_core::task::find(&root.join("tasks"), "softmax").unwrap();
    let src = std::fs::read_to_string(root.join("kb/examples/softmax_rows.metal")).unwrap();
    let grid = ["rows * 256".to_string(), "1".into(), "1".into()];
    let tg = ["256".to_string(), "1".into(), "1".into()];
    for (rows, cols) in [(3, 1001), (5, 64), (2, 4096)] {
        let w: BTreeMap<String, i64> = [("rows".to_string(), rows), ("cols".to_string(), cols)].into();
        let o = emulate_file(&task, &src, &grid, &tg, &w, 7, LIMIT).unwrap();
        assert!(o.passed(), "{rows}x{cols}: {}", o.summary());
    }
    // A threadgroup of 128 leaves half the partial sums unwritten (the kernel assumes 256):
    // the executor's NaN threadgroup memory shows it.
    let small = ["128".to_string(), "1".into(), "1".into()];
    let grid128 = ["rows * 128".to_string(), "1".into(), "1".into()];
    let w: BTreeMap<String, i64> = [("rows".to_string(), 3), ("cols".to_string(), 1001)].into();
    let o = emulate_file(&task, &src, &grid128, &small, &w, 7, LIMIT).unwrap();
    assert!(!o.passed(), "{}", o.summary());
    // A parameter that names no tensor or axis is an error before anything runs.
    let renamed = src.replace("device float* y [[buffer(1)]]", "device float* out [[buffer(1)]]");
    let e = emulate_file(&task, &renamed, &grid, &tg, &w, 7, LIMIT).unwrap_err();
    assert!(e.contains("`out`") && e.contains("no tensor"), "{e}");
}

#[cfg(target_os = "linux")]
#[test]
fn kernel_code_cannot_reach_past_its_buffers() {
    // A body is C++ under the shim: one that tries to start a program, open a file or a socket
    // gets EPERM from the executor's seccomp filter, and the run goes on; it finds no environment.
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("escaped");
    let body = format!(
        "extern \"C\" int system(const char*);\nextern \"C\" int open(const char*, int, ...);\n\
         extern \"C\" int socket(int, int, int);\nextern \"C\" int* __errno_location();\n\
         extern \"C\" char* getenv(const char*) noexcept;\n// @kernel body\n\
         if (thread_position_in_grid.x == 0) {{\n\
             y[0] = float(system(\"touch {}\"));\n\
             y[1] = float(open(\"/etc/hostname\", 0));\n\
             y[2] = float(*__errno_location());\n\
             y[3] = float(socket(2, 1, 0));\n\
             y[4] = getenv(\"HOME\") == nullptr ? 1.0f : 0.0f;\n}}\n",
        marker.display()
    );
    let y = run(&body, &[0.0], 5, 32, 32).unwrap();
    // glibc's system() reports a spawn it could not make as exit status 127
    assert!(y[0] == -1.0 || y[0] == (127 << 8) as f32, "system() must fail: {}", y[0]);
    assert_eq!((y[1], y[2]), (-1.0, 1.0), "open() must fail with EPERM");
    assert_eq!(y[3], -1.0, "socket() must fail");
    assert!(!marker.exists(), "a program ran");
    // and the process's environment is cleared (the parent's may hold API keys)
    assert_eq!(y[4], 1.0, "the kernel saw the environment");
}

#[cfg(target_os = "linux")]
#[test]
fn code_that_runs_before_the_kernel_is_confined_too() {
    // A namespace-scope object's initialiser in the header runs before main: the confinement is
    // already in place then.
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("escaped");
    let body = format!(
        "extern \"C\" int system(const char*);\nstatic int ks_early_call = system(\"touch {}\");\n\
         // @kernel body\nif (thread_position_in_grid.x == 0) y[0] = float(ks_early_call);\n",
        marker.display()
    );
    let y = run(&body, &[0.0], 1, 32, 32).unwrap();
    assert!(y[0] == -1.0 || y[0] == (127 << 8) as f32, "system() must fail: {}", y[0]);
    assert!(!marker.exists(), "a program ran before the kernel");
}
