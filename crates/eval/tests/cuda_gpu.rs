//! GPU tests of the CUDA back-end (run on the GPU machine by `scripts/gpu-tests.sh`). Without a
//! CUDA device every test prints "skipped: no CUDA device" and passes.
//!
//! Supervisor-level tests run the worker as this very test binary: the supervisor starts it
//! again with `KSEARCH_CUDA_TEST_WORKER=1` and the (ignored) test `worker_main`, which serves
//! requests with a `CudaBackend` exactly as `ksearch worker --backend cuda` does.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ksearch_core::protocol::{Candidate, EvalRequest, FailureClass, Lang, TimingReq, WorkloadReq, workload_label};
use ksearch_core::task::{LaunchSpec, Task, Workload};
use ksearch_eval::common::{host_reference, make_inputs};
use ksearch_eval::cuda::{CudaBackend, cuda_available};
use ksearch_eval::{Limits, Supervisor, WorkerSpec};

fn gpu() -> bool {
    if !cuda_available() {
        if std::env::var("KSEARCH_REQUIRE_CUDA").as_deref() == Ok("1") {
            panic!("KSEARCH_REQUIRE_CUDA=1 (scripts/gpu-tests.sh) but no CUDA device was found");
        }
        eprintln!("skipped: no CUDA device");
        return false;
    }
    true
}

/// A path in the repository: from the source tree when it exists, else from the current
/// directory (prebuilt test binaries run from the repository root on the GPU machine).
fn repo(rel: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel);
    if src.exists() { src } else { PathBuf::from(rel) }
}

fn task(name: &str) -> Task {
    Task::load(&repo(&format!("tasks/{name}/task.toml"))).expect("task loads")
}

fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("ksearch-cuda-test-cache-{}", std::process::id()))
}

fn wl(v: &[(&str, i64)]) -> Workload {
    v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
}

fn wreq(t: &Task, w: Workload, seed: u64) -> WorkloadReq {
    WorkloadReq {
        label: workload_label(&w, &t.axes),
        axes: w,
        seed,
    }
}

#[test]
#[ignore]
fn worker_main() {
    if std::env::var("KSEARCH_CUDA_TEST_WORKER").is_err() {
        return;
    }
    // libtest has printed "test worker_main ... " without a newline: end that line so the
    // supervisor reads the greeting on a line of its own.
    // SAFETY: a write of one byte to the process's stdout.
    unsafe { libc::write(1, b"\n".as_ptr() as *const libc::c_void, 1) };
    let cache = PathBuf::from(std::env::var("KSEARCH_CUDA_TEST_CACHE").unwrap_or_else(|_| cache_dir().display().to_string()));
    if std::env::var("KSEARCH_CUDA_TEST_WORKER").as_deref() == Ok("cpu") {
        let mut b = ksearch_eval::cpu::CpuBackend::new(cache);
        std::process::exit(ksearch_eval::worker::serve(&mut b));
    }
    let code = match CudaBackend::new(0, cache) {
        Ok(mut b) => ksearch_eval::worker::serve(&mut b),
        Err(e) => {
            eprintln!("{e}");
            1
        }
    };
    std::process::exit(code);
}

fn supervisor(run_timeout_s: u64) -> Supervisor {
    supervisor_for("1", run_timeout_s)
}

fn supervisor_for(worker: &str, run_timeout_s: u64) -> Supervisor {
    let spec = WorkerSpec {
        program: std::env::current_exe().expect("test binary"),
        args: ["worker_main", "--exact", "--ignored", "--nocapture", "--test-threads=1"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        env: vec![
            ("KSEARCH_CUDA_TEST_WORKER".into(), worker.into()),
            ("KSEARCH_CUDA_TEST_CACHE".into(), cache_dir().display().to_string()),
        ],
    };
    Supervisor::new(
        spec,
        Limits {
            compile_timeout: Duration::from_secs(30),
            run_timeout: Duration::from_secs(run_timeout_s),
            mem_limit_bytes: 16 << 30,
        },
    )
}

fn softmax_request(id: u64, file: &str, shared: &str, w: Workload, check_only: bool) -> EvalRequest {
    let t = task("softmax");
    let source = std::fs::read_to_string(repo(&format!("tests/gpu/{file}"))).expect("bad kernel source");
    EvalRequest {
        id,
        candidate: Candidate {
            lang: Lang::Cuda,
            source,
            launches: vec![LaunchSpec {
                entry: "softmax".into(),
                grid: ["rows".into(), "1".into(), "1".into()],
                block: ["256".into(), "1".into(), "1".into()],
                shared: shared.into(),
                inputs: vec![],
                outputs: vec![],
            }],
            scratch: vec![],
            defines: BTreeMap::new(),
            options: BTreeMap::new(),
        },
        workloads: vec![wreq(&t, w, 1000 + id)],
        backend: ksearch_core::Backend::Cuda,
        task: t,
        timing: TimingReq {
            warmup: 2,
            min_reps: 5,
            max_reps: 30,
            target_ms: 30.0,
            flush: true,
        },
        check_only,
    }
}

/// Without a driver or device, opening the back-end fails with one clear line (no panic).
#[test]
fn no_device_is_a_clear_error() {
    if cuda_available() {
        return;
    }
    let e = CudaBackend::new(0, cache_dir()).err().expect("no device here");
    println!("{e}");
    assert!(e.starts_with("no CUDA") || e.starts_with("no NVRTC"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

/// The self-starting worker greets the supervisor (checked with the CPU back-end, so it runs
/// everywhere; CPU evaluations need the `ksearch runner` of the real binary and are tested in
/// the CLI's tests).
#[test]
fn self_started_worker_answers() {
    let mut sup = supervisor_for("cpu", 20);
    let dev = sup.start().expect("the worker greets");
    assert!(dev.contains("threads"), "{dev}");
    assert!(sup.isolation.is_some(), "the CPU worker says how it contains candidates");
}

/// The device references agree with the host f64 references on small workloads.
#[test]
fn device_references_match_host_references() {
    if !gpu() {
        return;
    }
    let mut b = CudaBackend::new(0, cache_dir()).expect("backend");
    let cases: Vec<(&str, Workload)> = vec![
        ("softmax", wl(&[("rows", 37), ("cols", 1000)])),
        ("softmax", wl(&[("rows", 3), ("cols", 5)])),
        ("rmsnorm", wl(&[("rows", 33), ("cols", 777)])),
        (
            "attention",
            wl(&[("B", 2), ("H", 3), ("Hkv", 3), ("L", 70), ("D", 40), ("causal", 0)]),
        ),
        (
            "attention",
            wl(&[("B", 1), ("H", 2), ("Hkv", 1), ("L", 65), ("D", 128), ("causal", 1)]),
        ),
        (
            "attention",
            wl(&[("B", 1), ("H", 1), ("Hkv", 1), ("L", 33), ("D", 256), ("causal", 0)]),
        ),
        (
            "attention",
            wl(&[("B", 1), ("H", 4), ("Hkv", 2), ("L", 100), ("D", 96), ("causal", 1)]),
        ),
        (
            "attention",
            wl(&[("B", 2), ("H", 2), ("Hkv", 1), ("L", 47), ("D", 64), ("causal", 0)]),
        ),
        (
            "attention",
            wl(&[("B", 1), ("H", 1), ("Hkv", 1), ("L", 1), ("D", 128), ("causal", 1)]),
        ),
        ("mamba_scan", wl(&[("batch", 2), ("L", 50), ("D", 70), ("N", 16)])),
        ("mamba_scan", wl(&[("batch", 1), ("L", 31), ("D", 13), ("N", 8)])),
        ("mamba_step", wl(&[("batch", 3), ("D", 100), ("N", 16)])),
        ("mamba_step", wl(&[("batch", 2), ("D", 9), ("N", 5)])),
    ];
    for (name, w) in cases {
        let t = task(name);
        let r = wreq(&t, w, 7);
        let inputs = make_inputs(&t, ksearch_core::Backend::Cuda, &r).unwrap();
        let host = host_reference(&t, &r, &inputs).unwrap();
        let dev = b
            .device_reference(&t, &r, &inputs)
            .unwrap_or_else(|e| panic!("{name} {}: {e}", r.label))
            .unwrap_or_else(|| panic!("{name} {}: no device reference", r.label));
        assert_eq!(host.len(), dev.len());
        let mut worst = 0.0f64;
        for (h, d) in host.iter().zip(&dev) {
            assert_eq!(h.len(), d.len());
            for (i, (x, y)) in h.iter().zip(d).enumerate() {
                let err = (x - y).abs();
                assert!(
                    err <= 1e-9 + 1e-9 * x.abs(),
                    "{name} {}: element {i}: host {x}, device {y}",
                    r.label
                );
                worst = worst.max(err / x.abs().max(1e-3));
            }
        }
        println!("reference ok  {name:<10} {:<40} worst rel err {worst:.2e}", r.label);
    }
}

/// The device references are fast enough for the largest workloads.
#[test]
fn device_references_are_fast_at_scale() {
    if !gpu() {
        return;
    }
    let mut b = CudaBackend::new(0, cache_dir()).expect("backend");
    b.set_host_reference_limit(0.0);
    for (name, w) in [
        ("mamba_scan", wl(&[("batch", 1), ("L", 4096), ("D", 2048), ("N", 16)])),
        (
            "attention",
            wl(&[("B", 1), ("H", 16), ("Hkv", 4), ("L", 4096), ("D", 128), ("causal", 0)]),
        ),
        ("softmax", wl(&[("rows", 4096), ("cols", 8192)])),
    ] {
        let t = task(name);
        let r = wreq(&t, w, 3);
        let inputs = make_inputs(&t, ksearch_core::Backend::Cuda, &r).unwrap();
        // Once to compile and warm up, once timed.
        b.device_reference(&t, &r, &inputs).unwrap().unwrap();
        let t0 = Instant::now();
        let out = b.device_reference(&t, &r, &inputs).unwrap().unwrap();
        let s = t0.elapsed().as_secs_f64();
        assert!(out[0].iter().all(|v| v.is_finite()));
        println!(
            "reference at scale  {name:<10} {:<40} {:.3} s (uploads and downloads included)",
            r.label, s
        );
        assert!(s < 10.0, "{name} reference too slow: {s:.1} s");
    }
}

/// A correct kernel passes and is timed; bad kernels are classified, and the same supervisor
/// goes on evaluating after each.
#[test]
fn bad_kernels_are_classified_and_the_supervisor_recovers() {
    if !gpu() {
        return;
    }
    let mut sup = supervisor(8);
    let small = || wl(&[("rows", 256), ("cols", 1024)]);
    let dev = sup.start().expect("worker starts");
    println!("device: {dev}");
    assert!(!dev.is_empty());
    let ok = |sup: &mut Supervisor, id: u64| {
        let r = sup.eval(&softmax_request(id, "softmax_ok.cu", "0", small(), false));
        assert!(
            r.ok(),
            "good kernel failed: {:?} {:?}",
            r.failure,
            r.workloads.first().map(|w| &w.failure)
        );
        let w = &r.workloads[0];
        let t = w.timing.as_ref().expect("timed");
        println!(
            "ok kernel: median {:.2} us (min {:.2}, spread {:.2}, {} reps), floor {:.2} us, {} registers",
            t.median_us,
            t.min_us,
            t.spread,
            t.reps,
            w.floor_us.unwrap_or(0.0),
            r.resources.registers.unwrap_or(0)
        );
        assert!(
            r.resources.registers.unwrap_or(0) > 0,
            "no resource report: {:?}",
            r.resources
        );
    };
    ok(&mut sup, 1);
    let cases: &[(&str, &str, FailureClass)] = &[
        ("compile_error.cu", "0", FailureClass::Compile),
        ("illegal_address.cu", "0", FailureClass::Crash),
        ("too_much_shared.cu", "1048576", FailureClass::Launch),
        ("out_of_bounds.cu", "0", FailureClass::OutOfBounds),
        ("unwritten.cu", "0", FailureClass::Unwritten),
        ("spin.cu", "0", FailureClass::Timeout),
    ];
    let mut id = 10;
    for (file, shared, want) in cases {
        id += 1;
        let t0 = Instant::now();
        let r = sup.eval(&softmax_request(id, file, shared, small(), true));
        let f = r
            .failure
            .clone()
            .or_else(|| r.workloads.iter().find_map(|w| w.failure.clone()))
            .unwrap_or_else(|| panic!("{file}: no failure reported"));
        println!(
            "{file:<20} -> {} in {:.1} s: {}",
            f.class,
            t0.elapsed().as_secs_f64(),
            first_line(&f.message)
        );
        assert_eq!(f.class, *want, "{file}: {}", f.message);
        id += 1;
        ok(&mut sup, id);
    }
    println!("worker starts: {}", sup.starts);
    assert!(sup.starts >= 3, "crash and timeout must each restart the worker");
}

/// The shipped CUDA seeds and kernels (defaults) pass on their search workloads.
#[test]
fn shipped_cuda_kernels_pass() {
    if !gpu() {
        return;
    }
    let tasks = ksearch_core::task::load_all(&repo("tasks")).expect("tasks load");
    let mut sup = supervisor(60);
    let mut id = 100;
    let mut failed = Vec::new();
    for t in &tasks {
        let Some(b) = t.backend(ksearch_core::Backend::Cuda) else {
            continue;
        };
        for k in t.kernels(ksearch_core::Backend::Cuda) {
            id += 1;
            let defines = k.default_config();
            let req = EvalRequest {
                id,
                task: t.clone(),
                backend: ksearch_core::Backend::Cuda,
                candidate: Candidate {
                    lang: Lang::Cuda,
                    source: k.source.clone(),
                    launches: k.launches.clone(),
                    scratch: k.scratch.clone(),
                    defines: defines.clone(),
                    options: k
                        .options
                        .iter()
                        .filter_map(|(n, v)| serde_json::to_value(v).ok().map(|v| (n.clone(), v)))
                        .collect(),
                },
                workloads: b
                    .search
                    .iter()
                    .filter(|w| k.admits(&defines, w).unwrap_or(false))
                    .map(|w| wreq(t, w.clone(), 42))
                    .collect(),
                timing: TimingReq {
                    warmup: 2,
                    min_reps: 5,
                    max_reps: 20,
                    target_ms: 50.0,
                    flush: true,
                },
                check_only: false,
            };
            let r = sup.eval(&req);
            if let Some(f) = &r.failure {
                println!("{}/{}: {} {}", t.name, k.name, f.class, first_line(&f.message));
                failed.push(format!("{}/{}", t.name, k.name));
                continue;
            }
            for w in &r.workloads {
                match (&w.failure, &w.timing) {
                    (Some(f), _) => {
                        println!("{}/{} {}: {} {}", t.name, k.name, w.label, f.class, first_line(&f.message));
                        failed.push(format!("{}/{} {}", t.name, k.name, w.label));
                    }
                    (None, Some(tm)) => println!(
                        "{}/{} {}: {:.1} us (floor {:.1} us, {:.2} TB/s, {:.1} TFLOP/s, max rel err {:.1e})",
                        t.name,
                        k.name,
                        w.label,
                        tm.median_us,
                        w.floor_us.unwrap_or(0.0),
                        w.bytes / tm.median_us / 1e6,
                        w.flops / tm.median_us / 1e6,
                        w.check.max_rel_err
                    ),
                    _ => {}
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// Host-side cost of one evaluation at the largest attention workload: drawing the seeded
/// inputs and checking every element (no GPU needed). `--ignored` to run.
#[test]
#[ignore]
fn host_costs_at_scale() {
    let t = task("attention");
    let r = wreq(
        &t,
        wl(&[("B", 4), ("H", 32), ("Hkv", 8), ("L", 2048), ("D", 128), ("causal", 0)]),
        11,
    );
    let t0 = Instant::now();
    let inputs = make_inputs(&t, ksearch_core::Backend::Cuda, &r).unwrap();
    let draw_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let par = ksearch_eval::common::make_inputs_parallel(&t, ksearch_core::Backend::Cuda, std::slice::from_ref(&r)).unwrap();
    let gen_par = t1.elapsed().as_secs_f64();
    assert_eq!(par.len(), 1);
    for (a, b) in inputs.iter().zip(&par[0]) {
        assert_eq!(a.bytes, b.bytes, "parallel inputs differ for `{}`", a.name);
        assert_eq!(a.values, b.values, "parallel inputs differ for `{}`", a.name);
    }
    let refs: Vec<Vec<f64>> = vec![inputs[0].values.clone()];
    let out = vec![inputs[0].bytes.clone()];
    let t2 = Instant::now();
    let (c, _) = ksearch_eval::common::check_outputs(&t, ksearch_core::Backend::Cuda, &out, &refs);
    let chk = t2.elapsed().as_secs_f64();
    println!(
        "host costs {}: inputs {draw_s:.2} s (parallel {gen_par:.2} s), one check of {} elements {chk:.2} s",
        r.label, c.elements
    );
}

/// The CUDA back-end's parallel input drawing gives exactly `make_inputs`'s tensors (no GPU
/// needed): every task's CUDA search workloads shrunk, parts forced small.
#[test]
fn parallel_inputs_match_make_inputs() {
    for (name, w) in [
        (
            "attention",
            wl(&[("B", 1), ("H", 6), ("Hkv", 3), ("L", 130), ("D", 64), ("causal", 1)]),
        ),
        ("mamba_scan", wl(&[("batch", 2), ("L", 77), ("D", 96), ("N", 16)])),
        ("mamba_step", wl(&[("batch", 3), ("D", 100), ("N", 16)])),
        ("softmax", wl(&[("rows", 33), ("cols", 1001)])),
    ] {
        let t = task(name);
        let reqs = vec![wreq(&t, w.clone(), 17), wreq(&t, w, 18)];
        for min_part in [1, 7, 1000, 1 << 20] {
            let par = ksearch_eval::common::make_inputs_parts(&t, ksearch_core::Backend::Cuda, &reqs, min_part, |n| n).unwrap();
            assert_eq!(par.len(), reqs.len());
            for (r, got) in reqs.iter().zip(&par) {
                let want = make_inputs(&t, ksearch_core::Backend::Cuda, r).unwrap();
                assert_eq!(want.len(), got.len());
                for (a, b) in want.iter().zip(got) {
                    assert_eq!((&a.name, a.dtype, &a.shape), (&b.name, b.dtype, &b.shape));
                    assert_eq!(a.bytes, b.bytes, "{name}: `{}` differs (min_part {min_part})", a.name);
                    assert_eq!(a.values, b.values, "{name}: `{}` differs (min_part {min_part})", a.name);
                }
            }
        }
    }
}

/// The parallel element check reports what `check_outputs` reports (no GPU needed).
#[test]
fn parallel_check_matches_check_outputs() {
    use ksearch_core::data;
    use ksearch_core::task::DType;
    let t = task("mamba_scan");
    let w = wl(&[("batch", 1), ("L", 1200), ("D", 2048), ("N", 16)]);
    let r = wreq(&t, w, 5);
    let inputs = make_inputs(&t, ksearch_core::Backend::Cuda, &r).unwrap();
    // Reference: u as y (f16) and A tiled as the state (f32); outputs: the same values, perturbed.
    let y_ref: Vec<f64> = inputs[0].values.clone();
    let n_state = 2048 * 16;
    let s_ref: Vec<f64> = (0..n_state).map(|i| inputs[2].values[i % inputs[2].values.len()]).collect();
    let refs = vec![y_ref.clone(), s_ref.clone()];
    let mut y_out = y_ref.iter().map(|v| v * (1.0 + 1e-3)).collect::<Vec<_>>();
    let s_out = s_ref.iter().map(|v| v + 1e-6).collect::<Vec<_>>();
    let enc = |y: &[f64], s: &[f64]| vec![data::encode(y, DType::F16), data::encode(s, DType::F32)];
    let a = ksearch_eval::common::check_outputs(&t, ksearch_core::Backend::Cuda, &enc(&y_out, &s_out), &refs);
    let b = ksearch_eval::common::check_outputs_parallel(&t, ksearch_core::Backend::Cuda, &enc(&y_out, &s_out), &refs, &[]);
    assert!(a.0.passed() && a.1.is_none());
    assert_eq!(a.0, b.0);
    assert!(b.1.is_none());
    // One bad element far in: the same failure.
    y_out[1_500_000] += 1.0;
    let a = ksearch_eval::common::check_outputs(&t, ksearch_core::Backend::Cuda, &enc(&y_out, &s_out), &refs);
    let b = ksearch_eval::common::check_outputs_parallel(&t, ksearch_core::Backend::Cuda, &enc(&y_out, &s_out), &refs, &[]);
    assert!(!a.0.passed());
    assert_eq!(a.0, b.0);
    assert_eq!(a.1.map(|f| f.message), b.1.map(|f| f.message));
}
