//! Prompt templates (minijinja, `prompts/*.j2`), their bounded render contexts, the JSON schemas of
//! the planner replies, and the Rust types those replies parse into.
//!
//! Templates are read from a `prompts/` directory when it has them, else the copies embedded in
//! the binary are used. A rendered template is split at a line `=== USER ===` into the system
//! message (before) and the user message (after).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{LazyLock, OnceLock};

use minijinja::{AutoEscape, Environment, UndefinedBehavior};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::ParseError;
use crate::parse::extract_json;
use crate::types::{ChatRequest, Message, Role};

pub const PLANNER_INIT: &str = "planner_init.j2";
pub const PLANNER_UPDATE: &str = "planner_update.j2";
pub const CODER: &str = "coder.j2";
pub const REPAIR: &str = "repair.j2";

const EMBEDDED: &[(&str, &str)] = &[
    (PLANNER_INIT, include_str!("../../../prompts/planner_init.j2")),
    (PLANNER_UPDATE, include_str!("../../../prompts/planner_update.j2")),
    (CODER, include_str!("../../../prompts/coder.j2")),
    (REPAIR, include_str!("../../../prompts/repair.j2")),
];

/// The line that separates the system part from the user part of a rendered template.
pub const USER_MARKER: &str = "=== USER ===";

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("prompt template {name}: {message}")]
    Template { name: String, message: String },
    #[error("reading prompt template {path}: {message}")]
    Io { path: String, message: String },
}

// ---------------------------------------------------------------------------------------------
// Render contexts

/// An estimated impact on one resource: 0–10 (10 = best use of it) and a short note.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Impact {
    pub rating: f64,
    #[serde(default)]
    pub note: String,
}

impl Default for Impact {
    fn default() -> Self {
        Impact {
            rating: 5.0,
            note: String::new(),
        }
    }
}

/// The kernel task, as the models see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskSummary {
    pub name: String,
    pub description: String,
    /// The reference computation (expression, pseudo-code or source).
    pub reference: String,
    /// The interface the candidate must implement: entry point(s), argument order, launch contract.
    pub interface: String,
    /// Shapes / workloads, one per line item (e.g. `B=8 H=32 L=4096 D=128`).
    pub shapes: Vec<String>,
    pub dtype: String,
    /// Correctness criterion (e.g. `atol 1e-3, rtol 1e-3`).
    pub tolerance: String,
}

/// The target back-end and what the model must respect there.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetInfo {
    /// `cpu`, `cuda`, `mlx-metal`, `mlx-cuda`…
    pub name: String,
    /// The language a candidate is written in (`cpp`, `cuda`, `mlx_metal`, `mlx_cuda`).
    pub lang: String,
    /// The machine: device name, bandwidth, memory limits…
    pub hardware: String,
    /// Target context text: translation rules, hardware limits, knowledge-base excerpts.
    pub context: String,
}

/// One tree node as the planner sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeView {
    pub id: i64,
    pub parent: Option<i64>,
    pub title: String,
    pub description: String,
    pub pattern: Option<String>,
    /// `open`, `solved`, `failed`, `pruned`, `too_hard`…
    pub status: String,
    pub overall: f64,
    pub confidence: f64,
    pub bandwidth: Impact,
    pub registers: Impact,
    pub hw_fit: Impact,
    pub difficulty: u8,
    pub prior: f64,
    /// Measured speed-up over the seed.
    pub speedup: Option<f64>,
    pub time_us: Option<f64>,
    /// Failure class of a failed node.
    pub failure: Option<String>,
}

/// One evaluation result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalView {
    pub node_id: i64,
    pub title: String,
    /// `correct`, `compile_error`, `wrong_result`, `timeout`, `crash`…
    pub outcome: String,
    pub speedup: Option<f64>,
    pub time_us: Option<f64>,
    /// Per-workload timings or correctness details, already formatted.
    pub details: String,
    /// Compiler / runtime log (truncated when rendered).
    pub log: String,
}

/// The best candidate so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BestView {
    pub node_id: i64,
    pub title: String,
    pub speedup: f64,
    pub time_us: Option<f64>,
    pub source: Option<String>,
}

/// Context of both planner prompts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerContext {
    pub task: TaskSummary,
    pub target: TargetInfo,
    pub round: u32,
    pub max_rounds: Option<u32>,
    /// Seed (naive) source, for the init prompt.
    pub seed_source: Option<String>,
    /// Root → current node.
    pub active_path: Vec<NodeView>,
    /// Open nodes, best first.
    pub frontier: Vec<NodeView>,
    pub best: Option<BestView>,
    /// Most recent last.
    pub last_evaluations: Vec<EvalView>,
    /// Free-form notes carried over (lessons learnt, KB hints).
    pub notes: Vec<String>,
}

/// Context of the coder prompt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CoderContext {
    pub task: TaskSummary,
    pub target: TargetInfo,
    /// The ONE modification to implement.
    pub action: NodeView,
    pub parent_title: String,
    pub parent_source: String,
    /// 1 for the first try at this action; more for debug rounds.
    pub attempt: u32,
    /// Source of the previous failed try at this action, if any.
    pub failed_source: Option<String>,
    /// Log of the last failure (compile errors, mismatch report…).
    pub last_failure: Option<String>,
}

/// Size bounds applied before rendering.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    pub max_source_chars: usize,
    pub max_log_chars: usize,
    pub max_context_chars: usize,
    pub max_text_chars: usize,
    pub max_note_chars: usize,
    pub max_path: usize,
    pub max_frontier: usize,
    pub max_evals: usize,
    pub max_notes: usize,
    pub max_shapes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_source_chars: 16_000,
            max_log_chars: 4_000,
            max_context_chars: 8_000,
            max_text_chars: 3_000,
            max_note_chars: 300,
            max_path: 8,
            max_frontier: 12,
            max_evals: 6,
            max_notes: 10,
            max_shapes: 8,
        }
    }
}

/// Keep the head and the tail of a long text, with a marker saying how much was cut.
pub fn truncate_middle(s: &str, max: usize) -> String {
    let s = s.trim_end();
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let keep_head = max * 2 / 3;
    let keep_tail = max.saturating_sub(keep_head);
    let head: String = s.chars().take(keep_head).collect();
    let tail: String = s.chars().skip(n - keep_tail).collect();
    format!("{head}\n[... {} characters omitted ...]\n{tail}", n - keep_head - keep_tail)
}

fn cap_list<T: Clone>(v: &[T], max: usize, keep_last: bool) -> (Vec<T>, usize) {
    if v.len() <= max {
        return (v.to_vec(), 0);
    }
    let omitted = v.len() - max;
    if keep_last {
        (v[omitted..].to_vec(), omitted)
    } else {
        (v[..max].to_vec(), omitted)
    }
}

impl Limits {
    fn task(&self, t: &TaskSummary) -> TaskSummary {
        let (shapes, _) = cap_list(&t.shapes, self.max_shapes, false);
        TaskSummary {
            name: t.name.clone(),
            description: truncate_middle(&t.description, self.max_text_chars),
            reference: truncate_middle(&t.reference, self.max_source_chars / 2),
            interface: truncate_middle(&t.interface, self.max_text_chars),
            shapes,
            dtype: t.dtype.clone(),
            tolerance: t.tolerance.clone(),
        }
    }
    fn target(&self, t: &TargetInfo) -> TargetInfo {
        TargetInfo {
            name: t.name.clone(),
            lang: t.lang.clone(),
            hardware: truncate_middle(&t.hardware, self.max_text_chars),
            context: truncate_middle(&t.context, self.max_context_chars),
        }
    }
    fn node(&self, n: &NodeView) -> NodeView {
        let imp = |i: &Impact| Impact {
            rating: i.rating,
            note: truncate_middle(&i.note, self.max_note_chars),
        };
        NodeView {
            title: truncate_middle(&n.title, self.max_note_chars),
            description: truncate_middle(&n.description, self.max_text_chars / 2),
            bandwidth: imp(&n.bandwidth),
            registers: imp(&n.registers),
            hw_fit: imp(&n.hw_fit),
            ..n.clone()
        }
    }
    fn eval(&self, e: &EvalView) -> EvalView {
        EvalView {
            details: truncate_middle(&e.details, self.max_text_chars / 2),
            log: truncate_middle(&e.log, self.max_log_chars),
            ..e.clone()
        }
    }
}

/// What the planner templates receive (bounded).
#[derive(Serialize)]
struct PlannerView {
    task: TaskSummary,
    target: TargetInfo,
    round: u32,
    max_rounds: Option<u32>,
    seed_source: Option<String>,
    active_path: Vec<NodeView>,
    path_omitted: usize,
    frontier: Vec<NodeView>,
    frontier_omitted: usize,
    best: Option<BestView>,
    last_evaluations: Vec<EvalView>,
    evals_omitted: usize,
    notes: Vec<String>,
}

fn planner_view(c: &PlannerContext, l: &Limits) -> PlannerView {
    let (path, path_omitted) = cap_list(&c.active_path, l.max_path, true);
    let (frontier, frontier_omitted) = cap_list(&c.frontier, l.max_frontier, false);
    let (evals, evals_omitted) = cap_list(&c.last_evaluations, l.max_evals, true);
    let (notes, _) = cap_list(&c.notes, l.max_notes, true);
    PlannerView {
        task: l.task(&c.task),
        target: l.target(&c.target),
        round: c.round,
        max_rounds: c.max_rounds,
        seed_source: c.seed_source.as_deref().map(|s| truncate_middle(s, l.max_source_chars)),
        active_path: path.iter().map(|n| l.node(n)).collect(),
        path_omitted,
        frontier: frontier.iter().map(|n| l.node(n)).collect(),
        frontier_omitted,
        best: c.best.as_ref().map(|b| BestView {
            title: truncate_middle(&b.title, l.max_note_chars),
            source: b.source.as_deref().map(|s| truncate_middle(s, l.max_source_chars / 2)),
            ..b.clone()
        }),
        last_evaluations: evals.iter().map(|e| l.eval(e)).collect(),
        evals_omitted,
        notes: notes.iter().map(|s| truncate_middle(s, l.max_note_chars)).collect(),
    }
}

fn coder_view(c: &CoderContext, l: &Limits) -> CoderContext {
    CoderContext {
        task: l.task(&c.task),
        target: l.target(&c.target),
        action: l.node(&c.action),
        parent_title: truncate_middle(&c.parent_title, l.max_note_chars),
        parent_source: truncate_middle(&c.parent_source, l.max_source_chars),
        attempt: c.attempt.max(1),
        failed_source: c.failed_source.as_deref().map(|s| truncate_middle(s, l.max_source_chars / 2)),
        last_failure: c.last_failure.as_deref().map(|s| truncate_middle(s, l.max_log_chars)),
    }
}

// ---------------------------------------------------------------------------------------------
// The template set

/// Where a template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Embedded,
    File(String),
}

/// The loaded templates and the size limits applied to contexts.
pub struct Prompts {
    env: Environment<'static>,
    origins: BTreeMap<String, Origin>,
    limits: Limits,
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompts")
            .field("origins", &self.origins)
            .field("limits", &self.limits)
            .finish()
    }
}

fn new_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::SemiStrict);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env
}

/// Jinja's `trim_blocks` + `lstrip_blocks`, applied to the source so that they hold whatever the
/// minijinja version: whitespace before a `{%`/`{#` tag that opens a line is dropped, and so is
/// the newline after a line that ends with `%}`/`#}`.
pub fn trim_blocks(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.split_inclusive('\n') {
        let body = line.strip_suffix('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
        let text = body.unwrap_or(line);
        let lead = text.trim_start();
        let text = if lead.starts_with("{%") || lead.starts_with("{#") {
            lead
        } else {
            text
        };
        out.push_str(text);
        let tail = text.trim_end();
        if body.is_some() && !(tail.ends_with("%}") || tail.ends_with("#}")) {
            out.push('\n');
        }
    }
    out
}

/// serde_json → minijinja values, through conversions every supported minijinja version has.
fn to_jinja(v: &Value) -> minijinja::Value {
    match v {
        Value::Null => minijinja::Value::from(()),
        Value::Bool(b) => minijinja::Value::from(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => minijinja::Value::from(i),
            None => minijinja::Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => minijinja::Value::from(s.clone()),
        Value::Array(a) => minijinja::Value::from(a.iter().map(to_jinja).collect::<Vec<_>>()),
        Value::Object(o) => minijinja::Value::from(
            o.iter()
                .map(|(k, v)| (k.clone(), to_jinja(v)))
                .collect::<BTreeMap<String, minijinja::Value>>(),
        ),
    }
}

fn template_err(name: &str, e: minijinja::Error) -> PromptError {
    let mut message = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        message.push_str(&format!(": {s}"));
        src = s.source();
    }
    PromptError::Template {
        name: name.to_string(),
        message,
    }
}

impl Prompts {
    /// The templates compiled into the binary. Cached; cheap to call.
    pub fn embedded() -> &'static Prompts {
        static P: OnceLock<Prompts> = OnceLock::new();
        P.get_or_init(|| Prompts::load(None).unwrap_or_else(|e| panic!("embedded prompt templates are invalid: {e}")))
    }

    /// Templates from `dir` where it has the file, embedded copies otherwise.
    pub fn load(dir: Option<&Path>) -> Result<Prompts, PromptError> {
        let mut env = new_env();
        let mut origins = BTreeMap::new();
        for (name, embedded) in EMBEDDED {
            let file = dir.map(|d| d.join(name)).filter(|p| p.is_file());
            let (src, origin) = match file {
                Some(p) => {
                    let s = std::fs::read_to_string(&p).map_err(|e| PromptError::Io {
                        path: p.display().to_string(),
                        message: e.to_string(),
                    })?;
                    (s, Origin::File(p.display().to_string()))
                }
                None => (embedded.to_string(), Origin::Embedded),
            };
            // Leaked: templates are loaded once per run and must outlive the environment.
            let src: &'static str = Box::leak(trim_blocks(&src).into_boxed_str());
            env.add_template(name, src).map_err(|e| template_err(name, e))?;
            origins.insert(name.to_string(), origin);
        }
        Ok(Prompts {
            env,
            origins,
            limits: Limits::default(),
        })
    }

    /// `prompts/` under `root` if it exists, else embedded.
    pub fn discover(root: &Path) -> Result<Prompts, PromptError> {
        let d = root.join("prompts");
        Prompts::load(d.is_dir().then_some(d.as_path()))
    }

    pub fn with_limits(mut self, limits: Limits) -> Prompts {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn origin(&self, name: &str) -> Option<&Origin> {
        self.origins.get(name)
    }

    /// Render a template with any serialisable context, unbounded (the typed methods bound sizes).
    pub fn render_raw<S: Serialize>(&self, name: &str, ctx: &S) -> Result<String, PromptError> {
        let t = self.env.get_template(name).map_err(|e| template_err(name, e))?;
        let v = serde_json::to_value(ctx).map_err(|e| PromptError::Template {
            name: name.to_string(),
            message: e.to_string(),
        })?;
        t.render(to_jinja(&v)).map_err(|e| template_err(name, e))
    }

    fn messages<S: Serialize>(&self, name: &str, ctx: &S) -> Result<Vec<Message>, PromptError> {
        Ok(split_messages(&self.render_raw(name, ctx)?))
    }

    pub fn planner_init(&self, ctx: &PlannerContext) -> Result<Vec<Message>, PromptError> {
        self.messages(PLANNER_INIT, &planner_view(ctx, &self.limits))
    }

    pub fn planner_update(&self, ctx: &PlannerContext) -> Result<Vec<Message>, PromptError> {
        self.messages(PLANNER_UPDATE, &planner_view(ctx, &self.limits))
    }

    pub fn coder(&self, ctx: &CoderContext) -> Result<Vec<Message>, PromptError> {
        self.messages(CODER, &coder_view(ctx, &self.limits))
    }

    /// The user message asking the model to fix an unparseable reply.
    pub fn repair(&self, err: &ParseError, lang: Option<&str>) -> Result<String, PromptError> {
        let ctx = json!({
            "kind": err.kind(),
            "error": err.to_string(),
            "guidance": err.guidance(),
            "expects": if matches!(err, ParseError::NoCodeBlock | ParseError::TruncatedCode | ParseError::EmptyCode | ParseError::WrongLanguage { .. } | ParseError::Refused { .. })
                || (matches!(err, ParseError::Truncated { .. }) && lang.is_some()) { "code" } else { "json" },
            "lang": lang,
        });
        Ok(self.render_raw(REPAIR, &ctx)?.trim().to_string())
    }

    /// The planner's first request, with the init schema attached.
    pub fn planner_init_request(&self, ctx: &PlannerContext) -> Result<ChatRequest, PromptError> {
        Ok(ChatRequest::new(self.planner_init(ctx)?).with_schema("planner_init", PLANNER_INIT_SCHEMA.clone()))
    }

    /// A planner update request, with the update schema attached.
    pub fn planner_update_request(&self, ctx: &PlannerContext) -> Result<ChatRequest, PromptError> {
        Ok(ChatRequest::new(self.planner_update(ctx)?).with_schema("planner_update", PLANNER_UPDATE_SCHEMA.clone()))
    }

    pub fn coder_request(&self, ctx: &CoderContext) -> Result<ChatRequest, PromptError> {
        Ok(ChatRequest::new(self.coder(ctx)?))
    }

    /// `req` followed by the bad reply (bounded) and a repair message: the retry after a parse error.
    pub fn repair_request(
        &self,
        req: &ChatRequest,
        reply: &str,
        err: &ParseError,
        lang: Option<&str>,
    ) -> Result<ChatRequest, PromptError> {
        let mut r = req.clone();
        r.messages
            .push(Message::assistant(truncate_middle(reply, self.limits.max_source_chars)));
        r.messages.push(Message::user(self.repair(err, lang)?));
        Ok(r)
    }
}

/// Split rendered text at [`USER_MARKER`] into a system and a user message.
pub fn split_messages(rendered: &str) -> Vec<Message> {
    let mut sys = String::new();
    let mut user = String::new();
    let mut seen = false;
    for line in rendered.split_inclusive('\n') {
        if !seen && line.trim() == USER_MARKER {
            seen = true;
            continue;
        }
        if seen { user.push_str(line) } else { sys.push_str(line) }
    }
    if !seen {
        return vec![Message {
            role: Role::User,
            content: sys.trim().to_string(),
        }];
    }
    let mut v = Vec::new();
    if !sys.trim().is_empty() {
        v.push(Message::system(sys.trim()));
    }
    v.push(Message::user(user.trim()));
    v
}

// ---------------------------------------------------------------------------------------------
// Schemas

fn impact_schema(what: &str) -> Value {
    json!({
        "type": "object",
        "description": format!("Estimated effect on {what}: rating 0-10 (10 = best use / no problem) and a one-line note."),
        "properties": {"rating": {"type": "number"}, "note": {"type": "string"}},
        "required": ["rating", "note"],
        "additionalProperties": false
    })
}

fn action_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "description": "Short name of ONE modification."},
            "description": {"type": "string", "description": "What to change and why, concrete enough for a coder."},
            "pattern": {"type": ["string", "null"], "description": "Optimisation pattern name (e.g. tiling, online_softmax, vectorized_loads), or null."},
            "overall": {"type": "number", "description": "Overall rating 0-10."},
            "confidence": {"type": "number", "description": "Confidence in the rating, 0-1."},
            "bandwidth": impact_schema("memory bandwidth"),
            "registers": impact_schema("register pressure"),
            "hw_fit": impact_schema("fit to the target hardware"),
            "difficulty": {"type": "integer", "description": "1 (trivial) - 5 (very hard)."},
            "prior": {"type": "number", "description": "Prior probability 0-1 that it beats its parent."}
        },
        "required": ["title", "description", "pattern", "overall", "confidence", "bandwidth", "registers", "hw_fit", "difficulty", "prior"],
        "additionalProperties": false
    })
}

fn nullable(mut v: Value) -> Value {
    json!({"anyOf": [v.take(), {"type": "null"}]})
}

/// JSON schema of the planner's first reply (strict-mode compatible).
pub static PLANNER_INIT_SCHEMA: LazyLock<Value> = LazyLock::new(|| {
    json!({
        "type": "object",
        "properties": {
            "classification": {"type": "string", "description": "Kernel class and whether it is memory- or compute-bound at the given shapes."},
            "reference_rewrite": {"type": "string", "description": "The reference computation rewritten in the target's terms (threads, tiles, memory levels)."},
            "bottlenecks": {"type": "array", "items": {"type": "string"}, "description": "Bottleneck hypotheses, most likely first."},
            "families": {"type": "array", "items": {"type": "string"}, "description": "2-3 candidate kernel families."},
            "actions": {"type": "array", "items": action_schema(), "description": "At least 3 open action nodes, each ONE modification of the seed."}
        },
        "required": ["classification", "reference_rewrite", "bottlenecks", "families", "actions"],
        "additionalProperties": false
    })
});

/// JSON schema of a planner update reply (strict-mode compatible: one flat op object).
pub static PLANNER_UPDATE_SCHEMA: LazyLock<Value> = LazyLock::new(|| {
    let num = |d: &str| json!({"type": ["number", "null"], "description": d});
    let op = json!({
        "type": "object",
        "properties": {
            "op": {"type": "string", "enum": ["update", "insert", "split", "prune"]},
            "node": {"type": ["integer", "null"], "description": "Target node id (update, split, prune)."},
            "parent": {"type": ["integer", "null"], "description": "Parent node id (insert)."},
            "action": nullable(action_schema()),
            "actions": nullable(json!({"type": "array", "items": action_schema(), "description": "2-3 narrower actions (split)."})),
            "overall": num("New overall rating 0-10 (update)."),
            "confidence": num("New confidence 0-1 (update)."),
            "bandwidth": nullable(impact_schema("memory bandwidth")),
            "registers": nullable(impact_schema("register pressure")),
            "hw_fit": nullable(impact_schema("fit to the target hardware")),
            "difficulty": {"type": ["integer", "null"]},
            "prior": num("New prior 0-1 (update)."),
            "reason": {"type": ["string", "null"], "description": "Why (required for prune)."}
        },
        "required": ["op", "node", "parent", "action", "actions", "overall", "confidence", "bandwidth", "registers", "hw_fit", "difficulty", "prior", "reason"],
        "additionalProperties": false
    });
    json!({
        "type": "object",
        "properties": {
            "analysis": {"type": "string", "description": "What the measurements say about the hypotheses."},
            "ops": {"type": "array", "items": op}
        },
        "required": ["analysis", "ops"],
        "additionalProperties": false
    })
});

// ---------------------------------------------------------------------------------------------
// Parsed replies

/// One proposed action node (clamped: overall 0–10, confidence 0–1, impacts 0–10, difficulty 1–5, prior 0–1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProposedAction {
    pub title: String,
    pub description: String,
    pub pattern: Option<String>,
    pub overall: f64,
    pub confidence: f64,
    pub bandwidth: Impact,
    pub registers: Impact,
    pub hw_fit: Impact,
    pub difficulty: u8,
    pub prior: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerInit {
    pub classification: String,
    pub reference_rewrite: String,
    pub bottlenecks: Vec<String>,
    pub families: Vec<String>,
    pub actions: Vec<ProposedAction>,
}

/// New values for a node's assessment; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RatingUpdate {
    pub overall: Option<f64>,
    pub confidence: Option<f64>,
    pub bandwidth: Option<Impact>,
    pub registers: Option<Impact>,
    pub hw_fit: Option<Impact>,
    pub difficulty: Option<u8>,
    pub prior: Option<f64>,
    pub reason: Option<String>,
}

/// One edit of the search tree proposed by the planner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TreeOp {
    Update {
        node: i64,
        changes: RatingUpdate,
    },
    Insert {
        parent: i64,
        action: ProposedAction,
    },
    /// Replace action `node` by 2–3 narrower actions (siblings under its parent).
    Split {
        node: i64,
        into: Vec<ProposedAction>,
    },
    Prune {
        node: i64,
        reason: String,
    },
}

impl TreeOp {
    /// The node the op refers to (the parent for inserts).
    pub fn target(&self) -> i64 {
        match self {
            TreeOp::Update { node, .. } | TreeOp::Split { node, .. } | TreeOp::Prune { node, .. } => *node,
            TreeOp::Insert { parent, .. } => *parent,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerUpdate {
    pub analysis: String,
    pub ops: Vec<TreeOp>,
    /// Ops that could not be understood, with why (the rest of the reply is still used).
    pub rejected: Vec<String>,
}

fn num_of(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().trim_end_matches('%').trim().parse::<f64>().ok(),
        _ => None,
    }
    .filter(|x| x.is_finite())
}

fn str_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.trim().to_string(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

fn get<'a>(o: &'a serde_json::Map<String, Value>, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| o.get(*k)).filter(|v| !v.is_null())
}

/// A node id: an integer, or a string like `"12"`, `"#12"`, `"n12"`, `"node 12"`.
fn id_of(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64)),
        Value::String(s) => {
            let d: String = s.chars().skip_while(|c| !c.is_ascii_digit() && *c != '-').collect();
            d.trim().parse().ok()
        }
        _ => None,
    }
}

fn impact_of(v: Option<&Value>, default: f64) -> Option<Impact> {
    let v = v?;
    if let Some(r) = num_of(v) {
        return Some(Impact {
            rating: r.clamp(0.0, 10.0),
            note: String::new(),
        });
    }
    let o = v.as_object()?;
    let rating = get(o, &["rating", "score", "value"])
        .and_then(num_of)
        .unwrap_or(default)
        .clamp(0.0, 10.0);
    Some(Impact {
        rating,
        note: str_of(get(o, &["note", "notes", "reason", "comment"])),
    })
}

const BANDWIDTH_KEYS: &[&str] = &["bandwidth", "memory_bandwidth", "memory", "bw"];
const REGISTERS_KEYS: &[&str] = &["registers", "register_pressure", "regs"];
const HW_FIT_KEYS: &[&str] = &["hw_fit", "hardware_fit", "hardware", "fit"];

/// Impacts may sit at the action's top level or inside an `impacts` object.
fn impact_field(o: &serde_json::Map<String, Value>, keys: &[&str]) -> Option<Impact> {
    impact_of(get(o, keys), 5.0).or_else(|| {
        get(o, &["impacts", "impact"])
            .and_then(Value::as_object)
            .and_then(|i| impact_of(get(i, keys), 5.0))
    })
}

/// Bounds on what one planner reply may put into the tree.
const MAX_ACTIONS: usize = 12;
const MAX_OPS: usize = 24;
const MAX_TITLE: usize = 160;
const MAX_DESCRIPTION: usize = 4000;

fn action_of(v: &Value) -> Result<ProposedAction, String> {
    let o = v.as_object().ok_or("an action is not an object")?;
    let title = str_of(get(o, &["title", "name", "action"]));
    let description = str_of(get(o, &["description", "details", "rationale"]));
    if title.is_empty() && description.is_empty() {
        return Err("an action has neither title nor description".into());
    }
    let title: String = if title.is_empty() {
        description.chars().take(80).collect()
    } else {
        title.chars().take(MAX_TITLE).collect()
    };
    let description: String = description.chars().take(MAX_DESCRIPTION).collect();
    let n = |keys: &[&str], d: f64, lo: f64, hi: f64| get(o, keys).and_then(num_of).unwrap_or(d).clamp(lo, hi);
    let pattern = Some(str_of(get(o, &["pattern"]))).filter(|p| !p.is_empty() && p != "null" && p != "none");
    Ok(ProposedAction {
        title,
        description,
        pattern,
        overall: n(&["overall", "overall_rating", "rating", "score"], 5.0, 0.0, 10.0),
        confidence: n(&["confidence"], 0.3, 0.0, 1.0),
        bandwidth: impact_field(o, BANDWIDTH_KEYS).unwrap_or_default(),
        registers: impact_field(o, REGISTERS_KEYS).unwrap_or_default(),
        hw_fit: impact_field(o, HW_FIT_KEYS).unwrap_or_default(),
        difficulty: n(&["difficulty"], 2.0, 1.0, 5.0).round() as u8,
        prior: n(&["prior", "prior_score"], 0.5, 0.0, 1.0),
    })
}

fn str_list(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::Array(a)) => a.iter().map(|x| str_of(Some(x))).filter(|s| !s.is_empty()).collect(),
        Some(Value::String(s)) if !s.trim().is_empty() => vec![s.trim().to_string()],
        _ => Vec::new(),
    }
}

fn schema_err(m: impl Into<String>) -> ParseError {
    ParseError::Schema { message: m.into() }
}

impl PlannerInit {
    /// Parse the planner's first reply (tolerant of prose, fences, field-name variants).
    pub fn parse(text: &str) -> Result<PlannerInit, ParseError> {
        PlannerInit::from_value(&extract_json(text)?)
    }

    pub fn from_value(v: &Value) -> Result<PlannerInit, ParseError> {
        let o = v.as_object().ok_or_else(|| schema_err("the reply is not a JSON object"))?;
        let acts = get(o, &["actions", "nodes", "proposals"])
            .and_then(Value::as_array)
            .ok_or_else(|| schema_err("missing `actions` array"))?;
        let mut actions = Vec::new();
        // A reply proposes a handful of actions; more are cut, not inserted by the thousand.
        for a in acts.iter().take(MAX_ACTIONS) {
            actions.push(action_of(a).map_err(schema_err)?);
        }
        if actions.is_empty() {
            return Err(schema_err("`actions` is empty; propose at least 3 actions"));
        }
        Ok(PlannerInit {
            classification: str_of(get(o, &["classification", "class", "kernel_class"])),
            reference_rewrite: str_of(get(o, &["reference_rewrite", "rewrite", "reference"])),
            bottlenecks: str_list(get(o, &["bottlenecks", "bottleneck", "hypotheses"])),
            families: str_list(get(o, &["families", "candidate_families"])),
            actions,
        })
    }
}

fn op_of(v: &Value) -> Result<TreeOp, String> {
    let o = v.as_object().ok_or("an op is not an object")?;
    let kind = str_of(get(o, &["op", "type", "kind"])).to_ascii_lowercase();
    let node = id_of(get(o, &["node", "node_id", "id", "target"]));
    let need_node = || node.ok_or_else(|| format!("`{kind}` needs a `node` id"));
    match kind.as_str() {
        "update" | "rerate" | "revise" => {
            let n = |keys: &[&str], lo: f64, hi: f64| get(o, keys).and_then(num_of).map(|x| x.clamp(lo, hi));
            let changes = RatingUpdate {
                overall: n(&["overall", "overall_rating", "rating"], 0.0, 10.0),
                confidence: n(&["confidence"], 0.0, 1.0),
                bandwidth: impact_field(o, BANDWIDTH_KEYS),
                registers: impact_field(o, REGISTERS_KEYS),
                hw_fit: impact_field(o, HW_FIT_KEYS),
                difficulty: n(&["difficulty"], 1.0, 5.0).map(|d| d.round() as u8),
                prior: n(&["prior"], 0.0, 1.0),
                reason: Some(str_of(get(o, &["reason", "note"]))).filter(|s| !s.is_empty()),
            };
            Ok(TreeOp::Update {
                node: need_node()?,
                changes,
            })
        }
        "insert" | "add" | "expand" => {
            let parent = id_of(get(o, &["parent", "parent_id"]))
                .or(node)
                .ok_or("`insert` needs a `parent` id")?;
            let action = match get(o, &["action"]) {
                Some(a) => action_of(a)?,
                // Some models put the action's fields at the op's top level.
                None => action_of(v)?,
            };
            Ok(TreeOp::Insert { parent, action })
        }
        "split" => {
            let node = need_node()?;
            let list = get(o, &["actions", "into", "children"])
                .and_then(Value::as_array)
                .ok_or("`split` needs an `actions` array")?;
            let into = list.iter().take(MAX_ACTIONS).map(action_of).collect::<Result<Vec<_>, _>>()?;
            if into.len() < 2 {
                return Err(format!("`split` of node {node} needs at least 2 actions, got {}", into.len()));
            }
            Ok(TreeOp::Split { node, into })
        }
        "prune" | "remove" | "delete" => Ok(TreeOp::Prune {
            node: need_node()?,
            reason: str_of(get(o, &["reason", "note", "why"])),
        }),
        "" => Err("an op has no `op` field".into()),
        k => Err(format!("unknown op `{k}` (use update, insert, split or prune)")),
    }
}

impl PlannerUpdate {
    /// Parse a planner update reply. Unknown or malformed ops are listed in `rejected`.
    pub fn parse(text: &str) -> Result<PlannerUpdate, ParseError> {
        PlannerUpdate::from_value(&extract_json(text)?)
    }

    pub fn from_value(v: &Value) -> Result<PlannerUpdate, ParseError> {
        let (o, ops) = match v {
            Value::Array(a) => (None, a),
            Value::Object(o) => (
                Some(o),
                get(o, &["ops", "operations", "edits"])
                    .and_then(Value::as_array)
                    .ok_or_else(|| schema_err("missing `ops` array"))?,
            ),
            _ => return Err(schema_err("the reply is not a JSON object")),
        };
        let mut parsed = Vec::new();
        let mut rejected = Vec::new();
        if ops.len() > MAX_OPS {
            rejected.push(format!(
                "ops {} to {}: at most {MAX_OPS} ops per reply",
                MAX_OPS,
                ops.len() - 1
            ));
        }
        for (i, op) in ops.iter().enumerate().take(MAX_OPS) {
            match op_of(op) {
                Ok(t) => parsed.push(t),
                Err(e) => rejected.push(format!("op {i}: {e}")),
            }
        }
        if parsed.is_empty() && !rejected.is_empty() {
            return Err(schema_err(format!("no usable op: {}", rejected.join("; "))));
        }
        Ok(PlannerUpdate {
            analysis: o
                .map(|o| str_of(get(o, &["analysis", "revision", "summary"])))
                .unwrap_or_default(),
            ops: parsed,
            rejected,
        })
    }
}
