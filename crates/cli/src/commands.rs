//! The subcommands.

use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use ksearch_core::Backend;
use ksearch_core::protocol::{Candidate, TimingReq};
use ksearch_core::task::{self, Task};
use ksearch_core::tree::{NodeStatus, Tree};
use ksearch_store::Store;

use crate::config::{self, FileConfig, locate_dir, parse_bytes, parse_duration};
use crate::pool::make_pool;
use crate::{Cmd, Global, RunFlags};
use ksearch_eval::Pool;
use ksearch_search::llm_planner::{LlmFlags, LlmPlanner};
use ksearch_search::planner::{Offline, Planner};
use ksearch_search::{Event, Parts, Report, RunConfig, RunEnd, Search, StopRules};

/// Commands that only print end quietly when their reader goes away (`ksearch kb rules | head
/// -1`): the default SIGPIPE action instead of a panic in `println!`. Commands that talk to
/// workers keep SIGPIPE ignored, so a dead worker is an error they handle.
fn end_quietly_on_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: resets one signal's disposition for this process; no memory is involved.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

pub fn dispatch(g: &Global, cmd: Cmd) -> Result<i32> {
    if matches!(
        cmd,
        Cmd::Kb(_) | Cmd::Tasks | Cmd::Runs | Cmd::Tree { .. } | Cmd::Best { .. } | Cmd::Log { .. }
    ) {
        end_quietly_on_broken_pipe();
    }
    match cmd {
        Cmd::Worker {
            backend,
            device,
            cache,
            mem_limit,
        } => worker(&backend, device, cache, mem_limit),
        Cmd::Runner {
            shm_fd,
            so_fd,
            slots,
            offsets,
            entries,
            mem_limit,
        } => Ok(ksearch_eval::sandbox::runner_main(
            shm_fd, so_fd, &slots, &offsets, &entries, mem_limit,
        )),
        Cmd::Tasks => tasks(g),
        Cmd::Run { task, flags } => run(g, &task, &flags),
        Cmd::Resume { run, flags } => resume(g, run, &flags),
        Cmd::Runs => runs(g),
        Cmd::Tree { run, all } => tree(g, run, all),
        Cmd::Best { run, output, json } => best(g, run, output.as_deref(), json),
        Cmd::Export { run, mlx, torch, output } => export(g, run, mlx, torch, &output),
        Cmd::Bench {
            task,
            kernel,
            backend,
            like,
            entry,
            defines,
            heldout,
        } => bench(
            g,
            &task,
            &kernel,
            backend.as_deref(),
            like.as_deref(),
            entry.as_deref(),
            &defines,
            heldout,
        ),
        Cmd::Log { run, node, full } => log(g, run, node, full),
        Cmd::Report { run, output, watch } => {
            let fc = file_config(g)?;
            crate::report::run(&store_path(g, &fc), kb_dir(g, &fc).as_deref(), run, &output, watch)
        }
        Cmd::Kb(k) => {
            let fc = file_config(g).ok();
            let tasks = fc.as_ref().and_then(|fc| tasks_dir(g, fc).ok());
            // --kb-dir (or the config's) as given: a wrong one is an error, not ignored.
            let kb = g.kb_dir.clone().or_else(|| fc.as_ref().and_then(|fc| fc.run.kb_dir.clone()));
            crate::kb_cmd::run(k, tasks, kb)
        }
        Cmd::NvrtcCheck { task, arch, max_configs } => nvrtc_check(g, task.as_deref(), &arch, max_configs),
        Cmd::Translate {
            task,
            kernel,
            from,
            like,
            output,
            rounds,
            timeout,
            model,
            base_url,
            api_key_env,
        } => {
            let fc = file_config(g)?;
            let dir = tasks_dir(g, &fc)?;
            let kb = load_kb(kb_dir(g, &fc).as_deref())
                .context("no knowledge base found (give --kb-dir or run from the repository)")?;
            let mut llm = fc.llm.as_ref().map(serde_json::to_value).transpose()?;
            let flags = LlmFlags {
                model,
                base_url,
                api_key_env,
                ..Default::default()
            };
            ksearch_search::llm_planner::apply_flags(&mut llm, &flags)?;
            let args = crate::translate::TranslateArgs {
                task,
                kernel,
                from,
                like,
                out: output,
                rounds,
                timeout,
            };
            crate::translate::run(&dir, &kb, llm, &args)
        }
    }
}

fn file_config(g: &Global) -> Result<FileConfig> {
    config::load(g.config.as_deref())
}

/// How the first worker contains candidate code, in words for a header.
fn isolation_of(pool: &Pool) -> String {
    match pool.workers.first().and_then(|w| w.isolation.clone()) {
        Some(i) if !i.is_empty() => i,
        _ => "worker process only (the back-end runs trusted host code; candidate code is device code)".into(),
    }
}

/// Which clock the first worker times calls with, as its hello said.
fn clock_of(pool: &Pool) -> Option<String> {
    pool.workers.first().and_then(|w| w.clock.clone()).filter(|c| !c.is_empty())
}

fn store_path(g: &Global, fc: &FileConfig) -> PathBuf {
    g.store
        .clone()
        .or_else(|| fc.run.store.clone())
        .unwrap_or_else(|| PathBuf::from(".ksearch/store.db"))
}

fn open_store(g: &Global, fc: &FileConfig) -> Result<Store> {
    Ok(Store::open(&store_path(g, fc))?)
}

/// The store of a command that only reads: it must exist, and it is opened read-only (nothing
/// is created, a read-only store can be read).
fn open_store_ro(g: &Global, fc: &FileConfig) -> Result<Store> {
    Ok(Store::open_read_only(&store_path(g, fc))?)
}

fn tasks_dir(g: &Global, fc: &FileConfig) -> Result<PathBuf> {
    locate_dir(g.tasks_dir.as_deref().or(fc.run.tasks_dir.as_deref()), "tasks")
        .context("no tasks folder found (give --tasks-dir or run from the repository)")
}

fn kb_dir(g: &Global, fc: &FileConfig) -> Option<PathBuf> {
    locate_dir(g.kb_dir.as_deref().or(fc.run.kb_dir.as_deref()), "kb")
}

fn load_kb(dir: Option<&Path>) -> Option<ksearch_kb::Kb> {
    let d = dir?;
    match ksearch_kb::Kb::load(d) {
        Ok(k) => Some(k),
        Err(e) => {
            eprintln!("warning: knowledge base not loaded: {e}");
            None
        }
    }
}

fn worker(backend: &str, device: usize, cache: Option<PathBuf>, mem_limit: Option<u64>) -> Result<i32> {
    let backend: Backend = backend.parse()?;
    let cache = cache.unwrap_or_else(|| PathBuf::from(".ksearch/cache").join(backend.name()));
    match backend {
        Backend::Cpu => {
            let mut b = ksearch_eval::cpu::CpuBackend::new(cache);
            if let Some(m) = mem_limit {
                b.set_mem_limit(m);
            }
            Ok(ksearch_eval::worker::serve(&mut b))
        }
        Backend::Cuda => cuda_worker(device, cache),
        b @ (Backend::MlxCuda | Backend::MlxMetal) => {
            bail!(
                "the {b} worker is the Python package `ksearch_mlx`: run `python3 -m ksearch_mlx.worker --backend {b}` with python/ on PYTHONPATH"
            )
        }
    }
}

fn cuda_worker(device: usize, cache: PathBuf) -> Result<i32> {
    let mut b = ksearch_eval::cuda::CudaBackend::new(device, cache).map_err(|e| anyhow::anyhow!("cuda back-end: {e}"))?;
    Ok(ksearch_eval::worker::serve(&mut b))
}

fn cuda_available() -> bool {
    ksearch_eval::cuda::cuda_available()
}

/// Compile-check every shipped CUDA kernel with NVRTC (no GPU needed).
pub fn nvrtc_check(g: &Global, task: Option<&str>, arch: &str, max: usize) -> Result<i32> {
    let fc = file_config(g)?;
    let dir = tasks_dir(g, &fc)?;
    let tasks = match task {
        Some(t) => vec![task::find(&dir, t)?],
        None => task::load_all(&dir)?,
    };
    if !ksearch_eval::cuda::nvrtc_available() {
        bail!("libnvrtc not found (pip install nvidia-cuda-nvrtc==13.0.* and put its lib folder on LD_LIBRARY_PATH)");
    }
    let (n0, f0) = ksearch_eval::cuda::nvrtc_check(&tasks, arch, max, &mut |line| println!("{line}"));
    let (n1, f1) = ksearch_eval::mlx_cuda::nvrtc_check(&tasks, arch, max, &mut |line| println!("{line}"));
    let (n, failed) = (n0 + n1, f0 + f1);
    println!("nvrtc-check: {} passed, {failed} failed", n - failed);
    Ok(if failed == 0 { 0 } else { 1 })
}

fn tasks(g: &Global) -> Result<i32> {
    let fc = file_config(g)?;
    let dir = tasks_dir(g, &fc)?;
    let mut broken = 0;
    for t in task::load_each(&dir)? {
        let t = match t {
            Ok(t) => t,
            Err(e) => {
                // Reported, and the other tasks are still listed.
                eprintln!("error: {e}");
                broken += 1;
                continue;
            }
        };
        let backs: Vec<String> = t
            .backends
            .iter()
            .map(|(n, b)| {
                format!(
                    "{n} ({} kernels, {}+{} workloads)",
                    1 + b.kernels.len(),
                    b.search.len(),
                    b.heldout.len()
                )
            })
            .collect();
        println!("{:<12} {}  [{}]", t.name, t.description, backs.join(", "));
    }
    Ok(if broken == 0 { 0 } else { 2 })
}

fn resolve_backend(requested: &str, task: &Task) -> Result<Backend> {
    // `auto`: CUDA when a GPU is present and the task has CUDA kernels; `mlx`: Metal bodies on
    // macOS, CUDA bodies through MLX's CUDA back-end elsewhere.
    let b = Backend::resolve(requested, cuda_available, |b| task.backend(b).is_some())?;
    if task.backend(b).is_none() {
        let have: Vec<&String> = task.backends.keys().collect();
        bail!("task {} has no kernels for the {b} back-end (it has: {have:?})", task.name);
    }
    if b.is_mlx()
        && let Some(r) = task.reference.file()
    {
        bail!(
            "task {} brings its own reference ({}), which the MLX back-ends do not run: use --backend cpu or cuda",
            task.name,
            r.file
        );
    }
    Ok(b)
}

fn build_config(g: &Global, fc: &FileConfig, task: &Task, f: &RunFlags, prev: Option<RunConfig>) -> Result<RunConfig> {
    let r = &fc.run;
    let e = &fc.eval;
    let mut cfg = match prev {
        Some(p) => p,
        None => {
            let backend = resolve_backend(f.backend.as_deref().unwrap_or(&r.backend), task)?;
            RunConfig {
                task: task.name.clone(),
                task_path: task.dir.join("task.toml"),
                backend,
                planner: r.planner.clone(),
                rounds: r.rounds,
                patience: r.patience,
                seed: r.seed,
                context: r.context.clone(),
                workers: r.workers,
                devices: vec![],
                compile_timeout_s: parse_duration(&e.compile_timeout)?.as_secs_f64(),
                run_timeout_s: parse_duration(&e.run_timeout)?.as_secs_f64(),
                mem_limit_bytes: parse_bytes(&e.mem_limit)?,
                timing: TimingReq {
                    warmup: e.warmup,
                    min_reps: e.min_reps,
                    max_reps: e.max_reps,
                    target_ms: e.target_ms,
                    flush: e.flush,
                },
                kb_dir: kb_dir(g, fc),
                cache_dir: store_path(g, fc)
                    .parent()
                    .map(|p| p.join("cache"))
                    .unwrap_or_else(|| PathBuf::from(".ksearch/cache")),
                llm: fc.llm.as_ref().map(serde_json::to_value).transpose()?,
                launcher: crate::config::launcher(fc, None)?,
                task_digest: Some(task.digest()),
            }
        }
    };
    if let Some(p) = &f.planner {
        cfg.planner = p.clone();
    }
    if let Some(v) = f.rounds {
        cfg.rounds = v;
    }
    if let Some(v) = f.patience {
        cfg.patience = v;
    }
    if let Some(v) = f.seed {
        cfg.seed = v;
    }
    if let Some(v) = &f.context {
        if !["none", "generic", "full"].contains(&v.as_str()) {
            bail!("--context must be none, generic or full (got `{v}`)");
        }
        cfg.context = v.clone();
    }
    if f.launcher.is_some() {
        cfg.launcher = crate::config::launcher(fc, f.launcher.as_deref())?;
    }
    if let Some(v) = &f.devices {
        cfg.devices = v.clone();
    }
    if let Some(v) = f.workers {
        cfg.workers = v;
    }
    if cfg.backend == Backend::Cuda && cfg.devices.is_empty() {
        // One worker per GPU found.
        cfg.devices = (0..ksearch_eval::cuda::cuda_device_count().max(1)).collect();
    }
    if let Some(v) = &f.compile_timeout {
        cfg.compile_timeout_s = parse_duration(v)?.as_secs_f64();
    }
    if let Some(v) = &f.run_timeout {
        cfg.run_timeout_s = parse_duration(v)?.as_secs_f64();
    }
    if let Some(v) = &f.mem_limit {
        cfg.mem_limit_bytes = parse_bytes(v)?;
    }
    // A worker needs a moment to start and a compiler to run: a shorter time-out could only
    // fail every candidate (or the worker's start) with a reason that hides the cause.
    if cfg.compile_timeout_s < 1.0 {
        bail!(
            "compile time-out {} is too short: starting a worker and compiling a kernel take longer (use at least 1s)",
            humantime::format_duration(Duration::from_secs_f64(cfg.compile_timeout_s.max(0.0)))
        );
    }
    if cfg.run_timeout_s <= 0.0 {
        bail!("run time-out must be above zero");
    }
    if let Some(v) = f.max_reps {
        if v == 0 {
            bail!("--max-reps 0: a kernel is timed at least once");
        }
        cfg.timing.max_reps = v;
        cfg.timing.min_reps = cfg.timing.min_reps.min(cfg.timing.max_reps);
    }
    if cfg.timing.min_reps == 0 || cfg.timing.min_reps > cfg.timing.max_reps {
        bail!(
            "min_reps {} and max_reps {}: a kernel is timed at least once and min_reps <= max_reps",
            cfg.timing.min_reps,
            cfg.timing.max_reps
        );
    }
    if cfg.rounds == 0 {
        bail!("rounds 0 would stop before the first round: use at least 1");
    }
    if cfg.patience == 0 {
        bail!("patience 0 would stop before the first round: use at least 1");
    }
    // The runner maps its buffers and loads a shared object: below this, every candidate (the
    // seed too) fails for want of memory, which would read as the kernels' fault.
    const MIN_MEM: u64 = 64 << 20;
    if cfg.mem_limit_bytes < MIN_MEM {
        bail!(
            "memory limit of {} bytes is too small for a runner (use at least 64MiB)",
            cfg.mem_limit_bytes
        );
    }
    fits_memory(task, cfg.backend, cfg.mem_limit_bytes)?;
    if let Some(d) = &g.kb_dir
        && let Err(e) = ksearch_kb::Kb::load(d)
    {
        bail!("--kb-dir {}: {e}", d.display());
    }
    if !["offline", "llm"].contains(&cfg.planner.as_str()) {
        bail!("unknown planner `{}` (use offline or llm)", cfg.planner);
    }
    if task.reference.file().is_some() {
        // A reference the task brings is compiled now, into the workers' cache: a broken one
        // fails here, in one line, before any run is recorded.
        ksearch_eval::task_ref::compile(task, &cfg.cache_dir.join(cfg.backend.name()))
            .map_err(|e| anyhow::anyhow!("{}: {e}", task.dir.join("task.toml").display()))?;
    }
    let llm_flags = LlmFlags {
        model: f.model.clone(),
        planner_model: f.planner_model.clone(),
        coder_model: f.coder_model.clone(),
        base_url: f.base_url.clone(),
        api_key_env: f.api_key_env.clone(),
        max_cost: f.max_cost,
        max_llm_calls: f.max_llm_calls,
    };
    ksearch_search::llm_planner::apply_flags(&mut cfg.llm, &llm_flags)?;
    if cfg.planner == "llm" {
        // Fail early (before a run is created) on an unusable [llm] configuration.
        ksearch_search::llm_planner::settings(cfg.llm.as_ref())?;
    }
    Ok(cfg)
}

/// Refuses, before any run is recorded, a workload whose tensors alone exceed a worker's memory
/// limit: every kernel would fail on it (the seed too), which would read as the kernels' fault,
/// and a held-out one would fail only after the whole search.
fn fits_memory(task: &Task, backend: Backend, limit: u64) -> Result<()> {
    let Some(b) = task.backend(backend) else { return Ok(()) };
    for (kind, list) in [("search", &b.search), ("heldout", &b.heldout)] {
        for (i, w) in list.iter().enumerate() {
            let at = || {
                format!(
                    "{}: backends.{}.{kind}[{i}] ({})",
                    task.dir.join("task.toml").display(),
                    backend.name(),
                    ksearch_core::protocol::workload_label(w, &task.axes)
                )
            };
            let need = task.buffer_bytes(backend, w).map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
            if need > limit {
                bail!(
                    "{}: its tensors take {}, more than a worker's memory limit of {} (raise --mem-limit or `mem_limit` under [eval] in ksearch.toml, or make the workload smaller)",
                    at(),
                    show_bytes(need),
                    show_bytes(limit)
                );
            }
        }
    }
    Ok(())
}

/// `n` bytes in the largest binary unit that keeps it at or above 1.
fn show_bytes(n: u64) -> String {
    const UNITS: [&str; 7] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn make_planner(cfg: &RunConfig, quiet: bool) -> Result<Box<dyn Planner>> {
    match cfg.planner.as_str() {
        "offline" => Ok(Box::new(Offline::default())),
        "llm" => Ok(Box::new(LlmPlanner::from_config(cfg, quiet)?)),
        other => bail!("the {other} planner is not available in this build"),
    }
}

fn run(g: &Global, task_name: &str, f: &RunFlags) -> Result<i32> {
    let fc = file_config(g)?;
    let dir = tasks_dir(g, &fc)?;
    let task = task::find(&dir, task_name)?;
    let cfg = build_config(g, &fc, &task, f, None)?;
    let budget = f
        .time_budget
        .as_deref()
        .or(fc.run.time_budget.as_deref())
        .map(parse_duration)
        .transpose()?;
    let store = open_store(g, &fc)?;
    let started = start_pool(&cfg)?;
    let run_id = store.create_run(
        &task.name,
        cfg.backend,
        &cfg.planner,
        cfg.seed,
        "",
        &serde_json::to_value(&cfg)?,
    )?;
    // This process drives the run until it returns (the lock goes with it, or with the process).
    let _owner = store.lock_run(run_id)?;
    if !g.quiet {
        eprintln!(
            "run {run_id}: {} on {} ({}), planner {}, {} rounds",
            task.name, cfg.backend, started.1, cfg.planner, cfg.rounds
        );
        eprintln!("isolation: {}", isolation_of(&started.0));
        if let Some(c) = clock_of(&started.0) {
            eprintln!("timing: {c}");
        }
    }
    let mut s = new_search_with(store, run_id, cfg.clone(), task, g.quiet, Some(started))?;
    let stop = StopRules::of(&cfg, budget);
    let pb = progress(&mut s, g.quiet);
    s.set_interrupt(stop_signals());
    let end = s.run(stop);
    conclude(&s, end, &pb)
}

/// Start one worker per device; fails (before any run is recorded) when a worker cannot start
/// or says it cannot run kernels here.
fn start_pool(cfg: &RunConfig) -> Result<(ksearch_eval::Pool, String)> {
    let mut pool = make_pool(cfg)?;
    let mut device = String::new();
    for w in pool.workers.iter_mut() {
        device = w.start().map_err(|e| {
            if cfg.backend.is_mlx() {
                let e = e.trim_start_matches("worker did not start: ").trim();
                anyhow::anyhow!(
                    "the {} worker (python -m ksearch_mlx.worker) did not start: {e}; set KSEARCH_PYTHON to an interpreter with MLX (pip install -e python)",
                    cfg.backend
                )
            } else {
                anyhow::anyhow!("{} worker: {e}", cfg.backend)
            }
        })?;
        if w.kernels == Some(false) {
            bail!("the {} worker cannot run kernels here: {}", cfg.backend, w.device);
        }
    }
    Ok((pool, device))
}

fn new_search(store: Store, run_id: i64, cfg: RunConfig, task: Task, quiet: bool) -> Result<Search> {
    new_search_with(store, run_id, cfg, task, quiet, None)
}

fn new_search_with(
    store: Store,
    run_id: i64,
    cfg: RunConfig,
    task: Task,
    quiet: bool,
    started: Option<(Pool, String)>,
) -> Result<Search> {
    let (pool, device) = match started {
        Some(p) => p,
        None => start_pool(&cfg)?,
    };
    let kb = load_kb(cfg.kb_dir.as_deref());
    let profile = kb.as_ref().map(|k| {
        let (p, warn) = k.detect(cfg.backend, &device);
        if let Some(w) = warn
            && !quiet
        {
            eprintln!("warning: {w}");
        }
        p.name.clone()
    });
    let planner = make_planner(&cfg, quiet)?;
    Ok(Search::new(Parts {
        store,
        run_id,
        cfg,
        task,
        evaluator: Box::new(pool),
        kb,
        profile,
        planner,
    }))
}

/// The progress bar of a search (hidden when quiet), fed by the engine's events; log lines are
/// written above it.
fn progress(s: &mut Search, quiet: bool) -> indicatif::ProgressBar {
    let pb = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(s.config().rounds as u64)
    };
    pb.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} round {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Log lines are written above the bar, not through it.
    crate::show_progress(&pb);
    let bar = pb.clone();
    let t0 = Instant::now();
    let run_id = s.run_id();
    s.on_event(move |e| match e {
        Event::Note(line) => {
            if !quiet {
                bar.suspend(|| eprintln!("{line}"));
            }
        }
        Event::Resumed {
            round,
            nodes,
            evaluations,
        } => {
            bar.set_position(*round as u64);
            if !quiet {
                bar.suspend(|| {
                    eprintln!("resuming run {run_id} at round {round} ({nodes} nodes, {evaluations} evaluations kept)")
                });
            }
        }
        Event::Round {
            round,
            best,
            evaluations,
        } => {
            let per_min = *evaluations as f64 / t0.elapsed().as_secs_f64().max(1e-3) * 60.0;
            bar.set_position(*round as u64);
            bar.set_message(format!("best {best:.2}x | {per_min:.1} evals/min"));
        }
        Event::Finishing { reason } => {
            bar.finish_and_clear();
            if !quiet {
                eprintln!("stopping: {reason}; re-timing the best against the seed and validating on held-out workloads");
            }
        }
    });
    pb
}

/// Raised by SIGINT or SIGTERM while a run is driven.
static STOP: AtomicBool = AtomicBool::new(false);
/// The first stop signal received (0: none).
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    // Only async-signal-safe work: atomics and _exit.
    if STOP_SIGNAL.swap(sig, Ordering::SeqCst) != 0 {
        // A second signal: leave at once; the store is transactional, nothing booked is lost.
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
    STOP.store(true, Ordering::SeqCst);
}

/// Stop the run on SIGINT and SIGTERM (the engine looks at the flag between evaluations); a
/// second one exits at once.
fn stop_signals() -> &'static AtomicBool {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics and calls _exit;
        // SA_RESTART keeps the reads from workers going when the signal lands.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    &STOP
}

/// What a run's end prints, and its exit code.
fn conclude(s: &Search, end: Result<RunEnd>, pb: &indicatif::ProgressBar) -> Result<i32> {
    pb.finish_and_clear();
    let run_id = s.run_id();
    match end? {
        RunEnd::Interrupted => {
            eprintln!("interrupted: resume with ksearch resume {run_id}");
            Ok(128 + STOP_SIGNAL.load(Ordering::SeqCst))
        }
        RunEnd::Stopped { reason } => {
            println!(
                "run {run_id} stopped at round {}: {reason}; continue with `ksearch resume {run_id}`",
                s.round()
            );
            // No result yet (no final phase ran): not a success for a script.
            Ok(1)
        }
        RunEnd::Finished(report) => {
            print_report(&report);
            if let Some(line) = s.cost_line() {
                println!("{line}");
            }
            if report.stop_reason.starts_with("time budget") {
                println!(
                    "run {run_id} stopped on its time budget; continue with `ksearch resume {run_id} --time-budget <duration>`"
                );
            }
            Ok(if report.no_result().is_none() { 0 } else { 1 })
        }
    }
}

fn print_report(r: &Report) {
    println!("run {} · {} on {} · {}", r.run, r.task, r.backend, r.device);
    println!(
        "{} rounds, {} evaluations, stopped: {}",
        r.rounds, r.evaluations, r.stop_reason
    );
    if let (Some(n), Some(sp)) = (r.best_node, r.speedup) {
        println!("best: node {n} ({})", r.best_action.clone().unwrap_or_default());
        println!(
            "speed-up over the naive seed: {sp:.2}x (verified: re-timed back to back, geometric mean over {} search workloads){}",
            r.workloads.len(),
            r.search_speedup
                .map(|s| format!("; in-search figure {s:.2}x"))
                .unwrap_or_default()
        );
        for ((w, s), b) in r.workloads.iter().zip(&r.seed_us).zip(&r.best_us) {
            println!("  {w:<40} seed {s:>10.1} us   best {b:>10.1} us   {:.2}x", s / b);
        }
        if r.retimed.len() > 1 {
            let all: Vec<String> = r
                .retimed
                .iter()
                .map(|t| {
                    format!(
                        "node {} {} (in search {})",
                        t.node,
                        t.verified.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "failed".into()),
                        t.search.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into())
                    )
                })
                .collect();
            println!("re-timed candidates: {}", all.join(", "));
        }
        if let Some(h) = &r.heldout {
            match (h.passed, h.speedup) {
                (true, Some(hs)) if hs > 1.0 => {
                    println!("held-out validation: passed on {} workloads ({hs:.2}x)", h.workloads.len())
                }
                (true, Some(hs)) if h.noisy() => println!(
                    "held-out validation: passed on {} workloads; their timings are too noisy to compare with the seed ({hs:.2}x, spread {:.0}%)",
                    h.workloads.len(),
                    h.spread.unwrap_or(0.0) * 100.0
                ),
                (true, Some(hs)) => println!(
                    "held-out validation: correct on {} workloads but slower than the seed ({hs:.2}x)",
                    h.workloads.len()
                ),
                (true, None) => println!("held-out validation: passed ({})", h.message.clone().unwrap_or_default()),
                (false, _) => println!("held-out validation: FAILED: {}", h.message.clone().unwrap_or_default()),
            }
        }
        if let Some(n) = &r.native {
            match n.ratio {
                Some(x) => println!(
                    "against {} on the search workloads: {x:.2}x (its time / the best kernel's; above 1 is faster){}",
                    n.name,
                    n.message.as_ref().map(|m| format!("; note: {m}")).unwrap_or_default()
                ),
                None => println!("{} could not be timed: {}", n.name, n.message.clone().unwrap_or_default()),
            }
        }
    }
    if let Some(l) = ksearch_search::noise_line(r.spread) {
        println!("{l}");
    }
    if let Some(why) = r.no_result() {
        println!("no result: {why}");
    }
}

fn resume(g: &Global, run_id: i64, f: &RunFlags) -> Result<i32> {
    let fc = file_config(g)?;
    let store = open_store(g, &fc)?;
    let row = store.run(run_id)?;
    // A run that stopped on a time limit, or on its rounds when more are given, goes on.
    let stopped_on = |p: &str| row.stop_reason.as_deref().is_some_and(|r| r.starts_with(p));
    let limit_stop = stopped_on("time budget") || (stopped_on("round budget") && f.rounds.is_some_and(|n| n > row.round));
    if row.status.starts_with("done")
        && !limit_stop
        && let Some(rep) = row.report.clone().and_then(|v| serde_json::from_value::<Report>(v).ok())
    {
        eprintln!("run {run_id} already finished");
        print_report(&rep);
        return Ok(if rep.no_result().is_none() { 0 } else { 1 });
    }
    // One driver per run: refused (nothing written) while another process drives it.
    let _owner = store.lock_run(run_id)?;
    let prev: RunConfig = serde_json::from_value(row.config.clone()).context("the run's stored configuration is unreadable")?;
    let task = Task::load(&prev.task_path).or_else(|_| {
        let dir = tasks_dir(g, &fc)?;
        task::find(&dir, &prev.task).map_err(anyhow::Error::from)
    })?;
    // What the run measured must stay what it measures: the same task, back-end and inputs.
    if let Some(d) = &prev.task_digest
        && *d != task.digest()
    {
        bail!(
            "task `{}` changed since run {run_id} started ({} or a kernel file): its measurements would not compare; start a new run",
            prev.task,
            prev.task_path.display()
        );
    }
    if let Some(b) = f.backend.as_deref()
        && resolve_backend(b, &task)? != prev.backend
    {
        bail!(
            "run {run_id} runs on {}: a run keeps its back-end (--backend {b} starts a new run with `ksearch run`)",
            prev.backend
        );
    }
    if let Some(s) = f.seed
        && s != prev.seed
    {
        bail!(
            "run {run_id} draws its inputs with seed {}: a run keeps its seed (--seed {s})",
            prev.seed
        );
    }
    let cfg = build_config(g, &fc, &task, f, Some(prev))?;
    store.set_run_config(run_id, &serde_json::to_value(&cfg)?)?;
    store.set_run_status(run_id, "running", None)?;
    let budget = f
        .time_budget
        .as_deref()
        .or(fc.run.time_budget.as_deref())
        .map(parse_duration)
        .transpose()?;
    let stop = StopRules::of(&cfg, budget);
    let mut s = new_search(store, run_id, cfg, task, g.quiet)?;
    let pb = progress(&mut s, g.quiet);
    s.set_interrupt(stop_signals());
    let end = s.resume(stop);
    conclude(&s, end, &pb)
}

fn runs(g: &Global) -> Result<i32> {
    let fc = file_config(g)?;
    let store = open_store_ro(g, &fc)?;
    let rows = store.runs()?;
    if rows.is_empty() {
        println!("no runs yet (try: ksearch run softmax)");
    }
    for r in rows {
        let evals = store.count_evaluations(r.id)?;
        let report: Option<Report> = r.report.clone().and_then(|v| serde_json::from_value(v).ok());
        let (mut status, figure) = run_figure(&r.status, r.best_speedup, report.as_ref());
        // `running` with nobody holding its lock: the process that drove it died.
        if status == "running" && !store.run_is_driven(r.id) {
            status = "interrupted".into();
        }
        println!(
            "{:>4}  {:<12} {:<5} {:<8} {:<15} round {:>3}  {:>4} evals  {}  {}",
            r.id, r.task, r.backend, r.planner, status, r.round, evals, figure, r.created_at
        );
    }
    Ok(0)
}

/// A run's status and figure for the list: the verified figure when the run has its final
/// report (a run whose re-timed best is not a result says so), else the in-search figure,
/// labelled as such.
pub(crate) fn run_figure(status: &str, search_best: Option<f64>, report: Option<&Report>) -> (String, String) {
    let x = |v: Option<f64>| v.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into());
    match report {
        Some(rep) => {
            let status = if status.starts_with("done") {
                if rep.no_result().is_none() { "done" } else { "done_no_result" }
            } else {
                status
            };
            let figure = match rep.no_result() {
                None => format!(
                    "best {} verified (in search {})",
                    x(rep.speedup),
                    x(rep.search_speedup.or(search_best))
                ),
                Some(_) if rep.speedup.is_some() => format!(
                    "no result (re-timed {}, in search {})",
                    x(rep.speedup),
                    x(rep.search_speedup.or(search_best))
                ),
                Some(_) => "no result".to_string(),
            };
            (status.to_string(), figure)
        }
        None => (
            status.to_string(),
            match search_best {
                Some(s) => format!("in search {s:.2}x (not re-timed yet)"),
                None => "-".into(),
            },
        ),
    }
}

pub fn render_tree(t: &Tree, all: bool) -> String {
    let mut out = String::new();
    fn walk(t: &Tree, id: i64, prefix: &str, last: bool, root: bool, all: bool, out: &mut String) {
        let Some(n) = t.get(id) else { return };
        let a = &n.assessment;
        let speed = match (n.status, n.speedup) {
            (NodeStatus::Solved, Some(s)) => format!("{s:.2}x"),
            (NodeStatus::Failed, _) => format!("FAILED {}", n.failure.map(|f| f.name()).unwrap_or("")),
            (s, _) => s.name().to_string(),
        };
        let branch = if root {
            ""
        } else if last {
            "└─ "
        } else {
            "├─ "
        };
        out.push_str(&format!(
            "{prefix}{branch}#{} {}  {}  rating {:.1} conf {:.2} | bw {:.1} reg {:.1} hw {:.1} | diff {} prior {:.2} visits {}\n",
            n.id,
            n.action.summary(),
            speed,
            a.overall,
            a.confidence,
            a.bandwidth.rating,
            a.registers.rating,
            a.hw_fit.rating,
            a.difficulty,
            a.prior,
            n.visits
        ));
        let kids: Vec<i64> = t
            .children(id)
            .into_iter()
            .filter(|c| all || c.status != NodeStatus::Open)
            .map(|c| c.id)
            .collect();
        let hidden = t.children(id).len() - kids.len();
        let child_prefix = if root {
            prefix.to_string()
        } else {
            format!("{prefix}{}", if last { "   " } else { "│  " })
        };
        for (i, c) in kids.iter().enumerate() {
            walk(t, *c, &child_prefix, i + 1 == kids.len() && hidden == 0, false, all, out);
        }
        if hidden > 0 {
            out.push_str(&format!("{child_prefix}└─ … {hidden} open\n"));
        }
    }
    if let Some(r) = t.root() {
        walk(t, r.id, "", true, true, all, &mut out);
    }
    out
}

fn tree(g: &Global, run_id: i64, all: bool) -> Result<i32> {
    let fc = file_config(g)?;
    let store = open_store_ro(g, &fc)?;
    let row = store.run(run_id)?;
    let t = Tree::from_nodes(store.nodes(run_id)?);
    let report: Option<Report> = row.report.clone().and_then(|v| serde_json::from_value(v).ok());
    let (status, figure) = run_figure(&row.status, row.best_speedup, report.as_ref());
    println!(
        "run {} · {} on {} · {} · round {} · {}",
        row.id, row.task, row.backend, status, row.round, figure
    );
    let mut text = render_tree(&t, all);
    if let Some(rep) = &report {
        // The node figures are the search's; those re-timed at the end carry their verified one.
        for r in &rep.retimed {
            let Some(n) = t.get(r.node) else { continue };
            let (Some(sp), NodeStatus::Solved) = (n.speedup, n.status) else {
                continue;
            };
            let verified = r.verified.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "failed".into());
            text = text.replacen(
                &format!("#{} {}  {sp:.2}x  ", n.id, n.action.summary()),
                &format!("#{} {}  {sp:.2}x (re-timed {verified})  ", n.id, n.action.summary()),
                1,
            );
        }
    }
    println!("speed-ups: as measured in the search; (re-timed …): the final back-to-back re-timing");
    print!("{text}");
    Ok(0)
}

/// Kernel source with its defines written in front, so it compiles on its own.
pub fn standalone_source(c: &Candidate) -> String {
    let mut s = String::new();
    for (k, v) in &c.defines {
        s.push_str(&format!("#define {k} {v}\n"));
    }
    s.push_str(&c.source);
    s
}

fn best(g: &Global, run_id: i64, output: Option<&Path>, json: bool) -> Result<i32> {
    let fc = file_config(g)?;
    let store = open_store_ro(g, &fc)?;
    let row = store.run(run_id)?;
    if json {
        let mut v = row
            .report
            .clone()
            .context("the run has no final report yet (resume it to finish)")?;
        // The verdict travels with the figures: `no_result` says why the run has none (null:
        // it has one), and the exit code is 1 then, as without --json.
        let why = serde_json::from_value::<Report>(v.clone()).ok().and_then(|r| r.no_result());
        v["no_result"] = serde_json::json!(why);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(if why.is_none() { 0 } else { 1 });
    }
    let t = Tree::from_nodes(store.nodes(run_id)?);
    let report: Option<Report> = row.report.clone().and_then(|v| serde_json::from_value(v).ok());
    // A finished run answers with its verified figures only: a best that is no result once
    // re-timed is no result here too, with the run's own message.
    if let Some(why) = report.as_ref().and_then(|r| r.no_result()) {
        println!("run {run_id}: no result: {why}");
        return Ok(1);
    }
    let node_id = report
        .as_ref()
        .and_then(|r| r.best_node)
        .or_else(|| t.best().filter(|b| b.parent.is_some()).map(|b| b.id));
    let Some(node) = node_id.and_then(|id| t.get(id)) else {
        // A run that failed (its seed did) says why, not that nothing beat the seed.
        let why = match (row.status.as_str(), &row.stop_reason) {
            ("failed", Some(r)) => r.clone(),
            _ => ksearch_search::NO_FASTER.to_string(),
        };
        println!("run {run_id}: no result: {why}");
        return Ok(1);
    };
    let key = node.candidate.clone().context("best node has no candidate")?;
    let (kernel, cand) = store.candidate(&key)?.context("candidate missing")?;
    println!(
        "run {run_id} · best node {} · kernel {kernel} · {}",
        node.id,
        node.action.summary()
    );
    if let Some(r) = &report {
        if let Some(sp) = r.speedup {
            println!(
                "speed-up over the seed: {sp:.2}x (verified: final re-timing){}",
                r.search_speedup
                    .or(node.speedup)
                    .map(|s| format!("; in-search figure {s:.2}x"))
                    .unwrap_or_default()
            );
        }
        if let Some(h) = &r.heldout {
            match h.speedup {
                Some(hs) => println!("held-out: passed, {hs:.2}x the seed on {} workloads", h.workloads.len()),
                None => println!("held-out: passed"),
            }
        }
        if let Some(l) = ksearch_search::noise_line(r.spread) {
            println!("{l}");
        }
    } else if let Some(sp) = node.speedup {
        println!("in-search figure: {sp:.2}x over the seed (run not finished: not re-timed yet)");
    }
    for l in &cand.launches {
        println!(
            "launch {}: grid [{}] block [{}] shared {}",
            l.entry,
            l.grid.join(", "),
            l.block.join(", "),
            l.shared
        );
    }
    let src = standalone_source(&cand);
    match output {
        Some(p) => {
            std::fs::write(p, &src).with_context(|| format!("cannot write {}", p.display()))?;
            println!("written to {}", p.display());
        }
        None => println!("\n{src}"),
    }
    Ok(0)
}

/// `ksearch export <run> --mlx -o file.py`: NVRTC through ctypes (`python/ksearch_nvrtc.py`), the
/// runtime of `python/ksearch_mlx/runtime.py`, the task and the best candidate as JSON, and the
/// task's functions (`export_tail.py`) and, for the attention task, the mlx-lm Llama patch
/// (`export_llama.py`), in one file that needs only MLX (and mlx-lm for `patch_mlx_lm` and
/// `patch_mlx_lm_llama`, libnvrtc for a kernel that is a whole CUDA translation unit).
fn export(g: &Global, run_id: i64, mlx: bool, torch: bool, output: &Path) -> Result<i32> {
    if !mlx && !torch {
        bail!("say what to export for: --mlx (a run on mlx-cuda or mlx-metal) or --torch (a run on cuda)");
    }
    let fc = file_config(g)?;
    let store = open_store_ro(g, &fc)?;
    if torch {
        return crate::torch_export::export(&store, run_id, output);
    }
    let row = store.run(run_id)?;
    if !row.backend.is_mlx() {
        bail!(
            "run {run_id} searched the {} back-end; --mlx exports runs of mlx-cuda or mlx-metal (ksearch run {} --backend mlx)",
            row.backend,
            row.task
        );
    }
    let cfg: RunConfig = serde_json::from_value(row.config.clone()).context("run configuration unreadable")?;
    let mut task = Task::load(&cfg.task_path).with_context(|| format!("task of run {run_id}"))?;
    let t = Tree::from_nodes(store.nodes(run_id)?);
    let report: Option<Report> = row.report.clone().and_then(|v| serde_json::from_value(v).ok());
    let node = report
        .as_ref()
        .and_then(|r| r.best_node)
        .or_else(|| t.best().map(|b| b.id))
        .and_then(|id| t.get(id))
        .context("the run has no measured kernel yet")?;
    let key = node.candidate.clone().context("best node has no candidate")?;
    let (kernel, cand) = store.candidate(&key)?.context("candidate missing from the store")?;
    // The kernel's constraints travel with it, so the exported function refuses shapes the
    // specialised kernel cannot handle; the task keeps only this back-end, without its kernels.
    let constraints = task
        .kernel(cfg.backend, &kernel)
        .map(|k| k.constraints.clone())
        .unwrap_or_default();
    // The candidate with every other value of its shape-tied tunables (e.g. HD for D = 64, 96),
    // so that the module runs every shape class the search built for.
    let builds = task
        .kernel(cfg.backend, &kernel)
        .map(|k| other_builds(k, &cand.defines))
        .unwrap_or_default();
    task.backends.retain(|b, _| *b == row.backend.name());
    for b in task.backends.values_mut() {
        b.kernels.clear();
    }
    let mut cand_json = serde_json::to_value(&cand)?;
    cand_json["constraints"] = serde_json::json!(constraints);
    if !builds.is_empty() {
        cand_json["builds"] = serde_json::json!(builds);
    }
    let dir = crate::pool::mlx_package_dir()
        .context("python/ksearch_mlx not found (run from the repository or set KSEARCH_MLX_PATH)")?;
    let read = |f: &str| {
        let p = dir.join("ksearch_mlx").join(f);
        std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))
    };
    let (runtime, tail) = (read("runtime.py")?, read("export_tail.py")?);
    // NVRTC through ctypes (python/ksearch_nvrtc.py): a kernel that is a whole CUDA translation
    // unit (form = "cuda") is compiled on first use, for the GPU at hand.
    let nvrtc_path = dir.join("ksearch_nvrtc.py");
    let nvrtc = std::fs::read_to_string(&nvrtc_path).with_context(|| format!("cannot read {}", nvrtc_path.display()))?;
    let speedup = report.as_ref().and_then(|r| r.speedup).or(node.speedup);
    let mut m = format!(
        "# Generated by ksearch {} from run {run_id} ({} on {}, {}): best node {}, kernel `{kernel}`{}.\n\
         # Self-contained: needs mlx (and mlx-lm for patch_mlx_lm / patch_mlx_lm_llama). Change the search, not this file.\n",
        env!("CARGO_PKG_VERSION"),
        row.task,
        row.backend,
        row.device,
        node.id,
        speedup.map(|s| format!(", {s:.2}x the seed")).unwrap_or_default()
    );
    if ksearch_core::mlx::Form::of_candidate(&cand) == ksearch_core::mlx::Form::Cuda {
        m.push_str(
            "# The kernel is a whole CUDA translation unit: it is compiled with NVRTC on first use\n\
             # (libnvrtc.so.13: pip install nvidia-cuda-nvrtc, or $KSEARCH_NVRTC) for the GPU at hand.\n",
        );
    }
    m.push_str(&nvrtc);
    m.push('\n');
    m.push_str(&runtime);
    m.push_str("\n\n# ---- the search's result ----\nimport json as _json\n");
    m.push_str(&format!("TASK = {}\n", py_json(&serde_json::to_value(&task)?)?));
    m.push_str(&format!("CANDIDATE = {}\n", py_json(&cand_json)?));
    m.push_str(&format!("BACKEND = {:?}\n\n", row.backend.name()));
    m.push_str(&tail);
    // The attention task's module also patches mlx-lm's Llama attention (export_llama.py).
    if task.name == "attention" {
        m.push('\n');
        m.push_str(&read("export_llama.py")?);
    }
    std::fs::write(output, m).with_context(|| format!("cannot write {}", output.display()))?;
    println!(
        "run {run_id} · node {} · kernel {kernel} → {} (call {}(…); patch_mlx_lm() for the Mamba tasks, patch_mlx_lm_llama() for attention)",
        node.id,
        output.display(),
        row.task
    );
    Ok(0)
}

/// `defines` with every other combination of `k`'s shape-tied tunables (pattern
/// `specialisation`), in their declared order; empty when it has none.
fn other_builds(k: &ksearch_core::KernelSpec, defines: &BTreeMap<String, i64>) -> Vec<BTreeMap<String, i64>> {
    let tied: Vec<&ksearch_core::task::Tunable> = k
        .tunables
        .iter()
        .filter(|t| t.pattern.as_deref() == Some("specialisation"))
        .collect();
    if tied.is_empty() {
        return Vec::new();
    }
    let mut builds: Vec<BTreeMap<String, i64>> = vec![defines.clone()];
    for t in tied {
        builds = builds
            .iter()
            .flat_map(|b| {
                t.values.iter().map(move |v| {
                    let mut d = b.clone();
                    d.insert(t.name.clone(), *v);
                    d
                })
            })
            .collect();
    }
    builds.retain(|b| b != defines);
    builds.dedup();
    builds.truncate(64);
    builds
}

/// A JSON value as a Python expression: `_json.loads("…")` with the text as a Python string
/// literal (JSON string escapes are valid Python string escapes).
fn py_json(v: &serde_json::Value) -> Result<String> {
    let text = serde_json::to_string(v)?;
    Ok(format!("_json.loads({})", serde_json::to_string(&text)?))
}

/// Whether `bench` reports its second look at a noisy (seed, candidate) pair rather than the
/// first: always where the candidate failed the second time (wrong or crashed once is the kernel's
/// answer, not noise), else where the seed ran and the pair was calmer.
fn take_second_look(first_spread: f64, seed_failed: bool, candidate_failed: bool, second_spread: f64) -> bool {
    candidate_failed || (!seed_failed && second_spread < first_spread)
}

#[allow(clippy::too_many_arguments)]
fn bench(
    g: &Global,
    task_name: &str,
    kernel: &Path,
    backend: Option<&str>,
    like: Option<&str>,
    entry: Option<&str>,
    defines: &[String],
    heldout: bool,
) -> Result<i32> {
    let fc = file_config(g)?;
    let dir = tasks_dir(g, &fc)?;
    let task = task::find(&dir, task_name)?;
    let flags = RunFlags {
        backend: backend.map(String::from),
        ..RunFlags::default()
    };
    let cfg = build_config(g, &fc, &task, &flags, None)?;
    let source = ksearch_core::read_source(kernel).with_context(|| format!("cannot read {}", kernel.display()))?;
    let mut defs = BTreeMap::new();
    for d in defines {
        let (k, v) = d
            .split_once('=')
            .with_context(|| format!("--define wants NAME=VALUE, got `{d}`"))?;
        let v: i64 = v
            .trim()
            .parse()
            .with_context(|| format!("--define {k}: `{v}` is not an integer"))?;
        defs.insert(k.trim().to_string(), v);
    }
    for k in defs.keys() {
        if let Some(line) = defines_itself(&source, k) {
            bail!(
                "{}:{line}: the file defines {k} itself, so -D {k}=… would not reach the kernel (remove its #define, or guard it with #ifndef {k})",
                kernel.display()
            );
        }
    }
    let seed_k = task.kernel(cfg.backend, "seed").context("task has no seed")?.clone();
    let base = match like {
        Some(n) => task
            .kernel(cfg.backend, n)
            .with_context(|| format!("no kernel `{n}` in task {}", task.name))?
            .clone(),
        None => seed_k.clone(),
    };
    let mut launches = base.launches.clone();
    if let Some(e) = entry {
        for l in launches.iter_mut() {
            l.entry = e.to_string();
        }
    }
    if like.is_some() {
        for (k, v) in base.default_config() {
            defs.entry(k).or_insert(v);
        }
    }
    // The options of the kernel named by --like (e.g. an MLX whole CUDA unit's form).
    let options = match like {
        Some(_) => ksearch_search::planner::instantiate(cfg.backend, &base, &BTreeMap::new()).options,
        None => Default::default(),
    };
    let cand = Candidate {
        lang: cfg.backend.lang(),
        source,
        launches,
        scratch: base.scratch.clone(),
        defines: defs,
        options,
    };
    let seed_cand = ksearch_search::planner::instantiate(cfg.backend, &seed_k, &BTreeMap::new());
    let mut store = Store::open(Path::new(":memory:"))?;
    let _ = &mut store;
    let run_id = store.create_run(&task.name, cfg.backend, "bench", cfg.seed, "", &serde_json::json!({}))?;
    let (pool, device) = start_pool(&cfg)?;
    let isolation = isolation_of(&pool);
    let clock = clock_of(&pool).map(|c| format!("; timing: {c}")).unwrap_or_default();
    let mut s = new_search_with(store, run_id, cfg.clone(), task, true, Some((pool, device.clone())))?;
    let mut rows = Vec::new();
    let (mut worst, mut retimed) = (0.0f64, false);
    for (which, list_heldout) in [(false, false), (true, true)] {
        if which && !heldout {
            continue;
        }
        let [mut rs, mut rc]: [ksearch_core::protocol::EvalReply; 2] = s
            .evaluate_as_is(&[&seed_cand, &cand], list_heldout, None)
            .try_into()
            .map_err(|_| anyhow::anyhow!("the evaluator answered the wrong number of requests"))?;
        let spread = |a: &ksearch_core::protocol::EvalReply, b: &ksearch_core::protocol::EvalReply| {
            ksearch_search::max_spread(a).max(ksearch_search::max_spread(b))
        };
        if ksearch_search::failure_of(&rc).is_none() && spread(&rs, &rc) > ksearch_search::NOISY_SPREAD {
            // Noisy: time both again, back to back, with three times the repetitions, and keep
            // the calmer pair.
            let more = ksearch_search::more_reps(&cfg.timing);
            let [rs2, rc2]: [ksearch_core::protocol::EvalReply; 2] = s
                .evaluate_as_is(&[&seed_cand, &cand], list_heldout, Some(&more))
                .try_into()
                .map_err(|_| anyhow::anyhow!("the evaluator answered the wrong number of requests"))?;
            retimed = true;
            if take_second_look(
                spread(&rs, &rc),
                ksearch_search::failure_of(&rs2).is_some(),
                ksearch_search::failure_of(&rc2).is_some(),
                spread(&rs2, &rc2),
            ) {
                (rs, rc) = (rs2, rc2);
            }
        }
        if ksearch_search::failure_of(&rc).is_none() {
            worst = worst.max(spread(&rs, &rc));
        }
        rows.push((list_heldout, rs, rc));
    }
    println!(
        "{} on {} ({}); isolation: {}{clock}",
        s.task().name,
        cfg.backend,
        device,
        isolation
    );
    let mut ok = true;
    for (h, rs, rc) in &rows {
        if let Some(f) = ksearch_search::failure_of(rc) {
            println!(
                "kernel FAILED ({}){}: {}",
                f.class,
                if *h { " on held-out workloads" } else { "" },
                as_users_file(&f.message, kernel)
            );
            if !rc.compile.log.trim().is_empty() && f.class == ksearch_core::FailureClass::Compile {
                println!("{}", as_users_file(&rc.compile.log, kernel));
            }
            ok = false;
            continue;
        }
        for (ws, wc) in rs.workloads.iter().zip(&rc.workloads) {
            let (Some(a), Some(b)) = (ws.timing.as_ref(), wc.timing.as_ref()) else {
                continue;
            };
            println!(
                "  {}{:<40} seed {:>10.1} us   kernel {:>10.1} us (min {:.1}, spread {:.0}%)   {:.2}x   max err {:.2e}",
                if *h { "[held-out] " } else { "" },
                wc.label,
                a.median_us,
                b.median_us,
                b.min_us,
                b.spread * 100.0,
                a.median_us / b.median_us,
                wc.check.max_abs_err
            );
        }
    }
    if let Some(l) = ksearch_search::noise_line(Some(worst)) {
        println!(
            "{l}{}",
            if retimed {
                " (even timed again with 3x the repetitions)"
            } else {
                ""
            }
        );
    }
    Ok(if ok { 0 } else { 1 })
}

/// A compiler's or checker's message about the benched file, naming that file instead of the
/// name the back-end compiled it under (its lines are the file's own: defines are passed as
/// flags, not written into the source).
fn as_users_file(text: &str, file: &Path) -> String {
    let shown = file.display().to_string();
    let mut t = text.to_string();
    for internal in ["kernel.cpp", "candidate.cu", "source.metal", "body.metal"] {
        for sep in [":", "("] {
            t = t.replace(&format!("{internal}{sep}"), &format!("{shown}{sep}"));
        }
    }
    t
}

/// The line (1-based) where `src` defines `name` unconditionally (`#define NAME …` not guarded
/// by `#ifndef NAME` or `#if !defined(NAME)` just before it), if it does.
fn defines_itself(src: &str, name: &str) -> Option<usize> {
    let lines: Vec<&str> = src.lines().collect();
    let squash = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    for (i, l) in lines.iter().enumerate() {
        let t = squash(l.trim_start().trim_start_matches('#'));
        if !l.trim_start().starts_with('#') {
            continue;
        }
        let Some(rest) = t.strip_prefix("define ") else {
            continue;
        };
        let defined = rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("");
        if defined != name {
            continue;
        }
        let guard = lines[..i]
            .iter()
            .rev()
            .find(|p| !p.trim().is_empty())
            .map(|p| squash(p.trim_start().trim_start_matches('#')).replace(' ', ""))
            .unwrap_or_default();
        if guard == format!("ifndef{name}") || guard == format!("if!defined({name})") || guard == format!("if!defined{name}") {
            continue;
        }
        return Some(i + 1);
    }
    None
}

fn log(g: &Global, run_id: i64, node: Option<i64>, full: bool) -> Result<i32> {
    let fc = file_config(g)?;
    let store = open_store_ro(g, &fc)?;
    store.run(run_id)?;
    let calls = store.llm_calls(run_id, node)?;
    if calls.is_empty() {
        println!(
            "run {run_id} has no LLM calls{}",
            node.map(|n| format!(" for node {n}")).unwrap_or_default()
        );
        return Ok(0);
    }
    let cut = |s: &str, n: usize| {
        if full || s.len() <= n {
            s.to_string()
        } else {
            format!("{}… [{} chars]", &s[..s.floor_char_boundary(n)], s.len())
        }
    };
    for c in calls {
        println!(
            "#{} round {} node {} · {} · {} · {}+{} tokens · ${:.4} · {:.1}s · {} attempt(s){}",
            c.id,
            c.round,
            c.node_id.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            c.role,
            c.model,
            c.prompt_tokens,
            c.completion_tokens,
            c.cost_usd,
            c.latency_s,
            c.attempts,
            c.error.as_ref().map(|e| format!(" · ERROR: {e}")).unwrap_or_default()
        );
        println!("  prompt: {}", cut(&c.prompt, 300).replace('\n', "\n  "));
        if let Some(r) = &c.reply {
            println!("  reply:  {}", cut(r, 300).replace('\n', "\n  "));
        }
        if let Some(p) = &c.parsed {
            println!("  parsed: {}", cut(p, 300));
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::defines_itself;

    #[test]
    fn bench_keeps_a_failure_seen_on_its_second_look() {
        use super::take_second_look;
        // Noisy and correct first, wrong (or crashed) the second time: the failure is reported,
        // whether the second look was calmer or not, and whatever the seed did.
        assert!(take_second_look(0.4, false, true, 0.9));
        assert!(take_second_look(0.4, true, true, 0.1));
        // Both correct: the calmer pair.
        assert!(take_second_look(0.4, false, false, 0.1));
        assert!(!take_second_look(0.4, false, false, 0.5));
        // The seed failed the second time: the first pair stands.
        assert!(!take_second_look(0.4, true, false, 0.1));
    }

    #[test]
    fn compiler_messages_name_the_benched_file() {
        let f = std::path::Path::new("work/my_kernel.cu");
        assert_eq!(
            super::as_users_file("candidate.cu(3): error: x\nkernel.cpp:4:1: y", f),
            "work/my_kernel.cu(3): error: x\nwork/my_kernel.cu:4:1: y"
        );
        assert_eq!(super::as_users_file("no file here", f), "no file here");
    }

    #[test]
    fn a_define_of_the_files_own_is_found_unless_guarded() {
        let src = "// k\n#include <x>\n#define VEC 8\n#  define  BLOCK 4\n#ifndef TILE\n#define TILE 2\n#endif\n";
        assert_eq!(defines_itself(src, "VEC"), Some(3));
        assert_eq!(defines_itself(src, "BLOCK"), Some(4));
        assert_eq!(defines_itself(src, "TILE"), None, "guarded: -D overrides it");
        assert_eq!(defines_itself(src, "VE"), None);
        assert_eq!(defines_itself("#if !defined(VEC)\n#define VEC 1\n#endif\n", "VEC"), None);
    }
}
