use serde::{Deserialize, Serialize};

use crate::error::LlmError;

/// How structured output is requested when a [`crate::ChatRequest`] carries a JSON schema.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredMode {
    /// `json_schema`; if the server rejects it (400 naming `response_format`/`json_schema`), fall back
    /// to `json_object`, then to nothing, and remember the fallback for later calls.
    #[default]
    Auto,
    /// Always `response_format: {type: json_schema}`.
    JsonSchema,
    /// Always `response_format: {type: json_object}`.
    JsonObject,
    /// Never send `response_format` (the prompt alone asks for JSON).
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
    /// Name of the environment variable holding the API key (read at call time). None: no auth.
    pub api_key_env: Option<String>,
    pub temperature: Option<f64>,
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
            max_tokens: None,
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
        Ok(())
    }

    /// Cost of a call with these token counts.
    pub fn cost(&self, prompt_tokens: u64, completion_tokens: u64) -> f64 {
        (prompt_tokens as f64 * self.price_prompt_per_mtok + completion_tokens as f64 * self.price_completion_per_mtok) / 1e6
    }

    /// `{base_url}/chat/completions`, tolerant of a trailing slash.
    pub fn endpoint(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}
