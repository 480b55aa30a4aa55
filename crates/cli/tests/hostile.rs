//! The adversarial suite on the CPU back-end: every kernel of `fixtures/hostile` tries to fool
//! or escape its judge, and must end the way `fixtures/hostile/expect.toml` says, both through
//! `ksearch bench` and through a full `ksearch run`; after the run no process of it is left,
//! the compile cache is intact, and a secret planted in the environment appears nowhere.
//! The same table drives the CUDA suite on the GPU machine (`scripts/gpu-tests.sh`).

use assert_cmd::Command;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CANARY: &str = "sk-canary-7f3a9c2e51d84b6a";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// kernel → the outcomes it may have ("ok" or failure classes), for `backend`.
fn expectations(backend: &str) -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(fixtures().join("hostile/expect.toml")).unwrap();
    let v: toml::Table = toml::from_str(&text).unwrap();
    v[backend]
        .as_table()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let allowed = v
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect();
            (k.clone(), allowed)
        })
        .collect()
}

/// kernel → the most `bench` may find it faster than the seed (kernels that pass but must gain
/// nothing), for `backend`.
fn max_speedups(backend: &str) -> BTreeMap<String, f64> {
    let text = std::fs::read_to_string(fixtures().join("hostile/expect.toml")).unwrap();
    let v: toml::Table = toml::from_str(&text).unwrap();
    v.get(&format!("{backend}-max-speedup"))
        .and_then(|t| t.as_table())
        .map(|t| t.iter().map(|(k, v)| (k.clone(), v.as_float().unwrap())).collect())
        .unwrap_or_default()
}

/// The speed-ups over the seed that `bench` printed (one per workload).
fn speedups_of_bench(o: &std::process::Output) -> Vec<f64> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains(" seed ") && l.contains(" kernel "))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_suffix('x').and_then(|n| n.parse::<f64>().ok()))
        })
        .collect()
}

fn ks(dir: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(dir)
        .env("OPENAI_API_KEY", CANARY)
        .env("MY_SERVICE_PASS", CANARY)
        .arg("--tasks-dir")
        .arg(fixtures())
        .arg("--store")
        .arg(dir.join(".ksearch/store.db"));
    c
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `ksearch runner` processes that outlived their worker (re-parented to init).
fn orphan_runners() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().nth(1))
            .unwrap_or("");
        if cmd.contains("ksearch") && cmd.contains(" runner ") && ppid == "1" {
            out.push(format!("{pid}: {cmd}"));
        }
    }
    out
}

fn outcome_of_bench(o: &std::process::Output) -> String {
    let t = text(o);
    match t.split("kernel FAILED (").nth(1) {
        Some(rest) => rest.split(')').next().unwrap_or("").to_string(),
        None if o.status.code() == Some(0) => "ok".into(),
        None => format!("exit {:?}: {t}", o.status.code()),
    }
}

#[test]
fn hostile_kernels_are_rejected_by_bench() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("ksearch.toml"), "[eval]\nrun_timeout = \"10s\"\nmax_reps = 5\n").unwrap();
    let mut wrong = Vec::new();
    let fastest = max_speedups("cpu");
    for (kernel, allowed) in expectations("cpu") {
        let file = fixtures().join(format!("hostile/cpu/{kernel}.cpp"));
        let o = ks(d.path()).args(["bench", "hostile"]).arg(&file).output().unwrap();
        let got = outcome_of_bench(&o);
        if !allowed.contains(&got) {
            wrong.push(format!("{kernel}: {got} (expected one of {allowed:?})\n{}", text(&o)));
        }
        // A kernel that passes but must gain nothing: timed no faster than its bound.
        if let Some(max) = fastest.get(&kernel).filter(|_| got == "ok") {
            let sp = speedups_of_bench(&o);
            if sp.is_empty() || sp.iter().any(|s| s > max) {
                wrong.push(format!("{kernel}: speed-ups {sp:?} (at most {max}x expected)\n{}", text(&o)));
            }
        }
        assert!(
            !text(&o).contains(CANARY),
            "{kernel}: the secret reached the terminal:\n{}",
            text(&o)
        );
        // A kernel that fails is a failed bench: exit 1, never a crash of ksearch.
        let code = o.status.code();
        assert!(
            (got == "ok" && code == Some(0)) || (got != "ok" && code == Some(1)),
            "{kernel}: exit {code:?}"
        );
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(orphan_runners().is_empty(), "left behind: {:?}", orphan_runners());
}

#[test]
fn hostile_kernels_are_rejected_by_a_run_and_leave_nothing_behind() {
    let d = tempfile::tempdir().unwrap();
    let expect = expectations("cpu");
    // A round for every kernel, and some to spare.
    let rounds = (expect.len() + 5).to_string();
    let o = ks(d.path())
        .args([
            "run",
            "hostile",
            "--rounds",
            &rounds,
            "--patience",
            "100",
            "--run-timeout",
            "10s",
            "--max-reps",
            "5",
        ])
        .output()
        .unwrap();
    let out = text(&o);
    // Nothing killed the search: it ends as a search ends (1 when nothing beat the seed).
    assert!(
        matches!(o.status.code(), Some(0) | Some(1)),
        "exit {:?}\n{out}",
        o.status.code()
    );
    assert!(out.contains("isolation: "), "{out}");
    // The worker's hello says which clock times the calls, and the header prints it.
    assert!(out.contains("timing: the host's monotonic clock"), "{out}");
    let tree = text(&ks(d.path()).args(["tree", "1"]).output().unwrap());
    for (kernel, allowed) in &expect {
        if kernel == "good" {
            continue; // the seed
        }
        let line = tree
            .lines()
            .find(|l| l.contains(&format!("adopt {kernel} ")))
            .unwrap_or_else(|| panic!("no node for {kernel}:\n{tree}"));
        let ok = allowed.iter().any(|c| {
            if c == "ok" {
                !line.contains("FAILED")
            } else {
                line.contains(&format!("FAILED {c} "))
            }
        });
        assert!(ok, "{kernel}: {line} (expected one of {allowed:?})");
    }
    // The secret is nowhere: not on the terminal, not in any byte of the store.
    assert!(!out.contains(CANARY), "the secret reached the terminal");
    for f in std::fs::read_dir(d.path().join(".ksearch")).unwrap().flatten() {
        if f.path().is_file() {
            let bytes = std::fs::read(f.path()).unwrap();
            assert!(
                !bytes.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()),
                "the secret is in {}",
                f.path().display()
            );
        }
    }
    // The compile cache holds only verified artefacts: each matches the hash recorded with it.
    let cache = d.path().join(".ksearch/cache/cpu");
    let mut checked = 0;
    for f in std::fs::read_dir(&cache).unwrap().flatten() {
        let p = f.path();
        if p.extension().is_some_and(|e| e == "so") {
            use sha2::{Digest, Sha256};
            let sum = std::fs::read_to_string(p.with_extension("so.sha256")).unwrap();
            let hash: String = Sha256::digest(std::fs::read(&p).unwrap())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(hash, sum.trim(), "{} was changed after it was stored", p.display());
            checked += 1;
        }
    }
    assert!(checked > 10, "{checked} cache entries");
    assert!(orphan_runners().is_empty(), "left behind: {:?}", orphan_runners());
}

/// Waits until node 2 of run 1 is `running` for the `attempt`-th time, then kills the search.
fn kill_while_node_runs(child: &mut std::process::Child, store: &Path, attempt: u32) {
    let started = std::time::Instant::now();
    let deadline = started + std::time::Duration::from_secs(120);
    loop {
        if std::time::Instant::now() > deadline {
            let nodes = ksearch_store::Store::open(store).and_then(|s| s.nodes(1));
            panic!(
                "node 2 never ran for the {attempt}th time: {:?}",
                nodes.map(|v| v.iter().map(|n| (n.id, n.status, n.attempts)).collect::<Vec<_>>())
            );
        }
        // Opened only once the run made it (two processes creating one store race on its
        // migrations).
        if store.exists()
            && std::time::Instant::now() > started + std::time::Duration::from_secs(3)
            && let Ok(s) = ksearch_store::Store::open(store)
            && let Ok(nodes) = s.nodes(1)
            && nodes
                .iter()
                .any(|n| n.id == 2 && n.status == ksearch_core::tree::NodeStatus::Running && n.attempts == attempt)
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // Let the evaluation start in the worker.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A node during which the search process died twice is failed on the next resume
/// (`killed_orchestrator`), not retried forever; the run then goes on; nothing is left running.
#[test]
fn a_node_that_twice_outlived_the_search_is_failed_on_resume() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join(".ksearch/store.db");
    let spawn = |args: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_ksearch"));
        c.current_dir(d.path())
            .arg("--tasks-dir")
            .arg(fixtures())
            .arg("--store")
            .arg(&store)
            .arg("--quiet")
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        c.spawn().unwrap()
    };
    let mut run = spawn(&["run", "sleeper", "--rounds", "3", "--run-timeout", "600s", "--max-reps", "3"]);
    kill_while_node_runs(&mut run, &store, 1);
    let mut again = spawn(&["resume", "1", "--run-timeout", "600s"]);
    kill_while_node_runs(&mut again, &store, 2);
    let o = ks(d.path())
        .args(["--quiet", "resume", "1", "--run-timeout", "600s"])
        .output()
        .unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", text(&o));
    let s = ksearch_store::Store::open(&store).unwrap();
    let n2 = s.nodes(1).unwrap().into_iter().find(|n| n.id == 2).unwrap();
    assert_eq!(n2.status, ksearch_core::tree::NodeStatus::Failed, "{n2:?}");
    assert_eq!(n2.failure, Some(ksearch_core::protocol::FailureClass::KilledOrchestrator));
    assert!(s.run(1).unwrap().status.starts_with("done"), "the run finished");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(orphan_runners().is_empty(), "left behind: {:?}", orphan_runners());
}
