//! `ksearch report`: the HTML page of a real CPU run (every node, the data embedded, nothing
//! fetched from the network), `--watch` following the run while it runs, the read-only and
//! error behaviour, and the page in a real headless Chromium (`scripts/browser-check.py`, driven
//! by Playwright with the interpreter in `KSEARCH_PYTHON`). Without Chromium or Playwright the
//! browser part is skipped with its reason, unless `KSEARCH_REQUIRE_BROWSER=1` (scripts/test.sh),
//! where it fails.

mod support;

use assert_cmd::Command;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use ksearch_store::Store;

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

fn spawn(store: &Path, args: &[&str]) -> Child {
    std::process::Command::new(assert_cmd::cargo::cargo_bin("ksearch"))
        .current_dir(repo())
        .arg("--store")
        .arg(store)
        .arg("--quiet")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Wait for a child, killing it (and failing) if it is still there after `limit`: a guard
/// against a hang, not a measurement.
fn wait_or_kill(mut c: Child, limit: Duration, what: &str) -> std::process::Output {
    let t0 = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return c.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            panic!("{what} did not end: {}\n{}", stdout(&o), stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The JSON the page embeds.
fn embedded(html: &str) -> serde_json::Value {
    let start = html.find("id=\"ksearch-data\">").expect("data embedded") + "id=\"ksearch-data\">".len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).expect("embedded data is JSON")
}

fn status_in(html: &str) -> String {
    let start = html.find("<span id=\"run-status\">").expect("status shown") + "<span id=\"run-status\">".len();
    html[start..start + html[start..].find('<').unwrap()].to_string()
}

/// The browser check; `false`: skipped (with the reason printed). With `KSEARCH_REPORT_KEEP`
/// set to a folder, the page is copied there to be looked at.
fn browser_check(page: &Path, nodes: usize, evals: usize, shot: Option<&Path>) -> bool {
    if let Ok(keep) = std::env::var("KSEARCH_REPORT_KEEP") {
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::copy(page, Path::new(&keep).join(page.file_name().unwrap())).unwrap();
    }
    let py = std::env::var("KSEARCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut c = std::process::Command::new(&py);
    c.arg(repo().join("scripts/browser-check.py")).arg(page).args([
        "--nodes",
        &nodes.to_string(),
        "--evaluations",
        &evals.to_string(),
    ]);
    if let Some(s) = shot {
        c.arg("--screenshot").arg(s);
    }
    let o = c.output().unwrap_or_else(|e| panic!("cannot start {py}: {e}"));
    let text = format!("{}{}", stdout(&o), stderr(&o));
    if o.status.code() == Some(3) {
        if std::env::var("KSEARCH_REQUIRE_BROWSER").as_deref() == Ok("1") {
            panic!("KSEARCH_REQUIRE_BROWSER=1 but the browser check cannot run: {text}");
        }
        eprintln!("skipping the browser check: {}", text.trim());
        return false;
    }
    assert!(o.status.success(), "browser check failed:\n{text}");
    assert!(text.contains("ok ("), "{text}");
    true
}

#[test]
fn the_report_of_a_cpu_run_shows_every_node_follows_the_run_and_works_in_a_browser() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("store").join("s.db");
    let out = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let page = out.join("run.html");
    let run = spawn(
        &s,
        &["run", "softmax", "--backend", "cpu", "--rounds", "4", "--max-reps", "5"],
    );
    // Follow it with --watch as soon as the run is in the store.
    let t0 = Instant::now();
    while Store::open_read_only(&s).and_then(|st| st.run(1)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(300), "the run never appeared in the store");
        std::thread::sleep(Duration::from_millis(100));
    }
    let watch = spawn(&s, &["report", "1", "-o", page.to_str().unwrap(), "--watch"]);
    while !page.exists() {
        assert!(t0.elapsed() < Duration::from_secs(300), "--watch wrote nothing");
        std::thread::sleep(Duration::from_millis(100));
    }
    let first = std::fs::read_to_string(&page).unwrap();
    // A page written while the run runs reloads itself; one written after it ended does not.
    assert_eq!(
        status_in(&first) == "running",
        first.contains("http-equiv=\"refresh\""),
        "{}",
        status_in(&first)
    );
    let r = wait_or_kill(run, Duration::from_secs(900), "the run");
    assert!(r.status.success(), "{}\n{}", stdout(&r), stderr(&r));
    let w = wait_or_kill(watch, Duration::from_secs(120), "report --watch after the run ended");
    assert!(w.status.success(), "{}", stderr(&w));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        !html.contains("http-equiv=\"refresh\""),
        "the final page must not reload itself"
    );
    assert_eq!(status_in(&html), "done");

    // The same page without --watch, from the store opened read-only: only the output file
    // is created.
    let listing = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let store_dir = s.parent().unwrap();
    let before = listing(store_dir);
    let page2 = out.join("again.html");
    let o = ks(&s).args(["report", "1", "-o", page2.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(listing(store_dir), before, "report changed the store's folder");
    assert_eq!(listing(&out), vec!["again.html".to_string(), "run.html".to_string()]);
    let again = std::fs::read_to_string(&page2).unwrap();
    assert_eq!(
        again.replace(char::is_whitespace, ""),
        html.replace(char::is_whitespace, ""),
        "the watched page's last version is the page of the finished run"
    );

    // Every node of the run, and the data the plots are drawn from, are in the page.
    let st = Store::open_read_only(&s).unwrap();
    let nodes = st.nodes(1).unwrap();
    let evals: Vec<_> = st
        .evaluations(1, None)
        .unwrap()
        .into_iter()
        .filter(|e| e.purpose == "seed" || e.purpose == "search")
        .collect();
    assert!(
        nodes.len() > 3 && evals.len() >= 4,
        "{} nodes, {} evaluations",
        nodes.len(),
        evals.len()
    );
    for n in &nodes {
        assert!(html.contains(&format!("id=\"node-{}\"", n.id)), "node {} missing", n.id);
    }
    assert_eq!(html.matches("<details class=\"node ").count(), nodes.len());
    let data = embedded(&html);
    assert_eq!(data["node_count"], nodes.len());
    let points = data["evaluations"].as_array().unwrap();
    assert_eq!(points.len(), evals.len());
    for (p, e) in points.iter().zip(&evals) {
        assert_eq!(p["eval"], e.id);
        assert_eq!(p["ok"], e.reply.ok());
    }
    // The best-so-far curve never falls, and passing candidates sit on the roofline.
    let best: Vec<f64> = points.iter().filter_map(|p| p["best"].as_f64()).collect();
    assert!(best.windows(2).all(|w| w[1] >= w[0]), "{best:?}");
    assert!(points.iter().any(|p| p["intensity"].as_f64().is_some_and(|x| x > 0.0)));
    assert!(
        data["roofs"]["bandwidth_gbs"].as_f64().is_some_and(|b| b > 0.0),
        "{}",
        data["roofs"]
    );

    // Self-contained: no script or style fetched from anywhere.
    let lower = html.to_lowercase();
    for bad in [
        "<script src",
        "<link",
        "src=\"http",
        "href=\"http",
        "src='http",
        "href='http",
        "url(http",
        "@import",
    ] {
        assert!(!lower.contains(bad), "the page refers to something outside it: {bad}");
    }
    assert!(html.contains("Chart.js v4"), "Chart.js is inlined");

    // The header says what `ksearch runs` says of the run.
    let runs = stdout(&ks(&s).arg("runs").output().unwrap());
    let figure = runs.lines().next().unwrap();
    let figure = figure[figure.find("  best ").or_else(|| figure.find("  no result")).expect(figure) + 2..]
        .rsplit_once("  ")
        .unwrap()
        .0
        .to_string();
    assert!(html.contains(&figure), "header lacks `{figure}`");
    assert!(html.contains("none (offline planner)"), "offline runs have no LLM calls");

    // A symbolic link or a named pipe at the output path is written through, never replaced.
    let target = d.path().join("target.html");
    std::fs::write(&target, "old").unwrap();
    let link = out.join("link.html");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = ks(&s).args(["report", "1", "-o", link.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(),
        "the link was replaced"
    );
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        again,
        "the page went through the link"
    );
    let fifo = d.path().join("pipe");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|st| st.success()) {
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
        };
        let o = ks(&s).args(["report", "1", "-o", fifo.to_str().unwrap()]).output().unwrap();
        if !o.status.success() {
            let _ = std::fs::write(&fifo, ""); // the reader is not left waiting
        }
        assert!(o.status.success(), "{}", stderr(&o));
        let t0 = Instant::now();
        while !reader.is_finished() {
            // A pipe replaced by a file would leave the reader waiting for ever.
            assert!(t0.elapsed() < Duration::from_secs(60), "nothing came through the pipe");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(reader.join().unwrap(), again, "the page went through the pipe");
        use std::os::unix::fs::FileTypeExt;
        assert!(
            std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(),
            "the pipe was replaced"
        );
    }

    browser_check(&page, nodes.len(), evals.len(), None);
}

#[test]
fn unknown_runs_and_missing_stores_are_one_line_errors() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("none").join("s.db");
    let page = d.path().join("r.html");
    let o = ks(&missing)
        .args(["report", "1", "-o", page.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains(&missing.display().to_string()), "{}", stderr(&o));
    assert!(!missing.parent().unwrap().exists() && !page.exists(), "nothing is created");

    // A real (empty) store: the run is not there.
    let s = d.path().join("s.db");
    drop(Store::open(&s).unwrap());
    let o = ks(&s)
        .args(["report", "7", "-o", page.to_str().unwrap(), "--watch"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o).trim(),
        format!("error: no run 7 in {}", s.display()),
        "{}",
        stderr(&o)
    );
    assert!(!page.exists());
}

/// A planner action as the scripted planner proposes it.
fn action(title: &str) -> serde_json::Value {
    json!({
        "title": title,
        "description": format!("{title}: rewrite the row loop"),
        "pattern": "vectorised-loads",
        "overall": 7.0, "confidence": 0.6,
        "bandwidth": {"rating": 8, "note": "fewer passes"},
        "registers": {"rating": 7, "note": "8 accumulators"},
        "hw_fit": {"rating": 8, "note": "AVX2 lanes"},
        "difficulty": 2, "prior": 0.6
    })
}

/// A run with the LLM planner against a scripted OpenAI-compatible server on 127.0.0.1 whose
/// coder writes a kernel that does not compile every other time: the page lists every call
/// with the total cost, and the failures with their class and first line.
#[test]
fn an_llm_run_shows_its_calls_their_cost_and_its_failures() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use support::{Kind, Reply, Server};
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s.db");
    let coder_calls = AtomicUsize::new(0);
    let srv = Server::new(move |r, _| match r.kind {
        Kind::Init => {
            let v = json!({
                "classification": "memory-bound row reduction",
                "reference_rewrite": "max, sum of exp, scale",
                "bottlenecks": ["scalar exp"],
                "families": ["vectorised three-pass"],
                "actions": [action("vectorise"), action("two threads"), action("wider vectors")]
            });
            Reply::completion(&format!("```json\n{v}\n```"))
        }
        Kind::Update => Reply::completion(&json!({"analysis": "measured", "ops": []}).to_string()),
        Kind::Coder | Kind::Repair { .. } => {
            let src = if coder_calls.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
                "#include <cstddef>\nextern \"C\" void softmax(const float* x, float* y) { this_does_not_compile(); }\n"
                    .to_string()
            } else {
                let simd = std::fs::read_to_string(repo().join("tasks/softmax/cpu/rows_simd.cpp")).unwrap();
                format!("#define VEC 8\n#define FASTEXP 1\n#define ONLINE 0\n#define THREADS 1\n{simd}")
            };
            Reply::completion(&format!("```cpp\n{src}```"))
        }
        _ => Reply::completion("?"),
    });
    let cfg = d.path().join("ksearch.toml");
    std::fs::write(
        &cfg,
        format!(
            "[llm]\nbase_url = \"{}\"\nmodel = \"scripted-model\"\napi_key_env = \"KSEARCH_TEST_REPORT_KEY\"\nmax_retries = 1\nbackoff_base_s = 0.0\nmax_backoff_s = 0.0\ntimeout_s = 20.0\nprice_prompt_per_mtok = 2.0\nprice_completion_per_mtok = 10.0\n",
            srv.base_url()
        ),
    )
    .unwrap();
    let o = ks(&store)
        .env("KSEARCH_TEST_REPORT_KEY", "sk-test-report")
        .env_remove("OPENAI_API_KEY")
        .arg("--config")
        .arg(&cfg)
        .args([
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--planner",
            "llm",
            "--rounds",
            "4",
            "--max-reps",
            "3",
        ])
        .timeout(Duration::from_secs(600))
        .output()
        .unwrap();
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}\n{}", stdout(&o), stderr(&o));
    let page = d.path().join("llm.html");
    let r = ks(&store)
        .args(["report", "1", "-o", page.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", stderr(&r));
    let html = std::fs::read_to_string(&page).unwrap();

    let st = Store::open_read_only(&store).unwrap();
    let calls = st.llm_calls(1, None).unwrap();
    assert!(calls.iter().any(|c| c.role == "coder") && calls.iter().any(|c| c.role == "planner"));
    assert_eq!(html.matches("<tr class=\"call\">").count(), calls.len());
    let total: f64 = calls.iter().map(|c| c.cost_usd).sum();
    assert!(total > 0.0);
    assert!(
        html.contains(&format!("<b id=\"llm-cost\">${total:.4}</b>")),
        "total cost ${total:.4} not shown"
    );
    assert!(html.contains("scripted-model") && !html.contains("llm-none"));
    // The failed candidates: their class counted, and on their nodes the class and first line.
    let nodes = st.nodes(1).unwrap();
    let failed: Vec<_> = nodes.iter().filter(|n| n.failure.is_some()).collect();
    assert!(!failed.is_empty(), "no candidate failed: {}", stdout(&o));
    let data = embedded(&html);
    assert!(
        data["failures"]["compile"].as_u64().is_some_and(|n| n >= 1),
        "{}",
        data["failures"]
    );
    assert!(html.contains("<canvas id=\"chart-failures\">"));
    let shown: Vec<&str> = html
        .split("<code>compile</code> ")
        .skip(1)
        .map(|t| &t[..t.find('<').unwrap()])
        .collect();
    assert!(
        shown.iter().any(|l| l.contains("this_does_not_compile")),
        "the compiler's first line names the bad call: {shown:?}"
    );
    let evals = st
        .evaluations(1, None)
        .unwrap()
        .into_iter()
        .filter(|e| e.purpose == "seed" || e.purpose == "search")
        .count();
    browser_check(&page, nodes.len(), evals, None);
}
