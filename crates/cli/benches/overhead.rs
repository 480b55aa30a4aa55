//! The engine's own overhead per evaluation: everything except compiling and running the
//! kernel (planning, selection, the worker round trip, input generation, the reference, the
//! checks, the store's transactions). Runs a real search on a tiny task twice — the second time
//! every candidate is already compiled — and reports
//! `(wall time of the run - compile time - kernel time) / evaluations` from the store.
//!
//!     cargo bench -p ksearch --bench overhead

use std::path::Path;
use std::process::Command;
use std::time::Instant;

fn main() {
    let exe = env!("CARGO_BIN_EXE_ksearch");
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let task = here.join("tests/fixtures/tiny");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("s.db");
    let mut results = Vec::new();
    for (pass, flush) in [("cold cache", true), ("warm cache", true), ("warm, no flush", false)] {
        let cfg = dir.path().join("ksearch.toml");
        std::fs::write(
            &cfg,
            format!("[eval]\nflush = {flush}\nmin_reps = 5\nmax_reps = 5\ntarget_ms = 0.0\n"),
        )
        .expect("config");
        let t = Instant::now();
        let st = Command::new(exe)
            .current_dir(dir.path())
            .args([
                "--quiet",
                "--config",
                cfg.to_str().unwrap(),
                "--store",
                store.to_str().unwrap(),
                "run",
            ])
            .arg(&task)
            .args(["--rounds", "30", "--patience", "100"])
            .output()
            .expect("run ksearch");
        let wall = t.elapsed().as_secs_f64();
        assert!(st.status.code().is_some(), "ksearch died");
        let s = ksearch_store::Store::open(&store).expect("store");
        let runs = s.runs().expect("runs");
        let run = runs.last().expect("a run");
        let evals = s.evaluations(run.id, None).expect("evaluations");
        let compile: f64 = evals.iter().map(|e| e.reply.compile.seconds).sum();
        let kernel: f64 = evals.iter().map(|e| e.reply.kernel_s).sum();
        let n = evals.len() as f64;
        let per = (wall - compile - kernel) / n * 1e3;
        results.push((pass, n, wall, compile, kernel, per));
    }
    println!(
        "{:<16} {:>6} {:>9} {:>10} {:>9} {:>22}",
        "pass", "evals", "wall s", "compile s", "kernel s", "overhead ms / eval"
    );
    for (p, n, w, c, k, per) in results {
        println!("{p:<16} {n:>6} {w:>9.2} {c:>10.2} {k:>9.3} {per:>22.2}");
    }
    println!("(overhead includes process start, worker start and the final re-timing; target: < 20 ms)");
}
