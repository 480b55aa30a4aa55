use std::collections::VecDeque;
use std::sync::Mutex;

use crate::error::LlmError;
use crate::types::{ChatRequest, ChatResponse, LlmClient, Usage};

/// An offline [`LlmClient`] that replays scripted replies in order and records the requests it got.
/// For tests of the search loop; an exhausted script answers `LlmError::Connection`.
pub struct ScriptedClient {
    model: String,
    replies: Mutex<VecDeque<Result<String, LlmError>>>,
    seen: Mutex<Vec<ChatRequest>>,
    cost_per_call: f64,
}

impl ScriptedClient {
    pub fn new<S: Into<String>>(model: &str, replies: impl IntoIterator<Item = S>) -> ScriptedClient {
        ScriptedClient {
            model: model.to_string(),
            replies: Mutex::new(replies.into_iter().map(|s| Ok(s.into())).collect()),
            seen: Mutex::new(Vec::new()),
            cost_per_call: 0.0,
        }
    }
    /// Queue a reply (Ok) or a failure (Err).
    pub fn push(&self, r: Result<String, LlmError>) {
        self.replies.lock().unwrap_or_else(|p| p.into_inner()).push_back(r);
    }
    pub fn with_cost_per_call(mut self, usd: f64) -> ScriptedClient {
        self.cost_per_call = usd;
        self
    }
    /// Requests received so far.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn remaining(&self) -> usize {
        self.replies.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl LlmClient for ScriptedClient {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).push(req.clone());
        let next = self.replies.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        let content = next.unwrap_or_else(|| Err(LlmError::Connection("scripted client: no reply left".into())))?;
        let prompt_chars: usize = req.messages.iter().map(|m| m.content.len()).sum();
        Ok(ChatResponse {
            usage: Usage {
                prompt_tokens: prompt_chars.div_ceil(4) as u64,
                completion_tokens: content.len().div_ceil(4) as u64,
                estimated: true,
            },
            raw: String::new(),
            content,
            cost_usd: self.cost_per_call,
            latency_s: 0.0,
            model: self.model.clone(),
            attempts: 1,
            finish_reason: Some("stop".into()),
        })
    }
    fn model(&self) -> &str {
        &self.model
    }
}
