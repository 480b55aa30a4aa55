//! The LLM client layer of ksearch.
//!
//! - [`LlmClient`] and its one real implementation [`OpenAiCompatible`]: chat completions over any
//!   OpenAI-compatible endpoint (OpenAI, Gemini's compatible endpoint, OpenRouter, vLLM, Ollama,
//!   llama.cpp…), with time-outs, retries, back-off, `Retry-After`, cost accounting, and automatic
//!   degradation when a server rejects optional request fields.
//! - [`Budget`] and [`Budgeted`]: a persistent spend / call cap.
//! - [`parse`]: tolerant extraction of JSON and code from model replies, language detection and
//!   repair prompts.
//! - [`prompts`]: the minijinja prompt templates, their bounded render contexts, the JSON schemas of
//!   the planner replies and the Rust types those replies parse into.
//! - [`ScriptedClient`]: an offline client replaying canned replies, for tests of callers.

mod budget;
mod client;
mod config;
mod error;
mod mock;
pub mod parse;
pub mod prompts;
mod types;

pub use budget::{Budget, Budgeted};
pub use client::{OpenAiCompatible, Sleeper};
pub use config::{DEFAULT_KEY_ENV, DEFAULT_MAX_TOKENS, ModelConfig, StructuredMode};
pub use error::{LlmError, ParseError};
pub use mock::ScriptedClient;
pub use parse::{detect_lang, extract_code, extract_json, repair_prompt};
pub use types::{ChatRequest, ChatResponse, LlmClient, Message, Role, Usage};
