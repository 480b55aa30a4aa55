use thiserror::Error;

/// Errors of a chat call. No variant ever carries the API key (bodies are redacted).
#[derive(Debug, Clone, Error, PartialEq)]
pub enum LlmError {
    /// The server answered with a non-success status that is not retried (or was the last one).
    #[error("HTTP {status} from the LLM server: {body_excerpt}")]
    Http { status: u16, body_excerpt: String },
    /// No complete answer within the configured time-out.
    #[error("LLM request timed out after {after_s:.1} s")]
    Timeout { after_s: f64 },
    /// Could not connect, or the connection broke before a full answer.
    #[error("connection to the LLM server failed: {0}")]
    Connection(String),
    /// Every attempt failed; `last` is the final failure.
    #[error("LLM call failed after {attempts} attempts; last error: {last}")]
    Exhausted { attempts: u32, last: Box<LlmError> },
    /// The server answered 2xx but the body is not a usable chat completion.
    #[error("unusable response from the LLM server: {0}")]
    BadResponse(String),
    /// The run's budget forbids another call.
    #[error("LLM budget exhausted: {0}")]
    Budget(String),
    /// `api_key_env` names a variable that is not set (the variable's name, never a value).
    #[error("environment variable {var} (api_key_env) is not set")]
    MissingApiKey { var: String },
    /// The server refused the key (401 / 403): the run cannot go on without a change.
    #[error("HTTP {status} from the LLM server: {}; {body_excerpt}", match var {
        Some(v) => format!("the key in ${v} was refused"),
        None => format!("no API key was sent (set ${} or name the key's variable with --api-key-env / `api_key_env`)", crate::config::DEFAULT_KEY_ENV),
    })]
    Auth {
        status: u16,
        /// The variable the key came from (its name only).
        var: Option<String>,
        body_excerpt: String,
    },
    /// The run's time budget ran out before or during the call.
    #[error("the run's time budget ran out during the LLM call (after {attempts} attempt(s){})", last.as_ref().map(|l| format!("; last error: {l}")).unwrap_or_default())]
    Deadline { attempts: u32, last: Option<String> },
    /// The model configuration is unusable.
    #[error("invalid LLM configuration: {0}")]
    Config(String),
}

impl LlmError {
    /// Whether the failure is transient (worth another attempt).
    pub fn is_retryable(&self) -> bool {
        match self {
            LlmError::Http { status, .. } => *status == 408 || *status == 409 || *status == 429 || *status >= 500,
            LlmError::Timeout { .. } | LlmError::Connection(_) => true,
            _ => false,
        }
    }

    /// HTTP attempts the failed call made (0: none reached the network).
    pub fn attempts(&self) -> u32 {
        match self {
            LlmError::Exhausted { attempts, .. } | LlmError::Deadline { attempts, .. } => *attempts,
            LlmError::Budget(_) | LlmError::MissingApiKey { .. } | LlmError::Config(_) => 0,
            _ => 1,
        }
    }

    /// A failure of the transport or the server (rate limit, time-out, connection, 5xx, an
    /// unusable body), not of the model's answer: the action it was for is not to blame.
    pub fn is_transport(&self) -> bool {
        match self.root() {
            LlmError::Http { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            LlmError::Timeout { .. } | LlmError::Connection(_) | LlmError::Deadline { .. } => true,
            LlmError::BadResponse(m) => !m.starts_with("the model refused") && !m.starts_with("empty message"),
            _ => false,
        }
    }

    /// The innermost error (through `Exhausted`).
    pub fn root(&self) -> &LlmError {
        match self {
            LlmError::Exhausted { last, .. } => last.root(),
            e => e,
        }
    }
}

/// Errors of reply parsing; each says what was wrong so that a repair prompt can be built.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum ParseError {
    #[error("the reply contains no JSON object")]
    NoJson,
    #[error("the JSON in the reply is truncated (it ends before all brackets/strings are closed): ...{tail}")]
    TruncatedJson { tail: String },
    #[error("the JSON in the reply is invalid: {message}")]
    InvalidJson { message: String },
    #[error("the JSON does not have the expected structure: {message}")]
    Schema { message: String },
    /// The server says the reply hit the token limit (`finish_reason: length`).
    #[error("the reply was cut off at the token limit (finish_reason: length{})", max_tokens.map(|n| format!(", max_tokens {n}")).unwrap_or_default())]
    Truncated { max_tokens: Option<u32> },
    #[error("the reply contains no fenced code block")]
    NoCodeBlock,
    #[error("the code block is truncated (no closing fence and unbalanced braces)")]
    TruncatedCode,
    #[error("the code block is empty")]
    EmptyCode,
    #[error("the code is {found}, but {expected} was asked for")]
    WrongLanguage { expected: String, found: String },
    /// The code does something a candidate may not (see `ksearch_kb::untrusted`).
    #[error("the code was refused: {reason}")]
    Refused { reason: String },
}
