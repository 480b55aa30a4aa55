//! Opening and migrating stores, and the rows of a run's finishing step.

use std::path::Path;

use ksearch_core::protocol::{EvalReply, FailureClass, Timing, WorkloadResult};
use ksearch_core::tree::{Action, Assessment, Node};
use ksearch_store::{SCHEMA_VERSION, Store, StoreError};
use rusqlite::Connection;

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

#[test]
fn many_connections_opening_one_new_store_at_once_all_succeed() {
    for k in 0..3 {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(format!("s{k}.db"));
        let start = std::sync::Arc::new(std::sync::Barrier::new(20));
        let hs: Vec<_> = (0..20)
            .map(|_| {
                let (p, start) = (p.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    Store::open(&p)
                        .map(|s| s.schema_version().unwrap())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), Ok(SCHEMA_VERSION));
        }
        let c = Connection::open(&p).unwrap();
        let mode: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
        let tables: i64 = c
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN
                 ('runs', 'nodes', 'candidates', 'evaluations', 'eval_workloads', 'artifacts', 'llm_calls')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 7);
    }
}

/// A store written by a newer ksearch: refused in one line naming it, not a byte changed,
/// nothing left beside it. Once in the rollback-journal mode SQLite starts files in (where
/// switching to WAL would rewrite the header), once already in WAL mode.
#[test]
fn a_newer_store_is_refused_and_left_byte_identical() {
    for wal in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("new.db");
        {
            let c = Connection::open(&p).unwrap();
            if wal {
                c.pragma_update(None, "journal_mode", "WAL").unwrap();
            }
            c.execute_batch("CREATE TABLE future (x INTEGER); INSERT INTO future VALUES (1);")
                .unwrap();
            c.pragma_update(None, "user_version", SCHEMA_VERSION + 5).unwrap();
        }
        let before = bytes(&p);
        for e in [Store::open(&p).err().unwrap(), Store::open_read_only(&p).err().unwrap()] {
            assert!(matches!(e, StoreError::TooNew { .. }), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&p.display().to_string()) && msg.contains("newer"), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        assert!(before == bytes(&p), "the newer store was changed (wal: {wal})");
        let left: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(left, vec!["new.db".to_string()], "wal: {wal}");
    }
}

fn timed(us: f64) -> EvalReply {
    let mut r = EvalReply::failed(1, FailureClass::Wrong, "x");
    r.failure = None;
    r.workloads.push(WorkloadResult {
        label: "rows=8".into(),
        timing: Some(Timing {
            median_us: us,
            min_us: us,
            spread: 0.01,
            reps: 5,
        }),
        ..Default::default()
    });
    r
}

fn purposes(s: &Store, run: i64) -> Vec<(Option<i64>, String, f64)> {
    s.evaluations(run, None)
        .unwrap()
        .into_iter()
        .map(|e| {
            let us = e.reply.workloads[0].timing.as_ref().unwrap().median_us;
            (e.node_id, e.purpose, us)
        })
        .collect()
}

fn workload_rows(p: &Path) -> i64 {
    let c = Connection::open(p).unwrap();
    c.query_row("SELECT count(*) FROM eval_workloads", [], |r| r.get(0)).unwrap()
}

/// A finishing step killed during held-out validation and done again by `resume`: the rows
/// of the killed phase are replaced, not kept beside the new ones, and not counted twice;
/// within one phase every row stays (the seed is re-timed once per candidate).
#[test]
fn final_phase_rows_are_replaced_by_a_later_phase_not_duplicated() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("s.db");
    let (run, seed, a, b);
    {
        let s = Store::open(&p).unwrap();
        run = s
            .create_run(
                "softmax",
                ksearch_core::Backend::Cpu,
                "offline",
                1,
                "",
                &serde_json::json!({}),
            )
            .unwrap();
        let n = |parent| Node::new(0, parent, Action::Seed, None, Assessment::default(), 0);
        seed = s.insert_node(run, &n(None)).unwrap();
        a = s.insert_node(run, &n(Some(seed))).unwrap();
        b = s.insert_node(run, &n(Some(seed))).unwrap();
        s.insert_evaluation(run, Some(seed), None, 0, "seed", &timed(10.0), 1.0)
            .unwrap();
        s.insert_evaluation(run, Some(a), None, 1, "search", &timed(5.0), 1.0)
            .unwrap();
        // The first finish: seed and a, seed and b re-timed, then held-out for a... killed.
        for (node, us) in [(seed, 11.0), (a, 6.0), (seed, 12.0), (b, 7.0), (seed, 13.0)] {
            s.insert_evaluation(run, Some(node), None, 3, "final", &timed(us), 1.0)
                .unwrap();
        }
        s.insert_evaluation(run, Some(seed), None, 3, "heldout", &timed(14.0), 1.0)
            .unwrap();
        assert_eq!(s.count_evaluations(run).unwrap(), 8);
    }
    // resume: the whole finishing step again, in a new process (a new handle).
    let mut s = Store::open(&p).unwrap();
    for (node, us) in [(seed, 21.0), (a, 16.0), (seed, 22.0), (b, 17.0)] {
        s.insert_evaluation(run, Some(node), None, 3, "final", &timed(us), 1.0)
            .unwrap();
    }
    s.insert_evaluation(run, Some(seed), None, 3, "heldout", &timed(24.0), 1.0)
        .unwrap();
    s.insert_evaluation(run, Some(a), None, 3, "heldout", &timed(26.0), 1.0)
        .unwrap();
    s.insert_evaluation(run, None, None, 3, "baseline", &timed(30.0), 1.0)
        .unwrap();
    let want = vec![
        (Some(seed), "seed".to_string(), 10.0),
        (Some(a), "search".to_string(), 5.0),
        (Some(seed), "final".to_string(), 21.0),
        (Some(a), "final".to_string(), 16.0),
        (Some(seed), "final".to_string(), 22.0),
        (Some(b), "final".to_string(), 17.0),
        (Some(seed), "heldout".to_string(), 24.0),
        (Some(a), "heldout".to_string(), 26.0),
        (None, "baseline".to_string(), 30.0),
    ];
    assert_eq!(purposes(&s, run), want);
    assert_eq!(s.count_evaluations(run).unwrap(), 9);
    assert_eq!(workload_rows(&p), 9, "the replaced rows' workloads went with them");

    // A later finish through the same handle starts its own phase.
    s.new_phase();
    s.insert_evaluation(run, None, None, 5, "baseline", &timed(31.0), 1.0)
        .unwrap();
    let got = purposes(&s, run);
    assert_eq!(got.len(), 9);
    assert_eq!(got.last().unwrap(), &(None, "baseline".to_string(), 31.0));
    // Inside a transaction the replacement is part of it: rolled back, nothing changed.
    let r: ksearch_store::Result<()> = s.atomic(|s| {
        s.insert_evaluation(run, Some(a), None, 5, "final", &timed(99.0), 1.0)?;
        Err(StoreError::NoRun(0))
    });
    assert!(r.is_err());
    assert_eq!(purposes(&s, run), got);
}
