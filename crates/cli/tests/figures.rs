//! One truth per figure: `runs`, `best` and a finished run's summary show the verified figure
//! (the final re-timing), the in-search figure only labelled, and a best that is not faster
//! than the seed once re-timed is no result everywhere (same message, exit 1). The stores are
//! written here directly, so each case is exact.

use assert_cmd::Command;
use ksearch_core::tree::{Action, Assessment, Node, NodeStatus};
use ksearch_store::Store;
use std::path::Path;

fn ks(store: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.arg("--store").arg(store).arg("--quiet");
    c
}

fn out(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A new softmax run on the CPU and its seed node, in `status` (measured at 1.0x when solved).
fn run_with_seed(st: &Store, status: NodeStatus) -> (i64, i64) {
    let run = st
        .create_run(
            "softmax",
            ksearch_core::Backend::Cpu,
            "offline",
            1,
            "test cpu",
            &serde_json::json!({}),
        )
        .unwrap();
    let mut seed = Node::new(0, None, Action::Seed, None, Assessment::default(), 0);
    seed.status = status;
    seed.speedup = (status == NodeStatus::Solved).then_some(1.0);
    (run, st.insert_node(run, &seed).unwrap())
}

/// A finished run whose best node measured `search` during the search and `verified` in the
/// final re-timing; `heldout` is the held-out speed-up.
fn finished_run(st: &Store, search: f64, verified: Option<f64>, heldout: Option<f64>) -> i64 {
    let (run, seed_id) = run_with_seed(st, NodeStatus::Solved);
    let cand = ksearch_core::protocol::Candidate {
        lang: ksearch_core::protocol::Lang::Cpp,
        source: "extern \"C\" void k() {}\n".into(),
        launches: vec![],
        scratch: vec![],
        defines: Default::default(),
        options: Default::default(),
    };
    let key = st.put_candidate("rows", &cand).unwrap();
    let action = Action::Adopt {
        kernel: "rows".into(),
        config: Default::default(),
    };
    let mut best = Node::new(0, Some(seed_id), action, None, Assessment::default(), 1);
    best.id = st.insert_node(run, &best).unwrap();
    best.status = NodeStatus::Solved;
    best.speedup = Some(search);
    best.candidate = Some(key);
    st.update_node(&best).unwrap();
    st.set_run_best(run, best.id, search).unwrap();
    let report = serde_json::json!({
        "run": run, "task": "softmax", "backend": "cpu", "device": "test cpu",
        "rounds": 4, "evaluations": 10, "stop_reason": "round budget reached",
        "best_node": verified.map(|_| best.id), "best_action": "adopt rows",
        "seed_us": [10.0], "best_us": [10.0 / verified.unwrap_or(1.0)], "workloads": ["rows=4 cols=8"],
        "speedup": verified, "search_speedup": search,
        "heldout": heldout.map(|h| serde_json::json!({"passed": true, "workloads": ["rows=8 cols=8"], "speedup": h, "message": null})),
        "retimed": [{"node": best.id, "search": search, "verified": verified}],
        "spread": 0.05,
    });
    st.set_run_report(run, &report).unwrap();
    st.set_run_status(run, "done", Some("round budget reached")).unwrap();
    run
}

#[test]
fn a_best_slower_than_the_seed_once_re_timed_is_no_result_everywhere() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    {
        let st = Store::open(&s).unwrap();
        finished_run(&st, 2.31, Some(0.86), Some(1.2)); // run 1: slower once re-timed
        finished_run(&st, 9.26, Some(6.24), Some(5.0)); // run 2: a result
        finished_run(&st, 1.5, None, None); // run 3: nothing faster than the seed
        finished_run(&st, 3.0, Some(2.5), Some(0.22)); // run 4: slower on held-out workloads
        // run 5: its seed failed, as the search records it (a failed seed node, no report)
        let (run, _) = run_with_seed(&st, NodeStatus::Failed);
        st.set_run_status(
            run,
            "failed",
            Some("seed failed: kernel process exited with code 3 while running"),
        )
        .unwrap();
    }
    let o = ks(&s).arg("runs").output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let text = out(&o);
    let line = |id: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("no run {id} in {text}"))
            .to_string()
    };
    let l1 = line("1");
    assert!(
        l1.contains("done_no_result") && l1.contains("no result (re-timed 0.86x, in search 2.31x)"),
        "{l1}"
    );
    let l2 = line("2");
    assert!(l2.contains("best 6.24x verified (in search 9.26x)"), "{l2}");
    assert!(!l2.contains("no_result"), "{l2}");
    assert!(line("3").contains("no result"), "{text}");
    assert!(line("4").contains("no result (re-timed 2.50x"), "{text}");

    // `tree` labels its node figures and carries the verified one where a node was re-timed.
    let o = ks(&s).args(["tree", "1"]).output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let t = out(&o);
    let head = t.lines().next().unwrap_or("");
    assert!(
        head.contains("done_no_result") && head.contains("no result (re-timed 0.86x, in search 2.31x)"),
        "{t}"
    );
    assert!(t.contains("speed-ups: as measured in the search"), "{t}");
    assert!(t.contains("2.31x (re-timed 0.86x)"), "{t}");

    // `best` answers alike: exit 1 and the same message for every run without a result.
    for (run, why) in [
        ("1", "no result: no candidate faster than the seed once re-timed (best 0.86x)"),
        ("3", "no result: no candidate faster than the seed"),
        ("4", "slower than the seed on the held-out ones (0.22x)"),
        ("5", "no result: seed failed: kernel process exited with code 3"),
    ] {
        let o = ks(&s).args(["best", run]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "best {run}: {}", out(&o));
        assert!(out(&o).contains(why), "best {run}: {}", out(&o));
        assert_eq!(out(&o).trim().lines().count(), 1, "{}", out(&o));
    }
    // --json carries the same verdict and exit code.
    let o = ks(&s).args(["best", "1", "--json"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["no_result"], "no candidate faster than the seed once re-timed (best 0.86x)");
    let o = ks(&s).args(["best", "2", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["no_result"].is_null() && v["speedup"] == 6.24, "{v}");
    let o = ks(&s).args(["best", "2"]).output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    assert!(
        out(&o).contains("6.24x (verified: final re-timing); in-search figure 9.26x"),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("held-out: passed, 5.00x"), "{}", out(&o));
}

/// A finished run's summary (shown again by `resume`) says no result, with the same message
/// and exit 1, and never calls a held-out result slower than the seed a pass.
#[test]
fn the_summary_of_a_finished_run_tells_the_same_story() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    {
        let st = Store::open(&s).unwrap();
        finished_run(&st, 2.31, Some(0.86), None);
        finished_run(&st, 3.0, Some(2.5), Some(0.22));
        finished_run(&st, 9.26, Some(6.24), Some(5.0));
    }
    let o = ks(&s).args(["resume", "1"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(
        out(&o).contains("no result: no candidate faster than the seed once re-timed (best 0.86x)"),
        "{}",
        out(&o)
    );
    let o = ks(&s).args(["resume", "2"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    let text = out(&o);
    assert!(
        text.contains("held-out validation: correct on 1 workloads but slower than the seed (0.22x)"),
        "{text}"
    );
    assert!(!text.contains("validation: passed"), "{text}");
    let o = ks(&s).args(["resume", "3"]).output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let text = out(&o);
    assert!(
        text.contains("6.24x (verified") && text.contains("in-search figure 9.26x"),
        "{text}"
    );
    assert!(text.contains("held-out validation: passed on 1 workloads (5.00x)"), "{text}");
    assert!(!text.contains("no result"), "{text}");
}

/// Timings that spread widely are taken again with more repetitions and, still noisy, said so
/// in one line.
#[test]
fn bench_says_when_its_timings_are_noisy() {
    let d = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf();
    let k = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/noisy/softmax_noisy.cpp");
    let o = ks(&d.path().join("s.db"))
        .current_dir(&repo)
        .args(["bench", "softmax", k.to_str().unwrap(), "--backend", "cpu"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let text = out(&o);
    let noisy: Vec<&str> = text.lines().filter(|l| l.starts_with("timings noisy: spread ")).collect();
    assert_eq!(noisy.len(), 1, "{text}");
    assert!(
        noisy[0].contains("machine busy?") && noisy[0].contains("timed again with 3x the repetitions"),
        "{text}"
    );
}
