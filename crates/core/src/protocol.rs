//! The candidate and the worker protocol: JSON lines over a worker's stdin/stdout.
//! See `docs/protocol.md`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::data::Check;
use crate::task::{LaunchSpec, ScratchSpec, Task, Workload};

/// Source language of a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lang {
    /// C++ for the CPU back-end.
    Cpp,
    /// CUDA C++ (NVRTC).
    Cuda,
    /// An MLX custom-kernel body in CUDA dialect (`mx.fast.cuda_kernel`).
    MlxCuda,
    /// An MLX custom-kernel body in Metal dialect (`mx.fast.metal_kernel`).
    MlxMetal,
}

impl Lang {
    pub fn for_backend(backend: crate::Backend) -> Lang {
        backend.lang()
    }
}

/// One kernel to evaluate: source + entry points + launches + defines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub lang: Lang,
    pub source: String,
    /// Launches in sequence; sizes are expressions over axes and `defines`.
    pub launches: Vec<LaunchSpec>,
    #[serde(default)]
    pub scratch: Vec<ScratchSpec>,
    /// Compile-time defines: tunable values (and anything the coder sets).
    pub defines: BTreeMap<String, i64>,
    /// Back-end specific options passed through from the task (e.g. MLX template parameters).
    #[serde(default)]
    pub options: BTreeMap<String, serde_json::Value>,
}

impl Candidate {
    /// A stable identity: hash of the normalised source, launches and defines. Two candidates
    /// with the same key are the same experiment.
    pub fn key(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(normalise_source(&self.source).as_bytes());
        h.update(
            serde_json::to_vec(&(&self.lang, &self.launches, &self.scratch, &self.defines, &self.options)).unwrap_or_default(),
        );
        let d = h.finalize();
        d.iter().take(12).map(|b| format!("{b:02x}")).collect()
    }
}

/// Source with comments and whitespace runs removed, for duplicate detection.
pub fn normalise_source(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let b = src.as_bytes();
    let mut i = 0;
    let mut last_space = true;
    while i < b.len() {
        if b[i] == b'/' && i + 1 < b.len() && b[i + 1] == b'/' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && i + 1 < b.len() && b[i + 1] == b'*' {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i].is_ascii_whitespace() {
            if !last_space {
                out.push(' ');
                last_space = true;
            }
            i += 1;
        } else {
            let start = i;
            // keep string literals intact
            if b[i] == b'"' {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i = (i + 1).min(b.len());
            } else {
                i += 1;
                while i < b.len() && (b[i] & 0xC0) == 0x80 {
                    i += 1;
                }
            }
            out.push_str(&src[start..i.min(src.len())]);
            last_space = false;
        }
    }
    out.trim().to_string()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadReq {
    /// Label shown in reports (e.g. `rows=512,cols=2048`).
    pub label: String,
    pub axes: Workload,
    /// Seed of this evaluation's random inputs for this workload.
    pub seed: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingReq {
    pub warmup: u32,
    pub min_reps: u32,
    pub max_reps: u32,
    /// Stop repeating once this much time has been spent timing (milliseconds).
    pub target_ms: f64,
    /// Flush caches (or rotate inputs) between repetitions.
    pub flush: bool,
}

impl Default for TimingReq {
    fn default() -> Self {
        TimingReq {
            warmup: 2,
            min_reps: 5,
            max_reps: 50,
            target_ms: 300.0,
            flush: true,
        }
    }
}

/// A request to a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Compile, check against the reference and time `candidate` on every workload.
    Eval(Box<EvalRequest>),
    /// Time the back-end's native implementation of the task (e.g. MLX's own attention) on
    /// the request's workloads, with the same inputs, checks and timing; the candidate is
    /// ignored. Answered with an `Eval` reply (`resources.raw` names the baseline), or `Error`
    /// where the back-end has none.
    Baseline(Box<EvalRequest>),
    /// Say who you are (device, versions); answered with a `Hello` reply.
    Hello,
    /// Exit cleanly.
    Shutdown,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalRequest {
    pub id: u64,
    pub task: Task,
    pub backend: crate::Backend,
    pub candidate: Candidate,
    pub workloads: Vec<WorkloadReq>,
    pub timing: TimingReq,
    /// Skip timing (correctness only).
    #[serde(default)]
    pub check_only: bool,
}

/// Why an evaluation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// Rejected by a static rule before compiling.
    Check,
    Compile,
    /// Died with a signal or a device fault.
    Crash,
    Timeout,
    OutOfMemory,
    /// Results outside tolerance.
    Wrong,
    /// Some output elements were never written.
    Unwritten,
    /// NaN or infinity where the reference is finite.
    Nan,
    /// Wrote outside its output buffers.
    OutOfBounds,
    /// Faster than the physical floor: a bug or a cheat, never a result.
    BelowFloor,
    /// The launch itself was refused (bad configuration, resources over the device limits).
    Launch,
    /// The worker or the machine failed, not the candidate (a compiler or a CUDA library
    /// missing, the compile cache's disk full, a worker that cannot start): never booked on
    /// the candidate; the search stops and a resume tries the candidate again.
    Infra,
    /// The candidate changed one of its inputs.
    MutatedInput,
    /// The search process died while this candidate ran, more than once: it is not retried.
    KilledOrchestrator,
}

impl FailureClass {
    pub fn name(self) -> &'static str {
        match self {
            FailureClass::Check => "check",
            FailureClass::Compile => "compile",
            FailureClass::Crash => "crash",
            FailureClass::Timeout => "timeout",
            FailureClass::OutOfMemory => "out_of_memory",
            FailureClass::Wrong => "wrong",
            FailureClass::Unwritten => "unwritten",
            FailureClass::Nan => "nan",
            FailureClass::OutOfBounds => "out_of_bounds",
            FailureClass::BelowFloor => "below_floor",
            FailureClass::Launch => "launch",
            FailureClass::Infra => "infra",
            FailureClass::MutatedInput => "mutated_input",
            FailureClass::KilledOrchestrator => "killed_orchestrator",
        }
    }
    pub fn parse(s: &str) -> Option<FailureClass> {
        use FailureClass::*;
        [
            Check,
            Compile,
            Crash,
            Timeout,
            OutOfMemory,
            Wrong,
            Unwritten,
            Nan,
            OutOfBounds,
            BelowFloor,
            Launch,
            Infra,
            MutatedInput,
            KilledOrchestrator,
        ]
        .into_iter()
        .find(|c| c.name() == s)
    }
}

impl std::fmt::Display for FailureClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub class: FailureClass,
    pub message: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    /// (p90 - p10) / median.
    pub spread: f64,
    pub reps: u32,
}

impl Timing {
    pub fn from_samples(mut us: Vec<f64>) -> Timing {
        if us.is_empty() {
            return Timing::default();
        }
        us.sort_by(|a, b| a.total_cmp(b));
        let q = |f: f64| us[((us.len() - 1) as f64 * f).round() as usize];
        let median = q(0.5);
        Timing {
            median_us: median,
            min_us: us[0],
            spread: if median > 0.0 { (q(0.9) - q(0.1)) / median } else { 0.0 },
            reps: us.len() as u32,
        }
    }
}

/// Compiler resource report (registers, shared memory, spills) where the back-end has one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub registers: Option<u32>,
    #[serde(default)]
    pub shared_bytes: Option<u64>,
    #[serde(default)]
    pub spill_stores: Option<u64>,
    #[serde(default)]
    pub spill_loads: Option<u64>,
    #[serde(default)]
    pub stack_bytes: Option<u64>,
    /// Per entry point, as the compiler printed it.
    #[serde(default)]
    pub raw: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadResult {
    pub label: String,
    pub axes: Workload,
    pub seed: u64,
    pub check: Check,
    pub timing: Option<Timing>,
    /// Minimum bytes moved and flops done (from the task), for the roofline.
    pub bytes: f64,
    pub flops: f64,
    /// Lower bound on time from the device profile (microseconds), if known.
    #[serde(default)]
    pub floor_us: Option<f64>,
    #[serde(default)]
    pub failure: Option<Failure>,
    /// The build this workload ran with, where it differs per shape (shape-tied tunables
    /// specialised): the candidate's dispatch entry for this shape. Set by the search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defines: Option<BTreeMap<String, i64>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompileInfo {
    pub log: String,
    pub cached: bool,
    pub seconds: f64,
}

/// A worker's answer to one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Sent when the worker starts and in answer to `Hello`.
    Hello {
        backend: String,
        device: String,
        pid: u32,
        version: String,
        /// Whether this worker can run candidate kernels at all (the MLX worker says `false`
        /// when MLX has no GPU back-end here; `device` then says why). Absent: yes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kernels: Option<bool>,
        /// How this worker contains candidate code (e.g. `netns+landlock+seccomp`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        isolation: Option<String>,
        /// Which clock times candidate calls (e.g. CUDA events, the GPU clock of the MLX
        /// worker), printed in the run header.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clock: Option<String>,
    },
    /// A progress event for request `id` (the supervisor uses it to switch time-outs).
    Progress {
        id: u64,
        stage: String,
    },
    Eval(Box<EvalReply>),
    /// The request could not be read at all.
    Error {
        message: String,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalReply {
    pub id: u64,
    pub compile: CompileInfo,
    pub resources: Resources,
    pub workloads: Vec<WorkloadResult>,
    pub failure: Option<Failure>,
    /// Engine-side seconds the worker spent outside compiling and running the kernel.
    #[serde(default)]
    pub overhead_s: f64,
    #[serde(default)]
    pub kernel_s: f64,
    /// Seconds from the request's arrival to a loaded candidate (compiling, or taking it from
    /// the cache, and loading it), measured by the worker. Absent (0) from older workers.
    #[serde(default)]
    pub compile_s: f64,
    /// Seconds the worker held the device's lock (its measured phase: runs, checks, timing).
    #[serde(default)]
    pub device_s: f64,
    /// Seconds the worker waited for the device's lock (another worker was measuring).
    #[serde(default)]
    pub lock_wait_s: f64,
    /// When the worker held the device's lock: `[from, to]` in seconds of the machine's
    /// monotonic clock (`CLOCK_MONOTONIC`, shared by every process of one machine).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_spans: Vec<[f64; 2]>,
}

impl EvalReply {
    /// Whether the evaluation as a whole failed for a reason outside the candidate.
    pub fn infra(&self) -> bool {
        self.failure.as_ref().is_some_and(|f| f.class == FailureClass::Infra)
    }
    pub fn ok(&self) -> bool {
        self.failure.is_none() && self.workloads.iter().all(|w| w.failure.is_none() && w.check.passed())
    }
    /// A reply for a failure that happened before or instead of the worker's answer.
    pub fn failed(id: u64, class: FailureClass, message: impl Into<String>) -> EvalReply {
        EvalReply {
            id,
            failure: Some(Failure {
                class,
                message: message.into(),
            }),
            ..EvalReply::default()
        }
    }
}

/// `rows=512,cols=2048`
pub fn workload_label(w: &Workload, axes: &[String]) -> String {
    axes.iter()
        .map(|a| format!("{a}={}", w.get(a).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn normalisation_ignores_comments_and_spacing() {
        let a = "int f() { // hi\n  return 1; /* x */ }\n";
        let b = "int f() {\n\treturn 1;   }";
        assert_eq!(normalise_source(a), normalise_source(b));
        assert_ne!(normalise_source("a \"x  y\""), normalise_source("a \"x y\""));
    }
    #[test]
    fn timing_summary() {
        let t = Timing::from_samples(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((t.median_us, t.min_us, t.reps), (3.0, 1.0, 5));
        assert!((t.spread - 4.0 / 3.0).abs() < 1e-12); // (p90 - p10) / median = (5 - 1) / 3
    }
}
