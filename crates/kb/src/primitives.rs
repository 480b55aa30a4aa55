//! The CUDA <-> Metal primitive map: `kb/primitives.toml`.

use serde::{Deserialize, Serialize};
use std::path::Path;

use ksearch_core::backend::Dialect;

use crate::{KbError, line_of, parse_toml, read};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Primitive {
    pub id: String,
    pub kind: String,
    /// CUDA spellings; the first is canonical.
    pub cuda: Vec<String>,
    /// Metal spelling, or `none`.
    pub metal: String,
    /// The value types the mapping holds for (both spellings), or `none: …` where no values
    /// are involved.
    pub types: String,
    /// CUDA spellings whose type domain is narrower than `types` (e.g. `__reduce_add_sync`:
    /// 32-bit integers only).
    #[serde(default)]
    pub cuda_types: std::collections::BTreeMap<String, String>,
    pub note: String,
    #[serde(default)]
    pub mlx: Option<String>,
    pub cuda_example: String,
    pub metal_example: String,
    /// `body` (a statement inside a kernel) or `file` (a whole Metal source).
    #[serde(default = "body")]
    pub example_scope: String,
}

impl Primitive {
    /// Whether the mapping holds for floating-point values.
    pub fn takes_float(&self) -> bool {
        self.types.contains("float") || self.types.contains("half")
    }

    /// The spelling in `d` (the canonical one for CUDA; `none` where Metal has no equivalent);
    /// C++ has none.
    pub fn spelling(&self, d: Dialect) -> Option<&str> {
        match d {
            Dialect::Cuda => Some(&self.cuda[0]),
            Dialect::Metal => Some(&self.metal),
            Dialect::Cpp => None,
        }
    }

    /// The type domain of one CUDA spelling (its own where narrower, else the mapping's).
    pub fn cuda_domain(&self, spelling: &str) -> &str {
        self.cuda_types.get(spelling).map(String::as_str).unwrap_or(&self.types)
    }
}

/// The dialect of `ksearch kb map --to`: `metal` or `cuda` (the two sides of the map).
pub fn map_dialect(s: &str) -> Result<Dialect, String> {
    match s {
        "metal" => Ok(Dialect::Metal),
        "cuda" => Ok(Dialect::Cuda),
        _ => Err(format!("unknown dialect `{s}` (use metal or cuda)")),
    }
}

fn body() -> String {
    "body".into()
}

const KINDS: &[&str] = &[
    "index",
    "memory",
    "sync",
    "simd",
    "atomic",
    "type",
    "math",
    "matrix",
    "copy",
    "attribute",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    primitive: Vec<Primitive>,
}

pub(crate) fn load(path: &Path) -> Result<Vec<Primitive>, KbError> {
    let text = read(path)?;
    let f: File = parse_toml(&text, path, 0)?;
    let mut seen = std::collections::BTreeSet::new();
    for p in &f.primitive {
        let inv = |reason: String| KbError::Invalid {
            path: path.display().to_string(),
            line: line_of(&text, &format!("id = \"{}\"", p.id)),
            reason,
        };
        if !seen.insert(p.id.clone()) {
            return Err(inv(format!("primitive `{}` defined twice", p.id)));
        }
        if p.cuda.is_empty() {
            return Err(inv(format!("primitive `{}` has no CUDA spelling", p.id)));
        }
        if !KINDS.contains(&p.kind.as_str()) {
            return Err(inv(format!(
                "primitive `{}`: unknown kind `{}` (known: {})",
                p.id,
                p.kind,
                KINDS.join(", ")
            )));
        }
        if p.types.trim().is_empty() {
            return Err(inv(format!("primitive `{}` states no type domain (`types`)", p.id)));
        }
        if let Some(s) = p.cuda_types.keys().find(|s| !p.cuda.contains(s)) {
            return Err(inv(format!(
                "primitive `{}`: cuda_types names `{s}`, which is not one of its CUDA spellings",
                p.id
            )));
        }
        // What `kb map … --to cuda` answers is the first spelling: a float mapping must not
        // answer with a spelling that takes no floats.
        if let Some(d) = p.cuda_types.get(&p.cuda[0])
            && p.takes_float()
            && !d.contains("float")
        {
            return Err(inv(format!(
                "primitive `{}` takes floats, but its first CUDA spelling `{}` takes {d}",
                p.id, p.cuda[0]
            )));
        }
        if p.example_scope != "body" && p.example_scope != "file" {
            return Err(inv(format!("primitive `{}`: example_scope must be body or file", p.id)));
        }
    }
    Ok(f.primitive)
}

/// The identifier a spelling starts with: `threadgroup_barrier(mem_flags::...)` -> `threadgroup_barrier`.
fn head(s: &str) -> &str {
    let s = s.trim();
    let end = s.find(['(', ' ']).unwrap_or(s.len());
    &s[..end]
}

fn clean_query(q: &str) -> String {
    let q = q.trim();
    let q = q.strip_suffix("()").unwrap_or(q);
    q.to_string()
}

/// Primitives whose spelling in the dialect other than `to` matches `query`. C++ has no
/// spellings in the map: nothing translates to it.
pub(crate) fn lookup<'a>(all: &'a [Primitive], query: &str, to: Dialect) -> Vec<&'a Primitive> {
    match to {
        Dialect::Cuda | Dialect::Metal => {}
        Dialect::Cpp => return Vec::new(),
    }
    let q = clean_query(query);
    let qh = head(&q).to_string();
    let from = |p: &'a Primitive| -> Vec<&'a str> {
        match to {
            Dialect::Metal => p.cuda.iter().map(String::as_str).collect(),
            Dialect::Cuda => vec![p.metal.as_str()],
            Dialect::Cpp => Vec::new(),
        }
    };
    let tiers: [&dyn Fn(&str) -> bool; 3] = [
        &|s: &str| s == q || s.trim_end_matches('(') == q,
        &|s: &str| head(s) == qh || head(s).trim_start_matches("[[").trim_end_matches("]]") == qh,
        &|s: &str| !q.is_empty() && s.contains(q.as_str()),
    ];
    for t in tiers {
        let hits: Vec<&Primitive> = all
            .iter()
            .filter(|p| p.id == q || from(p).iter().any(|s| *s != "none" && t(s)))
            .collect();
        if !hits.is_empty() {
            return hits;
        }
    }
    Vec::new()
}
