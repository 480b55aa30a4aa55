//! Kernel tasks: `tasks/<name>/task.toml` and the kernel sources beside it.
//! The format is described in `docs/task-format.md`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::expr::{Expr, eval_i64};

/// Element types a tensor may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    F64,
    I32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::I32 => "i32",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::Bf16,
            "f64" => DType::F64,
            "i32" => DType::I32,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How random inputs are drawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum Init {
    Normal { mean: f64, std: f64 },
    Uniform { lo: f64, hi: f64 },
}

impl Default for Init {
    fn default() -> Self {
        Init::Normal { mean: 0.0, std: 1.0 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    pub name: String,
    /// Axis names, integer literals or expressions over the axes.
    pub shape: Vec<String>,
    pub dtype: DType,
    #[serde(default)]
    pub init: Init,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

/// A workload: a value for every axis.
pub type Workload = BTreeMap<String, i64>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchSpec {
    pub entry: String,
    #[serde(default = "one3")]
    pub grid: [String; 3],
    #[serde(default = "one3")]
    pub block: [String; 3],
    /// Dynamic shared (threadgroup) memory bytes, an expression.
    #[serde(default = "zero")]
    pub shared: String,
    /// MLX launches: the tensors this launch reads (task inputs, or scratch / outputs written by
    /// an earlier launch). Empty: every task input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<String>,
    /// MLX launches: the task outputs or scratch buffers this launch writes. Empty: every task
    /// output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<String>,
}

fn one3() -> [String; 3] {
    ["1".into(), "1".into(), "1".into()]
}
fn zero() -> String {
    "0".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScratchSpec {
    pub name: String,
    pub bytes: String,
    /// Element type where the back-end needs one (MLX scratch arrays); f32 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tunable {
    pub name: String,
    pub values: Vec<i64>,
    #[serde(default)]
    pub default: Option<i64>,
    /// The optimisation pattern this tunable expresses (a `kb/patterns` name).
    #[serde(default)]
    pub pattern: Option<String>,
}

impl Tunable {
    pub fn default_value(&self) -> i64 {
        self.default.unwrap_or(self.values[0])
    }
    /// A 0/1 tunable tagged with a pattern switches that pattern on or off.
    pub fn is_pattern_switch(&self) -> bool {
        self.pattern.is_some() && self.values.len() == 2 && self.values.contains(&0) && self.values.contains(&1)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelSpec {
    #[serde(default)]
    pub name: String,
    pub file: String,
    #[serde(default)]
    pub entry: Option<String>,
    #[serde(default)]
    pub launches: Vec<LaunchSpec>,
    #[serde(default)]
    pub scratch: Vec<ScratchSpec>,
    #[serde(default)]
    pub tunables: Vec<Tunable>,
    #[serde(default)]
    pub constraints: Vec<String>,
    #[serde(default)]
    pub pattern: Option<String>,
    #[serde(default)]
    pub description: String,
    /// Back-end specific options (e.g. MLX template parameters), passed through untouched.
    #[serde(default)]
    pub options: BTreeMap<String, toml::Value>,
    /// The kernel source, read from `file` when the task is loaded.
    #[serde(skip)]
    pub source: String,
}

impl KernelSpec {
    /// The kernel's name, `seed` for a back-end's seed (which has none).
    pub fn name_or_seed(&self) -> &str {
        if self.name.is_empty() { "seed" } else { &self.name }
    }

    /// Default value of every tunable.
    pub fn default_config(&self) -> BTreeMap<String, i64> {
        self.tunables.iter().map(|t| (t.name.clone(), t.default_value())).collect()
    }

    /// Does `config` satisfy every constraint for `workload`? Unknown names are an error.
    pub fn admits(&self, config: &BTreeMap<String, i64>, workload: &Workload) -> Result<bool, String> {
        let mut env = workload.clone();
        env.extend(config.iter().map(|(k, v)| (k.clone(), *v)));
        for c in &self.constraints {
            if eval_i64(c, &env).map_err(|e| e.to_string())? == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Why `specialise` finds no build of `config` for `workload`: the first constraint that
    /// breaks whatever values the shape-tied tunables take (such as `H % Hkv == 0`), else the
    /// first one `config` itself breaks; `None` where `config` is admitted. An expression that
    /// cannot be evaluated counts as broken.
    pub fn broken_constraint(&self, config: &BTreeMap<String, i64>, workload: &Workload) -> Option<&str> {
        let broken = |c: &BTreeMap<String, i64>| -> Vec<usize> {
            let mut env = workload.clone();
            env.extend(c.iter().map(|(k, v)| (k.clone(), *v)));
            (0..self.constraints.len())
                .filter(|&i| eval_i64(&self.constraints[i], &env).map_or(true, |v| v == 0))
                .collect()
        };
        let own = broken(config);
        let first = *own.first()?;
        // Intersect with the constraints every build of the shape-tied tunables breaks.
        let mut always = own.clone();
        for t in self
            .tunables
            .iter()
            .filter(|t| t.pattern.as_deref() == Some("specialisation"))
        {
            for v in &t.values {
                let mut c = config.clone();
                c.insert(t.name.clone(), *v);
                let b = broken(&c);
                always.retain(|i| b.contains(i));
            }
        }
        Some(self.constraints[always.first().copied().unwrap_or(first)].as_str())
    }

    /// The build of `config` for `workload`: `config` itself where it is admitted, else the
    /// same configuration with its shape-tied tunables (pattern `specialisation`, e.g. a head
    /// size `HD` with the constraint `HD == D`) set to the first values the workload admits;
    /// `None` when no such build exists. One candidate is a kernel family plus its free
    /// tunables; the builds per shape are its dispatch table.
    pub fn specialise(&self, config: &BTreeMap<String, i64>, workload: &Workload) -> Option<BTreeMap<String, i64>> {
        if self.admits(config, workload).unwrap_or(false) {
            return Some(config.clone());
        }
        let spec: Vec<&Tunable> = self
            .tunables
            .iter()
            .filter(|t| t.pattern.as_deref() == Some("specialisation"))
            .collect();
        if spec.is_empty() {
            return None;
        }
        let mut idx = vec![0usize; spec.len()];
        loop {
            let mut c = config.clone();
            for (t, i) in spec.iter().zip(&idx) {
                c.insert(t.name.clone(), t.values[*i]);
            }
            if self.admits(&c, workload).unwrap_or(false) {
                return Some(c);
            }
            let mut j = 0;
            loop {
                if j == idx.len() {
                    return None;
                }
                idx[j] += 1;
                if idx[j] < spec[j].values.len() {
                    break;
                }
                idx[j] = 0;
                j += 1;
            }
        }
    }

    /// The tunables a search chooses (all but the shape-tied ones).
    pub fn is_free(&self, name: &str) -> bool {
        self.tunables
            .iter()
            .any(|t| t.name == name && t.pattern.as_deref() != Some("specialisation"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    pub search: Vec<Workload>,
    #[serde(default)]
    pub heldout: Vec<Workload>,
    /// Small workloads on which the Linux-side executor runs this back-end's Metal kernels
    /// (`mlx-metal`; `ksearch kb run`, the kb crate's tests); the held-out ones where absent.
    #[serde(default)]
    pub emulate: Vec<Workload>,
    #[serde(default)]
    pub dtypes: BTreeMap<String, DType>,
    pub seed: KernelSpec,
    #[serde(default)]
    pub kernels: Vec<KernelSpec>,
    /// Library calls a candidate for this back-end must not make (checked before compiling).
    #[serde(default)]
    pub forbid: Vec<String>,
}

/// What a task computes, in f64: a host reference built into ksearch, by name
/// (`reference = "softmax"`, `ksearch-core::reference`), or one the task brings as a C++ file
/// (`reference = { file = "reference.cpp", entry = "my_ref" }`, see `docs/task-format.md`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reference {
    Named(String),
    File(FileReference),
}

/// A reference the task brings: plain C++ in f64, compiled with the host compiler and run by
/// the trusted side (never by the candidate's runner). It is the task author's code, as
/// trusted as the task file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileReference {
    /// The C++ source, relative to the task's folder.
    pub file: String,
    /// The function to call: `extern "C" void ENTRY(const double* const* inputs,
    /// double* const* outputs, const int64_t* dims)`.
    pub entry: String,
    /// The source text, read from `file` when the task is loaded; it travels with the task to
    /// the workers, which compile it. Not a field of `task.toml`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
}

impl Reference {
    /// The name of a built-in host reference.
    pub fn name(&self) -> Option<&str> {
        match self {
            Reference::Named(n) => Some(n),
            Reference::File(_) => None,
        }
    }
    /// The reference the task brings, if it brings one.
    pub fn file(&self) -> Option<&FileReference> {
        match self {
            Reference::Named(_) => None,
            Reference::File(f) => Some(f),
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Named(n) => f.write_str(n),
            Reference::File(r) => write!(f, "{} ({})", r.file, r.entry),
        }
    }
}

impl<'de> Deserialize<'de> for Reference {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Reference;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#"a host reference name (e.g. "softmax") or { file = "reference.cpp", entry = "my_ref" }"#)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Reference, E> {
                Ok(Reference::Named(v.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<Reference, A::Error> {
                FileReference::deserialize(serde::de::value::MapAccessDeserializer::new(m)).map(Reference::File)
            }
        }
        d.deserialize_any(V)
    }
}

/// Does `source` name function `entry` (the identifier followed by an opening parenthesis)?
/// A textual check at load; the compiler checks the definition and its signature.
fn names_function(source: &str, entry: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    source.match_indices(entry).any(|(i, _)| {
        let before_ok = source[..i].chars().next_back().is_none_or(|c| !ident(c));
        let after = source[i + entry.len()..].trim_start();
        before_ok && after.starts_with('(')
    })
}

fn is_c_identifier(s: &str) -> bool {
    let mut cs = s.chars();
    cs.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && cs.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The line of top-level key `key` (`key = …` or a `[key]` table), else the first line
/// mentioning it.
fn key_line(text: &str, key: &str) -> usize {
    text.lines()
        .position(|l| {
            let t = l.trim_start();
            t.starts_with(&format!("[{key}]")) || t.strip_prefix(key).is_some_and(|rest| rest.trim_start().starts_with('='))
        })
        .map(|i| i + 1)
        .unwrap_or_else(|| line_of(text, key))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub reference: Reference,
    pub axes: Vec<String>,
    #[serde(default)]
    pub flops: Option<String>,
    #[serde(default)]
    pub transcendentals: Option<String>,
    #[serde(default)]
    pub constants: BTreeMap<String, f64>,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub tolerance: BTreeMap<DType, Tolerance>,
    pub backends: BTreeMap<String, BackendSpec>,
    #[serde(skip)]
    pub dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The cause is text of this error, not a `source`: printed once.
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("{path}:{line}:{col}: {reason}")]
    Syntax {
        path: String,
        line: usize,
        col: usize,
        reason: String,
    },
    #[error("{path}:{line}: {reason}")]
    Invalid { path: String, line: usize, reason: String },
    #[error("no task named `{name}` under {dir} (known: {known})")]
    NotFound { name: String, dir: String, known: String },
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
    (line, col)
}

/// The first line mentioning `needle` (for semantic errors that have no span), or 1.
fn line_of(text: &str, needle: &str) -> usize {
    // Quoted names (tensors, tunables, files) are looked up inside tables first, so a tensor
    // that shares the task's name is still found where it is declared.
    let first_table = text.lines().position(|l| l.trim_start().starts_with('[')).unwrap_or(0);
    let quoted = needle.starts_with('"');
    text.lines()
        .enumerate()
        .skip(if quoted { first_table } else { 0 })
        .find(|(_, l)| l.contains(needle))
        .or_else(|| text.lines().enumerate().find(|(_, l)| l.contains(needle)))
        .map(|(i, _)| i + 1)
        .unwrap_or(1)
}

/// A tensor's resolved shape for a workload.
/// Launch wiring (MLX): what each launch reads must exist by then, every task output is
/// written by exactly one launch, scratch is written before it is read.
fn check_wiring(k: &KernelSpec, inputs: &[String], outputs: &[String]) -> Result<(), String> {
    if k.launches.iter().all(|l| l.inputs.is_empty() && l.outputs.is_empty()) {
        return Ok(());
    }
    let scratch: Vec<&str> = k.scratch.iter().map(|s| s.name.as_str()).collect();
    let mut avail: Vec<String> = inputs.to_vec();
    let mut written: Vec<String> = Vec::new();
    for l in &k.launches {
        let reads: Vec<String> = if l.inputs.is_empty() {
            inputs.to_vec()
        } else {
            l.inputs.clone()
        };
        for r in &reads {
            if !avail.contains(r) {
                return Err(format!(
                    "launch `{}` reads `{r}`, which is no task input and no earlier launch wrote",
                    l.entry
                ));
            }
        }
        let writes: Vec<String> = if l.outputs.is_empty() {
            outputs.to_vec()
        } else {
            l.outputs.clone()
        };
        for w in &writes {
            if !outputs.contains(w) && !scratch.contains(&w.as_str()) {
                return Err(format!(
                    "launch `{}` writes `{w}`, which is no task output and no scratch buffer",
                    l.entry
                ));
            }
            if written.contains(w) {
                return Err(format!("`{w}` is written by two launches"));
            }
            written.push(w.clone());
            avail.push(w.clone());
        }
    }
    if let Some(o) = outputs.iter().find(|o| !written.contains(o)) {
        return Err(format!("no launch writes output `{o}`"));
    }
    Ok(())
}

pub fn shape_of(t: &TensorSpec, w: &Workload) -> Result<Vec<usize>, String> {
    t.shape
        .iter()
        .map(|d| {
            eval_i64(d, w)
                .map_err(|e| format!("shape of `{}`: {e}", t.name))
                .and_then(|v| usize::try_from(v).map_err(|_| format!("shape of `{}`: negative size {v}", t.name)))
        })
        .collect()
}

/// Bytes of a tensor of `shape` and `dtype`, or why no machine holds it (the count overflows).
pub fn bytes_of(shape: &[usize], dtype: DType) -> Result<u64, String> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |n, d| n.checked_mul(*d as u64))
        .filter(|n| *n <= isize::MAX as u64)
        .ok_or_else(|| format!("of shape {shape:?} in {dtype} holds more bytes than a 64-bit machine addresses"))
}

impl Task {
    /// A digest of everything that decides what a run measures: the task's fields and every
    /// kernel's source. A run records it, and `resume` refuses a task that changed since.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(serde_json::to_string(self).unwrap_or_default().as_bytes());
        for (name, b) in &self.backends {
            for k in std::iter::once(&b.seed).chain(&b.kernels) {
                h.update(name.as_bytes());
                h.update([0]);
                h.update(k.name.as_bytes());
                h.update([0]);
                h.update(k.source.as_bytes());
                h.update([0]);
            }
        }
        h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
    }

    /// Load and validate `path` (a `task.toml`), reading every kernel source beside it.
    pub fn load(path: &Path) -> Result<Task, TaskError> {
        let p = path.display().to_string();
        let text = crate::read_source(path).map_err(|e| TaskError::Io {
            path: p.clone(),
            cause: e,
        })?;
        let mut task: Task = toml::from_str(&text).map_err(|e| {
            let (line, col) = e.span().map(|s| line_col(&text, s.start)).unwrap_or((1, 1));
            TaskError::Syntax {
                path: p.clone(),
                line,
                col,
                reason: e.message().trim().to_string(),
            }
        })?;
        task.dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        task.validate(&text, &p)?;
        Ok(task)
    }

    fn validate(&mut self, text: &str, p: &str) -> Result<(), TaskError> {
        let inv = |needle: &str, reason: String| TaskError::Invalid {
            path: p.to_string(),
            line: line_of(text, needle),
            reason,
        };
        if self.axes.is_empty() {
            return Err(inv("axes", "a task needs at least one axis".into()));
        }
        let at_ref = |reason: String| TaskError::Invalid {
            path: p.to_string(),
            line: key_line(text, "reference"),
            reason,
        };
        match &mut self.reference {
            Reference::Named(n) => {
                if crate::reference::lookup(n).is_none() {
                    return Err(at_ref(format!(
                        "unknown host reference `{n}` (known: {}; or a file of the task's own: {{ file = \"reference.cpp\", entry = \"my_ref\" }})",
                        crate::reference::names().join(", ")
                    )));
                }
            }
            Reference::File(f) => {
                if !f.source.is_empty() {
                    return Err(at_ref(
                        "reference: `source` is no task field (the source is read from `file`)".into(),
                    ));
                }
                if !is_c_identifier(&f.entry) {
                    return Err(at_ref(format!("reference entry `{}` is not a C identifier", f.entry)));
                }
                let src = self.dir.join(&f.file);
                let source = crate::read_source(&src).map_err(|e| at_ref(format!("reference file {}: {e}", src.display())))?;
                if !names_function(&source, &f.entry) {
                    return Err(at_ref(format!(
                        "reference entry `{}` not found in {} (it must define extern \"C\" void {}(const double* const* inputs, double* const* outputs, const int64_t* dims))",
                        f.entry,
                        src.display(),
                        f.entry
                    )));
                }
                f.source = source;
            }
        }
        if self.outputs.is_empty() {
            return Err(inv("[[outputs]]", "a task needs at least one output".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in self.inputs.iter().chain(&self.outputs) {
            if !seen.insert(t.name.clone()) {
                return Err(inv(&format!("\"{}\"", t.name), format!("tensor `{}` declared twice", t.name)));
            }
            for d in &t.shape {
                let e = Expr::parse(d).map_err(|e| inv(&format!("\"{}\"", t.name), e.to_string()))?;
                let mut vars = Vec::new();
                e.vars(&mut vars);
                if let Some(v) = vars.iter().find(|v| !self.axes.contains(v)) {
                    return Err(inv(
                        &format!("\"{}\"", t.name),
                        format!("shape of `{}` uses unknown axis `{v}`", t.name),
                    ));
                }
            }
            let finite = match t.init {
                Init::Normal { mean, std } => mean.is_finite() && std.is_finite() && std >= 0.0,
                Init::Uniform { lo, hi } => lo.is_finite() && hi.is_finite(),
            };
            if !finite {
                return Err(inv(
                    &format!("\"{}\"", t.name),
                    format!("`{}`: init needs finite numbers (and std >= 0)", t.name),
                ));
            }
            if let Init::Uniform { lo, hi } = t.init
                && lo >= hi
            {
                return Err(inv(
                    &format!("\"{}\"", t.name),
                    format!("`{}`: uniform init needs lo < hi", t.name),
                ));
            }
        }
        if self.backends.is_empty() {
            return Err(inv("[backends", "a task needs at least one [backends.<name>] section".into()));
        }
        for (dt, t) in &self.tolerance {
            if !(t.atol.is_finite() && t.rtol.is_finite() && t.atol >= 0.0 && t.rtol >= 0.0) {
                return Err(inv(
                    "[tolerance]",
                    format!("tolerance of {dt}: atol and rtol must be finite and >= 0"),
                ));
            }
        }
        for (k, v) in &self.constants {
            if !v.is_finite() {
                return Err(inv("[constants]", format!("constant `{k}` = {v}: constants must be finite")));
            }
        }
        let mut axis_seen = std::collections::BTreeSet::new();
        for a in &self.axes {
            if !is_c_identifier(a) || !axis_seen.insert(a.clone()) {
                return Err(inv("axes", format!("axis `{a}`: axes are distinct identifiers")));
            }
        }
        let axes = self.axes.clone();
        let names: Vec<String> = self.inputs.iter().chain(&self.outputs).map(|t| t.name.clone()).collect();
        let outputs = self.outputs.clone();
        let tensors: Vec<TensorSpec> = self.inputs.iter().chain(&self.outputs).cloned().collect();
        let names_in: Vec<String> = self.inputs.iter().map(|t| t.name.clone()).collect();
        let names_out: Vec<String> = self.outputs.iter().map(|t| t.name.clone()).collect();
        let tolerance = self.tolerance.clone();
        let dir = self.dir.clone();
        for (bname, b) in self.backends.iter_mut() {
            let sect = format!("[backends.{bname}");
            if let Err(e) = bname.parse::<crate::Backend>() {
                return Err(inv(&sect, format!("[backends.{bname}]: {e}")));
            }
            if b.search.is_empty() {
                return Err(inv(&sect, format!("backends.{bname}: no search workloads")));
            }
            if !b.emulate.is_empty() && !["mlx-metal", "cuda", "mlx-cuda"].contains(&bname.as_str()) {
                return Err(inv(
                    &sect,
                    format!(
                        "backends.{bname}.emulate: only the mlx-metal, cuda and mlx-cuda back-ends have emulated workloads (`ksearch kb emulate`)"
                    ),
                ));
            }
            for (kind, list) in [("search", &b.search), ("heldout", &b.heldout), ("emulate", &b.emulate)] {
                for (i, w) in list.iter().enumerate() {
                    for a in &axes {
                        if !w.contains_key(a) {
                            return Err(inv(
                                &sect,
                                format!("backends.{bname}.{kind}[{i}] gives no value for axis `{a}`"),
                            ));
                        }
                    }
                    if let Some(k) = w.keys().find(|k| !axes.contains(k)) {
                        return Err(inv(&sect, format!("backends.{bname}.{kind}[{i}] names unknown axis `{k}`")));
                    }
                    // Every tensor has at least one element: a zero or negative size is the
                    // task's mistake, said here, not a kernel's crash later.
                    for t in &tensors {
                        match shape_of(t, w) {
                            Ok(sh) if sh.iter().all(|d| *d >= 1) => {
                                let dt = b.dtypes.get(&t.name).copied().unwrap_or(t.dtype);
                                if let Err(e) = bytes_of(&sh, dt) {
                                    return Err(inv(&sect, format!("backends.{bname}.{kind}[{i}]: tensor `{}` {e}", t.name)));
                                }
                            }
                            Ok(sh) => {
                                return Err(inv(
                                    &sect,
                                    format!(
                                        "backends.{bname}.{kind}[{i}]: tensor `{}` has shape {sh:?} (every dimension must be at least 1)",
                                        t.name
                                    ),
                                ));
                            }
                            Err(e) => return Err(inv(&sect, format!("backends.{bname}.{kind}[{i}]: {e}"))),
                        }
                    }
                }
            }
            for n in b.dtypes.keys() {
                if !names.contains(n) {
                    return Err(inv(&sect, format!("backends.{bname}.dtypes names unknown tensor `{n}`")));
                }
            }
            for o in &outputs {
                let dt = b.dtypes.get(&o.name).copied().unwrap_or(o.dtype);
                if !tolerance.contains_key(&dt) {
                    return Err(inv(
                        "[tolerance]",
                        format!("no tolerance for dtype {dt} (output `{}` on {bname})", o.name),
                    ));
                }
            }
            b.seed.name = "seed".into();
            let kernels = std::iter::once(&mut b.seed).chain(b.kernels.iter_mut());
            let mut kernel_names = std::collections::BTreeSet::new();
            for k in kernels {
                let at = format!("\"{}\"", k.file);
                if k.name.is_empty() {
                    return Err(inv(&at, format!("backends.{bname}: a kernel has no name")));
                }
                if !kernel_names.insert(k.name.clone()) {
                    return Err(inv(&at, format!("backends.{bname}: two kernels are named `{}`", k.name)));
                }
                if k.launches.is_empty() {
                    match &k.entry {
                        Some(e) => k.launches.push(LaunchSpec {
                            entry: e.clone(),
                            grid: one3(),
                            block: one3(),
                            shared: zero(),
                            inputs: vec![],
                            outputs: vec![],
                        }),
                        None => return Err(inv(&at, format!("kernel `{}` needs `entry` or [[launches]]", k.name))),
                    }
                }
                let src = dir.join(&k.file);
                k.source = crate::read_source(&src)
                    .map_err(|e| inv(&at, format!("kernel `{}`: cannot read {}: {e}", k.name, src.display())))?;
                let form = crate::mlx::Form::of_options(&k.options).map_err(|r| inv(&at, format!("kernel `{}`: {r}", k.name)))?;
                if form == crate::mlx::Form::Cuda {
                    if bname.as_str() != crate::Backend::MlxCuda.name() {
                        return Err(inv(
                            &at,
                            format!(
                                "kernel `{}`: form = \"cuda\" (a whole CUDA translation unit run through MLX) is for [backends.mlx-cuda] kernels, not [backends.{bname}]",
                                k.name
                            ),
                        ));
                    }
                    if crate::mlx::has_sections(&k.source) {
                        return Err(inv(
                            &at,
                            format!(
                                "kernel `{}`: {} is a whole CUDA translation unit (form = \"cuda\"): it has no `// @kernel` sections",
                                k.name, k.file
                            ),
                        ));
                    }
                    for l in &k.launches {
                        if !names_function(&k.source, &l.entry) {
                            return Err(inv(
                                &at,
                                format!(
                                    "kernel `{}`: {} defines no function `{}` (form = \"cuda\" needs extern \"C\" __global__ void {}(...))",
                                    k.name, k.file, l.entry, l.entry
                                ),
                            ));
                        }
                    }
                    // Compile errors name the kernel's file, as the task gives it.
                    k.options
                        .entry("file".to_string())
                        .or_insert_with(|| toml::Value::String(k.file.clone()));
                } else if crate::mlx::has_sections(&k.source) {
                    for l in &k.launches {
                        if crate::mlx::body_of(&k.source, &l.entry).is_none() {
                            return Err(inv(
                                &at,
                                format!("kernel `{}`: {} has no `// @kernel {}` section", k.name, k.file, l.entry),
                            ));
                        }
                    }
                }
                let mut tn = std::collections::BTreeSet::new();
                for t in &k.tunables {
                    if t.values.is_empty() {
                        return Err(inv(&format!("\"{}\"", t.name), format!("tunable `{}` has no values", t.name)));
                    }
                    if let Some(d) = t.default
                        && !t.values.contains(&d)
                    {
                        return Err(inv(
                            &format!("\"{}\"", t.name),
                            format!("tunable `{}`: default {d} is not among its values", t.name),
                        ));
                    }
                    if !is_c_identifier(&t.name) {
                        return Err(inv(
                            &format!("\"{}\"", t.name),
                            format!(
                                "tunable `{}`: a tunable's name is an identifier (it becomes a -D define)",
                                t.name
                            ),
                        ));
                    }
                    if !tn.insert(t.name.clone()) || axes.contains(&t.name) {
                        return Err(inv(
                            &format!("\"{}\"", t.name),
                            format!("tunable `{}` clashes with another name", t.name),
                        ));
                    }
                }
                check_wiring(k, &names_in, &names_out).map_err(|r| inv(&at, format!("kernel `{}`: {r}", k.name)))?;
                // Every expression must parse and refer only to axes and tunables.
                let mut exprs: Vec<&String> = k.constraints.iter().collect();
                for l in &k.launches {
                    exprs.extend(l.grid.iter().chain(l.block.iter()).chain(std::iter::once(&l.shared)));
                }
                exprs.extend(k.scratch.iter().map(|s| &s.bytes));
                for e in exprs {
                    let parsed = Expr::parse(e).map_err(|err| inv(&at, format!("kernel `{}`: {err}", k.name)))?;
                    let mut vars = Vec::new();
                    parsed.vars(&mut vars);
                    if let Some(v) = vars.iter().find(|v| !axes.contains(v) && !tn.contains(*v)) {
                        return Err(inv(
                            &at,
                            format!("kernel `{}`: expression `{e}` uses unknown name `{v}`", k.name),
                        ));
                    }
                }
            }
        }
        // The cost expressions refer to axes only, and every workload of every back-end must
        // give them (and the tensor shapes) a value: an unknown name or a division by zero is
        // an error now, in the task file, not a silent zero later.
        let mut cost = Vec::new();
        for (key, f) in [("flops", &self.flops), ("transcendentals", &self.transcendentals)] {
            if let Some(f) = f {
                let e = Expr::parse(f).map_err(|e| inv(f, format!("{key}: {e}")))?;
                let mut vars = Vec::new();
                e.vars(&mut vars);
                if let Some(v) = vars.iter().find(|v| !self.axes.contains(v)) {
                    return Err(inv(
                        f,
                        format!("{key} `{f}` uses unknown axis `{v}` (axes: {})", self.axes.join(", ")),
                    ));
                }
                cost.push((key.to_string(), f.clone(), f.clone()));
            }
        }
        for t in self.inputs.iter().chain(&self.outputs) {
            for d in &t.shape {
                cost.push((format!("shape of `{}`", t.name), d.clone(), format!("\"{}\"", t.name)));
            }
        }
        for (bname, b) in &self.backends {
            for (kind, list) in [("search", &b.search), ("heldout", &b.heldout), ("emulate", &b.emulate)] {
                for (i, w) in list.iter().enumerate() {
                    for (what, e, needle) in &cost {
                        if let Err(err) = crate::expr::eval_f64(e, w) {
                            return Err(inv(needle, format!("{what}: {err} on backends.{bname}.{kind}[{i}]")));
                        }
                    }
                    if let Some(name) = self.reference.name()
                        && let Err(e) = crate::reference::precondition(name, w)
                    {
                        return Err(inv(
                            "reference",
                            format!(
                                "backends.{bname}.{kind}[{i}] ({}): {e}",
                                crate::protocol::workload_label(w, &self.axes)
                            ),
                        ));
                    }
                    // Every figure is a ratio to the seed, so the seed runs every workload: one
                    // it cannot run is the task's mistake, said here, not after a whole search
                    // (a held-out workload) or as the reference's failure.
                    if b.seed.specialise(&b.seed.default_config(), w).is_none() {
                        let c = b.seed.broken_constraint(&b.seed.default_config(), w).unwrap_or_default();
                        return Err(inv(
                            &format!("\"{}\"", b.seed.file),
                            format!(
                                "backends.{bname}.{kind}[{i}] ({}): the seed's constraint `{c}` does not hold, so nothing could be compared with the seed there",
                                crate::protocol::workload_label(w, &self.axes)
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The tolerance outputs of `dtype` are checked with: the task's, else atol 1e-5, rtol 1e-4.
    pub fn tolerance_of(&self, dtype: DType) -> Tolerance {
        self.tolerance
            .get(&dtype)
            .copied()
            .unwrap_or(Tolerance { atol: 1e-5, rtol: 1e-4 })
    }

    pub fn backend(&self, b: crate::Backend) -> Option<&BackendSpec> {
        self.backends.get(b.name())
    }

    /// The dtype of tensor `name` on back-end `backend` (override or declared).
    pub fn dtype_on(&self, backend: crate::Backend, t: &TensorSpec) -> DType {
        self.backends
            .get(backend.name())
            .and_then(|b| b.dtypes.get(&t.name).copied())
            .unwrap_or(t.dtype)
    }

    /// Bytes every evaluation must move at least once (inputs read, outputs written).
    pub fn min_bytes(&self, backend: crate::Backend, w: &Workload) -> Result<f64, String> {
        Ok(self.buffer_bytes(backend, w)? as f64)
    }

    /// Bytes of the task's tensors (inputs and outputs) on `backend` for workload `w`: what a
    /// worker holds at the least to run it.
    pub fn buffer_bytes(&self, backend: crate::Backend, w: &Workload) -> Result<u64, String> {
        let mut total = 0u64;
        for t in self.inputs.iter().chain(&self.outputs) {
            let n = bytes_of(&shape_of(t, w)?, self.dtype_on(backend, t)).map_err(|e| format!("tensor `{}` {e}", t.name))?;
            total = total
                .checked_add(n)
                .ok_or_else(|| "the tensors hold more bytes than a 64-bit machine addresses".to_string())?;
        }
        Ok(total)
    }

    pub fn flops(&self, w: &Workload) -> f64 {
        self.flops
            .as_deref()
            .and_then(|f| crate::expr::eval_f64(f, w).ok())
            .unwrap_or(0.0)
    }

    pub fn transcendentals(&self, w: &Workload) -> f64 {
        self.transcendentals
            .as_deref()
            .and_then(|f| crate::expr::eval_f64(f, w).ok())
            .unwrap_or(0.0)
    }

    /// Every kernel of a back-end, seed first.
    pub fn kernels(&self, backend: crate::Backend) -> Vec<&KernelSpec> {
        match self.backends.get(backend.name()) {
            Some(b) => std::iter::once(&b.seed).chain(b.kernels.iter()).collect(),
            None => Vec::new(),
        }
    }

    pub fn kernel(&self, backend: crate::Backend, name: &str) -> Option<&KernelSpec> {
        self.kernels(backend).into_iter().find(|k| k.name == name)
    }
}

/// Every task under `dir` (each `dir/<name>/task.toml`), sorted by name. Broken tasks are errors.
pub fn load_all(dir: &Path) -> Result<Vec<Task>, TaskError> {
    load_each(dir)?.into_iter().collect()
}

/// Every task under `dir`, each loaded on its own: a broken task is its own error and the
/// others still load.
pub fn load_each(dir: &Path) -> Result<Vec<Result<Task, TaskError>>, TaskError> {
    let rd = std::fs::read_dir(dir).map_err(|e| TaskError::Io {
        path: dir.display().to_string(),
        cause: e,
    })?;
    // A folder whose task.toml is there but cannot be read (no permission, a directory, a
    // symbolic link loop) is listed with its error, not skipped; only folders without one are.
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir() || std::fs::metadata(e.path()).is_err())
        .map(|e| e.path().join("task.toml"))
        .filter(|p| match std::fs::metadata(p) {
            Ok(_) => true,
            Err(e) => e.kind() != std::io::ErrorKind::NotFound || std::fs::symlink_metadata(p).is_ok(),
        })
        .collect();
    paths.sort();
    Ok(paths.iter().map(|p| Task::load(p)).collect())
}

/// Find a task by name under `dir`, or by a direct path to a `task.toml` or its folder.
pub fn find(dir: &Path, name: &str) -> Result<Task, TaskError> {
    let direct = Path::new(name);
    if direct.is_file() {
        return Task::load(direct);
    }
    if direct.join("task.toml").is_file() && (name.contains('/') || name.starts_with('.')) {
        return Task::load(&direct.join("task.toml"));
    }
    let p = dir.join(name).join("task.toml");
    let there = p.is_file()
        || std::fs::symlink_metadata(&p).is_ok()
        || std::fs::metadata(&p).is_err_and(|e| e.kind() != std::io::ErrorKind::NotFound);
    if there {
        // Loaded, or its own reason why not (permission, a directory, a link loop).
        return Task::load(&p);
    }
    let known = std::fs::read_dir(dir)
        .map(|rd| {
            let mut v: Vec<String> = rd
                .filter_map(|e| e.ok())
                .filter(|e| e.path().join("task.toml").is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v.join(", ")
        })
        .unwrap_or_default();
    Err(TaskError::NotFound {
        name: name.into(),
        dir: dir.display().to_string(),
        known,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct R {
        reference: Reference,
    }

    #[test]
    fn tensor_bytes_are_counted_without_wrapping() {
        assert_eq!(bytes_of(&[3, 7], DType::F16), Ok(42));
        // 2^32 x 2^32 f32 elements wrap a 64-bit product to 0: refused, never a zero-byte buffer.
        assert!(bytes_of(&[1 << 32, 1 << 32], DType::F32).is_err());
        assert!(bytes_of(&[1 << 62, 2], DType::F16).is_err());
    }

    #[test]
    fn a_reference_is_a_name_or_a_file_of_the_tasks_own() {
        let r: R = toml::from_str("reference = \"softmax\"").unwrap();
        assert_eq!(r.reference.name(), Some("softmax"));
        let r: R = toml::from_str("reference = { file = \"ref.cpp\", entry = \"my_ref\" }").unwrap();
        let f = r.reference.file().unwrap();
        assert_eq!((f.file.as_str(), f.entry.as_str()), ("ref.cpp", "my_ref"));
        assert_eq!(r.reference.to_string(), "ref.cpp (my_ref)");
        let e = toml::from_str::<R>("reference = { file = \"ref.cpp\", entry = \"f\", bogus = 1 }")
            .err()
            .unwrap();
        assert!(e.to_string().contains("unknown field"), "{e}");
        let e = toml::from_str::<R>("reference = 3").err().unwrap();
        assert!(e.to_string().contains("host reference name"), "{e}");
        // The source travels with the task to workers (JSON), and back.
        let with_source = Reference::File(FileReference {
            file: "ref.cpp".into(),
            entry: "f".into(),
            source: "extern \"C\" void f() {}".into(),
        });
        let j = serde_json::to_string(&with_source).unwrap();
        assert_eq!(serde_json::from_str::<Reference>(&j).unwrap(), with_source);
        assert_eq!(
            serde_json::to_string(&Reference::Named("rmsnorm".into())).unwrap(),
            "\"rmsnorm\""
        );
    }

    #[test]
    fn a_refused_build_names_the_constraint_no_head_size_can_meet() {
        let k: KernelSpec = toml::from_str(
            r#"
            file = "k.cu"
            constraints = ["HD == D", "H % Hkv == 0", "S * HD <= 256"]
            [[tunables]]
            name = "HD"
            values = [64, 128]
            pattern = "specialisation"
            [[tunables]]
            name = "S"
            values = [1, 2, 4]
            "#,
        )
        .unwrap();
        let cfg = |hd: i64, st: i64| BTreeMap::from([("HD".to_string(), hd), ("S".to_string(), st)]);
        let w = |h: i64, hkv: i64, d: i64| Workload::from([("H".into(), h), ("Hkv".into(), hkv), ("D".into(), d)]);
        // Admitted: nothing broken.
        assert_eq!(k.broken_constraint(&cfg(64, 2), &w(4, 2, 64)), None);
        // The head size alone is wrong: specialise() mends it, and the message names HD == D.
        assert!(k.specialise(&cfg(128, 1), &w(4, 2, 64)).is_some());
        assert_eq!(k.broken_constraint(&cfg(128, 1), &w(4, 2, 64)), Some("HD == D"));
        // Grouped heads that do not divide: broken at every head size, so named before HD == D.
        assert!(k.specialise(&cfg(128, 1), &w(3, 2, 64)).is_none());
        assert_eq!(k.broken_constraint(&cfg(128, 1), &w(3, 2, 64)), Some("H % Hkv == 0"));
        // A free tunable too large for the head size the shape needs.
        assert!(k.specialise(&cfg(128, 4), &w(4, 2, 128)).is_none());
        assert_eq!(k.broken_constraint(&cfg(128, 4), &w(4, 2, 128)), Some("S * HD <= 256"));
    }

    #[test]
    fn an_entry_is_found_as_a_function_name_only() {
        let src = "// layer_ref2(\nextern \"C\" void layer_ref (const double* const* i, double* const* o, const int64_t* d) {}";
        assert!(names_function(src, "layer_ref"));
        assert!(!names_function(src, "ayer_ref"));
        assert!(!names_function("int layer_ref = 1;", "layer_ref"));
        assert!(is_c_identifier("_ln2") && !is_c_identifier("2ln") && !is_c_identifier("a-b") && !is_c_identifier(""));
    }

    /// A task folder with one kernel file `k.cu` holding `kernel_src`, under `[backends.<backend>]`
    /// whose only kernel carries `extra` lines; returns what loading it gives.
    fn load_with_kernel(backend: &str, kernel_src: &str, extra: &str) -> Result<Task, TaskError> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ksearch-task-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("k.cu"), kernel_src).unwrap();
        std::fs::write(dir.join("seed.cu"), "y[0] = x[0];").unwrap();
        let text = format!(
            "name = \"t\"\nreference = \"softmax\"\naxes = [\"rows\", \"cols\"]\n\n\
             [[inputs]]\nname = \"x\"\nshape = [\"rows\", \"cols\"]\ndtype = \"f32\"\n\n\
             [[outputs]]\nname = \"y\"\nshape = [\"rows\", \"cols\"]\ndtype = \"f32\"\n\n\
             [tolerance]\nf32 = {{ atol = 1e-5, rtol = 1e-4 }}\n\n\
             [backends.{backend}]\nsearch = [ {{ rows = 2, cols = 8 }} ]\n\n\
             [backends.{backend}.seed]\nfile = \"seed.cu\"\nentry = \"softmax\"\n\n\
             [[backends.{backend}.kernels]]\nname = \"unit\"\nfile = \"k.cu\"\nentry = \"softmax\"\n{extra}\n"
        );
        std::fs::write(dir.join("task.toml"), text).unwrap();
        let r = Task::load(&dir.join("task.toml"));
        let _ = std::fs::remove_dir_all(&dir);
        r
    }

    const UNIT: &str = "#ifndef KS_AXIS\n#define KS_AXIS long long\n#endif\n\
                        extern \"C\" __global__ void softmax(const float* x, float* y, KS_AXIS rows, KS_AXIS cols) {}\n";

    #[test]
    fn a_whole_cuda_unit_is_an_mlx_cuda_kernel_whose_errors_name_its_file() {
        let t = load_with_kernel("mlx-cuda", UNIT, "options = { form = \"cuda\" }").unwrap();
        let k = t.kernel(crate::Backend::MlxCuda, "unit").unwrap();
        assert_eq!(crate::mlx::Form::of_options(&k.options), Ok(crate::mlx::Form::Cuda));
        assert_eq!(k.options.get("file").and_then(|v| v.as_str()), Some("k.cu"));
        // A body (the default) gets no file option.
        let t = load_with_kernel("mlx-cuda", "y[0] = x[0];", "").unwrap();
        let k = t.kernel(crate::Backend::MlxCuda, "unit").unwrap();
        assert_eq!(crate::mlx::Form::of_options(&k.options), Ok(crate::mlx::Form::Body));
        assert!(!k.options.contains_key("file"));
        // The shipped attention task: the wgmma kernel is one of its mlx-cuda kernels.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks/attention/task.toml");
        let t = Task::load(&root).unwrap();
        let k = t.kernel(crate::Backend::MlxCuda, "flash_wgmma").unwrap();
        assert_eq!(crate::mlx::Form::of_options(&k.options), Ok(crate::mlx::Form::Cuda));
        assert!(k.source.contains("KS_AXIS"));
    }

    #[test]
    fn a_cuda_unit_that_does_not_fit_is_refused_in_one_line() {
        let msg = |r: Result<Task, TaskError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let e = msg(load_with_kernel("cuda", UNIT, "options = { form = \"cuda\" }"));
        assert!(
            e.contains("task.toml:") && e.contains("is for [backends.mlx-cuda] kernels"),
            "{e}"
        );
        let e = msg(load_with_kernel(
            "mlx-cuda",
            &format!("// @kernel softmax\n{UNIT}"),
            "options = { form = \"cuda\" }",
        ));
        assert!(e.contains("no `// @kernel` sections"), "{e}");
        let e = msg(load_with_kernel(
            "mlx-cuda",
            &UNIT.replace("softmax(", "soft_max("),
            "options = { form = \"cuda\" }",
        ));
        assert!(e.contains("k.cu defines no function `softmax`"), "{e}");
        let e = msg(load_with_kernel("mlx-cuda", UNIT, "options = { form = \"ptx\" }"));
        assert!(e.contains("kernel `unit`: options.form `ptx` is unknown"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn the_reference_line_is_its_key_not_a_mention() {
        let text = "name = \"x\"\ndescription = \"checked against a reference\"\nreference = \"y\"\n";
        assert_eq!(key_line(text, "reference"), 3);
        assert_eq!(key_line("a = 1\n[reference]\nfile = \"r.cpp\"\n", "reference"), 2);
    }
}
