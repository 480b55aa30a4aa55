//! ksearch-kb: the knowledge base in `kb/` and what the search does with it.
//!
//! - hardware profiles (`kb/profiles/*.toml`), with a source for every figure, and device detection;
//! - the CUDA <-> Metal primitive map (`kb/primitives.toml`);
//! - machine-checkable rules (`kb/rules.toml`) and the static checks run on every candidate;
//! - optimisation patterns (`kb/patterns/*.md`: TOML front matter + Markdown);
//! - prompt context in three levels (`kb/templates/*.j2`) and the roofline floor;
//! - a Linux-side syntax check of Metal sources through a C++ compiler and `kb/metal-shim/`, and
//!   an executor that runs a task's Metal kernels on the CPU, checked against the task's reference.

use std::path::{Path, PathBuf};

mod check;
mod context;
mod emulate;
mod metal;
mod metal_exec;
mod patterns;
mod primitives;
mod profile;
mod roofline;
mod rules;

pub use check::{CheckOptions, Severity, SourceLang, Violation, check, check_launch, check_source, rejected, threadgroup_bytes};
pub use context::{ContextLevel, render_context};
pub mod untrusted;
pub use emulate::{EmuOutcome, emulate_configs, emulate_cuda_kernel, emulate_file, emulate_kernel, emulate_workloads};
pub use ksearch_core::Backend;
pub use ksearch_core::backend::{Dialect, Vendor};
pub use metal::{BodySig, find_cxx, metal_syntax_check, wrap_body};
pub use metal_exec::{EmuBuffer, EmuLaunch, metal_run, metal_run_file};
pub use patterns::Pattern;
pub use primitives::{Primitive, map_dialect};
pub use profile::Profile;
pub use roofline::floor_us;
pub use rules::{Rule, RuleExample};

/// Every error names the file (and line where one applies).
#[derive(Debug, thiserror::Error)]
pub enum KbError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}:{line}: {reason}")]
    Invalid { path: String, line: usize, reason: String },
}

/// The loaded knowledge base.
#[derive(Debug, Clone)]
pub struct Kb {
    pub dir: PathBuf,
    pub profiles: Vec<Profile>,
    pub primitives: Vec<Primitive>,
    pub rules: Vec<Rule>,
    pub patterns: Vec<Pattern>,
    /// Templates by file name (`generic.md.j2`, `full.md.j2`).
    pub templates: Vec<(String, String)>,
}

pub(crate) fn read(path: &Path) -> Result<String, KbError> {
    std::fs::read_to_string(path).map_err(|e| KbError::Io {
        path: path.display().to_string(),
        source: e,
    })
}

/// A regex compiled once per process and pattern: the static checks run on every candidate
/// of a search, and compiling their patterns each time cost more than matching them.
/// Panics on an invalid pattern (only the crate's own patterns come here).
pub(crate) fn cached_regex(pattern: &str) -> regex::Regex {
    try_cached_regex(pattern).unwrap_or_else(|| panic!("invalid pattern {pattern}"))
}

/// [`cached_regex`] for a pattern made from data (a rule's token): `None` when it does not compile.
pub(crate) fn try_cached_regex(pattern: &str) -> Option<regex::Regex> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<String, Option<regex::Regex>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(pattern.to_string())
        .or_insert_with(|| regex::Regex::new(&ascii_word_boundaries(pattern)).ok())
        .clone()
}

/// `pattern` with every `\b` made an ASCII word boundary (`(?-u:\b)`). The sources checked
/// are C-like code with comments and strings blanked, and a Unicode word boundary keeps the
/// regex engine on its slowest path (about 130 ms for one check of a 500-line kernel, against
/// a few ms).
fn ascii_word_boundaries(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('b') => out.push_str("(?-u:\\b)"),
            Some(n) => {
                out.push('\\');
                out.push(n);
            }
            None => out.push('\\'),
        }
    }
    out
}

pub(crate) fn line_of_offset(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The first line containing `needle`, or 1.
pub(crate) fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).map(|i| i + 1).unwrap_or(1)
}

pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(text: &str, path: &Path, line_base: usize) -> Result<T, KbError> {
    toml::from_str(text).map_err(|e| KbError::Invalid {
        path: path.display().to_string(),
        line: e.span().map(|s| line_of_offset(text, s.start)).unwrap_or(1) + line_base,
        reason: e.message().trim().to_string(),
    })
}

fn sorted_files(dir: &Path, ext: &str) -> Result<Vec<PathBuf>, KbError> {
    let rd = std::fs::read_dir(dir).map_err(|e| KbError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(ext))
        .collect();
    v.sort();
    Ok(v)
}

impl Kb {
    /// Load and validate the knowledge base under `dir`.
    pub fn load(dir: &Path) -> Result<Kb, KbError> {
        let mut profiles = Vec::new();
        for p in sorted_files(&dir.join("profiles"), ".toml")? {
            profiles.push(Profile::load(&p)?);
        }
        let primitives = primitives::load(&dir.join("primitives.toml"))?;
        let rules = rules::load(&dir.join("rules.toml"))?;
        let mut patterns = Vec::new();
        for p in sorted_files(&dir.join("patterns"), ".md")? {
            patterns.push(Pattern::load(&p)?);
        }
        let mut templates = Vec::new();
        for p in sorted_files(&dir.join("templates"), ".j2")? {
            let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
            templates.push((name, read(&p)?));
        }
        let kb = Kb {
            dir: dir.to_path_buf(),
            profiles,
            primitives,
            rules,
            patterns,
            templates,
        };
        kb.validate()?;
        Ok(kb)
    }

    fn validate(&self) -> Result<(), KbError> {
        let inv = |path: PathBuf, reason: String| KbError::Invalid {
            path: path.display().to_string(),
            line: 1,
            reason,
        };
        let mut seen = std::collections::BTreeSet::new();
        for p in &self.profiles {
            if !seen.insert(p.name.clone()) {
                return Err(inv(self.dir.join("profiles"), format!("profile `{}` defined twice", p.name)));
            }
        }
        for needed in ["cpu", "generic-cuda", "generic-apple"] {
            if self.profile(needed).is_none() {
                return Err(inv(
                    self.dir.join("profiles"),
                    format!("the fallback profile `{needed}` is missing"),
                ));
            }
        }
        for r in &self.rules {
            if self.profile(&r.example.profile).is_none() {
                return Err(inv(
                    self.dir.join("rules.toml"),
                    format!("rule `{}`: example names unknown profile `{}`", r.id, r.example.profile),
                ));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for p in &self.patterns {
            for n in std::iter::once(&p.name).chain(p.aliases.iter()) {
                if !names.insert(n.clone()) {
                    return Err(inv(
                        self.dir.join("patterns"),
                        format!("pattern name or alias `{n}` used twice"),
                    ));
                }
            }
        }
        for t in ["generic.md.j2", "full.md.j2"] {
            if !self.templates.iter().any(|(n, _)| n == t) {
                return Err(inv(self.dir.join("templates"), format!("template `{t}` is missing")));
            }
        }
        context::compile_templates(self).map_err(|e| inv(self.dir.join("templates"), e))?;
        Ok(())
    }

    /// Where the knowledge base is: `$KSEARCH_KB`, `./kb`, then `kb/` beside the executable or
    /// any of its ancestors, then the source tree this crate was built from.
    pub fn locate() -> Option<PathBuf> {
        let ok = |p: &Path| p.join("profiles").is_dir() && p.join("rules.toml").is_file();
        if let Some(v) = std::env::var_os("KSEARCH_KB") {
            let p = PathBuf::from(v);
            return ok(&p).then_some(p);
        }
        let cwd = PathBuf::from("kb");
        if ok(&cwd) {
            return Some(cwd);
        }
        if let Ok(exe) = std::env::current_exe() {
            for anc in exe.ancestors().skip(1) {
                let p = anc.join("kb");
                if ok(&p) {
                    return Some(p);
                }
            }
        }
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kb");
        ok(&src).then_some(src)
    }

    pub fn profile(&self, name: &str) -> Option<&Profile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    fn fallback(&self, name: &str) -> &Profile {
        self.profile(name)
            .or_else(|| self.profile("cpu"))
            .or(self.profiles.first())
            .expect("validated: fallback profiles exist")
    }

    /// The profile for a device on `backend`: `device_name` is what the driver reports
    /// ("NVIDIA H100 80GB HBM3", "Apple M3 Max") or a profile name. Unknown devices get a
    /// generic profile and a warning.
    pub fn detect(&self, backend: Backend, device_name: &str) -> (&Profile, Option<String>) {
        if let Some(p) = self.profile(device_name.trim()) {
            return (p, None);
        }
        let norm = profile::normalise(device_name);
        // A name that says its vendor wins; otherwise the back-end's vendor decides.
        let vendor = if norm.contains(" apple ") {
            "apple"
        } else if norm.contains(" nvidia ") {
            "nvidia"
        } else {
            match backend.vendor() {
                Vendor::Apple => "apple",
                Vendor::Nvidia => "nvidia",
                Vendor::Host if norm.contains(" tesla ") || norm.contains(" geforce ") => "nvidia",
                Vendor::Host => return (self.fallback("cpu"), None),
            }
        };
        let mut best: Option<(&Profile, usize)> = None;
        for p in self.profiles.iter().filter(|p| p.vendor == vendor) {
            for m in &p.matches {
                let pat = profile::normalise(m);
                if norm.contains(&pat) && best.is_none_or(|(_, l)| pat.len() > l) {
                    best = Some((p, pat.len()));
                }
            }
        }
        match best {
            Some((p, _)) => (p, None),
            None => {
                let g = self.fallback(if vendor == "apple" { "generic-apple" } else { "generic-cuda" });
                (
                    g,
                    Some(format!(
                        "unknown {} device `{device_name}`: using the `{}` profile (shared limits of the family, optimistic throughput); add a profile under {}",
                        if vendor == "apple" { "Apple" } else { "NVIDIA" },
                        g.name,
                        self.dir.join("profiles").display()
                    )),
                )
            }
        }
    }

    /// A pattern by name or alias.
    pub fn pattern(&self, name: &str) -> Option<&Pattern> {
        self.patterns
            .iter()
            .find(|p| p.name == name)
            .or_else(|| self.patterns.iter().find(|p| p.aliases.iter().any(|a| a == name)))
    }

    pub fn rule(&self, id: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.id == id)
    }

    /// Primitives whose spelling in the other dialect matches `query` (exact spelling first,
    /// then the identifier before any parenthesis, then a substring).
    pub fn map(&self, query: &str, to: Dialect) -> Vec<&Primitive> {
        primitives::lookup(&self.primitives, query, to)
    }

    /// The repository root the knowledge base sits in (the parent of `kb/`).
    pub fn repo_root(&self) -> PathBuf {
        self.dir.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
    }

    /// Pattern kernel references that do not exist on disk (relative to the repository root).
    pub fn missing_kernel_refs(&self) -> Vec<(String, String)> {
        let root = self.repo_root();
        let mut v = Vec::new();
        for p in &self.patterns {
            for r in &p.kernel_refs {
                if !root.join(r).is_file() {
                    v.push((p.name.clone(), r.clone()));
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod regex_tests {
    use super::*;

    #[test]
    fn word_boundaries_become_ascii_and_other_escapes_stay() {
        assert_eq!(ascii_word_boundaries(r"\bexp\w*\b"), r"(?-u:\b)exp\w*(?-u:\b)");
        assert_eq!(ascii_word_boundaries(r"a\\b\(\d"), r"a\\b\(\d");
        let re = cached_regex(r"\b__expf\s*\(");
        assert!(re.is_match("y = __expf (x);"));
        assert!(!re.is_match("y = my__expf(x);"));
        // Cached: the same pattern gives the same compiled regex, an invalid one None.
        assert_eq!(cached_regex(r"\bfoo\b").as_str(), cached_regex(r"\bfoo\b").as_str());
        assert!(try_cached_regex(r"(unclosed").is_none());
    }
}
