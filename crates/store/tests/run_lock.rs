//! A run has one driver at a time: `Store::lock_run` between two real processes. The second
//! process is this test binary itself, started with `LOCK_HOLDER_STORE` set so that only the
//! `lock_holder` entry runs: it takes the lock, says so on stdout and waits until killed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use ksearch_store::{Store, StoreError};

/// The second process's part (does nothing in an ordinary test run).
#[test]
fn lock_holder() {
    let (Ok(store), Ok(run)) = (std::env::var("LOCK_HOLDER_STORE"), std::env::var("LOCK_HOLDER_RUN")) else {
        return;
    };
    let s = Store::open(Path::new(&store)).unwrap();
    let _lock = s.lock_run(run.parse().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    println!("locked");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

/// Start a process holding run `run` of `store`; returns once it holds it.
fn holder(store: &Path, run: i64) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lock_holder", "--nocapture", "--test-threads=1"])
        .env("LOCK_HOLDER_STORE", store)
        .env("LOCK_HOLDER_RUN", run.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = c.stdout.take().unwrap();
    let said = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("locked"));
    assert!(said, "the holder process did not take the lock");
    c
}

fn new_run(store: &Path) -> (Store, i64) {
    let s = Store::open(store).unwrap();
    let run = s
        .create_run(
            "softmax",
            ksearch_core::Backend::Cpu,
            "offline",
            1,
            "",
            &serde_json::json!({}),
        )
        .unwrap();
    (s, run)
}

#[test]
fn a_second_driver_is_refused_with_the_owner_and_a_dead_owners_lock_is_taken_over() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("store.db");
    let (s, run) = new_run(&p);
    let other = s
        .create_run(
            "softmax",
            ksearch_core::Backend::Cpu,
            "offline",
            2,
            "",
            &serde_json::json!({}),
        )
        .unwrap();
    let mut child = holder(&p, run);
    let pid = child.id();

    let e = s.lock_run(run).unwrap_err();
    let StoreError::Locked {
        run: r,
        pid: owner,
        host,
        since,
    } = &e
    else {
        panic!("expected Locked, got {e}");
    };
    assert_eq!((*r, owner.as_str()), (run, pid.to_string().as_str()));
    assert!(!host.is_empty() && host != "?", "no host in {e}");
    assert!(since.len() == 20 && since.ends_with('Z'), "start time {since:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("run {run} is being driven by pid {pid} on {host} since ")),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");

    // Another run of the same store is free.
    drop(s.lock_run(other).unwrap());

    // The owner dies without letting go: its lock goes with it, and is taken over.
    child.kill().unwrap();
    child.wait().unwrap();
    let lock = s.lock_run(run).expect("a dead owner's lock is free");
    assert_eq!(lock.run(), run);
    let text = std::fs::read_to_string(d.path().join(format!("store.db.locks/run-{run}.lock"))).unwrap();
    assert!(
        text.contains(&format!("pid={}\n", std::process::id())),
        "the new owner is recorded: {text}"
    );

    // Held here, it is refused to another process too (and to this one).
    assert!(matches!(s.lock_run(run), Err(StoreError::Locked { .. })));
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lock_holder", "--nocapture", "--test-threads=1"])
        .env("LOCK_HOLDER_STORE", &p)
        .env("LOCK_HOLDER_RUN", run.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains(&format!("is being driven by pid {}", std::process::id())),
        "{text}"
    );

    // Released on drop.
    drop(lock);
    drop(s.lock_run(run).unwrap());
}

#[test]
fn locking_a_run_not_in_the_store_or_beside_an_unwritable_store_fails_in_one_line() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("store.db");
    let (s, _run) = new_run(&p);
    assert!(matches!(s.lock_run(99), Err(StoreError::NoRun(99))));

    // The lock folder's place is taken by a file: the error names the lock file.
    let (s2, run2) = new_run(&d.path().join("other.db"));
    std::fs::write(d.path().join("other.db.locks"), "x").unwrap();
    let e = s2.lock_run(run2).unwrap_err().to_string();
    assert!(
        e.contains("other.db.locks/run-") && e.contains("cannot create its folder"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}
