//! Rules: `kb/rules.toml`.

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::check::{Severity, SourceLang};
use crate::{KbError, line_of, parse_toml, read};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub id: String,
    pub kind: String,
    pub severity: Severity,
    /// The languages it applies to (empty: all).
    #[serde(default)]
    pub langs: Vec<SourceLang>,
    #[serde(default)]
    pub vendors: Vec<String>,
    pub summary: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub tokens: Vec<String>,
    pub example: RuleExample,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleExample {
    pub lang: SourceLang,
    pub profile: String,
    #[serde(default)]
    pub forbid: Vec<String>,
    #[serde(default)]
    pub dynamic_shared: Option<u64>,
    pub bad: String,
    pub good: String,
}

pub(crate) const KINDS: &[&str] = &[
    "threadgroup-limit",
    "static-shared-limit",
    "shared-optin-limit",
    "threads-limit",
    "tokens",
    "task-forbid",
    "mlx-signature",
    "mlx-include",
    "mlx-bounds-check",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    rule: Vec<Rule>,
}

impl Rule {
    pub fn applies(&self, lang: SourceLang, vendor: &str) -> bool {
        (self.langs.is_empty() || self.langs.contains(&lang))
            && (self.vendors.is_empty() || self.vendors.iter().any(|v| v == vendor))
    }
}

pub(crate) fn load(path: &Path) -> Result<Vec<Rule>, KbError> {
    let text = read(path)?;
    let f: File = parse_toml(&text, path, 0)?;
    let mut seen = std::collections::BTreeSet::new();
    for r in &f.rule {
        let inv = |reason: String| KbError::Invalid {
            path: path.display().to_string(),
            line: line_of(&text, &format!("id = \"{}\"", r.id)),
            reason,
        };
        if !seen.insert(r.id.clone()) {
            return Err(inv(format!("rule `{}` defined twice", r.id)));
        }
        if !KINDS.contains(&r.kind.as_str()) {
            return Err(inv(format!(
                "rule `{}`: unknown kind `{}` (known: {})",
                r.id,
                r.kind,
                KINDS.join(", ")
            )));
        }
        if r.kind == "tokens" && (r.tokens.is_empty() || r.message.is_empty()) {
            return Err(inv(format!("rule `{}`: a tokens rule needs `tokens` and `message`", r.id)));
        }
    }
    Ok(f.rule)
}
