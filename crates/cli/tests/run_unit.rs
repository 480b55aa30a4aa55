//! The run as a unit, through the real binary: many processes creating one store at once, a
//! store of a newer ksearch left untouched, and workers (with their runners) that end with
//! the search process that started them, even when it is killed mid-candidate, and with their
//! request channel when a launcher stands between them and the search.

mod quick;

use sha2::Digest;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn ksearch(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ksearch"));
    c.current_dir(dir);
    c
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Twenty `ksearch` processes open the same new store at once (`resume` creates and migrates
/// the store, then finds no run 1 in it): every one gets as far as that, none meets a half-made
/// schema, and the store ends at the current version.
#[test]
fn twenty_processes_creating_one_store_at_once_all_get_it() {
    for k in 0..3 {
        let d = tempfile::tempdir().unwrap();
        let store = d.path().join(format!("new{k}.db"));
        let kids: Vec<_> = (0..20)
            .map(|_| {
                ksearch(d.path())
                    .arg("--store")
                    .arg(&store)
                    .args(["resume", "1"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for kid in kids {
            let o = kid.wait_with_output().unwrap();
            let t = text(&o);
            assert_eq!(o.status.code(), Some(2), "{t}");
            assert_eq!(t.trim(), "error: no run 1 in the store", "round {k}");
        }
        let s = ksearch_store::Store::open_read_only(&store).unwrap();
        assert_eq!(s.schema_version().unwrap(), ksearch_store::SCHEMA_VERSION);
        assert!(s.runs().unwrap().is_empty());
    }
}

fn sha256(p: &Path) -> String {
    sha2::Sha256::digest(std::fs::read(p).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A store whose schema is newer than this ksearch: `run` and `runs` refuse it in one line
/// naming it, exit 2, and leave it byte-identical with nothing beside it.
#[test]
fn a_store_of_a_newer_ksearch_is_refused_and_left_as_it_was() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("future.db");
    drop(ksearch_store::Store::open(&store).unwrap());
    // As a newer ksearch would leave it: a higher user_version (header bytes 60..64), and in
    // the rollback-journal mode (bytes 18 and 19 = 1), which is what a switch to WAL rewrites.
    let mut b = std::fs::read(&store).unwrap();
    b[18] = 1;
    b[19] = 1;
    b[60..64].copy_from_slice(&(ksearch_store::SCHEMA_VERSION as u32 + 7).to_be_bytes());
    std::fs::write(&store, &b).unwrap();
    let before = sha256(&store);
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks");
    for args in [vec!["run", "softmax", "--backend", "cpu", "--rounds", "1"], vec!["runs"]] {
        let o = ksearch(d.path())
            .arg("--store")
            .arg(&store)
            .arg("--tasks-dir")
            .arg(&tasks)
            .args(&args)
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {t}");
        assert_eq!(t.trim().lines().count(), 1, "{args:?}: {t}");
        assert!(
            t.contains(&store.display().to_string()) && t.contains("newer than this ksearch"),
            "{args:?}: {t}"
        );
        assert_eq!(sha256(&store), before, "{args:?} changed the store");
    }
    let left: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(left, vec!["future.db".to_string()]);
}

/// Every live process: pid → (parent pid, command line). Zombies count as gone.
fn processes() -> Vec<(u32, u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (Some(state), Some(ppid)) = (f.next(), f.next().and_then(|p| p.parse::<u32>().ok())) else {
            continue;
        };
        if state == "Z" || state == "X" {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        out.push((pid, ppid, cmd));
    }
    out
}

/// The processes descending from `root` (not `root` itself).
fn descendants(root: u32) -> Vec<(u32, String)> {
    let all = processes();
    let mut found: Vec<(u32, String)> = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (pid, ppid, cmd) in &all {
            if *ppid == p && !found.iter().any(|(q, _)| q == pid) {
                found.push((*pid, cmd.clone()));
                frontier.push(*pid);
            }
        }
    }
    found
}

fn alive(pid: u32) -> bool {
    processes().iter().any(|(p, _, _)| *p == pid)
}

/// The search is killed with SIGKILL while its worker waits on a runner whose kernel never
/// returns: the worker and the runner are gone within 2 s, with nothing left to burn CPU.
#[test]
fn workers_and_runners_die_with_a_killed_search() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let mut search = ksearch(d.path())
        .arg("--tasks-dir")
        .arg(fixtures())
        .arg("--store")
        .arg(&store)
        .args([
            "--quiet",
            "run",
            "sleeper",
            "--backend",
            "cpu",
            "--rounds",
            "3",
            "--run-timeout",
            "600s",
            "--max-reps",
            "3",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = search.id();
    // Wait for the hanging candidate: node 2 running, and a worker with a runner under it.
    let deadline = Instant::now() + Duration::from_secs(180);
    let (worker, runner) = loop {
        assert!(
            Instant::now() < deadline,
            "the hanging candidate never ran; processes: {:?}",
            descendants(pid)
        );
        assert!(search.try_wait().unwrap().is_none(), "the search ended early");
        std::thread::sleep(Duration::from_millis(200));
        let running = ksearch_store::Store::open_read_only(&store)
            .and_then(|s| s.nodes(1))
            .map(|ns| {
                ns.iter()
                    .any(|n| n.id == 2 && n.status == ksearch_core::tree::NodeStatus::Running)
            })
            .unwrap_or(false);
        if !running {
            continue;
        }
        let kids = descendants(pid);
        let worker = kids.iter().find(|(_, c)| c.contains(" worker "));
        let runner = kids.iter().find(|(_, c)| c.contains(" runner "));
        if let (Some(w), Some(r)) = (worker, runner) {
            break (w.0, r.0);
        }
    };
    // Let the runner enter the kernel.
    std::thread::sleep(Duration::from_millis(1000));
    let left_before = descendants(pid);
    search.kill().unwrap();
    search.wait().unwrap();
    let killed = Instant::now();
    while (alive(worker) || alive(runner)) && killed.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let still: Vec<_> = left_before.iter().filter(|(p, _)| alive(*p)).collect();
    assert!(
        still.is_empty(),
        "alive {:.1} s after the search was killed: {still:?}",
        killed.elapsed().as_secs_f64()
    );
}

/// A worker whose parent lives on (as under a launcher: srun's step daemon is its parent, not
/// the search) still ends, runner and all, when its request channel hangs up during a kernel
/// that never returns.
#[test]
fn a_worker_ends_when_its_request_channel_hangs_up_mid_kernel() {
    use ksearch_core::protocol::{Candidate, EvalRequest, Lang, Reply, Request, TimingReq, WorkloadReq};
    use std::io::{BufRead, BufReader, Write};
    let d = tempfile::tempdir().unwrap();
    let task = ksearch_core::task::Task::load(&fixtures().join("sleeper/task.toml")).unwrap();
    let b = task.backend(ksearch_core::Backend::Cpu).unwrap();
    let k = b.kernels.iter().find(|k| k.name == "sleeper").unwrap();
    let req = EvalRequest {
        id: 1,
        task: task.clone(),
        backend: ksearch_core::Backend::Cpu,
        candidate: Candidate {
            lang: Lang::for_backend(ksearch_core::Backend::Cpu),
            source: k.source.clone(),
            launches: k.launches.clone(),
            scratch: k.scratch.clone(),
            defines: Default::default(),
            options: Default::default(),
        },
        workloads: vec![WorkloadReq {
            label: "w".into(),
            axes: b.search[0].clone(),
            seed: 1,
        }],
        timing: TimingReq {
            warmup: 1,
            min_reps: 1,
            max_reps: 1,
            target_ms: 10.0,
            flush: false,
        },
        check_only: false,
    };
    let mut w = Command::new(env!("CARGO_BIN_EXE_ksearch"))
        .args(["worker", "--backend", "cpu", "--cache"])
        .arg(d.path().join("cache"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = w.id();
    let mut stdin = w.stdin.take().unwrap();
    let mut lines = BufReader::new(w.stdout.take().unwrap()).lines();
    let line = serde_json::to_string(&Request::Eval(Box::new(req))).unwrap();
    writeln!(stdin, "{line}").unwrap();
    stdin.flush().unwrap();
    // Compiled and running: a "compiled" progress line, then the runner in the kernel.
    loop {
        let l = lines.next().expect("the worker ended before compiling").unwrap();
        if let Ok(Reply::Progress { stage, .. }) = serde_json::from_str::<Reply>(&l)
            && stage == "compiled"
        {
            break;
        }
        assert!(!matches!(serde_json::from_str::<Reply>(&l), Ok(Reply::Eval(_))), "{l}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let runner = loop {
        if let Some((r, _)) = descendants(pid).into_iter().find(|(_, c)| c.contains(" runner ")) {
            break r;
        }
        assert!(Instant::now() < deadline, "no runner under the worker");
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(alive(pid) && alive(runner), "the kernel is supposed to hang");
    drop(stdin);
    let closed = Instant::now();
    // Until the worker is reaped and the runner gone (a process whose main thread has ended
    // leaves the listing before its last threads do, and only then can it be reaped).
    let mut st = None;
    while closed.elapsed() < Duration::from_secs(2) {
        if st.is_none() {
            st = w.try_wait().unwrap();
        }
        if st.is_some() && !alive(runner) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let ok = st.is_some() && !alive(runner);
    let _ = w.kill();
    let _ = w.wait();
    assert!(
        ok,
        "worker (exit {st:?}) or runner alive {:.1} s after its request channel closed",
        closed.elapsed().as_secs_f64()
    );
}

// ----- one driver per run, signals, resume from every phase -----

/// The tasks these runs use: the repository's, the CPU softmax at smaller shapes (`quick`).
fn tasks_dir() -> PathBuf {
    quick::tasks()
}

/// `ksearch --store STORE --tasks-dir tasks --quiet ARGS` in `dir`.
fn on_store(dir: &Path, store: &Path, args: &[&str]) -> Command {
    let mut c = ksearch(dir);
    c.arg("--store")
        .arg(store)
        .arg("--tasks-dir")
        .arg(tasks_dir())
        .arg("--quiet")
        .args(args);
    c
}

/// A CPU softmax run of `rounds` rounds with few repetitions, started in the background.
fn spawn_run(dir: &Path, store: &Path, rounds: u32) -> std::process::Child {
    let rounds = rounds.to_string();
    on_store(
        dir,
        store,
        &[
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--rounds",
            &rounds,
            "--patience",
            "50",
            "--max-reps",
            "10",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// The purposes of run 1's evaluations so far (empty while the store or run is not there).
fn purposes(store: &Path) -> Vec<String> {
    ksearch_store::Store::open_read_only(store)
        .and_then(|s| s.evaluations(1, None))
        .map(|v| v.into_iter().map(|e| e.purpose).collect())
        .unwrap_or_default()
}

/// Wait (at most 5 minutes) until run 1's evaluations satisfy `ready`; the process must live.
fn wait_for(child: &mut std::process::Child, store: &Path, what: &str, ready: impl Fn(&[String]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if ready(&purposes(store)) {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            let mut out = String::new();
            for pipe in [
                child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read>),
                child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read>),
            ]
            .into_iter()
            .flatten()
            {
                let mut p = pipe;
                let _ = p.read_to_string(&mut out);
            }
            panic!("the search ended ({st}) before {what}: {:?}\n{out}", purposes(store));
        }
        assert!(Instant::now() < deadline, "never reached {what}: {:?}", purposes(store));
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &std::process::Child, sig: libc::c_int) {
    // SAFETY: a signal to a child of this test, by its pid.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
}

/// Run 1 ended whole: its report's counts agree with the store, it made `rounds` rounds, each
/// on one node, and no node was measured twice in the search (a node in flight at a kill or a
/// signal was booked once, when it was tried again).
fn check_whole(store: &Path, rounds: u32) {
    let s = ksearch_store::Store::open_read_only(store).unwrap();
    let row = s.run(1).unwrap();
    assert!(row.status.starts_with("done"), "status {}", row.status);
    let report: serde_json::Value = row.report.clone().expect("a report");
    let evals = s.evaluations(1, None).unwrap();
    assert_eq!(report["evaluations"].as_u64(), Some(evals.len() as u64), "{report}");
    assert_eq!(report["rounds"].as_u64(), Some(rounds as u64), "{report}");
    let nodes = s.nodes(1).unwrap();
    let booked = nodes
        .iter()
        .filter(|n| n.parent.is_some() && n.round_evaluated.is_some())
        .count();
    assert_eq!(booked, rounds as usize, "one booked node per round");
    let mut search: std::collections::BTreeMap<Option<i64>, usize> = Default::default();
    for e in evals.iter().filter(|e| e.purpose == "search" || e.purpose == "seed") {
        *search.entry(e.node_id).or_default() += 1;
    }
    assert!(search.values().all(|n| *n == 1), "a node measured twice: {search:?}");
    // One finish's rows: each candidate validated on the held-out workloads once, beside the seed
    // (timed again for every candidate tried: one whose held-out check fails gives way to the next).
    let seed = evals.iter().find(|e| e.purpose == "seed").map(|e| e.node_id);
    let mut finals: std::collections::BTreeMap<Option<i64>, usize> = Default::default();
    for e in evals.iter().filter(|e| e.purpose == "heldout") {
        *finals.entry(e.node_id).or_default() += 1;
    }
    let seed_rows = seed.and_then(|id| finals.remove(&id)).unwrap_or(0);
    assert!(finals.values().all(|n| *n == 1), "held-out rows of two finishes: {finals:?}");
    assert_eq!(seed_rows, finals.len(), "one seed row per candidate tried: {finals:?}");
    assert!(
        nodes.iter().all(|n| n.status != ksearch_core::tree::NodeStatus::Running),
        "a node left running"
    );
}

/// While a run is driven, `resume` of it is refused in one line (exit 2) and writes nothing;
/// after a `kill -9` of the run, two resumes start at once: exactly one proceeds and finishes it.
#[test]
fn one_driver_per_run_and_a_killed_drivers_run_is_taken_over() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let mut run = spawn_run(d.path(), &store, 4);
    wait_for(&mut run, &store, "two evaluations", |p| p.len() >= 2);
    // Frozen, so that the count cannot move while the second driver tries.
    signal(&run, libc::SIGSTOP);
    let before = purposes(&store);
    let cfg_before = ksearch_store::Store::open_read_only(&store).unwrap().run(1).unwrap().config;
    let o = on_store(d.path(), &store, &["resume", "1"]).output().unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert_eq!(t.trim().lines().count(), 1, "{t}");
    assert!(
        t.contains("run 1 is being driven by pid") && t.contains(&run.id().to_string()),
        "{t}"
    );
    assert_eq!(purposes(&store), before, "the refused resume wrote evaluations");
    let row = ksearch_store::Store::open_read_only(&store).unwrap().run(1).unwrap();
    assert_eq!(row.config, cfg_before);
    assert_eq!(row.status, "running");
    signal(&run, libc::SIGCONT);
    run.kill().unwrap();
    run.wait().unwrap();
    let both: Vec<_> = (0..2)
        .map(|_| {
            on_store(d.path(), &store, &["resume", "1"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = both.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let refused: Vec<_> = outs.iter().filter(|o| o.status.code() == Some(2)).collect();
    assert_eq!(refused.len(), 1, "{:?}", outs.iter().map(text).collect::<Vec<_>>());
    assert!(text(refused[0]).contains("is being driven by pid"), "{}", text(refused[0]));
    let went = outs.iter().find(|o| o.status.code() != Some(2)).unwrap();
    assert!(matches!(went.status.code(), Some(0) | Some(1)), "{}", text(went));
    check_whole(&store, 4);
}

/// SIGINT during a run: exit 130, the one line, the run `interrupted` (as `runs` shows it),
/// and `resume` finishes it with no evaluation done twice. SIGTERM alike, exit 143.
#[test]
fn sigint_and_sigterm_stop_a_run_cleanly_and_resume_finishes_it() {
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let d = tempfile::tempdir().unwrap();
        let store = d.path().join("store.db");
        let mut run = spawn_run(d.path(), &store, 3);
        // The seed's evaluation, then the signal while the first candidate is compiled or timed (after
        // two evaluations a run on a noisy machine may already be ending: its first candidate slower
        // than the seed, no action left).
        wait_for(&mut run, &store, "the seed's evaluation", |p| !p.is_empty());
        signal(&run, sig);
        let o = run.wait_with_output().unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(code), "{t}");
        assert_eq!(t.trim(), "interrupted: resume with ksearch resume 1", "{t}");
        let row = ksearch_store::Store::open_read_only(&store).unwrap().run(1).unwrap();
        assert_eq!(row.status, "interrupted");
        let runs = on_store(d.path(), &store, &["runs"]).output().unwrap();
        assert!(text(&runs).contains("interrupted"), "{}", text(&runs));
        let o = on_store(d.path(), &store, &["resume", "1"]).output().unwrap();
        assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", text(&o));
        check_whole(&store, 3);
    }
}

/// A moment of a run, told by its evaluations' purposes.
type Moment = Box<dyn Fn(&[String]) -> bool>;

/// `kill -9` early (after the seed), mid-search and during the final phase, each time followed
/// by `resume`: the run ends whole, its report counting what the store holds.
#[test]
fn a_run_killed_in_every_phase_resumes_to_the_same_counts() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let mut child = spawn_run(d.path(), &store, 4);
    let moments: [(&str, Moment); 3] = [
        ("the seed", Box::new(|p| !p.is_empty())),
        ("mid-search", Box::new(|p| p.iter().filter(|x| *x == "search").count() >= 2)),
        ("the final phase", Box::new(|p| p.iter().any(|x| x == "final"))),
    ];
    for (what, ready) in moments {
        wait_for(&mut child, &store, what, ready);
        child.kill().unwrap();
        child.wait().unwrap();
        child = on_store(d.path(), &store, &["resume", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", text(&o));
    check_whole(&store, 4);
}

/// `--time-budget 10s` covers the whole invocation, final phase included: the run ends within
/// 1.5 times its budget plus 5 s (a contract on a busy machine, not a speed figure) and says
/// that it stopped on its budget. It searches the repository's own softmax, not the quick
/// tasks': at an eighth of the elements a fast machine exhausts the offline planner's actions
/// in about 6 s (2026-12-04: 14 rounds, 31 evaluations in 6.2 s) and the budget never binds.
/// (10 s, not less: with evaluations of about 0.5 s here, a shorter budget leaves little room
/// for a round once the final phase's time is kept.)
#[test]
fn the_time_budget_covers_the_final_phase() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let t = Instant::now();
    let mut cmd = ksearch(d.path());
    cmd.arg("--store")
        .arg(&store)
        .arg("--tasks-dir")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks"))
        .arg("--quiet");
    let o = cmd
        .args([
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--rounds",
            "500",
            "--patience",
            "500",
            "--max-reps",
            "3",
            "--time-budget",
            "10s",
        ])
        .output()
        .unwrap();
    let wall = t.elapsed().as_secs_f64();
    let txt = text(&o);
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{txt}");
    assert!(txt.contains("stopped: time budget 10s reached"), "{txt}");
    assert!(wall <= 1.5 * 10.0 + 5.0, "{wall:.1} s for a 10 s budget: {txt}");
    let row = ksearch_store::Store::open_read_only(&store).unwrap().run(1).unwrap();
    assert!(row.status.starts_with("done"), "{}", row.status);
}

/// Two CPU workers: the rounds go two at a time, the run completes and its counts are right.
#[test]
fn two_workers_complete_a_run_with_the_counts_right() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let o = on_store(
        d.path(),
        &store,
        &[
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--workers",
            "2",
            "--rounds",
            "4",
            "--patience",
            "50",
            "--max-reps",
            "3",
        ],
    )
    .output()
    .unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", text(&o));
    assert!(text(&o).contains("4 rounds"), "{}", text(&o));
    check_whole(&store, 4);
}

/// A second SIGINT exits at once (130), and still nothing is lost: `resume` finishes the run
/// with every count right.
#[test]
fn a_second_sigint_exits_at_once_and_loses_nothing() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store.db");
    let mut run = spawn_run(d.path(), &store, 3);
    wait_for(&mut run, &store, "three evaluations", |p| p.len() >= 3);
    signal(&run, libc::SIGINT);
    signal(&run, libc::SIGINT);
    let o = run.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", text(&o));
    let o = on_store(d.path(), &store, &["resume", "1"]).output().unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", text(&o));
    check_whole(&store, 3);
}
