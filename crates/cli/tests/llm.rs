//! The LLM planner end to end: the real `ksearch` binary, the CPU back-end, a real store, and a
//! scripted OpenAI-compatible server on 127.0.0.1 standing in for the planner and coder models.
//! No timing assertions: "faster" is the run's own measured speed-up in the store.

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

fn ks(store: &Path, cfg: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(repo())
        .env(KEY_VAR, KEY)
        .arg("--store")
        .arg(store)
        .arg("--config")
        .arg(cfg)
        .arg("--quiet")
        .timeout(Duration::from_secs(240));
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
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
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
    assert!(
        nodes
            .iter()
            .any(|n| matches!(n.action, ksearch_core::tree::Action::Adopt { .. }) && n.speedup.is_some())
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
