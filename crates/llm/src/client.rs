use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::config::{ModelConfig, StructuredMode};
use crate::error::LlmError;
use crate::types::{ChatRequest, ChatResponse, LlmClient, Usage};

/// How the client waits between attempts (replaceable so tests can record waits instead).
pub type Sleeper = Arc<dyn Fn(Duration) + Send + Sync>;

/// Largest response body read (bytes).
const MAX_BODY: u64 = 32 << 20;
/// Characters of a server body kept in errors.
const EXCERPT: usize = 600;
/// Fallbacks applied to one call on 400s that name a request field.
const MAX_ADAPTATIONS: u32 = 5;

/// Which name carries the completion-token cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum TokenField {
    MaxTokens,
    MaxCompletionTokens,
    Omit,
}

/// What this client learnt a server rejects; kept for later calls (and, through
/// [`LlmClient::learnt`], by the caller for later runs against the same server and model).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct Adaptations {
    /// A downgraded structured-output mode (Auto only).
    structured: Option<StructuredMode>,
    drop_reasoning: bool,
    drop_temperature: bool,
    token_field: TokenField,
}

impl Default for Adaptations {
    fn default() -> Self {
        Adaptations {
            structured: None,
            drop_reasoning: false,
            drop_temperature: false,
            token_field: TokenField::MaxTokens,
        }
    }
}

/// A chat-completions client for any OpenAI-compatible endpoint.
pub struct OpenAiCompatible {
    cfg: ModelConfig,
    agent: ureq::Agent,
    adapt: Mutex<Adaptations>,
    sleeper: Sleeper,
    /// No call may run past this instant (the run's time budget).
    deadline: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for OpenAiCompatible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiCompatible")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

enum Failure {
    /// Non-2xx answer.
    Status {
        status: u16,
        retry_after: Option<Duration>,
        body: String,
    },
    /// Anything else; `retryable` says whether another attempt may help.
    Other { err: LlmError, retryable: bool },
}

impl OpenAiCompatible {
    pub fn new(cfg: ModelConfig) -> Result<OpenAiCompatible, LlmError> {
        cfg.validate()?;
        let total = Duration::from_secs_f64(cfg.timeout_s);
        let connect = Duration::from_secs_f64(cfg.connect_timeout_s.min(cfg.timeout_s));
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(total))
            .timeout_connect(Some(connect))
            .user_agent(concat!("ksearch/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(OpenAiCompatible {
            cfg,
            agent,
            adapt: Mutex::new(Adaptations::default()),
            sleeper: Arc::new(std::thread::sleep),
            deadline: Mutex::new(None),
        })
    }

    /// Replace how waits between attempts are done (tests record them instead of sleeping).
    pub fn with_sleeper(mut self, sleeper: Sleeper) -> OpenAiCompatible {
        self.sleeper = sleeper;
        self
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The fallbacks learnt from this server so far, e.g. `["response_format: json_object"]`.
    pub fn fallbacks(&self) -> Vec<String> {
        let a = *self.adapt.lock().unwrap_or_else(|p| p.into_inner());
        let mut v = Vec::new();
        if let Some(m) = a.structured {
            v.push(format!("response_format: {}", mode_name(m)));
        }
        if a.drop_reasoning {
            v.push("reasoning_effort: dropped".into());
        }
        if a.drop_temperature {
            v.push("temperature: dropped".into());
        }
        match a.token_field {
            TokenField::MaxTokens => {}
            TokenField::MaxCompletionTokens => v.push("max_tokens: sent as max_completion_tokens".into()),
            TokenField::Omit => v.push("max_tokens: dropped".into()),
        }
        v
    }

    /// The key's variable and the key (both None when no key is sent).
    fn api_key(&self) -> Result<(Option<String>, Option<String>), LlmError> {
        match self.cfg.key_var() {
            None => Ok((None, None)),
            Some(var) => match std::env::var(&var) {
                Ok(k) if !k.trim().is_empty() => Ok((Some(var), Some(k.trim().to_string()))),
                _ => Err(LlmError::MissingApiKey { var }),
            },
        }
    }

    fn deadline(&self) -> Option<Instant> {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn effective_mode(&self, a: &Adaptations) -> StructuredMode {
        a.structured.unwrap_or(self.cfg.structured_output)
    }

    /// The request body: standard chat-completions fields only.
    fn body(&self, req: &ChatRequest, a: &Adaptations) -> Value {
        let messages: Vec<Value> = req
            .messages
            .iter()
            .map(|m| json!({"role": m.role.as_str(), "content": m.content}))
            .collect();
        let mut body = serde_json::Map::new();
        body.insert("model".into(), json!(self.cfg.model));
        body.insert("messages".into(), Value::Array(messages));
        if let Some(t) = req.temperature.or(self.cfg.temperature)
            && !a.drop_temperature
        {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(n) = req.max_tokens.or(self.cfg.max_tokens) {
            match a.token_field {
                TokenField::MaxTokens => {
                    body.insert("max_tokens".into(), json!(n));
                }
                TokenField::MaxCompletionTokens => {
                    body.insert("max_completion_tokens".into(), json!(n));
                }
                TokenField::Omit => {}
            }
        }
        if let Some(r) = req.reasoning_effort.as_ref().or(self.cfg.reasoning_effort.as_ref())
            && !a.drop_reasoning
        {
            body.insert("reasoning_effort".into(), json!(r));
        }
        if let Some((name, schema)) = &req.json_schema {
            match self.effective_mode(a) {
                StructuredMode::Auto | StructuredMode::JsonSchema => {
                    body.insert(
                        "response_format".into(),
                        json!({"type": "json_schema", "json_schema": {"name": sanitize_name(name), "schema": schema, "strict": true}}),
                    );
                }
                StructuredMode::JsonObject => {
                    body.insert("response_format".into(), json!({"type": "json_object"}));
                }
                StructuredMode::None => {
                    // Plain text: the schema goes into the prompt.
                    let note = format!(
                        "\n\nReply with one JSON object (no other text) that follows this JSON schema:\n```json\n{schema}\n```"
                    );
                    if let Some(Value::Array(msgs)) = body.get_mut("messages")
                        && let Some(last) = msgs.iter_mut().rev().find(|m| m["role"] == "user")
                        && let Some(Value::String(c)) = last.get_mut("content")
                    {
                        c.push_str(&note);
                    }
                }
            }
        }
        Value::Object(body)
    }

    /// On a rejection (400, 422, 500 alike) that names a field we sent, change how that field is
    /// sent; true if changed.
    fn adapt_to_rejection(&self, body_sent: &Value, answer: &str) -> bool {
        let text = answer.to_ascii_lowercase();
        let sent = |k: &str| body_sent.get(k).is_some();
        let mut a = self.adapt.lock().unwrap_or_else(|p| p.into_inner());
        let what;
        if sent("response_format")
            && self.cfg.structured_output == StructuredMode::Auto
            && [
                "response_format",
                "json_schema",
                "json_object",
                "structured output",
                "response format",
            ]
            .iter()
            .any(|k| text.contains(k))
        {
            let next = match self.effective_mode(&a) {
                StructuredMode::Auto | StructuredMode::JsonSchema => StructuredMode::JsonObject,
                _ => StructuredMode::None,
            };
            a.structured = Some(next);
            what = format!("response_format -> {}", mode_name(next));
        } else if sent("reasoning_effort") && (text.contains("reasoning_effort") || text.contains("reasoning")) {
            a.drop_reasoning = true;
            what = "reasoning_effort dropped".to_string();
        } else if sent("max_tokens") && text.contains("max_tokens") {
            a.token_field = if text.contains("max_completion_tokens") {
                TokenField::MaxCompletionTokens
            } else {
                TokenField::Omit
            };
            what = "max_tokens adjusted".to_string();
        } else if sent("max_completion_tokens") && text.contains("max_completion_tokens") {
            a.token_field = TokenField::Omit;
            what = "max_completion_tokens dropped".to_string();
        } else if sent("temperature") && text.contains("temperature") {
            a.drop_temperature = true;
            what = "temperature dropped".to_string();
        } else {
            return false;
        }
        tracing::warn!(model = %self.cfg.model, change = %what, "LLM server rejected a request field; trying again with the change");
        true
    }

    fn attempt(&self, body: &str, key: Option<&str>, limit: Duration) -> Result<String, Failure> {
        let connect = Duration::from_secs_f64(self.cfg.connect_timeout_s).min(limit);
        let mut rb = self
            .agent
            .post(&self.cfg.endpoint())
            .config()
            .timeout_global(Some(limit))
            .timeout_connect(Some(connect))
            .build()
            .header("Content-Type", "application/json");
        if let Some(k) = key {
            rb = rb.header("Authorization", format!("Bearer {k}"));
        }
        let mut resp = rb.send(body.as_bytes()).map_err(|e| self.transport(e, key, limit))?;
        let status = resp.status().as_u16();
        let retry_after = retry_after(resp.headers());
        let text = resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_string()
            .map_err(|e| self.transport(e, key, limit))?;
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(Failure::Status {
                status,
                retry_after,
                body: redact(&text, key),
            })
        }
    }

    fn transport(&self, e: ureq::Error, key: Option<&str>, limit: Duration) -> Failure {
        let msg = redact(&e.to_string(), key);
        match e {
            ureq::Error::Timeout(_) => Failure::Other {
                err: LlmError::Timeout {
                    after_s: limit.as_secs_f64(),
                },
                retryable: true,
            },
            ureq::Error::Io(io) if matches!(io.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
                Failure::Other {
                    err: LlmError::Timeout {
                        after_s: limit.as_secs_f64(),
                    },
                    retryable: true,
                }
            }
            ureq::Error::BadUri(_) | ureq::Error::Http(_) | ureq::Error::RequireHttpsOnly(_) | ureq::Error::TlsRequired => {
                Failure::Other {
                    err: LlmError::Config(msg),
                    retryable: false,
                }
            }
            ureq::Error::BodyExceedsLimit(n) => Failure::Other {
                err: LlmError::BadResponse(format!("response body over {n} bytes")),
                retryable: false,
            },
            _ => Failure::Other {
                err: LlmError::Connection(msg),
                retryable: true,
            },
        }
    }

    /// Parse a 2xx body. Err(retryable, error).
    fn parse_completion(&self, req: &ChatRequest, text: &str) -> Result<Parsed, (bool, LlmError)> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            (
                true,
                LlmError::BadResponse(format!("body is not valid JSON ({e}): {}", excerpt(text, EXCERPT))),
            )
        })?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            let m = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err((
                true,
                LlmError::BadResponse(format!("server returned an error object: {}", excerpt(&m, EXCERPT))),
            ));
        }
        let choice = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
            .ok_or_else(|| {
                (
                    true,
                    LlmError::BadResponse(format!("no `choices` in the response: {}", excerpt(text, EXCERPT))),
                )
            })?;
        let finish_reason = choice.get("finish_reason").and_then(Value::as_str).map(str::to_string);
        let msg = choice.get("message").unwrap_or(&Value::Null);
        let content = match msg.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
                .collect::<Vec<_>>()
                .join(""),
            _ => String::new(),
        };
        if content.trim().is_empty() {
            if let Some(r) = msg.get("refusal").and_then(Value::as_str) {
                return Err((
                    false,
                    LlmError::BadResponse(format!("the model refused: {}", excerpt(r, EXCERPT))),
                ));
            }
            return Err((
                false,
                LlmError::BadResponse(format!(
                    "empty message content (finish_reason: {})",
                    finish_reason.as_deref().unwrap_or("none")
                )),
            ));
        }
        let u = v.get("usage").filter(|u| u.is_object());
        let num = |keys: &[&str]| u.and_then(|u| keys.iter().find_map(|k| u.get(*k).and_then(Value::as_u64)));
        let usage = match (
            num(&["prompt_tokens", "input_tokens"]),
            num(&["completion_tokens", "output_tokens"]),
        ) {
            (Some(p), Some(c)) => Usage {
                prompt_tokens: p,
                completion_tokens: c,
                estimated: false,
            },
            (p, c) => {
                let prompt_chars: usize = req.messages.iter().map(|m| m.content.chars().count() + 4).sum();
                Usage {
                    prompt_tokens: p.unwrap_or(prompt_chars.div_ceil(4) as u64),
                    completion_tokens: c.unwrap_or(content.chars().count().div_ceil(4) as u64),
                    estimated: true,
                }
            }
        };
        let model = v
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .unwrap_or(&self.cfg.model)
            .to_string();
        Ok(Parsed {
            content,
            usage,
            model,
            finish_reason,
        })
    }
}

struct Parsed {
    content: String,
    usage: Usage,
    model: String,
    finish_reason: Option<String>,
}

impl LlmClient for OpenAiCompatible {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        if req.messages.is_empty() {
            return Err(LlmError::Config("a chat request needs at least one message".into()));
        }
        let start = Instant::now();
        let (var, key) = self.api_key()?;
        let key = key.as_deref();
        let deadline = self.deadline();
        let per_call = Duration::from_secs_f64(self.cfg.timeout_s);
        let mut attempts = 0u32;
        let mut retries = 0u32;
        let mut adaptations = 0u32;
        let mut last: Option<LlmError> = None;
        let out_of_time = |attempts: u32, last: &Option<LlmError>| {
            tracing::info!(model = %self.cfg.model, attempts, "LLM call stopped: the run's time budget ran out");
            LlmError::Deadline {
                attempts,
                last: last.as_ref().map(|e| e.to_string()),
            }
        };
        let wrap = |attempts: u32, err: LlmError| {
            if attempts > 1 {
                LlmError::Exhausted {
                    attempts,
                    last: Box::new(err),
                }
            } else {
                err
            }
        };
        loop {
            // One deadline: no attempt runs past the run's time budget.
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l < Duration::from_millis(50)) {
                return Err(out_of_time(attempts, &last));
            }
            let limit = left.map_or(per_call, |l| l.min(per_call));
            let capped = limit < per_call;
            attempts += 1;
            let a = *self.adapt.lock().unwrap_or_else(|p| p.into_inner());
            let body = self.body(req, &a);
            let body_text = body.to_string();
            tracing::debug!(model = %self.cfg.model, attempt = attempts, bytes = body_text.len(), limit_s = limit.as_secs_f64(), "LLM request");
            let (err, retryable, wait_hint) = match self.attempt(&body_text, key, limit) {
                Ok(text) => match self.parse_completion(req, &text) {
                    Ok(p) => {
                        let cost = self.cfg.cost(p.usage.prompt_tokens, p.usage.completion_tokens);
                        let latency_s = start.elapsed().as_secs_f64();
                        tracing::info!(model = %p.model, attempts, latency_s, cost, "LLM reply");
                        return Ok(ChatResponse {
                            content: redact(&p.content, key),
                            usage: p.usage,
                            cost_usd: cost,
                            latency_s,
                            model: p.model,
                            attempts,
                            raw: redact(&text, key),
                            finish_reason: p.finish_reason,
                        });
                    }
                    Err((retryable, e)) => (redact_err(e, key), retryable, None),
                },
                Err(Failure::Status {
                    status,
                    retry_after,
                    body: answer,
                }) => {
                    if matches!(status, 400 | 415 | 422 | 500 | 501)
                        && adaptations < MAX_ADAPTATIONS
                        && self.adapt_to_rejection(&body, &answer)
                    {
                        adaptations += 1;
                        continue;
                    }
                    if status == 401 || status == 403 {
                        let e = LlmError::Auth {
                            status,
                            var: var.clone(),
                            body_excerpt: excerpt(&answer, EXCERPT),
                        };
                        return Err(wrap(attempts, e));
                    }
                    let e = LlmError::Http {
                        status,
                        body_excerpt: excerpt(&answer, EXCERPT),
                    };
                    let r = e.is_retryable();
                    (e, r, retry_after)
                }
                Err(Failure::Other { err, retryable }) => {
                    if capped && matches!(err, LlmError::Timeout { .. }) {
                        return Err(out_of_time(attempts, &Some(err)));
                    }
                    (redact_err(err, key), retryable, None)
                }
            };
            if !retryable || retries >= self.cfg.max_retries {
                if retryable {
                    tracing::warn!(model = %self.cfg.model, attempts, error = %err, "LLM call failed; no retries left");
                }
                return Err(wrap(attempts, err));
            }
            retries += 1;
            let wait = retry_delay(retries, wait_hint, self.cfg.backoff_base_s, self.cfg.max_backoff_s, jitter());
            if let Some(d) = deadline
                && Instant::now() + wait >= d
            {
                return Err(out_of_time(attempts, &Some(err)));
            }
            tracing::warn!(model = %self.cfg.model, attempt = attempts, error = %err, wait_s = wait.as_secs_f64(), "LLM call failed; retrying");
            last = Some(err);
            (self.sleeper)(wait);
        }
    }

    fn model(&self) -> &str {
        &self.cfg.model
    }

    fn set_deadline(&self, deadline: Option<Instant>) {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner()) = deadline;
    }

    fn learnt(&self) -> Option<Value> {
        let a = *self.adapt.lock().unwrap_or_else(|p| p.into_inner());
        (a != Adaptations::default()).then(|| serde_json::to_value(a).ok()).flatten()
    }

    fn restore_learnt(&self, v: &Value) {
        if let Ok(mut a) = serde_json::from_value::<Adaptations>(v.clone()) {
            if self.cfg.structured_output != StructuredMode::Auto {
                // A mode set in the configuration is kept as set.
                a.structured = None;
            }
            tracing::info!(model = %self.cfg.model, base_url = %self.cfg.base_url, learnt = %v, "using what an earlier run learnt about this server");
            *self.adapt.lock().unwrap_or_else(|p| p.into_inner()) = a;
        }
    }

    fn server_key(&self) -> Option<String> {
        Some(format!("{} {}", self.cfg.base_url.trim_end_matches('/'), self.cfg.model))
    }
}

/// The wait before retry number `retry` (1-based): the server's `Retry-After` if given, else
/// `base * 2^(retry-1) * (1 + jitter)`; both capped at `cap_s`.
pub(crate) fn retry_delay(retry: u32, retry_after: Option<Duration>, base_s: f64, cap_s: f64, jitter: f64) -> Duration {
    let cap = Duration::from_secs_f64(cap_s.max(0.0));
    if let Some(d) = retry_after {
        return d.min(cap);
    }
    let exp = 2f64.powi(retry.saturating_sub(1).min(30) as i32);
    let s = (base_s * exp * (1.0 + jitter.clamp(0.0, 1.0))).min(cap_s);
    Duration::from_secs_f64(s.max(0.0))
}

/// 0..0.25 from the clock (no RNG dependency; only spreads concurrent retries).
fn jitter() -> f64 {
    let n = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (n % 1000) as f64 / 1000.0 * 0.25
}

/// `Retry-After` in seconds (integer or decimal), or `retry-after-ms`. HTTP dates are ignored.
fn retry_after(h: &ureq::http::HeaderMap) -> Option<Duration> {
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::trim);
    let secs = |s: &str| s.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
    if let Some(ms) = get("retry-after-ms").and_then(secs) {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    get("retry-after").and_then(secs).map(Duration::from_secs_f64)
}

fn mode_name(m: StructuredMode) -> &'static str {
    match m {
        StructuredMode::Auto => "auto",
        StructuredMode::JsonSchema => "json_schema",
        StructuredMode::JsonObject => "json_object",
        StructuredMode::None => "none",
    }
}

/// Schema names must match `[a-zA-Z0-9_-]{1,64}` for OpenAI.
fn sanitize_name(n: &str) -> String {
    let s: String = n
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if s.is_empty() { "reply".into() } else { s }
}

/// The first `n` characters of a server's text, on one line.
pub(crate) fn excerpt(s: &str, n: usize) -> String {
    let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let s = one_line.as_str();
    if s.chars().count() <= n {
        return s.to_string();
    }
    let head: String = s.chars().take(n).collect();
    format!("{head}…")
}

/// Remove the API key from text that came back from the server (some echo headers).
pub(crate) fn redact(s: &str, key: Option<&str>) -> String {
    match key {
        Some(k) if k.len() >= 4 && s.contains(k) => s.replace(k, "[REDACTED]"),
        _ => s.to_string(),
    }
}

fn redact_err(e: LlmError, key: Option<&str>) -> LlmError {
    match e {
        LlmError::Connection(m) => LlmError::Connection(redact(&m, key)),
        LlmError::BadResponse(m) => LlmError::BadResponse(redact(&m, key)),
        LlmError::Config(m) => LlmError::Config(redact(&m, key)),
        LlmError::Http { status, body_excerpt } => LlmError::Http {
            status,
            body_excerpt: redact(&body_excerpt, key),
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_doubles_and_caps() {
        assert_eq!(retry_delay(1, None, 1.0, 60.0, 0.0), Duration::from_secs(1));
        assert_eq!(retry_delay(3, None, 1.0, 60.0, 0.0), Duration::from_secs(4));
        assert_eq!(retry_delay(10, None, 1.0, 60.0, 0.0), Duration::from_secs(60));
        assert_eq!(
            retry_delay(1, Some(Duration::from_secs(7)), 1.0, 60.0, 0.0),
            Duration::from_secs(7)
        );
        assert_eq!(
            retry_delay(1, Some(Duration::from_secs(700)), 1.0, 60.0, 0.0),
            Duration::from_secs(60)
        );
        assert!(retry_delay(2, None, 1.0, 60.0, 0.2) >= Duration::from_secs(2));
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize_name("planner init!"), "planner_init_");
        assert_eq!(sanitize_name(""), "reply");
    }

    #[test]
    fn redaction() {
        assert_eq!(
            redact("Bearer sk-secret-123 echoed", Some("sk-secret-123")),
            "Bearer [REDACTED] echoed"
        );
        assert_eq!(redact("abc", None), "abc");
    }
}
