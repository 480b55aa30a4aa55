//! Optimisation patterns: `kb/patterns/<name>.md`, TOML front matter between `+++` lines,
//! then a Markdown body.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use crate::{KbError, parse_toml, read};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pattern {
    pub name: String,
    pub title: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Prior probability (0-1) that applying the pattern improves a kernel where it applies.
    pub prior: f64,
    /// 1 (a one-line change) to 5 (a rewrite).
    pub difficulty: u8,
    /// Expected impacts as 0-10 ratings, 10 = best use (as `ksearch_core::Impact`).
    pub bandwidth: f64,
    pub registers: f64,
    pub hw_fit: f64,
    /// Per-vendor hardware fit where it differs (`apple`, `nvidia`).
    #[serde(default)]
    pub hw_fit_by_vendor: BTreeMap<String, f64>,
    pub when: String,
    pub cuda: String,
    pub metal: String,
    /// Knowledge-base kernels showing the pattern, relative to the repository root.
    #[serde(default)]
    pub kernel_refs: Vec<String>,
    #[serde(skip_deserializing)]
    pub body: String,
}

impl Pattern {
    pub fn load(path: &Path) -> Result<Pattern, KbError> {
        let text = read(path)?;
        let inv = |line: usize, reason: String| KbError::Invalid {
            path: path.display().to_string(),
            line,
            reason,
        };
        let rest = text.strip_prefix("+++\n").ok_or_else(|| {
            inv(
                1,
                "a pattern starts with a `+++` line, TOML front matter, and another `+++` line".into(),
            )
        })?;
        let end = rest
            .find("\n+++\n")
            .or_else(|| rest.strip_suffix("\n+++").map(|r| r.len()))
            .ok_or_else(|| inv(1, "the front matter has no closing `+++` line".into()))?;
        let front = &rest[..end];
        let mut p: Pattern = parse_toml(front, path, 1)?;
        p.body = rest.get(end + 5..).unwrap_or("").trim().to_string();
        let fl = |key: &str| front.lines().position(|l| l.starts_with(key)).map(|i| i + 2).unwrap_or(1);
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        if p.name != stem {
            return Err(inv(
                fl("name"),
                format!("pattern name `{}` differs from its file name `{stem}`", p.name),
            ));
        }
        if !(0.0..=1.0).contains(&p.prior) {
            return Err(inv(fl("prior"), format!("prior {} is outside 0..1", p.prior)));
        }
        if !(1..=5).contains(&p.difficulty) {
            return Err(inv(fl("difficulty"), format!("difficulty {} is outside 1..5", p.difficulty)));
        }
        for (k, v) in [("bandwidth", p.bandwidth), ("registers", p.registers), ("hw_fit", p.hw_fit)]
            .into_iter()
            .chain(p.hw_fit_by_vendor.values().map(|v| ("hw_fit_by_vendor", *v)))
        {
            if !(0.0..=10.0).contains(&v) {
                return Err(inv(fl(k), format!("{k} {v} is outside 0..10")));
            }
        }
        Ok(p)
    }

    /// Hardware fit for a vendor (`apple`, `nvidia`, `generic`).
    pub fn hw_fit_for(&self, vendor: &str) -> f64 {
        self.hw_fit_by_vendor.get(vendor).copied().unwrap_or(self.hw_fit)
    }
}
