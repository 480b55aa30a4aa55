//! `ksearch`: LLM-guided, world-model kernel search.
//!
//! Exit codes: 0 ok, 1 the search found nothing valid (or a checked kernel failed, or the LLM
//! planner had to stop the run: resumable),
//! 2 usage or input error.

// Printing never panics: a closed pipe (`ksearch run ... | head -1`) or a full disk drops the
// output, and the run goes on to its end (these shadow the standard macros in every module).
macro_rules! println {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}
macro_rules! print {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($t)*);
    }};
}
macro_rules! eprintln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}
mod commands;
mod config;
mod kb_cmd;
mod pool;
mod report;
mod torch_export;
mod translate;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "ksearch",
    version,
    about = "Search for fast, correct kernels: plan, write, compile, check, time, remember."
)]
struct Cli {
    /// Configuration file (default: ./ksearch.toml if present).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// The store (SQLite). Default: .ksearch/store.db
    #[arg(long, global = true)]
    store: Option<PathBuf>,
    /// Folder holding the tasks. Default: ./tasks, or the one next to the executable.
    #[arg(long, global = true)]
    tasks_dir: Option<PathBuf>,
    /// Folder holding the knowledge base. Default: ./kb, or the one next to the executable.
    #[arg(long, global = true)]
    kb_dir: Option<PathBuf>,
    /// Print less (log only errors).
    #[arg(long, short, global = true)]
    quiet: bool,
    /// Log more: -v info (each LLM call's outcome), -vv debug. RUST_LOG overrides both.
    #[arg(long, short, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone, Default)]
pub struct RunFlags {
    /// auto (CUDA if a GPU is present, else CPU), cpu or cuda.
    #[arg(long)]
    pub backend: Option<String>,
    /// Planner: offline (knowledge base and tunables) or llm.
    #[arg(long)]
    pub planner: Option<String>,
    /// Total rounds for the run (one modification each).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Wall-clock budget for this invocation, e.g. 90s, 5m.
    #[arg(long)]
    pub time_budget: Option<String>,
    /// Stop after this many rounds without a new best.
    #[arg(long)]
    pub patience: Option<u32>,
    /// Seed for the run's random inputs.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Translation-layer context for LLM prompts: none, generic or full.
    #[arg(long)]
    pub context: Option<String>,
    /// Devices to use (CUDA), e.g. 0,1. Default: every device found.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Worker processes per device: they compile at the same time and measure one at a time
    /// (default: 3 per GPU, at most the CPU count; 1 on the cpu back-end).
    #[arg(long)]
    pub workers: Option<u32>,
    /// How workers are started: local (child processes) or slurm (one `srun` job step each,
    /// see `[run.slurm]` and docs/launchers.md).
    #[arg(long)]
    pub launcher: Option<String>,
    /// Time-out for compiling one candidate, e.g. 120s.
    #[arg(long)]
    pub compile_timeout: Option<String>,
    /// Time-out for running one workload, e.g. 30s.
    #[arg(long)]
    pub run_timeout: Option<String>,
    /// Memory limit of a worker, e.g. 4GiB.
    #[arg(long)]
    pub mem_limit: Option<String>,
    /// Timed repetitions at most per workload.
    #[arg(long)]
    pub max_reps: Option<u32>,
    /// LLM: model for both roles (or see --planner-model / --coder-model).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub planner_model: Option<String>,
    #[arg(long)]
    pub coder_model: Option<String>,
    /// LLM: base URL of an OpenAI-compatible API.
    #[arg(long)]
    pub base_url: Option<String>,
    /// LLM: the environment variable holding the API key (default: OPENAI_API_KEY when set).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// LLM: stop when this much money (USD) has been spent.
    #[arg(long)]
    pub max_cost: Option<f64>,
    /// LLM: stop after this many calls.
    #[arg(long)]
    pub max_llm_calls: Option<u32>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Search for a faster kernel for TASK.
    Run {
        task: String,
        #[command(flatten)]
        flags: RunFlags,
    },
    /// Continue an interrupted run where it stopped.
    Resume {
        run: i64,
        #[command(flatten)]
        flags: RunFlags,
    },
    /// List the runs in the store.
    Runs,
    /// Show a run's search tree with ratings and speed-ups.
    Tree {
        run: i64,
        /// Show open (untried) nodes too.
        #[arg(long)]
        all: bool,
    },
    /// Show (or write) the best kernel of a run and its figures.
    Best {
        run: i64,
        /// Write the kernel source (with its defines) to this file.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Print the run's final report as JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Export a run's best kernel as a self-contained module for a framework.
    Export {
        run: i64,
        /// A Python module of MLX functions (the run must be on an MLX back-end).
        #[arg(long, conflicts_with = "torch")]
        mlx: bool,
        /// A Python module of PyTorch functions running the CUDA kernel (the run must be on the
        /// cuda back-end): a drop-in for SDPA (attention), mamba_ssm's selective scan (mamba_scan).
        #[arg(long)]
        torch: bool,
        /// Where to write the module.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Write a run's report as one self-contained HTML page (tree, plots, failures, LLM calls).
    Report {
        run: i64,
        /// The HTML file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Rewrite the page every few seconds while the run is running (the page reloads
        /// itself), once more when it ends, then exit.
        #[arg(long)]
        watch: bool,
    },
    /// Evaluate one kernel file against the task's seed.
    Bench {
        task: String,
        kernel: PathBuf,
        #[arg(long)]
        backend: Option<String>,
        /// Use the launches and options of this task kernel (default: a single launch `--entry`).
        #[arg(long)]
        like: Option<String>,
        /// Entry point (default: the seed's).
        #[arg(long)]
        entry: Option<String>,
        /// Compile-time defines NAME=VALUE.
        #[arg(long = "define", short = 'D')]
        defines: Vec<String>,
        /// Also validate on the held-out workloads.
        #[arg(long)]
        heldout: bool,
    },
    /// List the tasks.
    Tasks,
    /// Show the LLM calls of a run.
    Log {
        run: i64,
        #[arg(long)]
        node: Option<i64>,
        /// Print whole prompts and replies.
        #[arg(long)]
        full: bool,
    },
    /// Knowledge base: hardware profiles, CUDA<->Metal map, patterns, static checks.
    #[command(subcommand)]
    Kb(kb_cmd::KbCmd),
    /// Translate a task's CUDA kernel into an MLX Metal body with the LLM (the coder's model):
    /// kept once it passes the Metal rules, the syntax check and the Metal executor on the task's
    /// workloads (every output element against the reference); what fails goes back to the
    /// model. Correctness only: time the result on a Mac.
    Translate {
        task: String,
        /// The kernel (of --from), or `seed`.
        #[arg(long)]
        kernel: String,
        /// mlx-cuda (an MLX CUDA-dialect body) or cuda; default: mlx-cuda when it has the kernel.
        #[arg(long)]
        from: Option<String>,
        /// The mlx-metal kernel whose launches, tunables and constraints the translation fits;
        /// default: the Metal kernel of the same name, else the mlx-cuda body's own.
        #[arg(long)]
        like: Option<String>,
        /// Where the verified body goes (the last rejected attempt: beside it, `.rejected.metal`).
        #[arg(short, long)]
        output: PathBuf,
        /// Attempts at most (each failure goes back to the model).
        #[arg(long, default_value_t = 4)]
        rounds: u32,
        /// Seconds one emulated run may take.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// LLM: the model (default: the coder's of ksearch.toml's [llm]).
        #[arg(long)]
        model: Option<String>,
        /// LLM: base URL of an OpenAI-compatible API.
        #[arg(long)]
        base_url: Option<String>,
        /// LLM: the environment variable holding the API key (default: OPENAI_API_KEY when set).
        #[arg(long)]
        api_key_env: Option<String>,
    },
    /// Compile-check every shipped CUDA kernel with NVRTC (no GPU needed).
    #[command(hide = true)]
    NvrtcCheck {
        #[arg(long)]
        task: Option<String>,
        #[arg(long, default_value = "sm_90")]
        arch: String,
        /// Tunable combinations per kernel at most (a spread sample beyond).
        #[arg(long, default_value_t = 40)]
        max_configs: usize,
    },
    /// Serve evaluation requests on stdin/stdout (started by the supervisor).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        backend: String,
        #[arg(long, default_value_t = 0)]
        device: usize,
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Data memory each candidate's runner may allocate (bytes).
        #[arg(long)]
        mem_limit: Option<u64>,
    },
    /// Run one candidate's kernel in a sandbox (started by a CPU worker; never by hand).
    #[command(hide = true)]
    Runner {
        #[arg(long, allow_hyphen_values = true)]
        shm_fd: i32,
        #[arg(long, allow_hyphen_values = true)]
        so_fd: i32,
        #[arg(long, default_value = "")]
        slots: String,
        #[arg(long, default_value = "")]
        offsets: String,
        #[arg(long, default_value = "")]
        entries: String,
        #[arg(long, default_value_t = 0)]
        mem_limit: u64,
    },
}

pub struct Global {
    pub config: Option<PathBuf>,
    pub store: Option<PathBuf>,
    pub tasks_dir: Option<PathBuf>,
    pub kb_dir: Option<PathBuf>,
    pub quiet: bool,
}

/// The progress bar on the terminal, if any: log lines are written with it suspended.
static PROGRESS: std::sync::Mutex<Option<indicatif::ProgressBar>> = std::sync::Mutex::new(None);

/// Log lines go above this bar from now on.
pub fn show_progress(pb: &indicatif::ProgressBar) {
    if let Ok(mut p) = PROGRESS.lock() {
        *p = Some(pb.clone());
    }
}

/// stderr, with the progress bar (if any) out of the way while a line is written.
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let pb = PROGRESS.lock().ok().and_then(|p| p.clone());
        match pb {
            Some(pb) if !pb.is_hidden() && !pb.is_finished() => pb.suspend(|| std::io::stderr().write_all(buf))?,
            _ => std::io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Log lines (retries, fallbacks, time-outs: one line each) on stderr. `RUST_LOG` decides when
/// set; else warnings, errors only with `-q`, more with `-v`.
fn init_logging(quiet: bool, verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        _ => "debug",
    };
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LogWriter)
        .with_target(false)
        .without_time()
        .compact()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() {
    // Neither candidates nor anything else of this user may read this process's memory or
    // environment through /proc or ptrace.
    // SAFETY: prctl on this process, no memory arguments.
    #[cfg(target_os = "linux")]
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0);
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => 0,
                _ => 2,
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    init_logging(cli.quiet, cli.verbose);
    let g = Global {
        config: cli.config,
        store: cli.store,
        tasks_dir: cli.tasks_dir,
        kb_dir: cli.kb_dir,
        quiet: cli.quiet,
    };
    let code = match commands::dispatch(&g, cli.cmd) {
        Ok(c) => c,
        Err(e) => {
            let mut msg = format!("error: {e}");
            for cause in e.chain().skip(1) {
                msg.push_str(&format!(": {cause}"));
            }
            eprintln!("{msg}");
            2
        }
    };
    std::process::exit(code);
}
