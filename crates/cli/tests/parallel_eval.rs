//! Evaluation in parallel on the CPU back-end, with real worker processes (`ksearch worker`),
//! real compiles and real runners: several workers of one pool give the verdicts one worker
//! gives, the device lock keeps measurements apart, the accounting fields add up, and a
//! missing compiler or a full compile-cache disk is the machine's failure (`infra`), not the
//! candidate's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use ksearch_core::protocol::{Candidate, EvalReply, EvalRequest, Lang, TimingReq, WorkloadReq, workload_label};
use ksearch_core::task::Task;
use ksearch_eval::common::DeviceLock;
use ksearch_eval::{Limits, Pool, Supervisor, WorkerSpec};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn bad_task() -> Task {
    Task::load(&fixtures().join("bad/task.toml")).expect("fixture task loads")
}

fn worker(cache: &Path, env: &[(&str, &str)]) -> Supervisor {
    Supervisor::new(
        WorkerSpec {
            program: PathBuf::from(env!("CARGO_BIN_EXE_ksearch")),
            args: vec![
                "worker".into(),
                "--backend".into(),
                "cpu".into(),
                "--cache".into(),
                cache.display().to_string(),
                "--mem-limit".into(),
                (2u64 << 30).to_string(),
            ],
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .chain([("OMP_NUM_THREADS".to_string(), "1".to_string())])
                .collect(),
        },
        Limits {
            compile_timeout: Duration::from_secs(120),
            run_timeout: Duration::from_secs(20),
            mem_limit_bytes: 4 << 30,
        },
    )
}

fn pool(cache: &Path, n: usize, env: &[(&str, &str)]) -> Pool {
    Pool::new((0..n).map(|_| worker(cache, env)).collect())
}

/// A request for knowledge-base kernel `kernel` of the `bad` task (the seed is `good`).
fn request(t: &Task, id: u64, kernel: &str, defines: &[(&str, i64)]) -> EvalRequest {
    let k = t
        .kernel(ksearch_core::Backend::Cpu, kernel)
        .unwrap_or_else(|| panic!("no kernel {kernel}"));
    let b = t.backend(ksearch_core::Backend::Cpu).expect("cpu back-end");
    EvalRequest {
        id,
        task: t.clone(),
        backend: ksearch_core::Backend::Cpu,
        candidate: Candidate {
            lang: Lang::Cpp,
            source: k.source.clone(),
            launches: k.launches.clone(),
            scratch: k.scratch.clone(),
            defines: defines.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            options: BTreeMap::new(),
        },
        workloads: b
            .search
            .iter()
            .enumerate()
            .map(|(i, w)| WorkloadReq {
                label: workload_label(w, &t.axes),
                axes: w.clone(),
                seed: 1000 + id * 10 + i as u64,
            })
            .collect(),
        timing: TimingReq {
            warmup: 1,
            min_reps: 3,
            max_reps: 5,
            target_ms: 20.0,
            flush: false,
        },
        check_only: false,
    }
}

/// What a verdict is made of, timings left out: the failure class of the request and of
/// each workload, whether each check passed, and its counts of wrong, NaN and unwritten
/// elements.
fn verdict(r: &EvalReply) -> String {
    let mut v = format!("{:?}", r.failure.as_ref().map(|f| f.class));
    for w in &r.workloads {
        v.push_str(&format!(
            " | {} {:?} passed={} mismatches={} nan={} unwritten={}",
            w.label,
            w.failure.as_ref().map(|f| f.class),
            w.check.passed(),
            w.check.mismatches,
            w.check.nan,
            w.check.unwritten
        ));
    }
    v
}

fn batch(t: &Task) -> Vec<EvalRequest> {
    // Correct ones (distinct builds), one that does not compile, one that writes one element,
    // one that computes wrongly, and one that crashes its runner.
    [
        ("seed", vec![]),
        ("broken", vec![]),
        ("lazy", vec![]),
        ("seed", vec![("VARIANT", 1)]),
        ("wrong", vec![]),
        ("segfault", vec![]),
        ("seed", vec![("VARIANT", 2)]),
    ]
    .iter()
    .enumerate()
    .map(|(i, (k, d))| request(t, i as u64 + 1, k, d))
    .collect()
}

#[test]
fn two_workers_give_the_verdicts_of_one() {
    let t = bad_task();
    let reqs = batch(&t);
    let d1 = tempfile::tempdir().unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let one: Vec<String> = pool(d1.path(), 1, &[]).eval_many(&reqs).iter().map(verdict).collect();
    let mut p2 = pool(d2.path(), 2, &[]);
    let two = p2.eval_many(&reqs);
    let ids: Vec<u64> = two.iter().map(|r| r.id).collect();
    assert_eq!(ids, reqs.iter().map(|r| r.id).collect::<Vec<_>>(), "replies in request order");
    let two: Vec<String> = two.iter().map(verdict).collect();
    assert_eq!(one, two, "the same verdicts from one worker and from two");
    // The batch means something: correct, compile, unwritten, wrong and crash all occur.
    let all = one.join("\n");
    assert!(one[0].starts_with("None") && one[0].contains("passed=true"), "{all}");
    for class in ["Some(Compile)", "Some(Unwritten)", "Some(Wrong)", "Some(Crash)"] {
        assert!(all.contains(class), "no {class} in:\n{all}");
    }
    // A crashed worker was replaced: the pool still answers.
    let again = p2.eval_many(&reqs[..2]);
    assert_eq!(verdict(&again[0]), one[0]);
}

#[test]
fn two_workers_never_measure_at_the_same_time() {
    let t = bad_task();
    let reqs: Vec<EvalRequest> = (0..6).map(|i| request(&t, i + 1, "seed", &[("VARIANT", i as i64)])).collect();
    let d = tempfile::tempdir().unwrap();
    let mut p = pool(d.path(), 2, &[]);
    let replies = p.eval_many(&reqs);
    let mut spans: Vec<[f64; 2]> = Vec::new();
    for r in &replies {
        assert!(r.ok(), "{:?}", r.failure);
        assert_eq!(r.device_spans.len(), r.workloads.len(), "one hold of the lock per workload");
        spans.extend(r.device_spans.iter().copied());
    }
    spans.sort_by(|a, b| a[0].total_cmp(&b[0]));
    for w in spans.windows(2) {
        assert!(w[0][1] <= w[1][0], "measured phases overlap: {:?} and {:?}", w[0], w[1]);
    }
    let lock_file = DeviceLock::cpu(d.path()).path().to_path_buf();
    assert!(lock_file.is_file(), "the lock file is in the cache: {}", lock_file.display());
    let name = lock_file.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("cpu-") && name.ends_with("-0.lock"), "{name}");

    // While someone else holds the device's lock, a worker may compile but not measure: its
    // measured phase begins after the lock is released.
    let mut lock = DeviceLock::cpu(d.path());
    let hold = lock.acquire().expect("lock");
    let req = request(&t, 99, "seed", &[("VARIANT", 99)]);
    let reply = std::thread::scope(|s| {
        let h = s.spawn(|| p.eval_many(std::slice::from_ref(&req)));
        std::thread::sleep(Duration::from_millis(1500));
        let released = lock.release(hold)[1];
        let r = h.join().unwrap().pop().unwrap();
        (r, released)
    });
    let (r, released) = reply;
    assert!(r.ok(), "{:?}", r.failure);
    let first = r.device_spans.first().expect("a measured phase")[0];
    assert!(
        first >= released,
        "measured at {first} while the lock was held until {released}"
    );
}

#[test]
fn accounting_fields_are_filled_and_add_up() {
    let t = bad_task();
    let d = tempfile::tempdir().unwrap();
    let mut p = pool(d.path(), 2, &[]);
    for (i, k) in ["seed", "broken"].iter().enumerate() {
        let req = request(&t, i as u64 + 1, k, &[]);
        let t0 = std::time::Instant::now();
        let r = p.eval_many(std::slice::from_ref(&req)).pop().unwrap();
        let wall = t0.elapsed().as_secs_f64();
        for (name, v) in [
            ("compile_s", r.compile_s),
            ("device_s", r.device_s),
            ("lock_wait_s", r.lock_wait_s),
            ("overhead_s", r.overhead_s),
        ] {
            assert!(v.is_finite() && v >= 0.0, "{k}: {name} = {v}");
        }
        assert!(r.compile_s > 0.0, "{k}: compiling takes time");
        assert!(
            r.compile_s + r.lock_wait_s + r.device_s <= wall,
            "{k}: compile {} + wait {} + device {} > wall {wall}",
            r.compile_s,
            r.lock_wait_s,
            r.device_s
        );
        if *k == "seed" {
            assert!(
                r.device_s > 0.0 && r.device_s >= r.kernel_s,
                "device {} kernel {}",
                r.device_s,
                r.kernel_s
            );
        } else {
            assert_eq!(r.device_s, 0.0, "a candidate that does not compile never holds the device");
        }
    }
    let a = p.accounting();
    assert_eq!(a.evaluations, 2);
    assert!(a.critical_s > 0.0 && a.critical_s <= a.batch_s, "{a:?}");
    assert!(a.compile_s > 0.0 && a.device_s > 0.0, "{a:?}");
    let o = a.overhead(a.batch_s);
    assert!((0.0..1.0).contains(&o), "{a:?}: overhead {o}");
    assert!(a.line(a.batch_s).contains("2 in"), "{}", a.line(a.batch_s));
}

#[test]
fn a_missing_compiler_is_the_machines_failure() {
    let t = bad_task();
    let d = tempfile::tempdir().unwrap();
    let mut p = pool(d.path(), 1, &[("CXX", "/nonexistent/bin/c++")]);
    let r = p.eval_many(&[request(&t, 1, "seed", &[])]).pop().unwrap();
    assert!(r.infra(), "{:?}", r.failure);
    let msg = r.failure.unwrap().message;
    assert!(msg.contains("/nonexistent/bin/c++"), "names the compiler: {msg}");
}

#[test]
fn a_full_cache_disk_is_the_machines_failure() {
    let t = bad_task();
    let d = tempfile::tempdir().unwrap();
    let mnt = d.path().join("full");
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&mnt)
        .output();
    match ok {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "skipped: cannot mount a small tmpfs (needs root): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("skipped: cannot run mount: {e}");
            return;
        }
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(mnt.clone());
    // The lock file and the cache folder exist; then the disk is filled to the last byte.
    let lock_file = DeviceLock::cpu(&mnt.join("cache")).path().to_path_buf();
    std::fs::create_dir_all(lock_file.parent().unwrap()).unwrap();
    std::fs::write(&lock_file, b"").unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(mnt.join("filler")).unwrap();
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).and_then(|_| f.flush()).is_ok() {}
        while f.write_all(&chunk[..1]).and_then(|_| f.flush()).is_ok() {}
    }
    let mut p = pool(&mnt.join("cache"), 1, &[]);
    let r = p.eval_many(&[request(&t, 1, "seed", &[])]).pop().unwrap();
    assert!(r.infra(), "{:?}", r.failure);
    let msg = r.failure.unwrap().message;
    assert!(msg.contains("No space left on device"), "names the cause: {msg}");
}

fn ks(dir: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(dir)
        .arg("--tasks-dir")
        .arg(fixtures())
        .arg("--store")
        .arg(dir.join(".ksearch/store.db"));
    c
}

#[test]
fn a_run_without_a_compiler_stops_with_one_line_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let o = ks(d.path())
        .env("CXX", "/nonexistent/bin/c++")
        .args(["run", "tiny", "--backend", "cpu", "--rounds", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("infrastructure failure")).collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("error:") && l.contains("/nonexistent/bin/c++")),
        "one line naming the compiler:\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // Not booked on the seed: the run is stopped, not failed.
    let runs = ks(d.path()).arg("runs").output().unwrap();
    let runs = String::from_utf8_lossy(&runs.stdout);
    assert!(runs.contains("stopped"), "{runs}");
}

#[test]
fn a_run_reports_its_rate_and_overhead() {
    let d = tempfile::tempdir().unwrap();
    let o = ks(d.path())
        .args(["run", "tiny", "--backend", "cpu", "--rounds", "3", "--workers", "2"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.starts_with("evaluations: "))
        .unwrap_or_else(|| panic!("no accounting line in:\n{out}\n{}", String::from_utf8_lossy(&o.stderr)));
    assert!(
        line.contains("/min; overhead ") && line.contains(" s with no request in the pool; compile "),
        "{line}"
    );
}

/// A compiler that goes missing during a run: the candidate it could not compile is not booked
/// (its node stays open, nothing is recorded for it), the run stops in one line, and a resume
/// with the compiler back evaluates that node.
#[test]
fn a_compiler_gone_mid_run_leaves_the_node_open_for_resume() {
    use ksearch_core::tree::NodeStatus;
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let cxx = d.path().join("bin/cxx");
    std::fs::create_dir_all(cxx.parent().unwrap()).unwrap();
    let write = |body: &str| {
        std::fs::write(&cxx, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&cxx, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    // Compiles the seed, then removes itself: the next compile finds no compiler.
    write(r#"case " $* " in *" -o "*) c++ "$@"; rc=$?; rm -f "$0"; exit $rc;; *) exec c++ "$@";; esac"#);
    let o = ks(d.path())
        .env("CXX", &cxx)
        .args(["run", "tiny", "--backend", "cpu", "--rounds", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("error: infrastructure failure (not the candidate's)")
                && l.contains(&cxx.display().to_string())
                && l.contains("ksearch resume 1")),
        "{err}"
    );
    let store_path = d.path().join(".ksearch/store.db");
    {
        let st = ksearch_store::Store::open_read_only(&store_path).unwrap();
        assert_eq!(st.run(1).unwrap().status, "stopped");
        let evals = st.evaluations(1, None).unwrap();
        assert_eq!(evals.len(), 1, "only the seed's evaluation is recorded");
        assert_eq!(evals[0].purpose, "seed");
        let nodes = st.nodes(1).unwrap();
        assert!(nodes.len() > 1, "the planner opened actions");
        for n in nodes.iter().filter(|n| n.parent.is_some()) {
            assert_eq!(n.status, NodeStatus::Open, "node {} was booked: {:?}", n.id, n.failure);
            assert_eq!(n.attempts, 0, "node {}", n.id);
        }
    }
    // The compiler is back: the run goes on from the node it stopped at.
    write(r#"exec c++ "$@""#);
    let o = ks(d.path()).env("CXX", &cxx).args(["resume", "1"]).output().unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(matches!(o.status.code(), Some(0 | 1)), "{all}");
    let st = ksearch_store::Store::open_read_only(&store_path).unwrap();
    let searched = st
        .evaluations(1, None)
        .unwrap()
        .into_iter()
        .filter(|e| e.purpose == "search")
        .count();
    assert!(searched >= 1, "the resumed run evaluated candidates:\n{all}");
    assert!(st.run(1).unwrap().status.starts_with("done"), "{all}");
}

/// Times compared with each other go to one device: a pool of workers on two devices (CPU
/// workers standing for them) answers a pinned batch with the first device's workers only,
/// and an ordinary batch with all of them.
#[test]
fn a_pinned_batch_stays_on_one_device() {
    let t = bad_task();
    let reqs: Vec<EvalRequest> = (0..6).map(|i| request(&t, i + 1, "seed", &[("VARIANT", i as i64)])).collect();
    let d = tempfile::tempdir().unwrap();
    let workers = (0..4).map(|_| worker(d.path(), &[])).collect();
    let mut p = Pool::with_devices(workers, vec![0, 1, 0, 1]);
    let pinned = p.eval_many_on_one_device(&reqs);
    assert!(
        pinned.iter().all(|r| r.ok()),
        "{:?}",
        pinned.iter().map(verdict).collect::<Vec<_>>()
    );
    let started: Vec<u32> = p.workers.iter().map(|w| w.starts).collect();
    assert!(started[1] == 0 && started[3] == 0, "a device-1 worker measured: {started:?}");
    assert!(started[0] + started[2] >= 1, "{started:?}");
    let all = p.eval_many(&[reqs.clone(), reqs.clone()].concat());
    assert!(all.iter().all(|r| r.ok()));
    assert!(
        p.workers.iter().all(|w| w.starts >= 1),
        "an ordinary batch spreads over both devices"
    );
}
