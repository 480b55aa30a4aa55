//! The LLM planner end to end: the real `ksearch` binary, the CPU back-end, a real store, and a
//! scripted OpenAI-compatible server on 127.0.0.1 standing in for the planner and coder models.
//! No timing assertions: "faster" is the run's own measured speed-up in the store.

mod quick;
mod support;

use assert_cmd::Command;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ksearch_store::Store;
use support::{Base, Kind, Reply, Req, Server};

const KEY: &str = "sk-test-0123456789-SECRET-do-not-store";
const KEY_VAR: &str = "KSEARCH_TEST_LLM_KEY";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// A ksearch.toml for the scripted server (extra `[llm]` lines appended).
fn config(dir: &Path, base_url: &str, extra: &str) -> PathBuf {
    let p = dir.join(format!("ksearch-{}.toml", rand_name()));
    std::fs::write(
        &p,
        format!(
            "[llm]\nbase_url = \"{base_url}\"\nmodel = \"scripted-model\"\napi_key_env = \"{KEY_VAR}\"\nmax_retries = 1\nbackoff_base_s = 0.0\nmax_backoff_s = 0.0\ntimeout_s = 20.0\n{extra}\n"
        ),
    )
    .unwrap();
    p
}

fn rand_name() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

thread_local! {
    /// Set by the tests whose subject is the LLM plumbing alone (they accept a run with or
    /// without a result): their runs search the quick tasks (`quick`), the CPU softmax at an
    /// eighth of its elements. The others, which assert a speed-up, search the real shapes.
    static QUICK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This test's runs search the quick tasks.
fn plumbing_only() {
    QUICK.with(|q| q.set(true));
}

/// `--tasks-dir` of the quick tasks where this test asked for them.
fn tasks_for_this_test(c: &mut Command) {
    if QUICK.with(|q| q.get()) {
        c.arg("--tasks-dir").arg(quick::tasks());
    }
}

fn ks(store: &Path, cfg: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(repo())
        .env(KEY_VAR, KEY)
        .env_remove("OPENAI_API_KEY")
        .env_remove("RUST_LOG")
        .arg("--store")
        .arg(store)
        .arg("--config")
        .arg(cfg)
        .arg("--quiet")
        .timeout(Duration::from_secs(240));
    tasks_for_this_test(&mut c);
    c
}

fn out(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `ksearch run softmax --planner llm ...` and the run id; asserts exit 0 or 1 and no panic.
fn run(store: &Path, cfg: &Path, extra: &[&str]) -> (i64, std::process::Output) {
    let o = ks(store, cfg)
        .args(["run", "softmax", "--backend", "cpu", "--planner", "llm", "--max-reps", "3"])
        .args(extra)
        .output()
        .unwrap();
    check_exit(&o);
    let s = Store::open(store).unwrap();
    let id = s.runs().unwrap().iter().map(|r| r.id).max().expect("a run was created");
    (id, o)
}

fn check_exit(o: &std::process::Output) {
    let text = out(o);
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// The candidate a scripted coder writes: the task's vectorised softmax with its tunables as
/// `#define`s in front.
fn fast_softmax(vec: u32, fastexp: u32) -> String {
    let src = std::fs::read_to_string(repo().join("tasks/softmax/cpu/rows_simd.cpp")).unwrap();
    format!("#define VEC {vec}\n#define FASTEXP {fastexp}\n#define ONLINE 0\n#define THREADS 1\n{src}")
}

fn action(title: &str) -> Value {
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

fn init_reply() -> String {
    let v = json!({
        "classification": "memory-bound row reduction, ~1 flop/byte",
        "reference_rewrite": "one thread per row block; max, sum of exp, scale",
        "bottlenecks": ["scalar std::exp", "three passes over the row"],
        "families": ["vectorised three-pass", "online softmax"],
        "actions": [action("vectorise with polynomial exp"), action("online softmax"), action("two threads over rows")]
    });
    format!("Here is my plan.\n```json\n{v}\n```")
}

fn update_reply(r: &Req) -> String {
    let n = r.evaluated_node().unwrap_or(0);
    let mut follow = action(&format!("wider vectors after node {n}"));
    follow["title"] = json!(format!("wider vectors after node {n}"));
    json!({
        "analysis": "the vectorised exp removed the bottleneck",
        "ops": [
            {"op": "update", "node": n, "overall": 8.5, "confidence": 0.9, "reason": "measured"},
            {"op": "insert", "parent": n, "action": follow}
        ]
    })
    .to_string()
}

fn code(src: &str) -> String {
    format!("Here is the candidate:\n```cpp\n{src}```\nI vectorised the loops.")
}

/// The well-behaved server: a plan, faster code, sensible updates.
fn good_handler(r: &Req, i: usize) -> Reply {
    match r.kind {
        Kind::Init => Reply::completion(&init_reply()),
        Kind::Update => Reply::completion(&update_reply(r)),
        Kind::Coder => {
            let (v, f) = [(8, 1), (16, 1), (4, 1), (8, 0)][i % 4];
            Reply::completion(&code(&fast_softmax(v, f)))
        }
        _ => Reply::completion("?"),
    }
}

fn calls(store: &Path, run: i64) -> Vec<ksearch_store::LlmCallRow> {
    Store::open(store).unwrap().llm_calls(run, None).unwrap()
}

fn errors(store: &Path, run: i64) -> String {
    calls(store, run)
        .iter()
        .filter_map(|c| c.error.clone())
        .collect::<Vec<_>>()
        .join("\n")
}

/// No byte of the store (and its WAL) holds the API key. Call it with no `Store` of this process
/// open: closing a plain file handle on the database drops the process's SQLite (POSIX) locks.
fn assert_no_key(store: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let p = PathBuf::from(format!("{}{suffix}", store.display()));
        if let Ok(bytes) = std::fs::read(&p) {
            assert!(
                !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
                "the API key is in {}",
                p.display()
            );
        }
    }
}

#[test]
fn llm_run_reaches_a_faster_kernel_and_records_every_call() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s.db");
    let srv = Server::new(good_handler);
    let cfg = config(d.path(), &srv.base_url(), "");
    let (id, o) = run(&store, &cfg, &["--rounds", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
    let s = Store::open(&store).unwrap();
    let row = s.run(id).unwrap();
    assert!(row.status.starts_with("done"), "{}", row.status);
    assert!(
        row.best_speedup.unwrap_or(0.0) > 1.0,
        "best {:?}\n{}",
        row.best_speedup,
        out(&o)
    );
    // The best node is an LLM edit, written by the coder.
    let nodes = s.nodes(id).unwrap();
    let best = nodes.iter().find(|n| Some(n.id) == row.best_node).expect("best node");
    assert!(
        matches!(best.action, ksearch_core::tree::Action::Edit { .. }),
        "{:?}",
        best.action
    );
    // Init: a classification artifact and >= 3 open actions with ratings.
    let init = s.artifacts(id, "planner_init").unwrap();
    assert!(init[0].2.contains("memory-bound row reduction"), "{init:?}");
    assert!(nodes.len() >= 4);
    // Every call is recorded with its node, role, prompt, reply and usage; no errors.
    let c = calls(&store, id);
    assert!(c.iter().any(|c| c.role == "planner") && c.iter().any(|c| c.role == "coder"));
    assert!(
        c.iter().all(|c| c.node_id.is_some() && c.error.is_none()),
        "{:?}",
        errors(&store, id)
    );
    assert!(c.iter().all(|c| c.prompt_tokens == 1000 && c.reply.is_some()));
    let coder = c.iter().find(|c| c.role == "coder").unwrap();
    assert!(coder.prompt.contains("Parent candidate") && coder.prompt.contains("extern \"C\" void softmax"));
    // The key went to the server, not into the store.
    assert!(
        srv.requests()
            .iter()
            .all(|r| r.header("authorization") == Some(&format!("Bearer {KEY}")))
    );
    assert!(srv.requests().iter().any(|r| r.body.get("response_format").is_some()));
    drop(s);
    assert_no_key(&store);
    let cfg_text = row.config.to_string();
    assert!(cfg_text.contains(KEY_VAR) && !cfg_text.contains(KEY));
    // `ksearch log` shows the calls, also per node.
    let o = ks(&store, &cfg).args(["log", &id.to_string()]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success() && text.contains("planner") && text.contains("coder"),
        "{text}"
    );
    let o = ks(&store, &cfg)
        .args(["log", &id.to_string(), "--node", &best.id.to_string()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("coder"));
}

#[test]
fn failure_modes_are_recorded_and_never_crash_the_run() {
    let d = tempfile::tempdir().unwrap();

    // 1. Truncated JSON (repaired), wrong-language code (repaired), an answer that edits solved
    //    nodes (refused by validation).
    let srv = Server::new(|r, i| match r.kind {
        Kind::Init => Reply::completion("{\"classification\": \"row reduction\", \"actions\": [{\"title\": \"vec"),
        Kind::Repair { of: Base::Init } => Reply::completion(&init_reply()),
        Kind::Coder => Reply::completion("```python\nimport numpy as np\ndef softmax(x):\n    return np.exp(x)\n```"),
        Kind::Repair { of: Base::Coder } => Reply::completion(&code(&fast_softmax(8, 1))),
        Kind::Update => {
            let root = r.root_node().unwrap_or(1);
            let n = r.evaluated_node().unwrap_or(1);
            Reply::completion(
                &json!({"analysis": "x", "ops": [
                    {"op": "prune", "node": root, "reason": "seed is slow"},
                    {"op": "split", "node": n, "actions": [action("a"), action("b")]},
                    {"op": "frobnicate", "node": n}
                ]})
                .to_string(),
            )
        }
        _ => good_handler(r, i),
    });
    let store = d.path().join("a.db");
    let (id, _) = run(&store, &config(d.path(), &srv.base_url(), ""), &["--rounds", "1"]);
    let e = errors(&store, id);
    assert!(e.contains("truncated_json"), "{e}");
    assert!(e.contains("wrong_language"), "{e}");
    assert!(e.contains("validation refused") && e.contains("not open"), "{e}");
    let s = Store::open(&store).unwrap();
    assert!(
        s.nodes(id)
            .unwrap()
            .iter()
            .any(|n| n.parent.is_some() && n.speedup.unwrap_or(0.0) > 1.0)
    );
    assert_eq!(
        s.nodes(id)
            .unwrap()
            .iter()
            .find(|n| n.parent.is_none())
            .unwrap()
            .status
            .name(),
        "solved"
    );

    // 2. No code block, ever: the write fails after the repairs, the node records the failure,
    //    a debug action is queued under it.
    let srv = Server::new(|r, i| match r.kind {
        Kind::Coder | Kind::Repair { of: Base::Coder } => Reply::completion("I would vectorise the loop."),
        _ => good_handler(r, i),
    });
    let store = d.path().join("b.db");
    let (id, _) = run(&store, &config(d.path(), &srv.base_url(), ""), &["--rounds", "1"]);
    assert!(errors(&store, id).contains("no_code_block"));
    assert_eq!(srv.count(Kind::Repair { of: Base::Coder }), 2);
    let nodes = Store::open(&store).unwrap().nodes(id).unwrap();
    let failed = nodes.iter().find(|n| n.failure.is_some()).expect("a failed node");
    let ev = Store::open(&store).unwrap().evaluations(id, Some(failed.id)).unwrap();
    assert!(format!("{:?}", ev[0].reply.failure).contains("no candidate written"));
    assert!(
        nodes
            .iter()
            .any(|n| n.parent == Some(failed.id) && n.action.summary().starts_with("debug: fix"))
    );

    // 3. A 429 storm, 4. a hanging server, 5. closed connections: the init falls back to the
    //    knowledge base, every failed call is recorded, the run finishes.
    let cases: Vec<(&str, Reply, &str, &str)> = vec![
        (
            "429",
            Reply::status(
                429,
                vec![("Retry-After".into(), "0".into())],
                json!({"error": {"message": "Rate limit reached"}}),
            ),
            "",
            "429",
        ),
        (
            "hang",
            Reply::Hang(Duration::from_secs(4)),
            "timeout_s = 1.0\nmax_retries = 0",
            "timed out",
        ),
        ("close", Reply::Close, "max_retries = 0", "connection"),
    ];
    for (name, reply, extra, needle) in cases {
        let srv = Server::new(move |_, _| reply.clone());
        let store = d.path().join(format!("{name}.db"));
        // The extra lines override earlier keys: TOML forbids duplicates, so rewrite the file.
        let cfg = config(d.path(), &srv.base_url(), "");
        if !extra.is_empty() {
            let mut t = std::fs::read_to_string(&cfg).unwrap();
            for line in extra.lines() {
                let key = line.split('=').next().unwrap().trim();
                t = t
                    .lines()
                    .filter(|l| !l.starts_with(&format!("{key} ")))
                    .collect::<Vec<_>>()
                    .join("\n");
                t.push('\n');
                t.push_str(line);
                t.push('\n');
            }
            std::fs::write(&cfg, t).unwrap();
        }
        let (id, o) = run(&store, &cfg, &["--rounds", "1"]);
        let e = errors(&store, id);
        assert!(e.to_lowercase().contains(needle), "{name}: {e}\n{}", out(&o));
        let s = Store::open(&store).unwrap();
        assert!(s.run(id).unwrap().status.starts_with("done"), "{name}");
        assert!(s.nodes(id).unwrap().len() > 1, "{name}: no fallback actions");
    }
}

#[test]
fn budget_stops_cleanly_and_resume_continues_also_across_planners() {
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(good_handler);
    let cfg = config(d.path(), &srv.base_url(), "");
    let store = d.path().join("s.db");
    // Init + one coder call: then the budget is spent and the run stops, resumable.
    let (id, o) = run(&store, &cfg, &["--rounds", "3", "--max-llm-calls", "2"]);
    // Stopped without a result: exit 1, resumable.
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ksearch resume"));
    let s = Store::open(&store).unwrap();
    let row = s.run(id).unwrap();
    assert_eq!(row.status, "stopped", "{}", out(&o));
    assert!(row.stop_reason.unwrap_or_default().contains("budget"));
    assert_eq!(calls(&store, id).len(), 2);
    let budget = s.artifacts(id, "llm_budget").unwrap();
    assert!(budget.last().unwrap().2.contains("\"calls\":2"));
    drop(s);
    // Resume with a raised limit: it goes on to the end.
    let o = ks(&store, &cfg)
        .args(["resume", &id.to_string(), "--max-llm-calls", "50"])
        .output()
        .unwrap();
    check_exit(&o);
    let s = Store::open(&store).unwrap();
    let row = s.run(id).unwrap();
    assert!(row.status.starts_with("done"), "{}\n{}", row.status, out(&o));
    assert_eq!(row.round, 3);
    assert!(calls(&store, id).len() > 2);
    drop(s);
    assert_no_key(&store);

    // An LLM tree continued by the offline planner: its LLM edits are skipped, not failed.
    let (id2, _) = run(&store, &cfg, &["--rounds", "3", "--max-llm-calls", "2"]);
    let o = ks(&store, &cfg)
        .args(["resume", &id2.to_string(), "--planner", "offline"])
        .output()
        .unwrap();
    check_exit(&o);
    let nodes = Store::open(&store).unwrap().nodes(id2).unwrap();
    assert!(nodes.iter().all(|n| n.failure.is_none()), "{}", out(&o));
    assert!(nodes.iter().any(|n| n.status.name() == "open"));

    // An offline-made start continued by the LLM planner: no budget at all means the init
    // comes from the knowledge base and the run stops at once; then the LLM planner goes on.
    let (id3, o) = run(&store, &cfg, &["--rounds", "2", "--max-llm-calls", "0"]);
    assert_eq!(
        Store::open(&store).unwrap().run(id3).unwrap().status,
        "stopped",
        "{}",
        out(&o)
    );
    let o = ks(&store, &cfg)
        .args(["resume", &id3.to_string(), "--max-llm-calls", "10"])
        .output()
        .unwrap();
    check_exit(&o);
    let s = Store::open(&store).unwrap();
    assert!(s.run(id3).unwrap().status.starts_with("done"), "{}", out(&o));
    let nodes = s.nodes(id3).unwrap();
    // The knowledge base's actions stay; the LLM planner's initialisation, missing, is done on
    // resume and its actions join them.
    assert!(
        nodes
            .iter()
            .any(|n| matches!(n.action, ksearch_core::tree::Action::Adopt { .. }))
    );
    assert!(nodes.iter().any(|n| n.parent.is_some() && n.speedup.is_some()));
    assert!(!s.artifacts(id3, "planner_init").unwrap().is_empty());
    assert!(
        nodes
            .iter()
            .any(|n| matches!(n.action, ksearch_core::tree::Action::Edit { .. }))
    );
    assert!(calls(&store, id3).iter().any(|c| c.role == "planner" && c.error.is_none()));
}

#[test]
fn a_differently_behaving_server_needs_only_configuration() {
    // Rejects response_format with 400, sends no usage, and is configured by flags only.
    let srv = Server::new(|r, i| {
        if r.body.get("response_format").is_some() {
            return Reply::status(
                400,
                vec![],
                json!({"error": {"message": "response_format is not supported by this model", "type": "invalid_request_error"}}),
            );
        }
        match good_handler(r, i) {
            Reply::Http { body, .. } => {
                let mut v: Value = serde_json::from_str(&body).unwrap();
                v.as_object_mut().unwrap().remove("usage");
                Reply::Http {
                    status: 200,
                    headers: vec![],
                    body: v.to_string(),
                }
            }
            other => other,
        }
    });
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("empty.toml");
    std::fs::write(&cfg, "").unwrap();
    let store = d.path().join("s.db");
    let url = srv.base_url();
    let (id, o) = run(
        &store,
        &cfg,
        &[
            "--rounds",
            "2",
            "--base-url",
            &url,
            "--planner-model",
            "local-planner",
            "--coder-model",
            "local-coder",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
    let c = calls(&store, id);
    assert!(c.iter().all(|c| c.error.is_none()), "{}", errors(&store, id));
    assert!(
        c.iter().all(|c| c.prompt_tokens > 0),
        "token counts are estimated without usage"
    );
    let models: Vec<String> = srv
        .requests()
        .iter()
        .filter_map(|r| r.body["model"].as_str().map(String::from))
        .collect();
    assert!(models.contains(&"local-planner".to_string()) && models.contains(&"local-coder".to_string()));
    assert!(srv.requests().iter().all(|r| r.header("authorization").is_none()));
    assert!(Store::open(&store).unwrap().run(id).unwrap().best_speedup.unwrap_or(0.0) > 1.0);
}

/// A coder that somehow writes the key into its candidate (in a compiler error, so it would
/// also come back in the compile log): the key reaches no later prompt, no store byte and no
/// terminal line; the places it would have been show `[redacted]`. Only the Authorization
/// header carries the key.
#[test]
fn a_secret_reaches_no_prompt_no_store_byte_and_no_terminal_line() {
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s.db");
    let srv = Server::new(move |r: &Req, _i| match r.kind {
        Kind::Init => Reply::completion(&init_reply()),
        Kind::Update => Reply::completion(&update_reply(r)),
        Kind::Coder => Reply::completion(&code(&format!(
            "#include <cstdint>\n#error \"{KEY}\"\nextern \"C\" void softmax(void** bufs, const int64_t* dims) {{}}\n"
        ))),
        _ => Reply::completion("?"),
    });
    let cfg = config(d.path(), &srv.base_url(), "");
    let (_, o) = run(&store, &cfg, &["--rounds", "2"]);
    let text = out(&o);
    assert!(!text.contains(KEY), "the key reached the terminal:\n{text}");
    let reqs = srv.requests();
    assert!(
        reqs.iter().filter(|r| r.kind == Kind::Coder).count() >= 2,
        "a debug round saw the failure"
    );
    for r in &reqs {
        assert!(
            !r.body.to_string().contains(KEY),
            "a request body carries the key: {}",
            r.user
        );
        assert_eq!(r.header("authorization"), Some(format!("Bearer {KEY}").as_str()));
    }
    assert!(
        reqs.iter().any(|r| r.body.to_string().to_lowercase().contains("[redacted]")),
        "the failed candidate came back to the coder, scrubbed"
    );
    assert_no_key(&store);
}

// ----- servers that behave like the ones users meet -----

/// A ksearch.toml with exactly these `[llm]` lines (no key variable named).
fn plain_config(dir: &Path, base_url: &str, extra: &str) -> PathBuf {
    let p = dir.join(format!("ksearch-{}.toml", rand_name()));
    std::fs::write(
        &p,
        format!("[llm]\nbase_url = \"{base_url}\"\nmodel = \"scripted-model\"\nbackoff_base_s = 0.0\n{extra}\n"),
    )
    .unwrap();
    p
}

/// The binary without `--quiet` and with no key variables of the test's own environment.
fn ks_loud(store: &Path, cfg: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(repo())
        .env_remove("OPENAI_API_KEY")
        .env_remove(KEY_VAR)
        .env_remove("RUST_LOG")
        .arg("--store")
        .arg(store)
        .arg("--config")
        .arg(cfg)
        .timeout(Duration::from_secs(240));
    tasks_for_this_test(&mut c);
    c
}

fn softmax_run(c: &mut Command, extra: &[&str]) -> std::process::Output {
    c.args(["run", "softmax", "--backend", "cpu", "--planner", "llm", "--max-reps", "3"])
        .args(extra)
        .output()
        .unwrap()
}

fn last_run(store: &Path) -> i64 {
    Store::open(store)
        .unwrap()
        .runs()
        .unwrap()
        .iter()
        .map(|r| r.id)
        .max()
        .unwrap()
}

/// Like api.openai.com: 401 unless the request carries `Bearer <key>`.
fn keyed_server(key: &'static str) -> Server {
    Server::new(move |r, i| {
        if r.header("authorization") != Some(format!("Bearer {key}").as_str()) {
            return Reply::status(
                401,
                vec![],
                json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}}),
            );
        }
        good_handler(r, i)
    })
}

#[test]
fn openai_api_key_is_used_by_default_and_api_key_env_chooses_another() {
    // The subject is which key is sent: a run that ends with or without a faster kernel (exit
    // 0 or 1) used it; a refused key would stop the run with exit 2.
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let srv = keyed_server(KEY);
    let cfg = plain_config(d.path(), &srv.base_url(), "");
    // OPENAI_API_KEY, as every OpenAI client reads it.
    let store = d.path().join("a.db");
    let o = softmax_run(ks_loud(&store, &cfg).env("OPENAI_API_KEY", KEY), &["--rounds", "1"]);
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", out(&o));
    assert!(
        srv.requests()
            .iter()
            .all(|r| r.header("authorization") == Some(&format!("Bearer {KEY}")))
    );
    assert!(!out(&o).contains(KEY));
    assert!(calls(&store, last_run(&store)).iter().all(|c| c.error.is_none()));
    assert_no_key(&store);
    // --api-key-env names another variable; it wins over OPENAI_API_KEY.
    let store = d.path().join("b.db");
    let o = softmax_run(
        ks_loud(&store, &cfg)
            .env("OPENAI_API_KEY", "sk-wrong-key-0000")
            .env("MY_LLM_KEY", KEY),
        &["--rounds", "1", "--api-key-env", "MY_LLM_KEY"],
    );
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", out(&o));
    let row = Store::open(&store).unwrap().run(last_run(&store)).unwrap();
    assert!(row.config.to_string().contains("MY_LLM_KEY"));
    assert_no_key(&store);
    // And so does `[llm] api_key_env`.
    let cfg2 = plain_config(d.path(), &srv.base_url(), "api_key_env = \"TOML_LLM_KEY\"");
    let store = d.path().join("c.db");
    let o = softmax_run(
        ks_loud(&store, &cfg2)
            .env("OPENAI_API_KEY", "sk-wrong-key-0000")
            .env("TOML_LLM_KEY", KEY),
        &["--rounds", "1"],
    );
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{}", out(&o));
}

#[test]
fn a_refused_key_stops_the_run_with_exit_2_and_names_the_variable() {
    let d = tempfile::tempdir().unwrap();
    let srv = keyed_server(KEY);
    let cfg = plain_config(d.path(), &srv.base_url(), "");
    let store = d.path().join("s.db");
    let wrong = "sk-wrong-key-do-not-print-4242";
    let o = softmax_run(ks_loud(&store, &cfg).env("OPENAI_API_KEY", wrong), &["--rounds", "2"]);
    let text = out(&o);
    assert_eq!(o.status.code(), Some(2), "{text}");
    assert!(text.contains("401") && text.contains("$OPENAI_API_KEY"), "{text}");
    assert!(text.contains("ksearch resume"), "{text}");
    assert!(!text.contains(wrong), "{text}");
    // One request, no retries, no fall-back run on the knowledge base.
    assert_eq!(srv.requests().len(), 1);
    let id = last_run(&store);
    let row = Store::open(&store).unwrap().run(id).unwrap();
    assert_eq!(row.status, "stopped");
    // No key at all: the message says which variable to set.
    let store2 = d.path().join("t.db");
    let o = softmax_run(&mut ks_loud(&store2, &cfg), &["--rounds", "2"]);
    let text = out(&o);
    assert_eq!(o.status.code(), Some(2), "{text}");
    assert!(
        text.contains("no API key was sent") && text.contains("OPENAI_API_KEY"),
        "{text}"
    );
    // With the right key, resume continues the stopped run.
    let o = ks_loud(&store, &cfg)
        .env("OPENAI_API_KEY", KEY)
        .args(["resume", &id.to_string()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
    assert!(Store::open(&store).unwrap().run(id).unwrap().status.starts_with("done"));
    assert_no_key(&store);
}

#[test]
fn a_remote_base_url_without_a_key_is_warned_about() {
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    // Nothing is sent: the budget allows no call.
    let cfg = plain_config(d.path(), "https://llm.example.com/v1", "");
    let store = d.path().join("s.db");
    let o = softmax_run(&mut ks_loud(&store, &cfg), &["--rounds", "1", "--max-llm-calls", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("no API key")).collect();
    assert_eq!(warnings.len(), 1, "{}", out(&o));
    assert!(warnings[0].contains("llm.example.com") && warnings[0].contains("--api-key-env"));
    // A local server needs no key: no warning.
    let srv = Server::new(good_handler);
    let cfg = plain_config(d.path(), &srv.base_url(), "");
    let o = softmax_run(&mut ks_loud(&store, &cfg), &["--rounds", "1", "--max-llm-calls", "0"]);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("no API key"), "{}", out(&o));
}

/// llama.cpp's server through llama-cpp-python: `json_schema` is answered with HTTP 500
/// ("Input should be 'text' or 'json_object'"); `json_object` works.
fn llama_cpp_handler(r: &Req, i: usize) -> Reply {
    if r.body["response_format"]["type"] == "json_schema" {
        return Reply::status(
            500,
            vec![],
            json!({"error": {"message": "1 validation error for CreateChatCompletionRequest\nresponse_format.type\n  Input should be 'text' or 'json_object' [type=literal_error, input_value='json_schema', input_type=str]", "type": "internal_server_error"}}),
        );
    }
    good_handler(r, i)
}

#[test]
fn a_server_that_rejects_json_schema_with_500_is_negotiated_once_and_remembered() {
    // The subject is the negotiation: runs end with or without a faster kernel (exit 0 or 1).
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(llama_cpp_handler);
    let cfg = config(d.path(), &srv.base_url(), "max_tokens = 3000");
    let store = d.path().join("s.db");
    let (id, o) = run(&store, &cfg, &["--rounds", "1"]);
    check_exit(&o);
    assert!(calls(&store, id).iter().all(|c| c.error.is_none()), "{}", errors(&store, id));
    let first = srv.requests();
    let rejected = first
        .iter()
        .filter(|r| r.body["response_format"]["type"] == "json_schema")
        .count();
    // Once for the planner model; afterwards json_object.
    assert_eq!(rejected, 1, "{first:?}");
    // Every request caps its reply.
    assert!(first.iter().all(|r| r.body["max_tokens"] == json!(3000)));
    // The next run against the same server and model starts with json_object.
    let n = first.len();
    let (id2, o) = run(&store, &cfg, &["--rounds", "1"]);
    check_exit(&o);
    let later = &srv.requests()[n..];
    assert!(!later.is_empty());
    assert!(
        later.iter().all(|r| r.body["response_format"]["type"] != "json_schema"),
        "{later:?}"
    );
    assert!(calls(&store, id2).iter().all(|c| c.error.is_none()));
}

/// An OpenAI-compatible proxy that accepts no `response_format` at all (422 naming it) and
/// answers with plain text: the planner gets the schema in its prompt and the run works.
#[test]
fn a_server_that_rejects_every_structured_mode_gets_plain_text() {
    // The subject is the plain-text fall-back: runs end with or without a faster kernel (exit 0 or 1).
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(|r, i| {
        if r.body.get("response_format").is_some() {
            return Reply::status(
                422,
                vec![],
                json!({"detail": [{"type": "extra_forbidden", "loc": ["body", "response_format"], "msg": "Extra inputs are not permitted"}]}),
            );
        }
        good_handler(r, i)
    });
    let cfg = config(d.path(), &srv.base_url(), "");
    let store = d.path().join("s.db");
    let t0 = std::time::Instant::now();
    let (id, o) = run(&store, &cfg, &["--rounds", "1", "--time-budget", "120s"]);
    assert!(t0.elapsed() < Duration::from_secs(130));
    check_exit(&o);
    assert!(calls(&store, id).iter().all(|c| c.error.is_none()), "{}", errors(&store, id));
    let plain: Vec<Req> = srv
        .requests()
        .into_iter()
        .filter(|r| r.kind == Kind::Init && r.body.get("response_format").is_none())
        .collect();
    assert_eq!(plain.len(), 1);
    assert!(plain[0].user.contains("JSON schema") && plain[0].user.contains("\"actions\""));
    // resume (one more round) continues it, in plain text from the first request on.
    let n = srv.requests().len();
    let o = ks(&store, &cfg)
        .args(["resume", &id.to_string(), "--rounds", "2"])
        .output()
        .unwrap();
    check_exit(&o);
    assert_eq!(Store::open(&store).unwrap().run(id).unwrap().round, 2);
    let later = &srv.requests()[n..];
    assert!(!later.is_empty() && later.iter().all(|r| r.body.get("response_format").is_none()));
}

/// A server that accepts the connection and never answers: the run ends within its time
/// budget (+ 10 s), exits as documented (1: no result), says how to continue, and resume
/// continues it.
#[test]
fn a_hung_server_cannot_outlast_the_time_budget() {
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(|_, _| Reply::Hang(Duration::from_secs(600)));
    let cfg = plain_config(d.path(), &srv.base_url(), "timeout_s = 300.0\nmax_retries = 4");
    let store = d.path().join("s.db");
    let t0 = std::time::Instant::now();
    let o = softmax_run(&mut ks_loud(&store, &cfg), &["--rounds", "4", "--time-budget", "10s"]);
    let took = t0.elapsed();
    let text = out(&o);
    assert!(took < Duration::from_secs(20), "{took:?}\n{text}");
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{text}");
    assert!(text.contains("time budget"), "{text}");
    assert!(text.contains("ksearch resume"), "{text}");
    let id = last_run(&store);
    let c = calls(&store, id);
    assert!(!c.is_empty() && c.iter().all(|c| c.error.is_some()), "every call recorded");
    assert!(errors(&store, id).contains("time budget"), "{}", errors(&store, id));
    // resume continues it (a new budget by flag), and stops on that budget too.
    let t0 = std::time::Instant::now();
    let o = ks_loud(&store, &cfg)
        .args(["resume", &id.to_string(), "--time-budget", "5s"])
        .output()
        .unwrap();
    let text = out(&o);
    assert!(t0.elapsed() < Duration::from_secs(15), "{text}");
    assert!(!text.contains("already finished") && text.contains("resuming run"), "{text}");
    assert!(matches!(o.status.code(), Some(0) | Some(1)), "{text}");
}

/// A server that answers 200 with garbage: every call fails fast; the planner falls back to
/// the offline planner's actions each round and the run goes on to its last round. On the real
/// shapes: the rounds after the first are the adopted kernel's tunings (offered however far
/// behind it measured since 2026-12-05; before, only at half the seed's speed or better, and a
/// busy machine once measured it slower at the quick tasks' microsecond timings, so the run
/// ended after one round with no open action).
#[test]
fn a_garbage_server_falls_back_to_the_offline_planner_and_the_run_goes_on() {
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(|_, _| Reply::Http {
        status: 200,
        headers: vec![],
        body: "<html><body>502 Bad Gateway, probably</body></html>".into(),
    });
    let cfg = config(d.path(), &srv.base_url(), "");
    let store = d.path().join("s.db");
    let t0 = std::time::Instant::now();
    let (id, o) = run(&store, &cfg, &["--rounds", "3", "--time-budget", "200s"]);
    assert!(t0.elapsed() < Duration::from_secs(210));
    let s = Store::open(&store).unwrap();
    let row = s.run(id).unwrap();
    assert!(row.status.starts_with("done"), "{}", out(&o));
    assert_eq!(row.round, 3, "the run went on past round 1: {}", out(&o));
    assert!(errors(&store, id).contains("not valid JSON"));
    // After three failed planner calls in a row (the initialisation and two revisions, two
    // attempts each) the planner is not asked again in this invocation.
    assert_eq!(srv.count(Kind::Init) + srv.count(Kind::Update), 6, "{}", out(&o));
    drop(s);
    // A good server later: resume (more rounds) redoes the missing planner initialisation.
    let good = Server::new(good_handler);
    let o = ks(&store, &cfg)
        .args(["resume", &id.to_string(), "--rounds", "4", "--base-url", &good.base_url()])
        .output()
        .unwrap();
    check_exit(&o);
    let s = Store::open(&store).unwrap();
    assert!(!s.artifacts(id, "planner_init").unwrap().is_empty(), "{}", out(&o));
    assert_eq!(s.run(id).unwrap().round, 4);
    assert_eq!(good.count(Kind::Init), 1);
}

/// A server that fails the first request of the planner's initialisation with a 503: the
/// retry is one line on stderr, hidden by -q, and RUST_LOG shows more.
#[test]
fn retries_and_fallbacks_are_one_visible_line_each() {
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(|r, i| match (r.kind, i) {
        (Kind::Init, 0) => Reply::status(503, vec![], json!({"error": {"message": "model is loading"}})),
        (Kind::Update, _) => Reply::status(500, vec![], json!({"error": {"message": "worker crashed"}})),
        _ => good_handler(r, i),
    });
    let cfg = plain_config(d.path(), &srv.base_url(), "max_retries = 1\napi_key_env = \"\"");
    let store = d.path().join("s.db");
    let o = softmax_run(&mut ks_loud(&store, &cfg), &["--rounds", "1"]);
    check_exit(&o);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let retry: Vec<&str> = err.lines().filter(|l| l.contains("retrying")).collect();
    assert!(!retry.is_empty() && retry[0].contains("503"), "{err}");
    assert!(
        err.lines()
            .any(|l| l.contains("WARN") && l.contains("offline planner's next actions")),
        "{err}"
    );
    // -q: only errors.
    let o = softmax_run(ks_loud(&store, &cfg).arg("-q"), &["--rounds", "1"]);
    check_exit(&o);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("retrying"), "{}", out(&o));
    // RUST_LOG decides when set.
    let o = softmax_run(ks_loud(&store, &cfg).arg("-q").env("RUST_LOG", "debug"), &["--rounds", "1"]);
    check_exit(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("LLM request"), "{}", out(&o));
}

/// A coder endpoint that is rate-limited without end: the actions are reopened (not failed,
/// not too hard), the calls count against the LLM budget, three in a row stop the run, and
/// resume against a working server goes on.
#[test]
fn coder_transport_failures_reopen_the_action() {
    let d = tempfile::tempdir().unwrap();
    let srv = Server::new(|r, i| match r.kind {
        Kind::Coder | Kind::Repair { of: Base::Coder } => Reply::status(
            429,
            vec![("Retry-After".into(), "0".into())],
            json!({"error": {"message": "Rate limit reached for requests", "type": "requests"}}),
        ),
        _ => good_handler(r, i),
    });
    let cfg = config(d.path(), &srv.base_url(), "");
    let store = d.path().join("s.db");
    let (id, o) = run(&store, &cfg, &["--rounds", "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ksearch resume"), "{}", out(&o));
    let s = Store::open(&store).unwrap();
    let row = s.run(id).unwrap();
    assert_eq!(row.status, "stopped");
    assert!(row.stop_reason.unwrap_or_default().contains("transport"));
    assert_eq!(row.round, 0, "no round was used up");
    let nodes = s.nodes(id).unwrap();
    assert!(
        nodes.iter().all(|n| n.failure.is_none() && n.status.name() != "too_hard"),
        "{nodes:?}"
    );
    assert_eq!(s.count_evaluations(id).unwrap(), 1, "only the seed was evaluated");
    let coder: Vec<_> = calls(&store, id).into_iter().filter(|c| c.role == "coder").collect();
    assert_eq!(coder.len(), 3);
    assert!(
        coder
            .iter()
            .all(|c| c.attempts == 2 && c.error.as_deref().unwrap_or("").contains("429"))
    );
    let budget = s.artifacts(id, "llm_budget").unwrap();
    assert!(budget.last().unwrap().2.contains("\"calls\":4"), "{budget:?}");
    drop(s);
    let good = Server::new(good_handler);
    let o = ks(&store, &cfg)
        .args(["resume", &id.to_string(), "--base-url", &good.base_url()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
    let s = Store::open(&store).unwrap();
    assert!(s.run(id).unwrap().status.starts_with("done"));
    assert!(s.run(id).unwrap().best_speedup.unwrap_or(0.0) > 1.0);
}

fn with_finish(content: &str, finish: &str) -> Reply {
    let v = json!({
        "id": "chatcmpl-test", "object": "chat.completion", "model": "scripted-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 4096, "total_tokens": 5096}
    });
    Reply::Http {
        status: 200,
        headers: vec![],
        body: v.to_string(),
    }
}

/// Provenance: a reply cut at max_tokens is `truncated` (and the repair prompt says so); a
/// huge reply is stored cut, head and tail kept, its size recorded; a failed call keeps its
/// attempts and latency.
#[test]
fn provenance_is_recorded_truly() {
    plumbing_only();
    let d = tempfile::tempdir().unwrap();
    // A coder whose first reply is cut at the token limit.
    let srv = Server::new(|r, i| match r.kind {
        Kind::Coder => {
            let src = fast_softmax(8, 1);
            let cut: String = src.chars().take(src.len() / 2).collect();
            with_finish(&format!("```cpp\n{cut}"), "length")
        }
        Kind::Repair { of: Base::Coder } => Reply::completion(&code(&fast_softmax(8, 1))),
        _ => good_handler(r, i),
    });
    let store = d.path().join("a.db");
    let (id, _) = run(
        &store,
        &config(d.path(), &srv.base_url(), "max_tokens = 4096"),
        &["--rounds", "1"],
    );
    let c = calls(&store, id);
    let cut = c
        .iter()
        .find(|c| c.role == "coder" && c.error.is_some())
        .expect("the cut reply");
    let e = cut.error.clone().unwrap();
    assert!(e.starts_with("truncated") && e.contains("max_tokens 4096"), "{e}");
    let repair = srv
        .requests()
        .into_iter()
        .find(|r| r.kind == Kind::Repair { of: Base::Coder })
        .expect("a repair prompt");
    assert!(repair.user.contains("token limit"), "{}", repair.user);
    // A planner that answers with megabytes.
    let srv = Server::new(|r, i| match r.kind {
        Kind::Update => {
            let mut v: Value = serde_json::from_str(&update_reply(r)).unwrap();
            v["analysis"] = json!(format!("HEAD{}TAIL", "x".repeat(2 << 20)));
            Reply::completion(&v.to_string())
        }
        _ => good_handler(r, i),
    });
    let store = d.path().join("b.db");
    let (id, _) = run(&store, &config(d.path(), &srv.base_url(), ""), &["--rounds", "1"]);
    let big = calls(&store, id)
        .into_iter()
        .find(|c| c.reply.as_deref().unwrap_or("").contains("HEAD"))
        .expect("the big reply");
    let reply = big.reply.unwrap();
    assert!(reply.len() < 100_000, "{}", reply.len());
    assert!(
        reply.contains("TAIL") && reply.contains("characters"),
        "head and tail kept, size said"
    );
    assert!(std::fs::metadata(&store).unwrap().len() < 4 << 20);
    // A planner update that fails every attempt: attempts and latency are what happened.
    let srv = Server::new(|r, i| match r.kind {
        Kind::Update => Reply::status(502, vec![], json!({"error": {"message": "bad gateway"}})),
        _ => good_handler(r, i),
    });
    let store = d.path().join("c.db");
    let (id, _) = run(&store, &config(d.path(), &srv.base_url(), ""), &["--rounds", "1"]);
    let failed = calls(&store, id)
        .into_iter()
        .find(|c| c.error.as_deref().unwrap_or("").contains("502"))
        .expect("the failed update");
    assert_eq!(failed.attempts, 2);
    assert!(failed.latency_s > 0.0);
}

#[test]
fn model_code_that_reads_the_machines_files_is_refused_before_it_compiles() {
    // A file of this machine with a secret line, and coder replies that try to read it at
    // compile time: a quoted include (through a digraph and a comment), an absolute include
    // in brackets, an assembler `.incbin` in pieces. Each is refused before the compiler sees
    // it; the model is asked to rewrite; the file's contents reach neither the model nor the
    // store.
    let d = tempfile::tempdir().unwrap();
    let secret = d.path().join("notes.env");
    std::fs::write(&secret, "DATABASE_PASSWORD_hunter2canary77\n").unwrap();
    let p = secret.display().to_string();
    let attempts = [
        format!("%:/**/include \"{p}\"\n#include <cstdint>\nextern \"C\" void softmax(void** b, const int64_t* d) {{}}\n"),
        format!("#include <{p}>\n#include <cstdint>\nextern \"C\" void softmax(void** b, const int64_t* d) {{}}\n"),
        format!(
            "#include <cstdint>\nasm(\".inc\" \"bin \\\"{p}\\\"\");\nextern \"C\" void softmax(void** b, const int64_t* d) {{}}\n"
        ),
    ];
    let srv = Server::new(move |r, i| match r.kind {
        Kind::Coder => Reply::completion(&code(&attempts[i % attempts.len()])),
        Kind::Repair { of: Base::Coder } => Reply::completion(&code(&fast_softmax(8, 1))),
        _ => good_handler(r, i),
    });
    let store = d.path().join("s.db");
    let (id, o) = run(&store, &config(d.path(), &srv.base_url(), ""), &["--rounds", "3"]);
    let e = errors(&store, id);
    assert!(
        e.contains("refused") && e.contains("system headers by name only"),
        "{e}\n{}",
        out(&o)
    );
    assert!(e.contains("inline assembly"), "{e}");
    for r in srv.requests() {
        assert!(!r.body.to_string().contains("hunter2canary77"), "the file reached the model");
    }
    let db = std::fs::read(&store).unwrap();
    assert!(!db.windows(15).any(|w| w == b"hunter2canary77"), "the file reached the store");
    // The rewritten code was measured.
    assert!(
        srv.count(Kind::Repair { of: Base::Coder }) >= 3,
        "{}",
        srv.count(Kind::Repair { of: Base::Coder })
    );
}
