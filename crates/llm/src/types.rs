use serde::{Deserialize, Serialize};

use crate::error::LlmError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn system(content: impl Into<String>) -> Message {
        Message {
            role: Role::System,
            content: content.into(),
        }
    }
    pub fn user(content: impl Into<String>) -> Message {
        Message {
            role: Role::User,
            content: content.into(),
        }
    }
    pub fn assistant(content: impl Into<String>) -> Message {
        Message {
            role: Role::Assistant,
            content: content.into(),
        }
    }
}

/// One chat call. `None` fields fall back to the model's configuration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Structured output: schema name and JSON schema (sent per [`crate::StructuredMode`]).
    pub json_schema: Option<(String, serde_json::Value)>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    pub reasoning_effort: Option<String>,
}

impl ChatRequest {
    pub fn new(messages: Vec<Message>) -> ChatRequest {
        ChatRequest {
            messages,
            ..Default::default()
        }
    }
    pub fn with_schema(mut self, name: impl Into<String>, schema: serde_json::Value) -> ChatRequest {
        self.json_schema = Some((name.into(), schema));
        self
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// True when the server reported no `usage` and the counts are estimated (≈ 4 chars/token).
    #[serde(default)]
    pub estimated: bool,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// The assistant message text (reasoning fields excluded).
    pub content: String,
    pub usage: Usage,
    /// Cost of this call from the configured prices.
    pub cost_usd: f64,
    /// Wall time of the whole call, retries and waits included.
    pub latency_s: f64,
    /// The model that answered (as the server names it, else the configured one).
    pub model: String,
    /// HTTP attempts made (1 = first try succeeded).
    pub attempts: u32,
    /// The raw response body of the successful attempt (the API key redacted if echoed).
    pub raw: String,
    /// `finish_reason` of the first choice (`"length"` means the reply was cut off).
    #[serde(default)]
    pub finish_reason: Option<String>,
}

impl ChatResponse {
    /// Whether the server says the reply hit the token limit.
    pub fn truncated(&self) -> bool {
        self.finish_reason.as_deref() == Some("length")
    }
}

pub trait LlmClient: Send + Sync {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError>;
    fn model(&self) -> &str;
    /// No call may run past `deadline` (the run's time budget); None lifts it.
    fn set_deadline(&self, _deadline: Option<std::time::Instant>) {}
    /// What the client learnt about its server (fields it rejects), to remember for later runs.
    fn learnt(&self) -> Option<serde_json::Value> {
        None
    }
    /// Start from what an earlier run learnt (see [`LlmClient::learnt`]).
    fn restore_learnt(&self, _learnt: &serde_json::Value) {}
    /// Names the server and model, under which [`LlmClient::learnt`] is remembered.
    fn server_key(&self) -> Option<String> {
        None
    }
}

impl<T: LlmClient + ?Sized> LlmClient for std::sync::Arc<T> {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        (**self).chat(req)
    }
    fn model(&self) -> &str {
        (**self).model()
    }
    fn set_deadline(&self, d: Option<std::time::Instant>) {
        (**self).set_deadline(d)
    }
    fn learnt(&self) -> Option<serde_json::Value> {
        (**self).learnt()
    }
    fn restore_learnt(&self, v: &serde_json::Value) {
        (**self).restore_learnt(v)
    }
    fn server_key(&self) -> Option<String> {
        (**self).server_key()
    }
}

impl<T: LlmClient + ?Sized> LlmClient for Box<T> {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        (**self).chat(req)
    }
    fn model(&self) -> &str {
        (**self).model()
    }
    fn set_deadline(&self, d: Option<std::time::Instant>) {
        (**self).set_deadline(d)
    }
    fn learnt(&self) -> Option<serde_json::Value> {
        (**self).learnt()
    }
    fn restore_learnt(&self, v: &serde_json::Value) {
        (**self).restore_learnt(v)
    }
    fn server_key(&self) -> Option<String> {
        (**self).server_key()
    }
}
