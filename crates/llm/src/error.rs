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
    #[error("the reply contains no fenced code block")]
    NoCodeBlock,
    #[error("the code block is truncated (no closing fence and unbalanced braces)")]
    TruncatedCode,
    #[error("the code block is empty")]
    EmptyCode,
    #[error("the code is {found}, but {expected} was asked for")]
    WrongLanguage { expected: String, found: String },
}
