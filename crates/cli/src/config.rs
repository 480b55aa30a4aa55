//! Configuration: an optional `ksearch.toml` (current directory, or `--config`), overridden
//! by flags.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileConfig {
    pub run: RunSection,
    pub eval: EvalSection,
    /// `[llm]`, `[llm.planner]`, `[llm.coder]`: read by the LLM planner.
    pub llm: Option<toml::Table>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    pub backend: String,
    pub planner: String,
    pub rounds: u32,
    pub time_budget: Option<String>,
    /// Stop after this many rounds without a new best.
    pub patience: u32,
    pub seed: u64,
    pub store: Option<PathBuf>,
    pub tasks_dir: Option<PathBuf>,
    pub kb_dir: Option<PathBuf>,
    pub context: String,
    /// Worker processes per device; 0 = the back-end's default (3 per GPU, at most the CPU
    /// count; 1 on the cpu back-end, whose measurements use the cores a compile would).
    pub workers: u32,
    /// How workers are started: `local` (child processes) or `slurm` (`srun`, see `[run.slurm]`).
    pub launcher: String,
    pub slurm: SlurmSection,
}

/// `[run.slurm]`: the `srun` program and the arguments it is given for every worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmSection {
    pub srun: String,
    pub args: Vec<String>,
}

impl Default for SlurmSection {
    fn default() -> Self {
        SlurmSection {
            srun: "srun".into(),
            args: Vec::new(),
        }
    }
}

/// The launcher of a run: `flag` (`--launcher`) over `[run] launcher`, with `[run.slurm]`.
pub fn launcher(fc: &FileConfig, flag: Option<&str>) -> Result<ksearch_eval::Launcher> {
    match flag.unwrap_or(&fc.run.launcher) {
        "local" => Ok(ksearch_eval::Launcher::Local),
        "slurm" => {
            let s = &fc.run.slurm;
            if s.srun.trim().is_empty() {
                bail!("[run.slurm] srun is empty (the srun program, e.g. \"srun\")");
            }
            Ok(ksearch_eval::Launcher::Slurm {
                srun: s.srun.clone(),
                args: s.args.clone(),
            })
        }
        other => bail!("unknown launcher `{other}` (use local or slurm)"),
    }
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            backend: "auto".into(),
            planner: "offline".into(),
            rounds: 30,
            time_budget: None,
            patience: 12,
            seed: 1,
            store: None,
            tasks_dir: None,
            kb_dir: None,
            context: "full".into(),
            workers: 0,
            launcher: "local".into(),
            slurm: SlurmSection::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    pub compile_timeout: String,
    pub run_timeout: String,
    pub mem_limit: String,
    pub warmup: u32,
    pub min_reps: u32,
    pub max_reps: u32,
    pub target_ms: f64,
    pub flush: bool,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            compile_timeout: "120s".into(),
            run_timeout: "60s".into(),
            mem_limit: "8GiB".into(),
            warmup: 2,
            min_reps: 5,
            max_reps: 30,
            target_ms: 200.0,
            flush: true,
        }
    }
}

pub fn load(path: Option<&Path>) -> Result<FileConfig> {
    let (p, required) = match path {
        Some(p) => (p.to_path_buf(), true),
        None => (PathBuf::from("ksearch.toml"), false),
    };
    if !p.is_file() {
        if required {
            if p.exists() {
                bail!("config file {}: not a regular file", p.display());
            }
            bail!("config file {} not found", p.display());
        }
        return Ok(FileConfig::default());
    }
    let text = ksearch_core::read_source(&p).with_context(|| format!("cannot read {}", p.display()))?;
    toml::from_str(&text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
            .unwrap_or(1);
        anyhow::anyhow!("{}:{line}: {}", p.display(), e.message().trim())
    })
}

pub fn parse_duration(s: &str) -> Result<Duration> {
    // Deadlines are instants: a duration past a year would overflow them (and is a typo).
    const MAX: Duration = Duration::from_secs(366 * 24 * 3600);
    let d = humantime::parse_duration(s.trim()).map_err(|e| anyhow::anyhow!("bad duration `{s}`: {e} (e.g. 90s, 5m, 1h)"))?;
    if d > MAX {
        anyhow::bail!("duration `{s}` is longer than a year");
    }
    Ok(d)
}

pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("bad size `{s}` (e.g. 512MiB, 4GiB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("bad size unit in `{s}` (use B, KiB, MiB, GiB)"),
    };
    Ok((v * mult) as u64)
}

/// Find a data folder (`tasks`, `kb`): the given path, `$KSEARCH_<NAME>`, `./<name>`, or the
/// nearest ancestor of the executable holding one (so `target/release/ksearch` finds the repo's).
pub fn locate_dir(given: Option<&Path>, name: &str) -> Option<PathBuf> {
    if let Some(g) = given {
        return Some(g.to_path_buf());
    }
    if let Ok(v) = std::env::var(format!("KSEARCH_{}", name.to_uppercase())) {
        return Some(PathBuf::from(v));
    }
    let here = PathBuf::from(name);
    if here.is_dir() {
        return Some(here);
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).map(|a| a.join(name)).find(|p| p.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("100").unwrap(), 100);
        assert!(parse_bytes("4 parsecs").is_err());
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert!(parse_duration("soon").is_err());
    }
    #[test]
    fn launchers() {
        let fc: FileConfig = toml::from_str("[run]\nlauncher = \"slurm\"\n[run.slurm]\nargs = [\"--partition=gpu\"]\n").unwrap();
        assert_eq!(
            launcher(&fc, None).unwrap(),
            ksearch_eval::Launcher::Slurm {
                srun: "srun".into(),
                args: vec!["--partition=gpu".into()]
            }
        );
        assert_eq!(launcher(&fc, Some("local")).unwrap(), ksearch_eval::Launcher::Local);
        let e = launcher(&fc, Some("ray")).unwrap_err().to_string();
        assert_eq!(e, "unknown launcher `ray` (use local or slurm)");
    }
}
