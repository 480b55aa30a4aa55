use serde::{Deserialize, Serialize};

use crate::error::LlmError;

/// The variable read for the key when `api_key_env` is not set (as OpenAI's own clients do).
pub const DEFAULT_KEY_ENV: &str = "OPENAI_API_KEY";
/// `max_tokens` when none is configured.
pub const DEFAULT_MAX_TOKENS: u32 = 16384;

/// How structured output is requested when a [`crate::ChatRequest`] carries a JSON schema.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredMode {
    /// `json_schema`; if the server rejects it (a 400, 422 or 500 naming `response_format`,
    /// `json_schema` or `json_object`), fall back to `json_object`, then to plain text with the
    /// schema in the prompt, and remember the fallback for later calls.
    #[default]
    Auto,
    /// Always `response_format: {type: json_schema}`.
    JsonSchema,
    /// Always `response_format: {type: json_object}`.
    JsonObject,
    /// Never send `response_format`: the schema goes into the prompt as text.
    None,
}

/// One model endpoint, as a `[llm.planner]` / `[llm.coder]` TOML section.
///
/// ```toml
/// [llm.planner]
/// base_url = "https://api.openai.com/v1"
/// model = "o4-mini"
/// api_key_env = "OPENAI_API_KEY"
/// reasoning_effort = "high"
/// price_prompt_per_mtok = 1.1
/// price_completion_per_mtok = 4.4
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Up to and including the API version, e.g. `https://api.openai.com/v1`,
    /// `http://localhost:11434/v1`, `https://generativelanguage.googleapis.com/v1beta/openai`.
    pub base_url: String,
    pub model: String,
    /// Name of the environment variable holding the API key (read at call time). None: the
    /// key of `OPENAI_API_KEY` when that is set, else no `Authorization` header. An empty name
    /// sends no key at all.
    pub api_key_env: Option<String>,
    pub temperature: Option<f64>,
    /// Cap on the reply's tokens, always sent (as `max_tokens`, or `max_completion_tokens`
    /// where the server asks for that) so that no server generates without end.
    pub max_tokens: Option<u32>,
    /// `low` / `medium` / `high` for reasoning models; dropped (and remembered) if rejected.
    pub reasoning_effort: Option<String>,
    pub structured_output: StructuredMode,
    /// Limit for one whole HTTP attempt (connect + send + full answer), seconds.
    pub timeout_s: f64,
    /// Connect time-out, seconds (capped by `timeout_s`).
    pub connect_timeout_s: f64,
    /// Retries after the first attempt on 429 / 5xx / connection errors / time-outs.
    pub max_retries: u32,
    /// First back-off, seconds; doubles each retry.
    pub backoff_base_s: f64,
    /// Cap on one wait, `Retry-After` included, seconds.
    pub max_backoff_s: f64,
    /// USD per million prompt tokens.
    pub price_prompt_per_mtok: f64,
    /// USD per million completion tokens.
    pub price_completion_per_mtok: f64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            base_url: "https://api.openai.com/v1".into(),
            model: String::new(),
            api_key_env: None,
            temperature: None,
            max_tokens: Some(DEFAULT_MAX_TOKENS),
            reasoning_effort: None,
            structured_output: StructuredMode::Auto,
            timeout_s: 300.0,
            connect_timeout_s: 10.0,
            max_retries: 4,
            backoff_base_s: 2.0,
            max_backoff_s: 60.0,
            price_prompt_per_mtok: 0.0,
            price_completion_per_mtok: 0.0,
        }
    }
}

impl ModelConfig {
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> ModelConfig {
        ModelConfig {
            base_url: base_url.into(),
            model: model.into(),
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), LlmError> {
        let bad = |m: &str| Err(LlmError::Config(m.to_string()));
        if self.model.trim().is_empty() {
            return bad("`model` is empty");
        }
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return bad("`base_url` must start with http:// or https://");
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return bad("`timeout_s` must be > 0");
        }
        if !(self.connect_timeout_s.is_finite() && self.connect_timeout_s > 0.0) {
            return bad("`connect_timeout_s` must be > 0");
        }
        for (n, v) in [
            ("backoff_base_s", self.backoff_base_s),
            ("max_backoff_s", self.max_backoff_s),
            ("price_prompt_per_mtok", self.price_prompt_per_mtok),
            ("price_completion_per_mtok", self.price_completion_per_mtok),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(LlmError::Config(format!("`{n}` must be a finite number >= 0")));
            }
        }
        if let Some(t) = self.temperature
            && !(t.is_finite() && (0.0..=2.0).contains(&t))
        {
            return bad("`temperature` must be in 0..=2");
        }
        if self.max_tokens == Some(0) {
            return bad("`max_tokens` must be > 0");
        }
        Ok(())
    }

    /// Cost of a call with these token counts.
    pub fn cost(&self, prompt_tokens: u64, completion_tokens: u64) -> f64 {
        (prompt_tokens as f64 * self.price_prompt_per_mtok + completion_tokens as f64 * self.price_completion_per_mtok) / 1e6
    }

    /// The variable the key is read from: `api_key_env`, else `OPENAI_API_KEY` when it is set.
    /// None: no key is sent.
    pub fn key_var(&self) -> Option<String> {
        match &self.api_key_env {
            Some(v) if v.trim().is_empty() => None,
            Some(v) => Some(v.trim().to_string()),
            None => std::env::var(DEFAULT_KEY_ENV)
                .ok()
                .filter(|k| !k.trim().is_empty())
                .map(|_| DEFAULT_KEY_ENV.to_string()),
        }
    }

    /// Whether the base URL points at this machine (a local server needs no key).
    pub fn is_local(&self) -> bool {
        let rest = self.base_url.split_once("://").map(|(_, r)| r).unwrap_or(&self.base_url);
        let host_port = rest.split('/').next().unwrap_or("");
        let host = if let Some(h) = host_port.strip_prefix('[') {
            h.split(']').next().unwrap_or("")
        } else {
            host_port.split(':').next().unwrap_or("")
        };
        let host = host.to_ascii_lowercase();
        host == "localhost"
            || host.ends_with(".localhost")
            || host == "::1"
            || host == "0.0.0.0"
            || host.starts_with("127.")
            || host.ends_with(".local")
            || host.starts_with("10.")
            || host.starts_with("192.168.")
            || (host.starts_with("172.")
                && host
                    .split('.')
                    .nth(1)
                    .and_then(|x| x.parse::<u8>().ok())
                    .is_some_and(|x| (16..=31).contains(&x)))
    }

    /// `{base_url}/chat/completions`, tolerant of a trailing slash.
    pub fn endpoint(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}
