//! Hardware profiles: `kb/profiles/<name>.toml`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use ksearch_core::Backend;

use crate::{KbError, line_of, parse_toml, read};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub display_name: String,
    /// `nvidia`, `apple` or `generic`.
    pub vendor: String,
    #[serde(default)]
    pub arch: String,
    #[serde(default)]
    pub compute_capability: Option<String>,
    /// Back-ends this profile serves (their spellings in the file; an unknown one is an error
    /// naming the file and line).
    #[serde(default)]
    pub backends: Vec<Backend>,
    /// Device-name fragments that select this profile (matched on whole words, longest wins).
    #[serde(default, rename = "match")]
    pub matches: Vec<String>,
    #[serde(default)]
    pub notes: String,
    pub mem_bandwidth_gbs: f64,
    #[serde(default)]
    pub memory_gb: Option<f64>,
    /// SMs (NVIDIA) or GPU cores (Apple).
    #[serde(default)]
    pub compute_units: Option<u32>,
    #[serde(default)]
    pub clock_ghz: Option<f64>,
    /// Shared (threadgroup) memory a block may use without opt-in, KB.
    pub shared_per_block_kb: f64,
    /// With opt-in (dynamic shared memory above 48 KB on NVIDIA), KB.
    #[serde(default)]
    pub shared_optin_kb: Option<f64>,
    #[serde(default)]
    pub shared_per_sm_kb: Option<f64>,
    pub max_threads_per_block: u32,
    /// Warp / SIMD-group width.
    pub simd_width: u32,
    /// Register file per SM / core, KB.
    #[serde(default)]
    pub register_file_kb: Option<f64>,
    /// L2 (NVIDIA) or system-level cache (Apple), MB.
    #[serde(default)]
    pub l2_mb: Option<f64>,
    /// Special-function (exp2) results per second for the whole device.
    #[serde(default)]
    pub exp_per_s: Option<f64>,
    /// Peak TFLOPS per dtype: `f32`, `f16`, `f16_tensor`, `bf16_tensor`, `f16_matrix`, ...
    #[serde(default)]
    pub peak_tflops: BTreeMap<String, f64>,
    /// Source of every figure, keyed by field name (`peak_tflops.<dtype>` for peaks).
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
}

/// Lower-case, alphanumerics only, single spaces, padded with a space on each side.
pub(crate) fn normalise(s: &str) -> String {
    let mut out = String::from(" ");
    for w in s.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()) {
        out.push_str(&w.to_ascii_lowercase());
        out.push(' ');
    }
    out
}

impl Profile {
    pub fn load(path: &Path) -> Result<Profile, KbError> {
        let text = read(path)?;
        let p: Profile = parse_toml(&text, path, 0)?;
        let inv = |needle: &str, reason: String| KbError::Invalid {
            path: path.display().to_string(),
            line: line_of(&text, needle),
            reason,
        };
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        if p.name != stem {
            return Err(inv(
                "name",
                format!("profile name `{}` differs from its file name `{stem}`", p.name),
            ));
        }
        if !matches!(p.vendor.as_str(), "nvidia" | "apple" | "generic") {
            return Err(inv(
                "vendor",
                format!("vendor `{}` is not nvidia, apple or generic", p.vendor),
            ));
        }
        if let Some(k) = p.missing_sources().first() {
            return Err(inv(
                k.split('.').next_back().unwrap_or(k),
                format!("figure `{k}` has no entry under [sources]"),
            ));
        }
        if let Some(k) = p.sources.keys().find(|k| !p.figures().iter().any(|(f, _)| f == *k)) {
            return Err(inv(
                k,
                format!("[sources] names `{k}`, which is not a figure of this profile"),
            ));
        }
        if p.mem_bandwidth_gbs <= 0.0 {
            return Err(inv("mem_bandwidth_gbs", "mem_bandwidth_gbs must be positive".into()));
        }
        Ok(p)
    }

    /// Every figure the profile states, as (source key, value).
    pub fn figures(&self) -> Vec<(String, f64)> {
        let mut v = vec![
            ("mem_bandwidth_gbs".to_string(), self.mem_bandwidth_gbs),
            ("shared_per_block_kb".to_string(), self.shared_per_block_kb),
            ("max_threads_per_block".to_string(), self.max_threads_per_block as f64),
            ("simd_width".to_string(), self.simd_width as f64),
        ];
        let opt = [
            ("memory_gb", self.memory_gb),
            ("compute_units", self.compute_units.map(f64::from)),
            ("clock_ghz", self.clock_ghz),
            ("shared_optin_kb", self.shared_optin_kb),
            ("shared_per_sm_kb", self.shared_per_sm_kb),
            ("register_file_kb", self.register_file_kb),
            ("l2_mb", self.l2_mb),
            ("exp_per_s", self.exp_per_s),
        ];
        v.extend(opt.iter().filter_map(|(k, x)| x.map(|x| (k.to_string(), x))));
        v.extend(self.peak_tflops.iter().map(|(k, x)| (format!("peak_tflops.{k}"), *x)));
        v
    }

    /// Figures without a non-empty source.
    pub fn missing_sources(&self) -> Vec<String> {
        self.figures()
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| self.sources.get(k).is_none_or(|s| s.trim().is_empty()))
            .collect()
    }

    /// Shared / threadgroup bytes a block may use (with opt-in where the device has it).
    pub fn shared_limit_bytes(&self) -> u64 {
        (self.shared_optin_kb.unwrap_or(self.shared_per_block_kb) * 1024.0) as u64
    }

    /// Peak TFLOPS for `dtype`; an unknown dtype gets the highest peak (a safe, low floor).
    pub fn peak(&self, dtype: &str) -> Option<f64> {
        self.peak_tflops
            .get(dtype)
            .copied()
            .or_else(|| self.peak_tflops.values().copied().reduce(f64::max))
    }
}
