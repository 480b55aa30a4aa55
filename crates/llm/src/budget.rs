use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::LlmError;
use crate::types::{ChatRequest, ChatResponse, LlmClient};

/// A cap on LLM spend and calls for a run; serialisable so a resumed run continues the count.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Budget {
    pub max_cost_usd: Option<f64>,
    pub max_calls: Option<u32>,
    pub spent_usd: f64,
    pub calls: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Budget {
    pub fn new(max_cost_usd: Option<f64>, max_calls: Option<u32>) -> Budget {
        Budget {
            max_cost_usd,
            max_calls,
            ..Default::default()
        }
    }

    pub fn unlimited() -> Budget {
        Budget::default()
    }

    /// Ok if one more call is allowed.
    pub fn check(&self) -> Result<(), LlmError> {
        if let Some(m) = self.max_calls
            && self.calls >= m
        {
            return Err(LlmError::Budget(format!("{} of {} allowed LLM calls made", self.calls, m)));
        }
        if let Some(m) = self.max_cost_usd
            && self.spent_usd >= m
        {
            return Err(LlmError::Budget(format!(
                "spent ${:.4} of the ${:.4} allowed",
                self.spent_usd, m
            )));
        }
        Ok(())
    }

    pub fn record(&mut self, r: &ChatResponse) {
        self.calls += 1;
        self.spent_usd += r.cost_usd.max(0.0);
        self.prompt_tokens += r.usage.prompt_tokens;
        self.completion_tokens += r.usage.completion_tokens;
    }

    /// Dollars left, if capped.
    pub fn remaining_usd(&self) -> Option<f64> {
        self.max_cost_usd.map(|m| (m - self.spent_usd).max(0.0))
    }
}

/// A client that checks a shared [`Budget`] before each call and records each reply.
/// Planner and coder may share one budget (clone the `Arc`).
pub struct Budgeted<C> {
    inner: C,
    budget: Arc<Mutex<Budget>>,
}

impl<C: LlmClient> Budgeted<C> {
    pub fn new(inner: C, budget: Arc<Mutex<Budget>>) -> Budgeted<C> {
        Budgeted { inner, budget }
    }
    pub fn budget(&self) -> Arc<Mutex<Budget>> {
        self.budget.clone()
    }
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: LlmClient> LlmClient for Budgeted<C> {
    fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        self.budget.lock().unwrap_or_else(|p| p.into_inner()).check()?;
        let r = self.inner.chat(req)?;
        self.budget.lock().unwrap_or_else(|p| p.into_inner()).record(&r);
        Ok(r)
    }
    fn model(&self) -> &str {
        self.inner.model()
    }
    fn set_deadline(&self, d: Option<std::time::Instant>) {
        self.inner.set_deadline(d)
    }
    fn learnt(&self) -> Option<serde_json::Value> {
        self.inner.learnt()
    }
    fn restore_learnt(&self, v: &serde_json::Value) {
        self.inner.restore_learnt(v)
    }
    fn server_key(&self) -> Option<String> {
        self.inner.server_key()
    }
}
