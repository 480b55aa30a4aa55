//! The worker pool of a run: one worker process per device, the Rust worker (`ksearch worker`)
//! or the Python MLX worker, with the run's limits and the LLM keys scrubbed from replies.

use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Duration;

use ksearch_core::Backend;
use ksearch_eval::{Limits, Pool, Supervisor, WorkerSpec};
use ksearch_search::RunConfig;

/// Where the `ksearch_mlx` package lives: `$KSEARCH_MLX_PATH`, else a `python/` folder holding
/// it in the current directory or beside (an ancestor of) the executable. `None`: rely on an
/// installed package.
pub fn mlx_package_dir() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KSEARCH_MLX_PATH") {
        return Some(PathBuf::from(p));
    }
    let has = |d: &std::path::Path| d.join("ksearch_mlx").join("worker.py").is_file();
    let here = PathBuf::from("python");
    if has(&here) {
        return std::fs::canonicalize(&here).ok();
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).map(|a| a.join("python")).find(|p| has(p))
}

/// The interpreter (`$KSEARCH_PYTHON`, default `python3`) and environment of the MLX worker.
pub fn mlx_worker_command() -> Result<(PathBuf, Vec<(String, String)>)> {
    let python = std::env::var("KSEARCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut env = vec![("PYTHONUNBUFFERED".to_string(), "1".to_string())];
    if let Some(dir) = mlx_package_dir() {
        let mut path = dir.display().to_string();
        if let Ok(old) = std::env::var("PYTHONPATH")
            && !old.is_empty()
        {
            path = format!("{path}:{old}");
        }
        env.push(("PYTHONPATH".into(), path));
    }
    Ok((PathBuf::from(python), env))
}

pub fn make_pool(cfg: &RunConfig) -> Result<Pool> {
    let pool = make_pool_inner(cfg)?;
    let keys = ksearch_search::llm_planner::settings_keys(cfg.llm.as_ref());
    let mut pool = pool;
    if !keys.is_empty() {
        for w in &mut pool.workers {
            w.scrub_also(&keys);
        }
    }
    Ok(pool)
}

fn make_pool_inner(cfg: &RunConfig) -> Result<Pool> {
    let exe = std::env::current_exe().context("cannot find the ksearch executable")?;
    let limits = Limits {
        compile_timeout: Duration::from_secs_f64(cfg.compile_timeout_s),
        run_timeout: Duration::from_secs_f64(cfg.run_timeout_s),
        mem_limit_bytes: cfg.mem_limit_bytes,
    };
    let devices: Vec<usize> = if cfg.devices.is_empty() {
        vec![0]
    } else {
        cfg.devices.clone()
    };
    let mut workers = Vec::new();
    if cfg.backend.is_mlx() {
        let (program, env) = mlx_worker_command()?;
        for d in devices {
            let args = vec![
                "-m".to_string(),
                "ksearch_mlx.worker".into(),
                "--backend".into(),
                cfg.backend.to_string(),
                "--device".into(),
                d.to_string(),
                "--cache".into(),
                cfg.cache_dir.join(cfg.backend.name()).display().to_string(),
            ];
            workers.push(
                Supervisor::new(
                    WorkerSpec {
                        program: program.clone(),
                        args,
                        env: env.clone(),
                    },
                    limits,
                )
                .launched_by(cfg.launcher.clone(), true),
            );
        }
        return Ok(Pool::new(workers));
    }
    // Several workers per device, interleaved (one of each device, then the next).
    // A Slurm worker is a job step with a GPU of its own: one per device unless configured.
    let launched = !matches!(cfg.launcher, ksearch_eval::Launcher::Local);
    let per_device = workers_per_device(cfg.backend, cfg.workers.max(launched as u32), devices.len());
    let mut of_device = Vec::new();
    for d in (0..per_device).flat_map(|_| devices.iter().copied()) {
        of_device.push(d);
        let mut args = vec![
            "worker".to_string(),
            "--backend".into(),
            cfg.backend.to_string(),
            "--cache".into(),
        ];
        args.push(cfg.cache_dir.join(cfg.backend.name()).display().to_string());
        if cfg.backend.is_gpu() {
            args.push("--device".into());
            args.push(d.to_string());
        } else {
            args.push("--mem-limit".into());
            args.push(cfg.mem_limit_bytes.to_string());
        }
        let mut env = Vec::new();
        if cfg.backend == Backend::Cpu && std::env::var("OMP_NUM_THREADS").is_err() {
            let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            env.push(("OMP_NUM_THREADS".into(), n.to_string()));
        }
        workers.push(
            Supervisor::new(
                WorkerSpec {
                    program: exe.clone(),
                    args,
                    env,
                },
                limits,
            )
            .launched_by(cfg.launcher.clone(), cfg.backend.is_gpu()),
        );
    }
    Ok(Pool::with_devices(workers, of_device))
}

/// Worker processes per device: `configured` when above 0, else 3 per GPU (at most the CPU
/// count shared over the devices) and 1 on the CPU back-end (its measurements run on the cores
/// a compile would use). The MLX worker serves one per device (it takes no device lock).
pub fn workers_per_device(backend: Backend, configured: u32, devices: usize) -> usize {
    if backend.is_mlx() {
        return 1;
    }
    if configured > 0 {
        return configured as usize;
    }
    if backend == Backend::Cpu {
        return 1;
    }
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cpus / devices.max(1)).clamp(1, 3)
}
