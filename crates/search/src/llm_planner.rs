//! The LLM planner: a reasoning model ("planner") plans on the persistent search tree, a code
//! model ("coder") writes the full candidate for ONE modification per round.
//!
//! - Roles are configured by `[llm]` (both), `[llm.planner]` / `[llm.coder]` (one each) and the
//!   flags `--model --planner-model --coder-model --base-url --max-cost --max-llm-calls`. The run
//!   config keeps the merged table; it never holds a key, only `api_key_env`, the variable's name.
//! - Every call (prompt, raw reply, parsed result, usage, cost, latency, attempts, error) is stored
//!   in `llm_calls`, linked to its node. Unusable replies get a bounded number of repair prompts;
//!   transport failures are retried by the client; whatever still fails is recorded and the round
//!   goes on without it (a failed write, or measurement-only tree updates). Nothing here ends the
//!   run with an error.
//! - Failed LLM edits get up to `max_debug` debug rounds (a child "debug: fix …" action; the coder
//!   sees the failed source and its log), then the action is marked too hard.
//! - The budget (`max_cost` / `max_calls`) is persisted as the run artifact `llm_budget` after
//!   every call; when it is spent, [`Planner::stop_reason`] stops the run cleanly and `resume`
//!   (with a raised limit) continues the count.

use anyhow::{Result, bail};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use ksearch_core::Backend;
use ksearch_core::protocol::{Candidate, EvalReply, Lang};
use ksearch_core::tree::{self, Action, Assessment, Node, NodeStatus, Tree};
use ksearch_llm::prompts::{
    BestView, CoderContext, EvalView, Impact as PImpact, NodeView, PlannerContext, PlannerInit, PlannerUpdate, Prompts,
    ProposedAction, TargetInfo, TaskSummary, TreeOp, truncate_middle,
};
use ksearch_llm::{Budget, ChatRequest, ChatResponse, LlmClient, LlmError, ModelConfig, OpenAiCompatible, ParseError};
use ksearch_store::LlmCallRow;

use crate::planner::{Ctx, Offline, Outcome, Planner, Proposal, TreeEdit, Written, instantiate, validate_edit};

/// Keys of `[llm]` that are not model settings.
const OWN_KEYS: &[&str] = &["planner", "coder", "max_cost", "max_calls", "max_debug", "max_repairs"];
/// Keys that would put a secret into the run's stored configuration.
const SECRET_KEYS: &[&str] = &["api_key", "key", "token", "secret", "authorization"];
/// Separates an edit's title from its description in `Action::Edit`.
const TITLE_SEP: &str = " — ";
/// Title prefix of debug actions.
const DEBUG_PREFIX: &str = "debug: fix ";
/// Kernel label of LLM-written candidates in the store.
const LLM_KERNEL: &str = "llm";
/// Artifact kinds.
const BUDGET_ARTIFACT: &str = "llm_budget";
const INIT_ARTIFACT: &str = "planner_init";
/// What a server was found to accept, named `<base_url> <model>` (read by later runs).
const SERVER_ARTIFACT: &str = "llm_server";
/// Transport failures of the coder in a row after which the run stops (resumable).
const MAX_TRANSPORT_STREAK: u32 = 3;
/// Largest reply stored whole (characters); longer ones keep their head and tail.
const MAX_STORED_REPLY: usize = 64 * 1024;

/// The resolved `[llm]` settings of a run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub planner: ModelConfig,
    pub coder: ModelConfig,
    pub max_cost: Option<f64>,
    pub max_calls: Option<u32>,
    /// Debug rounds a failed LLM edit gets before it is marked too hard.
    pub max_debug: u32,
    /// Repair prompts after an unusable reply, per call.
    pub max_repairs: u32,
}

fn obj(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !v.is_object() {
        *v = json!({});
    }
    v.as_object_mut().expect("object")
}

/// A URL carrying credentials: a user or password before the host, or a query parameter named
/// like a key (`?key=`, `?api_key=`, `?token=`...).
fn secret_in_url(u: &str) -> Option<&'static str> {
    let rest = u.split_once("://").map(|(_, r)| r).unwrap_or(u);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') {
        return Some("carries credentials before its host");
    }
    let query = rest.split_once('?').map(|(_, q)| q).unwrap_or("");
    let keyish = query.split('&').any(|p| {
        let name = p.split('=').next().unwrap_or("").to_ascii_lowercase();
        ["key", "token", "secret", "password", "auth", "sig"]
            .iter()
            .any(|w| name.contains(w))
    });
    keyish.then_some("carries a key in its query")
}

fn check_secrets(v: &Value, at: &str) -> Result<()> {
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            if SECRET_KEYS.contains(&k.to_ascii_lowercase().as_str()) {
                bail!(
                    "[{at}] has `{k}`: API keys are never stored; put the key in an environment variable and name it with `api_key_env`"
                );
            }
            if k == "base_url"
                && let Some(u) = x.as_str()
                && let Some(why) = secret_in_url(u)
            {
                bail!(
                    "[{at}] base_url {why}: API keys are never stored; put the key in an environment variable and name it with `api_key_env`"
                );
            }
            if x.is_object() {
                check_secrets(x, &format!("{at}.{k}"))?;
            }
        }
    }
    Ok(())
}

/// The LLM settings given on the command line (each overrides the stored value).
#[derive(Debug, Clone, Default)]
pub struct LlmFlags {
    pub model: Option<String>,
    pub planner_model: Option<String>,
    pub coder_model: Option<String>,
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    pub max_cost: Option<f64>,
    pub max_llm_calls: Option<u32>,
}

/// Fold the LLM flags into the run's `[llm]` table (kept in the run config, so `resume` uses the
/// same models; a flag given to `resume` overrides the stored value).
pub fn apply_flags(llm: &mut Option<Value>, f: &LlmFlags) -> Result<()> {
    let any = f.model.is_some()
        || f.planner_model.is_some()
        || f.coder_model.is_some()
        || f.base_url.is_some()
        || f.api_key_env.is_some()
        || f.max_cost.is_some()
        || f.max_llm_calls.is_some();
    if llm.is_none() && !any {
        return Ok(());
    }
    let v = llm.get_or_insert_with(|| json!({}));
    let o = obj(v);
    let roles = ["planner", "coder"];
    if let Some(m) = &f.model {
        o.insert("model".into(), json!(m));
        for r in roles {
            if let Some(t) = o.get_mut(r).and_then(Value::as_object_mut) {
                t.remove("model");
            }
        }
    }
    if let Some(u) = &f.base_url {
        o.insert("base_url".into(), json!(u));
        for r in roles {
            if let Some(t) = o.get_mut(r).and_then(Value::as_object_mut) {
                t.remove("base_url");
            }
        }
    }
    if let Some(k) = &f.api_key_env {
        o.insert("api_key_env".into(), json!(k));
        for r in roles {
            if let Some(t) = o.get_mut(r).and_then(Value::as_object_mut) {
                t.remove("api_key_env");
            }
        }
    }
    for (r, m) in [("planner", &f.planner_model), ("coder", &f.coder_model)] {
        if let Some(m) = m {
            let t = o.entry(r.to_string()).or_insert_with(|| json!({}));
            obj(t).insert("model".into(), json!(m));
        }
    }
    if let Some(c) = f.max_cost {
        if !(c.is_finite() && c >= 0.0) {
            bail!("--max-cost must be a number >= 0");
        }
        o.insert("max_cost".into(), json!(c));
    }
    if let Some(n) = f.max_llm_calls {
        o.insert("max_calls".into(), json!(n));
    }
    check_secrets(v, "llm")
}

/// Resolve the two roles from the run's `[llm]` table.
pub fn settings(llm: Option<&Value>) -> Result<Settings> {
    let empty = json!({});
    let llm = llm.unwrap_or(&empty);
    check_secrets(llm, "llm")?;
    let o = llm.as_object().cloned().unwrap_or_default();
    let mut base = o.clone();
    for k in OWN_KEYS {
        base.remove(*k);
    }
    let role = |name: &str| -> Result<ModelConfig> {
        let mut m = base.clone();
        if let Some(t) = o.get(name) {
            let t = t.as_object().ok_or_else(|| anyhow::anyhow!("[llm.{name}] must be a table"))?;
            for (k, v) in t {
                m.insert(k.clone(), v.clone());
            }
        }
        let c: ModelConfig = serde_json::from_value(Value::Object(m)).map_err(|e| anyhow::anyhow!("[llm.{name}]: {e}"))?;
        if c.model.trim().is_empty() {
            bail!(
                "no model configured for the LLM {name}: give --model (or --{name}-model), or `model` in [llm] / [llm.{name}] of ksearch.toml"
            );
        }
        c.validate().map_err(|e| anyhow::anyhow!("[llm.{name}]: {e}"))?;
        Ok(c)
    };
    let num = |k: &str| o.get(k).and_then(Value::as_f64);
    Ok(Settings {
        planner: role("planner")?,
        coder: role("coder")?,
        max_cost: num("max_cost"),
        max_calls: num("max_calls").map(|x| x.max(0.0) as u32),
        max_debug: num("max_debug").map(|x| x.max(0.0) as u32).unwrap_or(2),
        max_repairs: num("max_repairs").map(|x| x.max(0.0) as u32).unwrap_or(2),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Planner,
    Coder,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Planner => "planner",
            Role::Coder => "coder",
        }
    }
}

/// One reply turned into something usable: the value, what to store as `parsed`, and a note
/// stored as the call's error (e.g. ops refused by validation).
struct Parsed<T> {
    value: T,
    parsed: String,
    note: Option<String>,
}

pub struct LlmPlanner {
    planner: Box<dyn LlmClient>,
    coder: Box<dyn LlmClient>,
    prompts: Prompts,
    settings: Settings,
    context: ksearch_kb::ContextLevel,
    max_rounds: u32,
    budget: Budget,
    budget_loaded: bool,
    stop: Option<String>,
    offline: Offline,
    quiet: bool,
    /// Secret values (the keys named by `api_key_env`, and the environment's secrets): scrubbed
    /// from every recorded prompt and reply and from every candidate a coder writes.
    scrub: ksearch_eval::scrub::Scrubber,
    /// Set when the run cannot go on (the server refused the key).
    fatal: Option<String>,
    /// The last failed call failed in transport (not in the model's answer).
    last_transport: bool,
    /// Transport failures of the coder in a row.
    transport_streak: u32,
    /// Transport failures of the planner in a row (at MAX_TRANSPORT_STREAK the offline planner
    /// revises the tree for the rest of this invocation).
    planner_streak: u32,
    /// What each role's server was found to accept, as last saved (None: not loaded yet).
    learnt: Option<[Option<Value>; 2]>,
    /// Lines not yet taken by the engine.
    notes: std::sync::Mutex<Vec<String>>,
}

impl LlmPlanner {
    pub fn from_config(cfg: &crate::engine::RunConfig, quiet: bool) -> Result<LlmPlanner> {
        let s = settings(cfg.llm.as_ref())?;
        let planner = OpenAiCompatible::new(s.planner.clone()).map_err(|e| anyhow::anyhow!("LLM planner: {e}"))?;
        let coder = OpenAiCompatible::new(s.coder.clone()).map_err(|e| anyhow::anyhow!("LLM coder: {e}"))?;
        let mut warned = Vec::new();
        let mut warnings = Vec::new();
        for (role, m) in [("planner", &s.planner), ("coder", &s.coder)] {
            if m.key_var().is_none() && !m.is_local() && !warned.contains(&m.base_url) {
                warnings.push(format!(
                    "warning: no API key for the LLM {role} at {} (set {} or name the key's variable with --api-key-env)",
                    m.base_url,
                    ksearch_llm::DEFAULT_KEY_ENV
                ));
                warned.push(m.base_url.clone());
            }
        }
        let root = std::env::current_dir().unwrap_or_default();
        let prompts = Prompts::discover(&root).map_err(|e| anyhow::anyhow!("{e}"))?;
        let p = LlmPlanner::new(Box::new(planner), Box::new(coder), prompts, s, cfg, quiet);
        for w in warnings {
            p.log(&w);
        }
        Ok(p)
    }

    pub fn new(
        planner: Box<dyn LlmClient>,
        coder: Box<dyn LlmClient>,
        prompts: Prompts,
        settings: Settings,
        cfg: &crate::engine::RunConfig,
        quiet: bool,
    ) -> LlmPlanner {
        let context = cfg.context.parse().unwrap_or(ksearch_kb::ContextLevel::Full);
        LlmPlanner {
            planner,
            coder,
            prompts,
            budget: Budget::new(settings.max_cost, settings.max_calls),
            settings,
            context,
            max_rounds: cfg.rounds,
            budget_loaded: false,
            stop: None,
            offline: Offline::default(),
            quiet,
            scrub: ksearch_eval::scrub::Scrubber::from_env(&settings_keys(cfg.llm.as_ref())),
            fatal: None,
            last_transport: false,
            transport_streak: 0,
            planner_streak: 0,
            learnt: None,
            notes: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A line for the engine's events (see `Planner::take_notes`).
    fn log(&self, s: &str) {
        if !self.quiet
            && let Ok(mut n) = self.notes.lock()
        {
            n.push(s.to_string());
        }
    }

    /// The spend so far of this run (from the last `llm_budget` artifact), with today's limits.
    fn load_budget(&mut self, ctx: &Ctx) {
        if self.budget_loaded {
            return;
        }
        self.budget_loaded = true;
        let Some(store) = ctx.store else { return };
        if let Ok(list) = store.artifacts(ctx.run_id, BUDGET_ARTIFACT)
            && let Some((_, _, content)) = list.last()
            && let Ok(b) = serde_json::from_str::<Budget>(content)
        {
            self.budget = Budget {
                max_cost_usd: self.settings.max_cost,
                max_calls: self.settings.max_calls,
                ..b
            };
        }
    }

    fn save_budget(&self, ctx: &Ctx) {
        if let Some(store) = ctx.store
            && let Ok(js) = serde_json::to_string(&self.budget)
            && let Err(e) = store.put_artifact(ctx.run_id, None, BUDGET_ARTIFACT, "budget", &js)
        {
            self.log(&format!("warning: could not save the LLM budget: {e}"));
        }
    }

    /// One chat call under the budget. Counts every call that reached (or tried to reach) the
    /// server, and sets the stop reason when the budget is spent.
    fn chat(&mut self, ctx: &Ctx, role: Role, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        self.load_budget(ctx);
        if let Err(e) = self.budget.check() {
            self.stop = Some(e.to_string());
            return Err(e);
        }
        self.load_learnt(ctx);
        let client = match role {
            Role::Planner => &self.planner,
            Role::Coder => &self.coder,
        };
        let r = client.chat(req);
        match &r {
            Ok(resp) => self.budget.record(resp),
            Err(e) if e.attempts() > 0 => self.budget.calls += 1,
            Err(_) => {}
        }
        self.last_transport = matches!(&r, Err(e) if e.is_transport());
        if role == Role::Planner {
            if self.last_transport {
                self.planner_streak += 1;
                if self.planner_streak == MAX_TRANSPORT_STREAK {
                    tracing::warn!(
                        "the LLM planner failed {} calls in a row; the offline planner revises the tree for the rest of this invocation (resume asks the LLM again)",
                        self.planner_streak
                    );
                }
            } else if r.is_ok() {
                self.planner_streak = 0;
            }
        }
        if let Err(e) = &r
            && let LlmError::Auth { .. } = e.root()
        {
            self.fatal = Some(e.root().to_string());
            self.stop = self.fatal.clone();
        }
        self.save_budget(ctx);
        self.save_learnt(ctx);
        if let Err(e) = self.budget.check() {
            self.stop = Some(e.to_string());
        }
        r
    }

    /// Start each role from what earlier runs learnt about its server and model.
    fn load_learnt(&mut self, ctx: &Ctx) {
        if self.learnt.is_some() {
            return;
        }
        let mut got: [Option<Value>; 2] = [None, None];
        if let Some(store) = ctx.store {
            for (i, c) in [&self.planner, &self.coder].into_iter().enumerate() {
                if let Some(k) = c.server_key()
                    && let Ok(Some(js)) = store.latest_artifact_named(SERVER_ARTIFACT, &k)
                    && let Ok(v) = serde_json::from_str::<Value>(&js)
                {
                    c.restore_learnt(&v);
                    got[i] = Some(v);
                }
            }
        }
        self.learnt = Some(got);
    }

    /// Remember what a server was found to reject, when that changed.
    fn save_learnt(&mut self, ctx: &Ctx) {
        let Some(store) = ctx.store else { return };
        let mut known = self.learnt.clone().unwrap_or_default();
        for (i, c) in [&self.planner, &self.coder].into_iter().enumerate() {
            let (Some(now), Some(k)) = (c.learnt(), c.server_key()) else {
                continue;
            };
            if known[i].as_ref() != Some(&now) {
                if let Err(e) = store.put_artifact(ctx.run_id, None, SERVER_ARTIFACT, &k, &now.to_string()) {
                    self.log(&format!("warning: could not remember what the LLM server accepts: {e}"));
                }
                known[i] = Some(now);
            }
        }
        self.learnt = Some(known);
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        ctx: &Ctx,
        role: Role,
        node: Option<i64>,
        req: &ChatRequest,
        resp: Option<&ChatResponse>,
        failed: Option<(u32, f64)>,
        parsed: Option<String>,
        error: Option<String>,
    ) {
        let Some(store) = ctx.store else { return };
        let prompt = req
            .messages
            .iter()
            .map(|m| format!("[{}]\n{}", m.role.as_str(), m.content))
            .collect::<Vec<_>>()
            .join("\n\n");
        let model = match role {
            Role::Planner => self.planner.model(),
            Role::Coder => self.coder.model(),
        };
        let sc = |t: String| self.scrub.text(&t);
        let row = LlmCallRow {
            id: 0,
            node_id: node,
            round: ctx.round,
            role: role.name().to_string(),
            model: resp.map(|r| r.model.clone()).unwrap_or_else(|| model.to_string()),
            prompt: sc(prompt),
            reply: resp.map(|r| sc(cap_reply(&r.content, MAX_STORED_REPLY))),
            parsed: parsed.map(sc),
            prompt_tokens: resp.map(|r| r.usage.prompt_tokens).unwrap_or(0),
            completion_tokens: resp.map(|r| r.usage.completion_tokens).unwrap_or(0),
            cost_usd: resp.map(|r| r.cost_usd).unwrap_or(0.0),
            latency_s: resp.map(|r| r.latency_s).or(failed.map(|f| f.1)).unwrap_or(0.0),
            attempts: resp.map(|r| r.attempts).or(failed.map(|f| f.0)).unwrap_or(0),
            error: error.map(sc),
            created_at: String::new(),
        };
        if let Err(e) = store.insert_llm_call(ctx.run_id, &row) {
            self.log(&format!("warning: could not record an LLM call: {e}"));
        }
    }

    /// Call, parse, and on an unusable reply send up to `max_repairs` repair prompts. Every call
    /// is recorded. `Err` says why no usable reply came (already recorded).
    fn converse<T>(
        &mut self,
        ctx: &Ctx,
        role: Role,
        node: Option<i64>,
        mut req: ChatRequest,
        lang: Option<&str>,
        parse: impl Fn(&str) -> Result<Parsed<T>, ParseError>,
    ) -> std::result::Result<T, String> {
        let mut attempt = 0;
        loop {
            let t0 = std::time::Instant::now();
            let resp = match self.chat(ctx, role, &req) {
                Ok(r) => r,
                Err(e) => {
                    let msg = e.to_string();
                    if !matches!(e, LlmError::Budget(_)) {
                        let failed = Some((e.attempts(), t0.elapsed().as_secs_f64()));
                        self.record(ctx, role, node, &req, None, failed, None, Some(msg.clone()));
                    }
                    if self.fatal.is_none() {
                        // (A fatal failure is reported once, where the run stops.)
                        self.log(&format!("round {}: LLM {} call failed: {msg}", ctx.round, role.name()));
                    }
                    return Err(msg);
                }
            };
            let mut result = parse(&resp.content);
            if resp.truncated() && result.is_err() {
                // Cut off at the token limit: that, not the structure, is what went wrong.
                result = Err(ParseError::Truncated {
                    max_tokens: self.max_tokens(role),
                });
            }
            match result {
                Ok(p) => {
                    self.record(ctx, role, node, &req, Some(&resp), None, Some(p.parsed), p.note);
                    return Ok(p.value);
                }
                Err(pe) => {
                    let msg = format!("{}: {pe}", pe.kind());
                    self.record(ctx, role, node, &req, Some(&resp), None, None, Some(msg.clone()));
                    if attempt >= self.settings.max_repairs {
                        let why = format!("unusable {} reply after {attempt} repair prompt(s): {pe}", role.name());
                        self.log(&format!("round {}: {why}", ctx.round));
                        return Err(why);
                    }
                    attempt += 1;
                    req = match self.prompts.repair_request(&req, &resp.content, &pe, lang) {
                        Ok(r) => r,
                        Err(e) => return Err(format!("repair prompt: {e}")),
                    };
                }
            }
        }
    }

    fn max_tokens(&self, role: Role) -> Option<u32> {
        match role {
            Role::Planner => self.settings.planner.max_tokens,
            Role::Coder => self.settings.coder.max_tokens,
        }
    }

    // ----- views -----

    fn task_summary(ctx: &Ctx) -> TaskSummary {
        let t = ctx.task;
        let b = t.backend(ctx.backend);
        let tensors = |list: &[ksearch_core::task::TensorSpec], what: &str| {
            list.iter()
                .map(|x| format!("{} [{}] {} ({what})", x.name, x.shape.join(", "), dtype_name(x.dtype)))
                .collect::<Vec<_>>()
        };
        let mut bufs = tensors(&t.inputs, "input");
        bufs.extend(tensors(&t.outputs, "output"));
        let entries: Vec<String> = b
            .map(|b| {
                let mut e: Vec<String> = b.seed.launches.iter().map(|l| l.entry.clone()).collect();
                if e.is_empty() {
                    e.extend(b.seed.entry.clone());
                }
                e
            })
            .unwrap_or_default();
        let signature = if ctx.backend == Backend::Cpu {
            format!(
                "extern \"C\" void {}(void** bufs, const int64_t* dims)",
                entries.first().map(String::as_str).unwrap_or("kernel")
            )
        } else {
            format!("entry point(s): {}", entries.join(", "))
        };
        let mut reference = match t.reference.file() {
            Some(r) => format!(
                "{}\nThe reference the task brings ({}, C++ in f64; inputs and outputs in declared order, dims = the axes):\n{}",
                t.description, r.file, r.source
            ),
            None => format!("{} (host reference `{}`)", t.description, t.reference),
        };
        if let Some(f) = &t.flops {
            reference.push_str(&format!("\nflops: {f}"));
        }
        let dtype = t.inputs.first().map(|x| dtype_name(x.dtype)).unwrap_or_default();
        let tolerance = t
            .inputs
            .first()
            .and_then(|x| t.tolerance.get(&x.dtype))
            .map(|tol| format!("|out - ref| <= {} + {} * |ref|", tol.atol, tol.rtol))
            .unwrap_or_default();
        TaskSummary {
            name: t.name.clone(),
            description: t.description.clone(),
            reference,
            interface: format!(
                "{signature}. Buffers in this order: {}. dims holds the axes in this order: {}. Keep the entry point names and the launch contract of the parent candidate.",
                bufs.join("; "),
                t.axes.join(", ")
            ),
            shapes: b
                .map(|b| {
                    b.search
                        .iter()
                        .map(|w| ksearch_core::protocol::workload_label(w, &t.axes))
                        .collect()
                })
                .unwrap_or_default(),
            dtype,
            tolerance,
        }
    }

    fn target(&self, ctx: &Ctx) -> TargetInfo {
        let lang = Lang::for_backend(ctx.backend);
        let profile = ctx.kb.zip(ctx.profile).and_then(|(kb, p)| kb.profile(p));
        let hardware = profile
            .map(|p| {
                let mut s = format!("{}: {:.0} GB/s memory bandwidth", p.display_name, p.mem_bandwidth_gbs);
                if let Some(c) = p.compute_units {
                    s.push_str(&format!(", {c} compute units"));
                }
                if !p.notes.trim().is_empty() {
                    s.push_str(&format!(". {}", p.notes.trim()));
                }
                s
            })
            .unwrap_or_default();
        let context = match (ctx.kb, profile) {
            (Some(kb), Some(p)) => ksearch_kb::render_context(kb, self.context, lang, p, Some(ctx.task)),
            _ => String::new(),
        };
        TargetInfo {
            name: ctx.backend.to_string(),
            lang: lang_hint(lang).to_string(),
            hardware,
            context,
        }
    }

    fn best_view(ctx: &Ctx) -> Option<BestView> {
        let b = ctx.tree.best().filter(|b| b.parent.is_some())?;
        Some(BestView {
            node_id: b.id,
            title: node_title(b),
            speedup: b.speedup.unwrap_or(1.0),
            time_us: b.time_us,
            source: candidate_of(ctx, b).map(|c| c.source),
        })
    }

    fn planner_context(&self, ctx: &Ctx) -> PlannerContext {
        PlannerContext {
            task: Self::task_summary(ctx),
            target: self.target(ctx),
            round: ctx.round,
            max_rounds: Some(self.max_rounds),
            ..Default::default()
        }
    }

    // ----- the coder -----

    fn write_edit(&mut self, ctx: &Ctx, node: &Node) -> std::result::Result<Written, String> {
        let path = ctx.tree.path(node.id);
        // The action to implement: the node itself, or for a debug node the action it debugs.
        let orig = path.iter().rev().find(|n| !is_debug(n)).copied().unwrap_or(node);
        let depth = path.iter().rev().take_while(|n| is_debug(n)).count() as u32;
        // The base: the nearest measured ancestor of the action, else the seed.
        let base_node = orig
            .parent
            .map(|p| ctx.tree.path(p))
            .unwrap_or_default()
            .into_iter()
            .rev()
            .find(|n| n.status == NodeStatus::Solved && n.candidate.is_some());
        let base = base_node
            .and_then(|n| candidate_of(ctx, n))
            .or_else(|| {
                let k = ctx.task.kernel(ctx.backend, "seed")?;
                Some(instantiate(ctx.backend, k, &BTreeMap::new()))
            })
            .ok_or("no parent candidate and no seed kernel")?;
        let (failed_source, last_failure) = if depth > 0 {
            let failed = node.parent.and_then(|p| ctx.tree.get(p));
            (
                failed.and_then(|f| candidate_of(ctx, f)).map(|c| c.source),
                failed.and_then(|f| failure_log_of(ctx, f.id)),
            )
        } else {
            (None, None)
        };
        let lang = lang_hint(base.lang);
        let cctx = CoderContext {
            task: Self::task_summary(ctx),
            target: self.target(ctx),
            action: node_view(orig),
            parent_title: base_node.map(node_title).unwrap_or_else(|| "naive seed".into()),
            parent_source: base.source.clone(),
            attempt: depth + 1,
            failed_source,
            last_failure,
        };
        let req = self.prompts.coder_request(&cctx).map_err(|e| e.to_string())?;
        let source = self.converse(ctx, Role::Coder, Some(node.id), req, Some(lang), |text| {
            let code = ksearch_llm::extract_code(text, Some(lang))?;
            // Nothing that reads the machine's files at compile time (its diagnostics come back
            // to the model): refused here, the model asked to rewrite.
            if let Some(reason) = ksearch_kb::untrusted::refusal(lang, &code) {
                return Err(ParseError::Refused { reason });
            }
            Ok(Parsed {
                parsed: format!("{} lines of {lang}", code.lines().count()),
                value: code,
                note: None,
            })
        })?;
        Ok(Written {
            kernel: LLM_KERNEL.to_string(),
            candidate: with_source(&base, self.scrub.text(&source)),
        })
    }

    // ----- the planner -----

    fn proposal(parent: i64, a: &ProposedAction) -> Proposal {
        let desc = a.description.trim();
        let description = if desc.is_empty() {
            a.title.trim().to_string()
        } else {
            format!("{}{TITLE_SEP}{desc}", a.title.trim())
        };
        Proposal {
            parent,
            action: Action::Edit { description },
            pattern: a.pattern.clone(),
            assessment: Assessment {
                overall: a.overall,
                confidence: a.confidence,
                bandwidth: core_impact(&a.bandwidth),
                registers: core_impact(&a.registers),
                hw_fit: core_impact(&a.hw_fit),
                difficulty: a.difficulty,
                prior: a.prior,
            }
            .clamped(),
        }
    }

    /// The planner's ops as validated tree edits; refused ops are returned with the reason.
    fn convert_ops(tree: &Tree, up: &PlannerUpdate, pending: &BTreeMap<i64, Assessment>) -> (Vec<TreeEdit>, Vec<String>) {
        let mut updates: BTreeMap<i64, Assessment> = BTreeMap::new();
        let mut edits = Vec::new();
        let mut refused: Vec<String> = up.rejected.clone();
        let mut touched_open: Vec<i64> = Vec::new();
        for op in &up.ops {
            let mut refuse = |why: String| refused.push(format!("{}: {why}", op_name(op)));
            match op {
                TreeOp::Update { node, changes } => {
                    let Some(n) = tree.get(*node) else {
                        refuse(format!("no node {node}"));
                        continue;
                    };
                    let a = updates
                        .entry(*node)
                        .or_insert_with(|| pending.get(node).cloned().unwrap_or_else(|| n.assessment.clone()));
                    if let Some(v) = changes.overall {
                        a.overall = v;
                    }
                    if let Some(v) = changes.confidence {
                        a.confidence = v;
                    }
                    if let Some(v) = changes.difficulty {
                        a.difficulty = v;
                    }
                    if let Some(v) = changes.prior {
                        a.prior = v;
                    }
                    // Measured impacts are evidence: the planner may not overwrite them.
                    for (slot, new) in [
                        (&mut a.bandwidth, &changes.bandwidth),
                        (&mut a.registers, &changes.registers),
                        (&mut a.hw_fit, &changes.hw_fit),
                    ] {
                        if let Some(i) = new
                            && !slot.note.starts_with("measured")
                        {
                            *slot = core_impact(i);
                        }
                    }
                }
                TreeOp::Insert { parent, action } => match tree.get(*parent) {
                    None => refuse(format!("no parent node {parent}")),
                    Some(p) if p.status != NodeStatus::Solved => {
                        refuse(format!("parent node {parent} is {}, not solved", p.status.name()))
                    }
                    Some(_) => {
                        let dup = tree
                            .children(*parent)
                            .iter()
                            .any(|c| c.status == NodeStatus::Open && node_title(c).eq_ignore_ascii_case(action.title.trim()));
                        if dup {
                            refuse(format!(
                                "an open action `{}` already exists under node {parent}",
                                action.title
                            ));
                        } else {
                            edits.push(TreeEdit::Insert(Self::proposal(*parent, action)));
                        }
                    }
                },
                TreeOp::Split { node, into } => {
                    let parent = tree.get(*node).and_then(|n| n.parent).unwrap_or(*node);
                    let e = TreeEdit::Split {
                        node: *node,
                        into: into.iter().map(|a| Self::proposal(parent, a)).collect(),
                    };
                    match validate_edit(tree, &e) {
                        Ok(()) if touched_open.contains(node) => refuse(format!("node {node} already pruned or split")),
                        Ok(()) => {
                            touched_open.push(*node);
                            edits.push(e)
                        }
                        Err(why) => refuse(why),
                    }
                }
                TreeOp::Prune { node, reason } => {
                    let e = TreeEdit::Prune {
                        node: *node,
                        reason: reason.clone(),
                    };
                    match validate_edit(tree, &e) {
                        Ok(()) if touched_open.contains(node) => refuse(format!("node {node} already pruned or split")),
                        Ok(()) => {
                            touched_open.push(*node);
                            edits.push(e)
                        }
                        Err(why) => refuse(why),
                    }
                }
            }
        }
        let mut out: Vec<TreeEdit> = updates
            .into_iter()
            .map(|(node, a)| TreeEdit::Update {
                node,
                assessment: a.clamped(),
            })
            .collect();
        out.extend(edits);
        (out, refused)
    }

    fn last_evaluations(ctx: &Ctx, node: &Node, o: &Outcome) -> Vec<EvalView> {
        let mut done: Vec<&Node> = ctx
            .tree
            .nodes
            .values()
            .filter(|n| n.id != node.id && n.parent.is_some() && n.round_evaluated.is_some())
            .collect();
        done.sort_by_key(|n| (n.round_evaluated, n.id));
        let mut v: Vec<EvalView> = done
            .iter()
            .rev()
            .take(4)
            .rev()
            .map(|n| EvalView {
                node_id: n.id,
                title: node_title(n),
                outcome: outcome_name(n),
                speedup: n.speedup,
                time_us: n.time_us,
                details: String::new(),
                log: String::new(),
            })
            .collect();
        let details = match (o.failure, o.speedup) {
            (None, Some(s)) => {
                let mut d = format!(
                    "{:.3}x over the seed, {:.3}x over its parent",
                    s,
                    s / o.parent_speedup.unwrap_or(1.0).max(1e-9)
                );
                if let Some(r) = o.roofline_fraction {
                    d.push_str(&format!("; {:.1}% of the roofline floor", 100.0 * r));
                }
                for w in &o.reply.workloads {
                    if let Some(t) = &w.timing {
                        d.push_str(&format!("\n- {}: {:.2} us", w.label, t.median_us));
                    }
                }
                d
            }
            (Some(f), _) => format!("{}: {}", f.class, f.message),
            _ => String::new(),
        };
        v.push(EvalView {
            node_id: node.id,
            title: node_title(node),
            outcome: outcome_name(node),
            speedup: o.speedup,
            time_us: node.time_us,
            details,
            log: if o.failure.is_some() {
                failure_log(o.reply)
            } else {
                String::new()
            },
        });
        v
    }
}

impl Planner for LlmPlanner {
    fn name(&self) -> &'static str {
        "llm"
    }

    fn init(&mut self, ctx: &Ctx) -> Result<Vec<Proposal>> {
        let root = ctx.tree.root().map(|r| r.id).unwrap_or(0);
        let mut pc = self.planner_context(ctx);
        pc.seed_source = ctx.tree.root().and_then(|r| candidate_of(ctx, r)).map(|c| c.source);
        let kernels: Vec<String> = ctx
            .task
            .kernels(ctx.backend)
            .into_iter()
            .skip(1)
            .map(|k| format!("{} ({})", k.name, k.description))
            .collect();
        if !kernels.is_empty() {
            pc.notes
                .push(format!("Expert kernels known for this task: {}", kernels.join("; ")));
        }
        let req = self.prompts.planner_init_request(&pc)?;
        let got = self.converse(ctx, Role::Planner, Some(root), req, None, |text| {
            let init = PlannerInit::parse(text)?;
            Ok(Parsed {
                parsed: serde_json::to_string(&init).unwrap_or_default(),
                value: init,
                note: None,
            })
        });
        match got {
            Ok(init) => {
                if let Some(store) = ctx.store
                    && let Err(e) = store.put_artifact(
                        ctx.run_id,
                        Some(root),
                        INIT_ARTIFACT,
                        "classification",
                        &serde_json::to_string_pretty(&init).unwrap_or_default(),
                    )
                {
                    self.log(&format!("warning: could not store the planner's classification: {e}"));
                }
                Ok(init.actions.iter().map(|a| Self::proposal(root, a)).collect())
            }
            Err(why) => {
                if let Some(f) = &self.fatal {
                    if let Some(store) = ctx.store {
                        let _ = store.set_run_status(ctx.run_id, "stopped", Some(f));
                    }
                    bail!("{f}; fix the key, then continue with `ksearch resume {}`", ctx.run_id);
                }
                // No plan from the model: start from the knowledge base's kernels instead.
                self.log(&format!(
                    "LLM planner initialisation failed ({why}); starting from the knowledge-base actions"
                ));
                self.offline.init(ctx)
            }
        }
    }

    fn can_write(&self, _node: &Node) -> bool {
        true
    }

    fn write(&mut self, ctx: &Ctx, node: &Node) -> std::result::Result<Written, String> {
        self.last_transport = false;
        match &node.action {
            Action::Edit { .. } => {
                let r = self.write_edit(ctx, node);
                if r.is_err() && self.last_transport {
                    self.transport_streak += 1;
                    tracing::warn!(
                        node = node.id,
                        "the LLM coder could not be reached; the action is reopened for a later round"
                    );
                    if self.transport_streak >= MAX_TRANSPORT_STREAK && self.stop.is_none() {
                        self.stop = Some(format!(
                            "the LLM coder failed {} calls in a row for transport reasons ({})",
                            self.transport_streak,
                            r.as_ref().err().cloned().unwrap_or_default()
                        ));
                    }
                } else {
                    self.transport_streak = 0;
                }
                r
            }
            _ => self.offline.write(ctx, node),
        }
    }

    fn retry_later(&self) -> bool {
        self.last_transport
    }

    fn fatal(&self) -> Option<String> {
        self.fatal.clone()
    }

    fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.planner.set_deadline(deadline);
        self.coder.set_deadline(deadline);
    }

    fn take_notes(&mut self) -> Vec<String> {
        self.notes.lock().map(|mut n| std::mem::take(&mut *n)).unwrap_or_default()
    }

    fn resumed(&mut self, ctx: &Ctx) -> Result<Vec<Proposal>> {
        // A run whose planner initialisation failed (or that another planner started): ask
        // the model again; its actions join the tree. A second failure changes nothing.
        let has_init = ctx
            .store
            .map(|s| s.artifacts(ctx.run_id, INIT_ARTIFACT).map(|a| !a.is_empty()).unwrap_or(true))
            .unwrap_or(true);
        if has_init || self.stop.is_some() {
            return Ok(Vec::new());
        }
        let n = ctx.tree.nodes.len();
        let props = self.init(ctx)?;
        let has_now = ctx
            .store
            .map(|s| s.artifacts(ctx.run_id, INIT_ARTIFACT).map(|a| !a.is_empty()).unwrap_or(false))
            .unwrap_or(false);
        if has_now {
            self.log(&format!(
                "the LLM planner's initialisation is done now ({} actions added to {n} nodes)",
                props.len()
            ));
            Ok(props)
        } else {
            Ok(Vec::new())
        }
    }

    fn update(&mut self, ctx: &Ctx, node: &Node, o: &Outcome) -> Result<Vec<TreeEdit>> {
        // Measurements first, as the offline planner does: they do not depend on the model.
        let mut pending: BTreeMap<i64, Assessment> = BTreeMap::new();
        let mut a = node.assessment.clone();
        match (o.failure, o.speedup) {
            (None, Some(s)) => {
                let ratio = s / o.parent_speedup.unwrap_or(1.0).max(1e-9);
                a.overall = 5.0 + 4.0 * ratio.log2();
                a.confidence = 0.9;
            }
            (Some(_), _) => {
                a.overall = 0.5;
                a.confidence = 0.9;
            }
            _ => {}
        }
        pending.insert(node.id, a.clamped());
        let mut tail = Vec::new();
        // Bounded debug rounds for a failed LLM edit.
        if let (Some(f), Action::Edit { .. }) = (o.failure, &node.action) {
            let path = ctx.tree.path(node.id);
            let depth = path.iter().rev().take_while(|n| is_debug(n)).count() as u32;
            let orig = path.iter().rev().find(|n| !is_debug(n)).copied().unwrap_or(node);
            if depth < self.settings.max_debug {
                let first = f.message.lines().next().unwrap_or("").trim();
                let first: String = first.chars().take(160).collect();
                let title = format!("{DEBUG_PREFIX}{}: {first}", f.class);
                let description = format!("{title}{TITLE_SEP}retry of node {} with its failure log", orig.id);
                let mut da = orig.assessment.clone();
                da.overall = (da.overall - 1.0).max(0.5);
                da.confidence = da.confidence.min(0.5);
                tail.push(TreeEdit::Insert(Proposal {
                    parent: node.id,
                    action: Action::Edit { description },
                    pattern: orig.pattern.clone(),
                    assessment: da.clamped(),
                }));
            } else {
                self.log(&format!(
                    "round {}: node {} failed after {depth} debug round(s): marked too hard",
                    ctx.round, orig.id
                ));
                let mut oa = pending.remove(&orig.id).unwrap_or_else(|| orig.assessment.clone());
                oa.overall = oa.overall.min(1.0);
                oa.confidence = 0.9;
                oa.hw_fit.note = format!("too hard: still failing after {depth} debug round(s) ({})", f.class);
                pending.insert(orig.id, oa.clamped());
                tail.push(TreeEdit::TooHard { node: node.id });
                if orig.id != node.id {
                    tail.push(TreeEdit::TooHard { node: orig.id });
                }
            }
        }
        // Then the model revises the tree.
        let mut pc = self.planner_context(ctx);
        pc.active_path = ctx.tree.path(node.id).into_iter().map(node_view).collect();
        let mut open: Vec<&Node> = ctx.tree.open();
        open.sort_by(|a, b| {
            b.assessment
                .overall
                .partial_cmp(&a.assessment.overall)
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        pc.frontier = open.into_iter().map(node_view).collect();
        pc.best = Self::best_view(ctx);
        pc.last_evaluations = Self::last_evaluations(ctx, node, o);
        if let Some(TreeEdit::Insert(p)) = tail.first() {
            pc.notes.push(format!(
                "Node {} failed; a debug action ({}) is queued under it automatically.",
                node.id,
                p.action.summary()
            ));
        }
        let mut edits = Vec::new();
        let llm = match self.prompts.planner_update_request(&pc) {
            Ok(_) if self.planner_streak >= MAX_TRANSPORT_STREAK => {
                Err(format!("the LLM planner failed {} calls in a row", self.planner_streak))
            }
            Ok(req) if self.stop.is_none() => {
                let tree = ctx.tree;
                let pend = &pending;
                self.converse(ctx, Role::Planner, Some(node.id), req, None, |text| {
                    let up = PlannerUpdate::parse(text)?;
                    let (edits, refused) = Self::convert_ops(tree, &up, pend);
                    let parsed = json!({
                        "analysis": up.analysis,
                        "ops": up.ops,
                        "applied": edits.len(),
                        "refused": refused,
                    });
                    Ok(Parsed {
                        parsed: parsed.to_string(),
                        note: (!refused.is_empty())
                            .then(|| format!("validation refused {} op(s): {}", refused.len(), refused.join("; "))),
                        value: (edits, refused),
                    })
                })
            }
            Ok(_) => Err(self.stop.clone().unwrap_or_default()),
            Err(e) => Err(e.to_string()),
        };
        match llm {
            Ok((llm_edits, refused)) => {
                for r in &refused {
                    self.log(&format!("round {}: planner op refused: {r}", ctx.round));
                }
                for e in llm_edits {
                    match e {
                        TreeEdit::Update { node, assessment } => {
                            pending.insert(node, assessment);
                        }
                        e => edits.push(e),
                    }
                }
            }
            Err(why) => {
                // The offline planner's next actions for this round, so that the run goes on.
                let fallback: Vec<TreeEdit> = self
                    .offline
                    .update(ctx, node, o)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|e| !matches!(e, TreeEdit::Update { .. }))
                    .collect();
                let mut added = fallback.len();
                edits.extend(fallback);
                let queued = tail.iter().any(|e| matches!(e, TreeEdit::Insert(_)));
                let open_left = ctx.tree.open().iter().any(|n| n.id != node.id);
                if added == 0 && !queued && !open_left {
                    let seen: Vec<String> = ctx.tree.nodes.values().map(|n| n.action.summary()).collect();
                    for p in self.offline.init(ctx).unwrap_or_default() {
                        if !seen.contains(&p.action.summary()) {
                            edits.push(TreeEdit::Insert(p));
                            added += 1;
                        }
                    }
                }
                tracing::warn!(
                    "round {}: no planner revision ({why}); measurements applied, the offline planner's next actions used ({added} added)",
                    ctx.round
                );
            }
        }
        let mut out: Vec<TreeEdit> = pending
            .into_iter()
            .map(|(node, assessment)| TreeEdit::Update { node, assessment })
            .collect();
        out.extend(edits);
        out.extend(tail);
        Ok(out)
    }

    fn stop_reason(&self) -> Option<String> {
        self.stop.clone()
    }
}

// ----- helpers -----

fn dtype_name(d: ksearch_core::task::DType) -> String {
    serde_json::to_value(d)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

fn lang_hint(l: Lang) -> &'static str {
    match l {
        Lang::Cpp => "cpp",
        Lang::Cuda | Lang::MlxCuda => "cuda",
        Lang::MlxMetal => "metal",
    }
}

fn is_debug(n: &Node) -> bool {
    matches!(&n.action, Action::Edit { description } if description.starts_with(DEBUG_PREFIX))
}

fn node_title(n: &Node) -> String {
    match &n.action {
        Action::Edit { description } => description
            .split_once(TITLE_SEP)
            .map(|(t, _)| t)
            .unwrap_or(description)
            .to_string(),
        a => a.summary(),
    }
}

fn op_name(op: &TreeOp) -> String {
    match op {
        TreeOp::Update { node, .. } => format!("update {node}"),
        TreeOp::Insert { parent, .. } => format!("insert under {parent}"),
        TreeOp::Split { node, .. } => format!("split {node}"),
        TreeOp::Prune { node, .. } => format!("prune {node}"),
    }
}

fn outcome_name(n: &Node) -> String {
    match (n.status, n.failure) {
        (_, Some(f)) => format!("failed ({f})"),
        (NodeStatus::Solved, _) => "correct".into(),
        (s, _) => s.name().into(),
    }
}

fn prompt_impact(i: &tree::Impact) -> PImpact {
    PImpact {
        rating: i.rating,
        note: i.note.clone(),
    }
}

fn core_impact(i: &PImpact) -> tree::Impact {
    tree::Impact::new(i.rating, i.note.clone())
}

fn node_view(n: &Node) -> NodeView {
    let a = &n.assessment;
    let description = match &n.action {
        Action::Edit { description } => description
            .split_once(TITLE_SEP)
            .map(|(_, d)| d.to_string())
            .unwrap_or_default(),
        _ => String::new(),
    };
    NodeView {
        id: n.id,
        parent: n.parent,
        title: node_title(n),
        description,
        pattern: n.pattern.clone(),
        status: n.status.name().to_string(),
        overall: (a.overall * 100.0).round() / 100.0,
        confidence: (a.confidence * 100.0).round() / 100.0,
        bandwidth: prompt_impact(&a.bandwidth),
        registers: prompt_impact(&a.registers),
        hw_fit: prompt_impact(&a.hw_fit),
        difficulty: a.difficulty,
        prior: (a.prior * 100.0).round() / 100.0,
        speedup: n.speedup,
        time_us: n.time_us,
        failure: n.failure.map(|f| f.name().to_string()),
    }
}

/// The stored candidate of a node.
fn candidate_of(ctx: &Ctx, n: &Node) -> Option<Candidate> {
    let key = n.candidate.as_deref()?;
    ctx.store?.candidate(key).ok().flatten().map(|(_, c)| c)
}

/// The failure log of a node's last evaluation.
fn failure_log_of(ctx: &Ctx, node: i64) -> Option<String> {
    let evals = ctx.store?.evaluations(ctx.run_id, Some(node)).ok()?;
    let last = evals.into_iter().rev().find(|e| e.purpose == "search")?;
    Some(failure_log(&last.reply)).filter(|s| !s.trim().is_empty())
}

/// What went wrong in a reply, for a prompt: the failure, per-workload failures, the compile log.
pub fn failure_log(r: &EvalReply) -> String {
    let mut s = String::new();
    if let Some(f) = &r.failure {
        s.push_str(&format!("{}: {}\n", f.class, f.message));
    }
    for w in &r.workloads {
        if let Some(f) = &w.failure {
            s.push_str(&format!("{}: {}: {}\n", w.label, f.class, f.message));
        } else if !w.check.passed() {
            s.push_str(&format!(
                "{}: wrong result (max abs err {:.3e})\n",
                w.label, w.check.max_abs_err
            ));
        }
    }
    if !r.compile.log.trim().is_empty() {
        s.push_str("compiler output:\n");
        s.push_str(&truncate_middle(r.compile.log.trim(), 4000));
        s.push('\n');
    }
    s
}

/// A reply cut to `max` characters: its head and tail, and how long it was.
fn cap_reply(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let half = max / 2;
    let head: String = s.chars().take(half).collect();
    let tail: String = s.chars().skip(n - half).collect();
    format!(
        "{head}\n[… reply of {n} characters ({} bytes) stored cut: {} characters left out …]\n{tail}",
        s.len(),
        n - 2 * half
    )
}

/// The parent's candidate with a new source. Defines the new source `#define`s itself are
/// dropped from the candidate's defines, so that the source decides them.
/// Every `api_key_env` named in `[llm]` (either role).
pub fn settings_keys(llm: Option<&serde_json::Value>) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    if k == "api_key_env"
                        && let Some(s) = x.as_str()
                    {
                        out.push(s.to_string());
                    }
                    walk(x, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    // The key read when none is named.
    let mut out = vec![ksearch_llm::DEFAULT_KEY_ENV.to_string()];
    if let Some(v) = llm {
        walk(v, &mut out);
    }
    out
}

fn with_source(base: &Candidate, source: String) -> Candidate {
    let own: Vec<String> = source
        .lines()
        .filter_map(|l| {
            let t = l.trim_start().strip_prefix('#')?.trim_start();
            let rest = t.strip_prefix("define")?;
            rest.split_whitespace()
                .next()
                .map(|n| n.split('(').next().unwrap_or(n).to_string())
        })
        .collect();
    let mut c = base.clone();
    c.defines.retain(|k, _| !own.contains(k));
    c.source = source;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_fold_into_roles_and_refuse_keys() {
        let f = LlmFlags {
            model: Some("m".into()),
            coder_model: Some("c".into()),
            base_url: Some("http://127.0.0.1:1/v1".into()),
            max_llm_calls: Some(3),
            ..Default::default()
        };
        let mut llm = Some(json!({"planner": {"model": "old", "reasoning_effort": "high"}, "api_key_env": "K"}));
        apply_flags(&mut llm, &f).unwrap();
        let s = settings(llm.as_ref()).unwrap();
        assert_eq!(s.planner.model, "m");
        assert_eq!(s.planner.reasoning_effort.as_deref(), Some("high"));
        assert_eq!(s.coder.model, "c");
        assert_eq!(s.coder.api_key_env.as_deref(), Some("K"));
        assert_eq!(s.max_calls, Some(3));
        let mut bad = Some(json!({"model": "m", "api_key": "sk-123"}));
        assert!(apply_flags(&mut bad, &LlmFlags::default()).is_err());
        assert!(settings(Some(&json!({}))).is_err());
    }

    #[test]
    fn own_defines_leave_the_candidate() {
        let mut base = Candidate {
            lang: Lang::Cpp,
            source: String::new(),
            launches: vec![],
            scratch: vec![],
            defines: BTreeMap::new(),
            options: BTreeMap::new(),
        };
        base.defines.insert("VEC".into(), 8);
        base.defines.insert("ONLINE".into(), 0);
        let c = with_source(&base, "#define VEC 16\nint x;\n".into());
        assert_eq!(c.defines.keys().collect::<Vec<_>>(), vec!["ONLINE"]);
    }
}
