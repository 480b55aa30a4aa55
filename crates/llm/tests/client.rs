//! The OpenAI-compatible client against local scripted servers.

mod support;

use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use ksearch_llm::prompts::{PLANNER_INIT_SCHEMA, PlannerInit};
use ksearch_llm::*;
use serde_json::{Value, json};
use support::{Reply, Server, completion_body};

const KEY_VAR: &str = "KSEARCH_LLM_TEST_KEY";
const KEY: &str = "sk-test-9f8e7d6c5b4a-SECRET";

fn init_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| unsafe {
        // SAFETY: set once, before any client of this test binary reads the environment
        // (every test calls init_env first).
        std::env::set_var(KEY_VAR, KEY);
    });
}

fn config(server: &Server) -> ModelConfig {
    init_env();
    ModelConfig {
        api_key_env: Some(KEY_VAR.into()),
        timeout_s: 5.0,
        connect_timeout_s: 2.0,
        max_retries: 3,
        backoff_base_s: 0.001,
        max_backoff_s: 60.0,
        ..ModelConfig::new(server.base_url(), "test-model")
    }
}

/// A client that records its waits instead of sleeping.
fn client(cfg: ModelConfig) -> (OpenAiCompatible, Arc<Mutex<Vec<Duration>>>) {
    let waits = Arc::new(Mutex::new(Vec::new()));
    let w = waits.clone();
    let c = OpenAiCompatible::new(cfg)
        .unwrap()
        .with_sleeper(Arc::new(move |d| w.lock().unwrap().push(d)));
    (c, waits)
}

fn hello() -> ChatRequest {
    ChatRequest::new(vec![Message::system("You are terse."), Message::user("Say hi.")])
}

#[test]
fn successful_call_reports_usage_and_cost() {
    let server = Server::scripted(vec![Reply::completion("hi there", Some((1000, 500)))]);
    let mut cfg = config(&server);
    cfg.price_prompt_per_mtok = 1.0;
    cfg.price_completion_per_mtok = 2.0;
    let (c, waits) = client(cfg);
    let r = c.chat(&hello()).unwrap();
    assert_eq!(r.content, "hi there");
    assert_eq!(
        r.usage,
        Usage {
            prompt_tokens: 1000,
            completion_tokens: 500,
            estimated: false
        }
    );
    assert!((r.cost_usd - 0.002).abs() < 1e-12, "cost {}", r.cost_usd);
    assert_eq!(r.model, "test-model-2025");
    assert_eq!(r.attempts, 1);
    assert_eq!(r.finish_reason.as_deref(), Some("stop"));
    assert!(r.latency_s >= 0.0);
    assert!(r.raw.contains("chatcmpl-test"));
    assert!(waits.lock().unwrap().is_empty());
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path, "/v1/chat/completions");
    assert_eq!(reqs[0].header("authorization"), Some(format!("Bearer {KEY}").as_str()));
    assert!(reqs[0].header("content-type").unwrap().starts_with("application/json"));
    assert_eq!(c.model(), "test-model");
}

const STANDARD_FIELDS: &[&str] = &[
    "model",
    "messages",
    "temperature",
    "max_tokens",
    "max_completion_tokens",
    "reasoning_effort",
    "response_format",
];

fn assert_standard(body: &Value) {
    let o = body.as_object().expect("body is an object");
    for k in o.keys() {
        assert!(STANDARD_FIELDS.contains(&k.as_str()), "non-standard field `{k}` in {body}");
    }
    for m in body["messages"].as_array().unwrap() {
        let m = m.as_object().unwrap();
        assert_eq!(m.len(), 2, "message has only role and content: {m:?}");
        assert!(["system", "user", "assistant"].contains(&m["role"].as_str().unwrap()));
        assert!(m["content"].is_string());
    }
}

#[test]
fn json_schema_request_is_standard_chat_completions() {
    let server = Server::scripted(vec![Reply::completion("{\"ok\": true}", Some((10, 5)))]);
    let mut cfg = config(&server);
    cfg.temperature = Some(0.7);
    cfg.max_tokens = Some(1234);
    let (c, _) = client(cfg);
    let schema = PLANNER_INIT_SCHEMA.clone();
    let mut req = hello().with_schema("planner init", schema.clone());
    req.temperature = Some(0.2); // the request overrides the config
    req.reasoning_effort = Some("high".into());
    c.chat(&req).unwrap();
    let body = server.requests()[0].json();
    assert_standard(&body);
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["temperature"], json!(0.2));
    assert_eq!(body["max_tokens"], json!(1234));
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["messages"][0], json!({"role": "system", "content": "You are terse."}));
    assert_eq!(body["messages"][1], json!({"role": "user", "content": "Say hi."}));
    let rf = &body["response_format"];
    assert_eq!(rf["type"], "json_schema");
    assert_eq!(rf["json_schema"]["name"], "planner_init");
    assert_eq!(rf["json_schema"]["strict"], true);
    assert_eq!(rf["json_schema"]["schema"], schema);
}

#[test]
fn json_object_and_none_modes_shape_the_request() {
    let server = Server::with_handler(|_, _| Reply::completion("{}", Some((1, 1))));
    let mut cfg = config(&server);
    cfg.structured_output = StructuredMode::JsonObject;
    let (c, _) = client(cfg.clone());
    c.chat(&hello().with_schema("x", json!({"type": "object"}))).unwrap();
    cfg.structured_output = StructuredMode::None;
    let (c, _) = client(cfg);
    c.chat(&hello().with_schema("x", json!({"type": "object"}))).unwrap();
    // No schema: no response_format whatever the mode; no optional fields when unset.
    c.chat(&hello()).unwrap();
    let reqs = server.requests();
    assert_eq!(reqs[0].json()["response_format"], json!({"type": "json_object"}));
    // Plain text: the schema travels in the prompt instead.
    let none = reqs[1].json();
    assert!(none.get("response_format").is_none());
    let user = none["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.starts_with("Say hi.") && user.contains("JSON schema") && user.contains("\"object\""),
        "{user}"
    );
    let plain = reqs[2].json();
    assert_standard(&plain);
    assert_eq!(plain["messages"][1]["content"], "Say hi.");
    // max_tokens is always sent, so that no server generates without end.
    assert_eq!(plain["max_tokens"], json!(DEFAULT_MAX_TOKENS));
    assert_eq!(
        plain.as_object().unwrap().len(),
        3,
        "only model, messages and max_tokens: {plain}"
    );
}

#[test]
fn rate_limit_storm_then_success_honours_retry_after() {
    let server = Server::scripted(vec![
        Reply::rate_limited("2"),
        Reply::rate_limited("2"),
        Reply::rate_limited("1"),
        Reply::completion("finally", Some((3, 4))),
    ]);
    let mut cfg = config(&server);
    cfg.max_retries = 5;
    let (c, waits) = client(cfg);
    let r = c.chat(&hello()).unwrap();
    assert_eq!(r.content, "finally");
    assert_eq!(r.attempts, 4);
    assert_eq!(server.count(), 4);
    assert_eq!(
        *waits.lock().unwrap(),
        vec![Duration::from_secs(2), Duration::from_secs(2), Duration::from_secs(1)]
    );
}

#[test]
fn retry_after_is_capped() {
    let server = Server::scripted(vec![Reply::rate_limited("3600"), Reply::completion("ok", None)]);
    let mut cfg = config(&server);
    cfg.max_backoff_s = 0.5;
    let (c, waits) = client(cfg);
    c.chat(&hello()).unwrap();
    assert_eq!(*waits.lock().unwrap(), vec![Duration::from_millis(500)]);
}

#[test]
fn server_errors_until_exhaustion_give_a_clear_error() {
    let server = Server::with_handler(|_, _| Reply::server_error());
    let mut cfg = config(&server);
    cfg.max_retries = 3;
    cfg.backoff_base_s = 0.01;
    let (c, waits) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    match &err {
        LlmError::Exhausted { attempts, last } => {
            assert_eq!(*attempts, 4);
            assert!(matches!(**last, LlmError::Http { status: 500, .. }), "{last:?}");
        }
        e => panic!("expected Exhausted, got {e:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("4 attempts") && msg.contains("HTTP 500") && msg.contains("internal error"),
        "{msg}"
    );
    assert_eq!(server.count(), 4);
    // Exponential back-off: base * 2^k, plus at most 25% jitter.
    let waits = waits.lock().unwrap().clone();
    assert_eq!(waits.len(), 3);
    for (k, w) in waits.iter().enumerate() {
        let lo = 0.01 * 2f64.powi(k as i32);
        assert!(
            w.as_secs_f64() >= lo - 1e-9 && w.as_secs_f64() <= lo * 1.25 + 1e-9,
            "wait {k}: {w:?}"
        );
    }
}

#[test]
fn client_errors_are_not_retried() {
    let server = Server::with_handler(|_, _| Reply::json(401, json!({"error": {"message": "Incorrect API key provided"}})));
    let (c, waits) = client(config(&server));
    let err = c.chat(&hello()).unwrap_err();
    assert!(
        matches!(&err, LlmError::Auth { status: 401, var: Some(v), body_excerpt } if body_excerpt.contains("Incorrect API key") && v == KEY_VAR),
        "{err:?}"
    );
    // The message names the variable, never the key.
    let msg = err.to_string();
    assert!(msg.contains(KEY_VAR) && !msg.contains(KEY), "{msg}");
    assert_eq!(server.count(), 1);
    assert!(waits.lock().unwrap().is_empty());
}

#[test]
fn a_hanging_server_times_out() {
    let server = Server::scripted(vec![Reply::Hang(Duration::from_secs(5))]);
    let mut cfg = config(&server);
    cfg.timeout_s = 0.3;
    cfg.max_retries = 0;
    let (c, _) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    assert!(matches!(err, LlmError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("timed out"));
}

#[test]
fn a_hanging_server_is_retried_then_exhausted() {
    let server = Server::with_handler(|_, _| Reply::Hang(Duration::from_secs(5)));
    let mut cfg = config(&server);
    cfg.timeout_s = 0.2;
    cfg.max_retries = 1;
    let (c, _) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    assert!(
        matches!(&err, LlmError::Exhausted { attempts: 2, last } if matches!(**last, LlmError::Timeout { .. })),
        "{err:?}"
    );
    assert!(matches!(err.root(), LlmError::Timeout { .. }));
}

#[test]
fn a_closed_connection_is_retried() {
    let server = Server::scripted(vec![Reply::Close, Reply::completion("after reconnect", Some((1, 2)))]);
    let (c, waits) = client(config(&server));
    let r = c.chat(&hello()).unwrap();
    assert_eq!(r.content, "after reconnect");
    assert_eq!(r.attempts, 2);
    assert_eq!(waits.lock().unwrap().len(), 1);
}

#[test]
fn a_closed_connection_every_time_is_a_connection_error() {
    let server = Server::with_handler(|_, _| Reply::Close);
    let mut cfg = config(&server);
    cfg.max_retries = 2;
    let (c, _) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    assert!(
        matches!(&err, LlmError::Exhausted { attempts: 3, last } if matches!(**last, LlmError::Connection(_))),
        "{err:?}"
    );
}

#[test]
fn a_body_cut_mid_transfer_is_retried() {
    let full = completion_body("whole", Some((1, 1))).to_string();
    let server = Server::scripted(vec![
        Reply::Cut {
            declared: full.len(),
            body: full[..full.len() / 2].to_string(),
        },
        Reply::completion("whole", Some((1, 1))),
    ]);
    let (c, _) = client(config(&server));
    let r = c.chat(&hello()).unwrap();
    assert_eq!((r.content.as_str(), r.attempts), ("whole", 2));
}

#[test]
fn truncated_json_body_is_a_bad_response() {
    let full = completion_body("x", Some((1, 1))).to_string();
    let cut = full[..full.len() - 20].to_string();
    let server = Server::with_handler(move |_, _| Reply::text(200, &cut));
    let mut cfg = config(&server);
    cfg.max_retries = 1;
    let (c, _) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    assert!(
        matches!(err.root(), LlmError::BadResponse(m) if m.contains("not valid JSON")),
        "{err:?}"
    );
    assert_eq!(server.count(), 2, "a malformed body is retried");
}

#[test]
fn an_error_object_with_status_200_is_retried() {
    let server = Server::scripted(vec![
        Reply::json(200, json!({"error": {"message": "upstream overloaded", "code": 502}})),
        Reply::completion("ok", Some((1, 1))),
    ]);
    let (c, _) = client(config(&server));
    assert_eq!(c.chat(&hello()).unwrap().attempts, 2);
}

#[test]
fn empty_content_is_a_bad_response() {
    let mut body = completion_body("", Some((10, 4096)));
    body["choices"][0]["finish_reason"] = json!("length");
    let server = Server::with_handler(move |_, _| Reply::json(200, body.clone()));
    let (c, _) = client(config(&server));
    let err = c.chat(&hello()).unwrap_err();
    assert!(matches!(&err, LlmError::BadResponse(m) if m.contains("length")), "{err:?}");
    assert_eq!(server.count(), 1);
}

#[test]
fn replies_without_code_or_with_bad_json_are_parse_errors() {
    let server = Server::scripted(vec![
        Reply::completion(
            "I would tile the rows and use shared memory, then vectorize the loads.",
            Some((5, 5)),
        ),
        Reply::completion(
            "```json\n{\"classification\": \"row reduction\", \"actions\": [{\"title\": \"tile\"",
            Some((5, 5)),
        ),
        Reply::completion("Here you go: {\"classification\": 'memory-bound', }", Some((5, 5))),
    ]);
    let (c, _) = client(config(&server));
    let prose = c.chat(&hello()).unwrap().content;
    let e = extract_code(&prose, Some("cuda")).unwrap_err();
    assert_eq!(e, ParseError::NoCodeBlock);
    assert!(repair_prompt(&e).contains("fenced code block"));

    let cut = c.chat(&hello()).unwrap().content;
    let e = PlannerInit::parse(&cut).unwrap_err();
    assert!(matches!(e, ParseError::TruncatedJson { .. }), "{e:?}");
    assert!(repair_prompt(&e).contains("cut off"));

    let bad = c.chat(&hello()).unwrap().content;
    let e = PlannerInit::parse(&bad).unwrap_err();
    assert!(matches!(e, ParseError::InvalidJson { .. }), "{e:?}");
}

#[test]
fn budget_stops_calls() {
    let server = Server::with_handler(|_, _| Reply::completion("ok", Some((1_000_000, 0))));
    let mut cfg = config(&server);
    cfg.price_prompt_per_mtok = 0.5;
    let (c, _) = client(cfg);
    let budget = Arc::new(Mutex::new(Budget::new(None, Some(2))));
    let b = Budgeted::new(c, budget.clone());
    b.chat(&hello()).unwrap();
    b.chat(&hello()).unwrap();
    let err = b.chat(&hello()).unwrap_err();
    assert!(matches!(&err, LlmError::Budget(m) if m.contains("2 of 2")), "{err:?}");
    assert_eq!(server.count(), 2, "the refused call never reached the server");
    let snapshot = budget.lock().unwrap().clone();
    assert_eq!(snapshot.calls, 2);
    assert!((snapshot.spent_usd - 1.0).abs() < 1e-9);

    // Persist and resume: a cost cap of $1.2 allows exactly one more $0.5 call.
    let mut resumed: Budget = serde_json::from_str(&serde_json::to_string(&snapshot).unwrap()).unwrap();
    resumed.max_calls = None;
    resumed.max_cost_usd = Some(1.2);
    let (c, _) = client(config(&server));
    let mut cfg2 = c.config().clone();
    cfg2.price_prompt_per_mtok = 0.5;
    let (c, _) = client(cfg2);
    let b = Budgeted::new(c, Arc::new(Mutex::new(resumed)));
    b.chat(&hello()).unwrap();
    assert!(matches!(b.chat(&hello()), Err(LlmError::Budget(_))));
    assert_eq!(b.budget().lock().unwrap().calls, 3);
    assert_eq!(server.count(), 3);
}

/// A server that echoes the request headers back, in replies and in errors.
fn echo_headers(r: &support::Recorded) -> String {
    r.headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_api_key_never_appears_in_outputs() {
    let server = Server::with_handler(|r, i| match i {
        0 => Reply::json(200, completion_body(&echo_headers(r), Some((1, 1)))),
        1 => Reply::json(400, json!({"error": {"message": echo_headers(r)}})),
        _ => Reply::json(503, json!({"error": {"message": echo_headers(r)}})),
    });
    let mut cfg = config(&server);
    cfg.max_retries = 1;
    let (c, _) = client(cfg);
    let ok = c.chat(&hello()).unwrap();
    assert!(
        ok.content.contains("[REDACTED]"),
        "the echo server did get the key: {}",
        ok.content
    );
    let e400 = c.chat(&hello()).unwrap_err();
    let e503 = c.chat(&hello()).unwrap_err();
    let texts = [
        format!("{ok:?}"),
        serde_json::to_string(&ok).unwrap(),
        ok.raw.clone(),
        e400.to_string(),
        format!("{e400:?}"),
        e503.to_string(),
        format!("{e503:?}"),
        format!("{c:?}"),
    ];
    for t in &texts {
        assert!(!t.contains(KEY), "key leaked into: {t}");
    }
    assert!(matches!(e503.root(), LlmError::Http { status: 503, .. }));
}

#[test]
fn a_missing_key_variable_is_named_not_valued() {
    let server = Server::scripted(vec![]);
    let mut cfg = config(&server);
    cfg.api_key_env = Some("KSEARCH_LLM_TEST_UNSET_VAR".into());
    let (c, _) = client(cfg);
    let err = c.chat(&hello()).unwrap_err();
    assert_eq!(
        err,
        LlmError::MissingApiKey {
            var: "KSEARCH_LLM_TEST_UNSET_VAR".into()
        }
    );
    assert_eq!(server.count(), 0);
}

/// A llama.cpp-like server: rejects any `response_format` with a 400, reports no `usage` and no
/// `model`, wants no API key.
fn llama_like() -> Server {
    Server::with_handler(|r, _| {
        let body = r.json();
        if body.get("response_format").is_some() {
            return Reply::json(
                400,
                json!({"error": {"code": 400, "message": "Unsupported param: response_format", "type": "invalid_request_error"}}),
            );
        }
        Reply::json(
            200,
            json!({
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "```json\n{\"a\": 1}\n```"}, "finish_reason": "stop"}]
            }),
        )
    })
}

#[test]
fn a_server_rejecting_response_format_works_in_auto_mode() {
    let server = llama_like();
    let cfg = ModelConfig {
        base_url: format!("{}/", server.base_url()), // a trailing slash is tolerated
        timeout_s: 5.0,
        backoff_base_s: 0.001,
        ..ModelConfig::new("", "local-gguf")
    };
    let (c, waits) = client(cfg);
    let req = hello().with_schema("x", json!({"type": "object"}));
    let r = c.chat(&req).unwrap();
    assert_eq!(extract_json(&r.content).unwrap(), json!({"a": 1}));
    assert!(r.usage.estimated && r.usage.prompt_tokens > 0 && r.usage.completion_tokens > 0);
    assert_eq!(r.cost_usd, 0.0);
    assert_eq!(r.model, "local-gguf");
    assert!(waits.lock().unwrap().is_empty(), "a field fallback is not a back-off");
    let reqs = server.requests();
    assert_eq!(reqs.len(), 3, "json_schema, then json_object, then none");
    assert_eq!(reqs[0].json()["response_format"]["type"], "json_schema");
    assert_eq!(reqs[1].json()["response_format"]["type"], "json_object");
    assert!(reqs[2].json().get("response_format").is_none());
    assert!(reqs.iter().all(|r| r.header("authorization").is_none()));
    assert_eq!(r.attempts, 3);
    // Remembered: the next call goes straight to the working shape.
    c.chat(&req).unwrap();
    assert_eq!(server.count(), 4);
    assert_eq!(c.fallbacks(), vec!["response_format: none".to_string()]);
}

#[test]
fn an_explicit_json_schema_mode_does_not_fall_back() {
    let server = llama_like();
    let mut cfg = ModelConfig::new(server.base_url(), "local");
    cfg.structured_output = StructuredMode::JsonSchema;
    let (c, _) = client(cfg);
    let err = c.chat(&hello().with_schema("x", json!({"type": "object"}))).unwrap_err();
    assert!(
        matches!(&err, LlmError::Http { status: 400, body_excerpt } if body_excerpt.contains("response_format")),
        "{err:?}"
    );
    assert_eq!(server.count(), 1);
}

#[test]
fn rejected_reasoning_effort_and_max_tokens_are_adapted() {
    // Like an OpenAI reasoning model behind a strict proxy.
    let server = Server::with_handler(|r, _| {
        let b = r.json();
        if b.get("reasoning_effort").is_some() {
            return Reply::json(
                400,
                json!({"error": {"message": "Unrecognized request argument supplied: reasoning_effort"}}),
            );
        }
        if b.get("max_tokens").is_some() {
            return Reply::json(
                400,
                json!({"error": {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead."}}),
            );
        }
        Reply::completion("ok", Some((2, 2)))
    });
    let mut cfg = config(&server);
    cfg.reasoning_effort = Some("medium".into());
    cfg.max_tokens = Some(999);
    let (c, _) = client(cfg);
    assert_eq!(c.chat(&hello()).unwrap().content, "ok");
    let last = server.requests().last().unwrap().json();
    assert!(last.get("reasoning_effort").is_none());
    assert_eq!(last["max_completion_tokens"], json!(999));
    assert_standard(&last);
    assert_eq!(server.count(), 3);
    c.chat(&hello()).unwrap();
    assert_eq!(server.count(), 4, "both fallbacks are remembered");
}

#[test]
fn an_unrelated_400_is_returned_at_once() {
    let server = Server::with_handler(|_, _| Reply::json(400, json!({"error": {"message": "context length exceeded"}})));
    let (c, _) = client(config(&server));
    let err = c.chat(&hello().with_schema("x", json!({}))).unwrap_err();
    assert!(matches!(err, LlmError::Http { status: 400, .. }));
    assert_eq!(server.count(), 1);
}

#[test]
fn content_parts_and_think_blocks_are_handled() {
    let server = Server::scripted(vec![Reply::json(
        200,
        json!({
            "model": "m",
            "choices": [{"message": {"role": "assistant", "content": [{"type": "text", "text": "<think>hmm {\"no\": 1}</think>"}, {"type": "text", "text": "{\"yes\": 2}"}]}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}
        }),
    )]);
    let (c, _) = client(config(&server));
    let r = c.chat(&hello()).unwrap();
    assert_eq!(extract_json(&r.content).unwrap(), json!({"yes": 2}));
}

#[test]
fn config_parses_from_a_toml_section() {
    #[derive(serde::Deserialize)]
    struct Root {
        llm: Llm,
    }
    #[derive(serde::Deserialize)]
    struct Llm {
        planner: ModelConfig,
        coder: ModelConfig,
    }
    let root: Root = toml::from_str(
        r#"
        [llm.planner]
        base_url = "https://generativelanguage.googleapis.com/v1beta/openai"
        model = "gemini-2.5-pro"
        api_key_env = "GEMINI_API_KEY"
        reasoning_effort = "high"
        structured_output = "json_schema"
        price_prompt_per_mtok = 1.25
        price_completion_per_mtok = 10.0

        [llm.coder]
        base_url = "http://localhost:11434/v1"
        model = "qwen2.5-coder:32b"
        structured_output = "none"
        timeout_s = 600
        max_retries = 1
        "#,
    )
    .unwrap();
    let p = &root.llm.planner;
    assert_eq!(p.structured_output, StructuredMode::JsonSchema);
    assert_eq!(
        p.endpoint(),
        "https://generativelanguage.googleapis.com/v1beta/openai/chat/completions"
    );
    assert_eq!(p.timeout_s, ModelConfig::default().timeout_s);
    assert!(p.validate().is_ok());
    let c = &root.llm.coder;
    assert_eq!(
        (c.structured_output, c.timeout_s, c.max_retries, c.api_key_env.as_deref()),
        (StructuredMode::None, 600.0, 1, None)
    );
    assert!(
        toml::from_str::<ModelConfig>("model = \"x\"\ntemprature = 0.1").is_err(),
        "typos are rejected"
    );
    assert!(matches!(ModelConfig::default().validate(), Err(LlmError::Config(_))));
}

#[test]
fn scripted_client_replays_and_records() {
    let s = ScriptedClient::new("offline", ["one", "two"]);
    assert_eq!(s.chat(&hello()).unwrap().content, "one");
    s.push(Err(LlmError::Timeout { after_s: 1.0 }));
    assert_eq!(s.chat(&hello()).unwrap().content, "two");
    assert!(matches!(s.chat(&hello()), Err(LlmError::Timeout { .. })));
    assert!(s.chat(&hello()).is_err());
    assert_eq!(s.requests().len(), 4);
}

/// llama.cpp's server (through llama-cpp-python) answers `json_schema` with a 500 whose body
/// names the accepted types; `json_object` works there.
fn llama_cpp_like(r: &support::Recorded, _: usize) -> Reply {
    let b = r.json();
    match b["response_format"]["type"].as_str() {
        Some("json_schema") => Reply::json(
            500,
            json!({"error": {"message": "1 validation error: response_format.type: Input should be 'text' or 'json_object'", "type": "internal_server_error"}}),
        ),
        _ => Reply::completion("{\"ok\": true}", Some((3, 3))),
    }
}

#[test]
fn a_500_that_names_response_format_downgrades_to_json_object() {
    let server = Server::with_handler(llama_cpp_like);
    let (c, waits) = client(config(&server));
    let req = hello().with_schema("x", json!({"type": "object"}));
    let r = c.chat(&req).unwrap();
    assert_eq!(r.attempts, 2);
    assert!(waits.lock().unwrap().is_empty(), "a rejection is not retried with back-off");
    let learnt = c.learnt().expect("the downgrade is remembered");
    // A later call (and a later client given what was learnt) starts with json_object.
    c.chat(&req).unwrap();
    let (c2, _) = client(config(&server));
    c2.restore_learnt(&learnt);
    c2.chat(&req).unwrap();
    let types: Vec<String> = server
        .requests()
        .iter()
        .map(|r| r.json()["response_format"]["type"].as_str().unwrap_or("-").to_string())
        .collect();
    assert_eq!(types, ["json_schema", "json_object", "json_object", "json_object"]);
    assert_eq!(c.server_key().unwrap(), format!("{} test-model", server.base_url()));
}

/// A server that rejects every `response_format` (422 naming the field): plain text, with the
/// schema in the prompt.
#[test]
fn a_server_rejecting_every_structured_mode_gets_the_schema_in_the_prompt() {
    let server = Server::with_handler(|r, _| {
        if r.json().get("response_format").is_some() {
            Reply::json(
                422,
                json!({"detail": [{"loc": ["body", "response_format"], "msg": "extra fields not permitted"}]}),
            )
        } else {
            Reply::completion("{\"ok\": true}", None)
        }
    });
    let (c, _) = client(config(&server));
    let r = c
        .chat(&hello().with_schema("x", json!({"type": "object", "required": ["ok"]})))
        .unwrap();
    assert_eq!(r.attempts, 3);
    let reqs = server.requests();
    let last = reqs.last().unwrap().json();
    assert!(last.get("response_format").is_none());
    assert!(last["messages"][1]["content"].as_str().unwrap().contains("\"required\""));
}

/// The run's deadline bounds a call in flight: a hung server is given up on when it passes,
/// whatever the per-call time-out and retries say.
#[test]
fn a_deadline_bounds_a_hung_call() {
    let server = Server::with_handler(|_, _| Reply::Hang(Duration::from_secs(30)));
    let mut cfg = config(&server);
    cfg.timeout_s = 300.0;
    cfg.max_retries = 4;
    let c = OpenAiCompatible::new(cfg).unwrap();
    let t0 = std::time::Instant::now();
    c.set_deadline(Some(t0 + Duration::from_millis(800)));
    let err = c.chat(&hello()).unwrap_err();
    assert!(matches!(err, LlmError::Deadline { attempts: 1, .. }), "{err:?}");
    assert!(err.to_string().contains("time budget"), "{err}");
    // Generous bound: the call ended with the deadline, not after 300 s.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    // Past the deadline, no request is made at all.
    let n = server.count();
    let err = c.chat(&hello()).unwrap_err();
    assert!(matches!(err, LlmError::Deadline { attempts: 0, .. }), "{err:?}");
    assert_eq!(server.count(), n);
}
