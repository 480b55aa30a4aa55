//! Integration tests: they drive the real `ksearch` binary, real compiler, real workers and a
//! real SQLite store in a temporary folder.

use assert_cmd::Command;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn ks(store: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(repo()).arg("--store").arg(store).arg("--quiet");
    c
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn lists_the_shipped_tasks() {
    let d = tempfile::tempdir().unwrap();
    let o = ks(&d.path().join("s.db")).arg("tasks").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for t in ["softmax", "rmsnorm", "attention", "mamba_scan", "mamba_step"] {
        assert!(out.contains(t), "missing task {t} in:\n{out}");
    }
}

#[test]
fn malformed_task_files_fail_with_file_line_and_reason() {
    let d = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str, &str)] = &[
        ("name = \"x\"\naxes = [\"n\"\n", ":2:", "unclosed array"),
        (
            "name = \"x\"\nreference = \"softmax\"\naxes = [\"n\"]\nbogus = 1\n",
            ":4:",
            "unknown field",
        ),
        (
            "name = \"x\"\nreference = \"softmax\"\naxes = [\"rows\"]\n[[inputs]]\nname = \"x\"\nshape = [\"rows\", \"cols\"]\ndtype = \"f32\"\n[[outputs]]\nname = \"y\"\nshape = [\"rows\"]\ndtype = \"f32\"\n[tolerance]\nf32 = { atol = 1e-5, rtol = 1e-4 }\n[backends.cpu]\nsearch = [{ rows = 4 }]\n[backends.cpu.seed]\nfile = \"k.cpp\"\nentry = \"k\"\n",
            ":5:",
            "unknown axis `cols`",
        ),
        (
            "name = \"x\"\nreference = \"nope\"\naxes = [\"rows\"]\ninputs = []\noutputs = []\n[tolerance]\n[backends]\n",
            ":2:",
            "unknown host reference",
        ),
    ];
    for (i, (text, line, reason)) in cases.iter().enumerate() {
        let dir = d.path().join(format!("t{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("task.toml"), text).unwrap();
        let o = ks(&d.path().join("s.db"))
            .args(["run", dir.to_str().unwrap(), "--rounds", "1"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "case {i}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains("task.toml") && err.contains(line) && err.contains(reason),
            "case {i}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "case {i}: one line expected: {err}");
    }
}

#[test]
fn usage_errors_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let o = ks(&s).args(["run", "softmax", "--rounds", "many"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = ks(&s).args(["run", "no_such_task"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no task named `no_such_task`"), "{}", stderr(&o));
    let o = ks(&s).args(["run", "softmax", "--backend", "tpu"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = ks(&s).args(["resume", "42"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no run 42"), "{}", stderr(&o));
}

#[test]
fn softmax_search_beats_the_seed_and_passes_held_out() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let o = ks(&s)
        .args(["run", "softmax", "--backend", "cpu", "--rounds", "4", "--max-reps", "5"])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("speed-up over the naive seed"), "{out}");
    assert!(out.contains("held-out validation: passed"), "{out}");
    // The tree, the run list and the best kernel are all readable afterwards.
    let t = ks(&s).args(["tree", "1"]).output().unwrap();
    assert!(
        stdout(&t).contains("naive seed") && stdout(&t).contains("rating"),
        "{}",
        stdout(&t)
    );
    let r = ks(&s).arg("runs").output().unwrap();
    assert!(
        stdout(&r).contains("softmax") && stdout(&r).contains("done"),
        "{}",
        stdout(&r)
    );
    let f = d.path().join("best.cpp");
    let b = ks(&s).args(["best", "1", "-o", f.to_str().unwrap()]).output().unwrap();
    assert!(b.status.success(), "{}", stderr(&b));
    let src = std::fs::read_to_string(&f).unwrap();
    assert!(src.contains("#define") && src.contains("extern \"C\""), "{src}");
    // The written kernel is a valid kernel on its own: bench it against the seed.
    let o = ks(&s)
        .args(["bench", "softmax", f.to_str().unwrap(), "--heldout"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("[held-out]"), "{}", stdout(&o));
}

#[test]
fn misbehaving_kernels_are_classified_and_the_search_goes_on() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let o = ks(&s)
        .args([
            "run",
            &fixture("bad"),
            "--rounds",
            "12",
            "--run-timeout",
            "3s",
            "--mem-limit",
            "512MiB",
            "--max-reps",
            "3",
        ])
        .output()
        .unwrap();
    // Nothing valid beyond the seed: exit code 1.
    assert_eq!(o.status.code(), Some(1), "{}\n{}", stdout(&o), stderr(&o));
    let t = stdout(&ks(&s).args(["tree", "1"]).output().unwrap());
    for (kernel, class) in [
        ("segfault", "FAILED crash"),
        ("spin", "FAILED timeout"),
        ("hog", "FAILED out_of_memory"),
        ("lazy", "FAILED unwritten"),
        ("nan", "FAILED nan"),
        ("overrun", "FAILED out_of_bounds"),
        ("wrong", "FAILED wrong"),
        ("broken", "FAILED compile"),
        ("cheat", "FAILED unwritten"),
    ] {
        let line = t
            .lines()
            .find(|l| l.contains(&format!("adopt {kernel} ")))
            .unwrap_or_else(|| panic!("no node for {kernel}:\n{t}"));
        assert!(line.contains(class), "{kernel}: {line}");
    }
    // Every one of them was recorded as an evaluation.
    let store = ksearch_store::Store::open(&s).unwrap();
    let evals = store.evaluations(1, None).unwrap();
    let failed = evals.iter().filter(|e| e.purpose == "search" && !e.reply.ok()).count();
    assert!(failed >= 9, "{failed} failed evaluations recorded");
}

#[test]
#[allow(clippy::zombie_processes)] // the child is killed and waited for inside the loop
fn kill_9_then_resume_keeps_every_evaluation() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let bin = assert_cmd::cargo::cargo_bin("ksearch");
    let mut child = std::process::Command::new(&bin)
        .current_dir(repo())
        .args([
            "--quiet",
            "--store",
            s.to_str().unwrap(),
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--rounds",
            "8",
            "--patience",
            "50",
            "--max-reps",
            "3",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until a few rounds are committed, then kill -9.
    let t0 = Instant::now();
    let (before_ids, round_at_kill) = loop {
        std::thread::sleep(Duration::from_millis(200));
        if let Ok(st) = ksearch_store::Store::open(&s)
            && let Ok(run) = st.run(1)
        {
            let ev = st.evaluations(1, None).unwrap_or_default();
            if run.round >= 3 && ev.len() >= 3 {
                // SAFETY: plain kill(2) on our own child.
                unsafe { libc_kill(child.id() as i32) };
                let _ = child.wait();
                let st = ksearch_store::Store::open(&s).unwrap();
                let ev: Vec<i64> = st.evaluations(1, None).unwrap().iter().map(|e| e.id).collect();
                break (ev, st.run(1).unwrap().round);
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(240), "run made no progress");
    };
    let st = ksearch_store::Store::open(&s).unwrap();
    assert_eq!(st.run(1).unwrap().status, "running");
    drop(st);
    let o = ks(&s).args(["resume", "1"]).output().unwrap();
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let st = ksearch_store::Store::open(&s).unwrap();
    let run = st.run(1).unwrap();
    assert!(run.status.starts_with("done"), "{}", run.status);
    assert!(
        run.round > round_at_kill,
        "round {} after resume, {round_at_kill} at kill",
        run.round
    );
    let after = st.evaluations(1, None).unwrap();
    for id in &before_ids {
        assert!(after.iter().any(|e| e.id == *id), "evaluation {id} lost");
    }
    // Rounds continue from where they were, not from 1.
    let resumed: Vec<u32> = after
        .iter()
        .filter(|e| !before_ids.contains(&e.id) && e.purpose == "search")
        .map(|e| e.round)
        .collect();
    assert!(resumed.iter().all(|r| *r >= round_at_kill), "{resumed:?} vs {round_at_kill}");
    // No node is left running.
    assert!(
        st.nodes(1)
            .unwrap()
            .iter()
            .all(|n| n.status != ksearch_core::NodeStatus::Running)
    );
}

unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
unsafe fn libc_kill(pid: i32) {
    unsafe {
        kill(pid, 9);
    }
}

/// One search over two shapes that need different builds of a kernel family (a shape-tied
/// `specialisation` tunable): the family is searched, each workload runs its own build, and
/// the held-out shape gets its build too.
#[test]
fn a_search_over_shapes_needing_different_builds_runs() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let o = ks(&s)
        .args(["run", &fixture("shapes"), "--rounds", "4", "--max-reps", "3"])
        .output()
        .unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}\n{}", stdout(&o), stderr(&o));
    let store = ksearch_store::Store::open(&s).unwrap();
    let nodes = store.nodes(1).unwrap();
    let adopted = nodes
        .iter()
        .filter(|n| format!("{:?}", n.action).contains("fixed_cols"))
        .find(|n| n.status == ksearch_core::tree::NodeStatus::Solved)
        .unwrap_or_else(|| panic!("the family was not searched: {nodes:?}\n{}", stderr(&o)));
    let evals = store.evaluations(1, Some(adopted.id)).unwrap();
    let search = evals.iter().find(|e| e.purpose == "search").expect("a search evaluation");
    let cols: Vec<Option<i64>> = search
        .reply
        .workloads
        .iter()
        .map(|w| w.defines.as_ref().and_then(|d| d.get("COLS").copied()))
        .collect();
    assert_eq!(cols, vec![Some(256), Some(512)], "each shape ran its own build");
    assert!(search.reply.ok(), "{:?}", search.reply.workloads);
}
