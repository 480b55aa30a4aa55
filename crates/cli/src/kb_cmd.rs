//! `ksearch kb`: browse the knowledge base and check kernel sources against its rules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ksearch_kb::{
    BodySig, CheckOptions, Dialect, Kb, SourceLang, check, emulate_configs, emulate_cuda_kernel, emulate_kernel,
    emulate_workloads, metal_syntax_check, rejected,
};

#[derive(clap::Subcommand, Debug)]
pub enum KbCmd {
    /// List the hardware profiles.
    Profiles,
    /// Show one hardware profile with the source of every figure.
    Show {
        /// Profile name (see `ksearch kb profiles`), e.g. m3-max, h100.
        profile: String,
    },
    /// Map a primitive between CUDA and Metal.
    Map {
        /// A CUDA or Metal spelling, e.g. __shfl_xor_sync, __syncthreads, simd_sum.
        primitive: String,
        /// The dialect to translate to: metal or cuda.
        #[arg(long, default_value = "metal")]
        to: String,
    },
    /// List the optimisation patterns with their priors.
    Patterns,
    /// List the rules.
    Rules,
    /// Check a kernel source against the rules (and, with --syntax, a Metal syntax check).
    Check {
        file: PathBuf,
        /// Target profile; default: generic-apple for Metal, generic-cuda for CUDA, cpu for C++.
        #[arg(long)]
        target: Option<String>,
        /// cpp, cuda, metal (a whole file), mlx-metal or mlx-cuda (an MLX body). Default: from
        /// the extension (.cu, .cpp/.cc, .metal: a whole file when it declares a kernel, else an MLX body).
        #[arg(long)]
        lang: Option<String>,
        /// Also syntax-check Metal sources with a C++ compiler and the Metal shim.
        #[arg(long)]
        syntax: bool,
        /// A library call the task forbids (repeatable).
        #[arg(long)]
        forbid: Vec<String>,
        /// Dynamic shared / threadgroup bytes of the launch.
        #[arg(long)]
        shared: Option<u64>,
        /// NAME=VALUE compile-time constant (repeatable).
        #[arg(short = 'D', long = "define")]
        defines: Vec<String>,
        /// MLX body input NAME:DTYPE (repeatable); default: from `// inputs:` comments or the task.toml above the file.
        #[arg(long)]
        input: Vec<String>,
        /// MLX body output NAME:DTYPE (repeatable).
        #[arg(long)]
        output: Vec<String>,
    },
    /// Run a task's Metal or CUDA kernels on this machine's CPU and check every output element
    /// against the task's reference. Correctness only: no timing. Metal (`--backend mlx-metal`):
    /// the shim's executor (threadgroups, barriers, SIMD-group functions, 16-bit storage) in a
    /// child process with a time limit, an address-space limit and (Linux) a seccomp filter.
    /// CUDA (`--backend cuda`): NVRTC's PTX of the build the CUDA back-end makes, run by a PTX
    /// interpreter (warps, divergence, barriers, shuffles, cp.async groups, ldmatrix, mma.sync,
    /// mbarriers, TMA tensor loads, wgmma; every access bounds-checked). Exit status: 0 when
    /// every run passed, 1 when one failed, 2 for a bad flag (a tunable value the task does not
    /// list included) or when no run was admitted (each skip names the constraint it breaks).
    Emulate {
        /// The task (a name under the tasks folder).
        task: String,
        /// Whose kernels: mlx-metal or cuda.
        #[arg(long, default_value = "mlx-metal")]
        backend: String,
        /// A kernel of the task's back-end, or `seed`; default: the seed and every kernel.
        #[arg(long)]
        kernel: Option<String>,
        /// A Metal body file to run in place of the kernel's source (its launches, tunables and
        /// scratch are the kernel's: --kernel, default the seed); or a whole Metal file (one
        /// `[[kernel]]` function), its pointer parameters bound to the task's tensors and its
        /// `constant T&` parameters to the axes by name, launched with --grid and --threadgroup.
        #[arg(long)]
        file: Option<PathBuf>,
        /// A whole file's grid: three expressions over the axes, in threads ("rows*256,1,1").
        #[arg(long)]
        grid: Option<String>,
        /// A whole file's threadgroup: three expressions over the axes ("256,1,1").
        #[arg(long)]
        threadgroup: Option<String>,
        /// NAME=VALUE: a tunable's value (repeatable); the others keep their defaults.
        #[arg(short = 'D', long = "define")]
        defines: Vec<String>,
        /// A workload, e.g. "B=1,H=4,Hkv=2,L=77,D=64,causal=1" (repeatable); default: the
        /// task's `emulate` workloads, else its held-out ones.
        #[arg(long)]
        workload: Vec<String>,
        /// Seconds one run may take.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// Run the defaults, then every other value of every tunable alone (with the -D values
        /// held), instead of the defaults only.
        #[arg(long)]
        each_value: bool,
    },
}

fn usage(msg: String) -> anyhow::Result<i32> {
    eprintln!("error: {msg}");
    Ok(2)
}

fn load(given: Option<&Path>) -> Result<Kb, String> {
    if let Some(d) = given {
        return Kb::load(d).map_err(|e| format!("--kb-dir {}: {e}", d.display()));
    }
    let dir = Kb::locate().ok_or("no knowledge base found: set KSEARCH_KB or --kb-dir, or run from the repository root")?;
    Kb::load(&dir).map_err(|e| e.to_string())
}

fn unknown_profile(kb: &Kb, name: &str) -> String {
    let names: Vec<&str> = kb.profiles.iter().map(|p| p.name.as_str()).collect();
    format!("unknown profile `{name}` (known: {})", names.join(", "))
}

fn pairs(v: &[String]) -> Result<Vec<(String, String)>, String> {
    v.iter()
        .map(|s| {
            s.split_once(':')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| format!("`{s}`: expected NAME:DTYPE"))
        })
        .collect()
}

/// The body signature from the options, `// inputs:` comments, or the task beside `tasks/<t>/mlx/`.
fn body_sig(file: &Path, src: &str, input: &[String], output: &[String]) -> Result<BodySig, String> {
    if !input.is_empty() || !output.is_empty() {
        return Ok(BodySig {
            inputs: pairs(input)?,
            outputs: pairs(output)?,
            ..Default::default()
        });
    }
    if let Some(s) = BodySig::from_comments(src) {
        return Ok(s);
    }
    let dir = file.parent().unwrap_or(Path::new("."));
    let toml = dir.parent().map(|p| p.join("task.toml"));
    if let Some(t) = toml.filter(|t| t.is_file()) {
        let task = ksearch_core::Task::load(&t).map_err(|e| e.to_string())?;
        let rel = format!(
            "{}/{}",
            dir.file_name().unwrap_or_default().to_string_lossy(),
            file.file_name().unwrap_or_default().to_string_lossy()
        );
        let backend = [ksearch_core::Backend::MlxMetal, ksearch_core::Backend::MlxCuda]
            .into_iter()
            .find(|b| task.backend(*b).is_some())
            .unwrap_or(ksearch_core::Backend::MlxMetal);
        return Ok(BodySig::from_task(&task, backend, Some(&rel)));
    }
    Ok(BodySig::default())
}

pub fn run(cmd: KbCmd, tasks: Option<PathBuf>, kb_dir: Option<PathBuf>) -> anyhow::Result<i32> {
    if let KbCmd::Emulate {
        task,
        backend,
        kernel,
        file,
        grid,
        threadgroup,
        defines,
        workload,
        timeout,
        each_value,
    } = cmd
    {
        let launch = (grid, threadgroup);
        return emulate(
            tasks,
            &task,
            &backend,
            kernel.as_deref(),
            file.as_deref(),
            launch,
            &defines,
            &workload,
            timeout,
            each_value,
        );
    }
    let kb = match load(kb_dir.as_deref()) {
        Ok(kb) => kb,
        Err(e) => return usage(e),
    };
    match cmd {
        KbCmd::Profiles => {
            println!(
                "{:<14} {:<8} {:>10} {:>10} {:>8}  DEVICE",
                "NAME", "VENDOR", "BW GB/s", "F32 TFLOPS", "SMEM KB"
            );
            for p in &kb.profiles {
                let f32 = p.peak_tflops.get("f32").map(|v| format!("{v}")).unwrap_or_else(|| "-".into());
                println!(
                    "{:<14} {:<8} {:>10} {:>10} {:>8}  {}",
                    p.name, p.vendor, p.mem_bandwidth_gbs, f32, p.shared_per_block_kb, p.display_name
                );
            }
            Ok(0)
        }
        KbCmd::Show { profile } => {
            let Some(p) = kb.profile(&profile) else {
                return usage(unknown_profile(&kb, &profile));
            };
            println!("{} ({})", p.display_name, p.name);
            println!("vendor: {}  arch: {}", p.vendor, p.arch);
            if let Some(cc) = &p.compute_capability {
                println!("compute capability: {cc}");
            }
            if !p.notes.is_empty() {
                println!("notes: {}", p.notes);
            }
            println!();
            for (k, v) in p.figures() {
                println!(
                    "{k:<24} {v:>12}   [{}]",
                    p.sources.get(&k).map(String::as_str).unwrap_or("no source")
                );
            }
            Ok(0)
        }
        KbCmd::Map { primitive, to } => {
            let d = match ksearch_kb::map_dialect(&to) {
                Ok(d) => d,
                Err(e) => return usage(e),
            };
            let hits = kb.map(&primitive, d);
            if hits.is_empty() {
                return usage(format!(
                    "no primitive matches `{primitive}` (try `ksearch kb map __syncthreads`)"
                ));
            }
            for p in hits {
                // (from, to, the examples in that order); nothing maps to C++ (no hits).
                let (from, target, examples) = match d {
                    Dialect::Metal => (
                        p.cuda.join(", "),
                        p.metal.clone(),
                        format!("  CUDA:  {}\n  Metal: {}", p.cuda_example, p.metal_example.trim()),
                    ),
                    Dialect::Cuda => (
                        p.metal.clone(),
                        p.cuda[0].clone(),
                        format!("  Metal: {}\n  CUDA:  {}", p.metal_example.trim(), p.cuda_example),
                    ),
                    Dialect::Cpp => continue,
                };
                println!("{from} -> {target}");
                println!("  types: {}", p.types);
                for (spelling, domain) in &p.cuda_types {
                    println!("  {spelling}: {domain}");
                }
                println!("  {}", p.note);
                if let Some(m) = &p.mlx {
                    println!("  MLX: {m}");
                }
                println!("{examples}");
            }
            Ok(0)
        }
        KbCmd::Patterns => {
            println!(
                "{:<24} {:>5} {:>4} {:>4} {:>4} {:>4}  TITLE",
                "NAME", "PRIOR", "DIFF", "BW", "REG", "FIT"
            );
            for p in &kb.patterns {
                println!(
                    "{:<24} {:>5} {:>4} {:>4} {:>4} {:>4}  {}",
                    p.name, p.prior, p.difficulty, p.bandwidth, p.registers, p.hw_fit, p.title
                );
            }
            for (p, r) in kb.missing_kernel_refs() {
                eprintln!("warning: pattern {p} references {r}, which does not exist");
            }
            Ok(0)
        }
        KbCmd::Rules => {
            for r in &kb.rules {
                println!("{} ({:?}): {}", r.id, r.severity, r.summary);
            }
            Ok(0)
        }
        KbCmd::Emulate { .. } => unreachable!("handled above"),
        KbCmd::Check {
            file,
            target,
            lang,
            syntax,
            forbid,
            shared,
            defines,
            input,
            output,
        } => {
            let src = match std::fs::read_to_string(&file) {
                Ok(s) => s,
                Err(e) => return usage(format!("{}: {e}", file.display())),
            };
            let lang: SourceLang = match lang {
                Some(l) => match l.parse() {
                    Ok(l) => l,
                    Err(e) => return usage(e),
                },
                None => match file.extension().and_then(|e| e.to_str()) {
                    Some("cu" | "cuh") => SourceLang::Cuda,
                    Some("cpp" | "cc" | "cxx" | "h" | "hpp") => SourceLang::Cpp,
                    Some("metal") => {
                        let sig = regex_lite_kernel(&src);
                        if sig { SourceLang::Metal } else { SourceLang::MlxMetal }
                    }
                    _ => return usage(format!("{}: cannot infer the language; pass --lang", file.display())),
                },
            };
            let default_target = match lang.dialect() {
                Dialect::Metal => "generic-apple",
                Dialect::Cuda => "generic-cuda",
                Dialect::Cpp => "cpu",
            };
            let tname = target.unwrap_or_else(|| default_target.to_string());
            let Some(profile) = kb.profile(&tname) else {
                return usage(unknown_profile(&kb, &tname));
            };
            let mut defs = BTreeMap::new();
            for d in &defines {
                match d
                    .split_once('=')
                    .and_then(|(n, v)| v.trim().parse::<i64>().ok().map(|v| (n.trim().to_string(), v)))
                {
                    Some((n, v)) => {
                        defs.insert(n, v);
                    }
                    None => return usage(format!("-D {d}: expected NAME=INTEGER")),
                }
            }
            let opts = CheckOptions {
                forbid,
                dynamic_shared_bytes: shared,
                defines: defs,
                block: None,
                header: false,
            };
            let v = check(&kb, &src, lang, profile, &opts);
            let mut bad = rejected(&v);
            for x in &v {
                let sev = if x.severity == ksearch_kb::Severity::Error {
                    "error"
                } else {
                    "warning"
                };
                println!("{}: {sev}: {x}", file.display());
            }
            let metal = match lang.dialect() {
                Dialect::Metal => true,
                Dialect::Cuda | Dialect::Cpp => false,
            };
            if syntax && metal {
                let sig = if lang.is_body() {
                    match body_sig(&file, &src, &input, &output) {
                        Ok(s) => Some(s),
                        Err(e) => return usage(e),
                    }
                } else {
                    None
                };
                match metal_syntax_check(&src, sig.as_ref()) {
                    Ok(()) => {}
                    Err(e) if e.starts_with("no C++ compiler") => return usage(e),
                    Err(e) => {
                        println!("{}: error: rule metal.syntax: {e}", file.display());
                        bad = true;
                    }
                }
            }
            if bad {
                println!("rejected: {} ({} on {})", file.display(), lang.name(), profile.name);
                Ok(1)
            } else {
                println!("accepted: {} ({} on {})", file.display(), lang.name(), profile.name);
                Ok(0)
            }
        }
    }
}

/// NAME=INTEGER pairs (`-D`), or a workload's comma-separated ones.
fn int_pairs<'a>(items: impl Iterator<Item = &'a str>, what: &str) -> Result<BTreeMap<String, i64>, String> {
    let mut out = BTreeMap::new();
    for d in items.filter(|d| !d.trim().is_empty()) {
        let (n, v) = d
            .split_once('=')
            .and_then(|(n, v)| v.trim().parse::<i64>().ok().map(|v| (n.trim().to_string(), v)))
            .ok_or_else(|| format!("{what} `{d}`: expected NAME=INTEGER"))?;
        out.insert(n, v);
    }
    Ok(out)
}

/// `ksearch kb emulate`: one line per kernel and workload; exit 1 when an output is wrong or a
/// run fails, 2 for a usage error.
#[allow(clippy::too_many_arguments)]
fn emulate(
    tasks: Option<PathBuf>,
    name: &str,
    backend: &str,
    kernel: Option<&str>,
    file: Option<&Path>,
    launch: (Option<String>, Option<String>),
    defines: &[String],
    workloads: &[String],
    timeout: u64,
    each_value: bool,
) -> anyhow::Result<i32> {
    let Some(dir) = tasks else {
        return usage("no tasks folder found (give --tasks-dir or run from the repository)".into());
    };
    let task = match ksearch_core::task::find(&dir, name) {
        Ok(t) => t,
        Err(e) => return usage(e.to_string()),
    };
    let backend = match backend {
        "mlx-metal" | "metal" => ksearch_core::Backend::MlxMetal,
        "cuda" => ksearch_core::Backend::Cuda,
        "mlx-cuda" => ksearch_core::Backend::MlxCuda,
        other => {
            return usage(format!(
                "--backend `{other}`: emulation runs mlx-metal, cuda or mlx-cuda (whole CUDA units) kernels"
            ));
        }
    };
    let cuda = matches!(backend, ksearch_core::Backend::Cuda | ksearch_core::Backend::MlxCuda);
    let mlx_unit = backend == ksearch_core::Backend::MlxCuda;
    let Some(b) = task.backend(backend) else {
        return usage(format!("task `{name}` has no {backend} back-end"));
    };
    if cuda && !ksearch_eval::cuda::nvrtc_available() {
        return usage(
            "--backend cuda compiles with NVRTC, which is not installed (pip install 'nvidia-cuda-nvrtc==13.0.*' \
             and put site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    let all: Vec<&ksearch_core::KernelSpec> = std::iter::once(&b.seed).chain(&b.kernels).collect();
    let names = || {
        std::iter::once("seed")
            .chain(b.kernels.iter().map(|k| k.name.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut chosen: Vec<ksearch_core::KernelSpec> = match kernel {
        Some("seed") => vec![b.seed.clone()],
        Some(k) => match b.kernels.iter().find(|x| x.name == k) {
            Some(x) => vec![x.clone()],
            None => return usage(format!("task `{name}` has no {backend} kernel `{k}` (known: {})", names())),
        },
        None if file.is_some() => vec![b.seed.clone()],
        None => all.into_iter().cloned().collect(),
    };
    let mut whole = None;
    if let Some(f) = file {
        match std::fs::read_to_string(f) {
            Ok(src) if !cuda && regex_lite_kernel(&src) => whole = Some(src),
            Ok(src) => chosen[0].source = src,
            Err(e) => return usage(format!("{}: {e}", f.display())),
        }
    }
    let three = |s: &Option<String>, what: &str| -> Result<Option<[String; 3]>, String> {
        let Some(s) = s else { return Ok(None) };
        let (mut parts, mut cur, mut depth) = (Vec::new(), String::new(), 0);
        for ch in s.chars() {
            match ch {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(std::mem::take(&mut cur).trim().to_string());
                    continue;
                }
                _ => {}
            }
            cur.push(ch);
        }
        parts.push(cur.trim().to_string());
        <[String; 3]>::try_from(parts)
            .map(Some)
            .map_err(|_| format!("--{what} `{s}`: expected three comma-separated expressions"))
    };
    let (grid, tg) = match (three(&launch.0, "grid"), three(&launch.1, "threadgroup")) {
        (Ok(g), Ok(t)) => (g, t),
        (Err(e), _) | (_, Err(e)) => return usage(e),
    };
    if whole.is_some() != (grid.is_some() && tg.is_some()) || (whole.is_none() && (grid.is_some() || tg.is_some())) {
        return usage(if whole.is_some() {
            "a whole Metal file (a `[[kernel]]` function) needs --grid and --threadgroup".into()
        } else {
            "--grid and --threadgroup go with a whole Metal file (--file declaring a `[[kernel]]` function)".into()
        });
    }
    let set = match int_pairs(defines.iter().map(String::as_str), "-D") {
        Ok(s) => s,
        Err(e) => return usage(e),
    };
    let mut list = Vec::new();
    for w in workloads {
        match int_pairs(w.split(','), "--workload") {
            Ok(m) => {
                if let Some(a) = task.axes.iter().find(|a| !m.contains_key(*a)) {
                    return usage(format!("--workload `{w}` gives no value for axis `{a}`"));
                }
                if let Some(k) = m.keys().find(|k| !task.axes.contains(k)) {
                    return usage(format!(
                        "--workload `{w}` names unknown axis `{k}` (axes: {})",
                        task.axes.join(", ")
                    ));
                }
                list.push(m);
            }
            Err(e) => return usage(e),
        }
    }
    if list.is_empty() {
        list = emulate_workloads(&task, backend);
    }
    if list.is_empty() {
        return usage(format!("task `{name}` has no workloads to emulate; give --workload"));
    }
    let show = |m: &BTreeMap<String, i64>| m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    let (mut ran, mut failed, mut skipped) = (0, 0, 0);
    if let (Some(src), Some(grid), Some(tg), Some(f)) = (&whole, &grid, &tg, file) {
        if !set.is_empty() || kernel.is_some() {
            return usage("-D and --kernel do not apply to a whole Metal file".into());
        }
        let fname = f.file_name().unwrap_or_default().to_string_lossy().into_owned();
        for (i, w) in list.iter().enumerate() {
            ran += 1;
            match ksearch_kb::emulate_file(
                &task,
                src,
                grid,
                tg,
                w,
                0x5eed + i as u64,
                std::time::Duration::from_secs(timeout),
            ) {
                Ok(o) => {
                    let ok = o.passed();
                    failed += usize::from(!ok);
                    println!("{} {fname} on {}: {}", if ok { "ok  " } else { "FAIL" }, show(w), o.summary());
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL {fname} on {}: {}", show(w), e.lines().next().unwrap_or_default());
                    for l in e.lines().skip(1).take(20) {
                        println!("     {l}");
                    }
                }
            }
        }
        println!("emulated {ran} run(s) of task `{name}` on the CPU: {failed} failed");
        return Ok(if failed > 0 { 1 } else { 0 });
    }
    for k in &chosen {
        let mut config = k.default_config();
        for (n, v) in &set {
            if !k.tunables.iter().any(|t| &t.name == n) {
                if kernel.is_some() || file.is_some() {
                    return usage(format!(
                        "kernel `{}` has no tunable `{n}`",
                        if k.name.is_empty() { "seed" } else { &k.name }
                    ));
                }
                continue;
            }
            let t = k.tunables.iter().find(|t| &t.name == n).expect("checked above");
            if !t.values.contains(v) {
                let vals: Vec<String> = t.values.iter().map(|x| x.to_string()).collect();
                return usage(format!(
                    "kernel `{}`: {n}={v} is not one of its values ({}; task `{name}`)",
                    if k.name.is_empty() { "seed" } else { &k.name },
                    vals.join(", ")
                ));
            }
            config.insert(n.clone(), *v);
        }
        let kname = if k.name.is_empty() { "seed" } else { k.name.as_str() };
        // --each-value: the defaults, then every other value of every tunable alone (-D values
        // held), so each value the search may pick has run.
        let configs: Vec<BTreeMap<String, i64>> = if each_value {
            let mut v: Vec<BTreeMap<String, i64>> = emulate_configs(k, &list)
                .into_iter()
                .map(|mut c| {
                    c.extend(
                        set.iter()
                            .filter(|(n, _)| k.tunables.iter().any(|t| &t.name == *n))
                            .map(|(n, v)| (n.clone(), *v)),
                    );
                    c
                })
                .collect();
            v.dedup();
            v
        } else {
            vec![config.clone()]
        };
        for config in &configs {
            for (i, w) in list.iter().enumerate() {
                let limit = std::time::Duration::from_secs(timeout);
                let r = if cuda {
                    let options: BTreeMap<String, serde_json::Value> = k
                        .options
                        .iter()
                        .filter_map(|(n, v)| serde_json::to_value(v).ok().map(|v| (n.clone(), v)))
                        .collect();
                    let ptx =
                        |c: &BTreeMap<String, i64>| ksearch_eval::cuda::emulation_ptx(&task, &k.source, &options, c, mlx_unit);
                    if mlx_unit && ksearch_core::mlx::Form::of_options(&k.options) != Ok(ksearch_core::mlx::Form::Cuda) {
                        skipped += 1;
                        println!(
                            "skip {kname} [{}] on {}: an MLX body (MLX's own compiler builds it), not a whole CUDA unit",
                            show(config),
                            show(w)
                        );
                        continue;
                    }
                    emulate_cuda_kernel(&task, backend, k, config, w, 0x5eed + i as u64, limit, &ptx)
                } else {
                    emulate_kernel(&task, k, config, w, 0x5eed + i as u64, limit)
                };
                match r {
                    Ok(None) => {
                        skipped += 1;
                        // specialise() found no build: name the constraint the configuration as
                        // given breaks (with its shape-tied tunables it may break another).
                        let why = k
                            .broken_constraint(config, w)
                            .map(|c| format!("`{c}` does not hold"))
                            .unwrap_or_else(|| "no build of its shape-tied tunables is admitted".into());
                        println!("skip {kname} [{}] on {}: not admitted: {why}", show(config), show(w));
                    }
                    Ok(Some(o)) => {
                        ran += 1;
                        let ok = o.passed();
                        failed += usize::from(!ok);
                        println!(
                            "{} {kname} [{}] on {}: {}",
                            if ok { "ok  " } else { "FAIL" },
                            show(&o.config),
                            show(w),
                            o.summary()
                        );
                    }
                    Err(e) if cuda && e.starts_with("PTX: ") && e.contains("unsupported instruction") => {
                        // A limit of the interpreter, not a fault of the kernel.
                        skipped += 1;
                        println!(
                            "skip {kname} [{}] on {}: not interpretable: {}",
                            show(config),
                            show(w),
                            &e[5..]
                        );
                    }
                    Err(e) => {
                        ran += 1;
                        failed += 1;
                        let first = e.lines().next().unwrap_or_default().to_string();
                        // The build that ran: its shape-tied tunables set for the workload.
                        let built = k.specialise(config, w).unwrap_or_else(|| config.clone());
                        println!("FAIL {kname} [{}] on {}: {first}", show(&built), show(w));
                        for l in e.lines().skip(1).take(20) {
                            println!("     {l}");
                        }
                    }
                }
            }
        }
    }
    println!(
        "emulated {ran} run(s) of task `{name}` on the CPU: {failed} failed, {skipped} skipped (not admitted, or not interpretable)"
    );
    if ran == 0 {
        // Nothing was checked: not a pass.
        return usage(format!(
            "no run of task `{name}` was admitted and interpretable, so nothing was checked (the skips above say why)"
        ));
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

/// Does a Metal source declare a kernel function (a whole file) rather than being an MLX body?
fn regex_lite_kernel(src: &str) -> bool {
    src.lines().any(|l| {
        let l = l.trim_start();
        !l.starts_with("//") && (l.contains("[[kernel") || l.contains("kernel void"))
    })
}
