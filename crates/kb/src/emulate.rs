//! A task's Metal kernels run on Linux: the shim's executor ([`crate::metal_run`]) on a workload,
//! inputs drawn as the judge draws them, outputs and scratch poisoned, every output element
//! checked against the task's host reference with the task's tolerance. It shows that a body
//! computes the right thing under Metal's rules (threadgroups, barriers, SIMD-group functions,
//! 16-bit storage); it says nothing of its speed.

use std::collections::BTreeMap;
use std::time::Duration;

use ksearch_core::data::{self, Check, Rng};
use ksearch_core::task::{KernelSpec, Task, Workload, shape_of};
use ksearch_core::{Backend, expr, reference};

use crate::metal::BodySig;
use crate::metal_exec::{EmuBuffer, EmuLaunch, metal_run, metal_run_file};

/// What one emulated run found, per output.
#[derive(Debug, Clone)]
pub struct EmuOutcome {
    /// The build: the configuration after shape-tied tunables were set for the workload.
    pub config: BTreeMap<String, i64>,
    pub checks: Vec<(String, Check)>,
    /// How the run went where that matters (the landing of asynchronous results).
    pub note: Option<String>,
}

impl EmuOutcome {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|(_, c)| c.passed())
    }
    /// One line: every output's elements and errors, or the first offending element, then how
    /// the run went where that matters.
    pub fn summary(&self) -> String {
        let checks = self
            .checks
            .iter()
            .map(|(n, c)| {
                if c.passed() {
                    format!("`{n}` {} elements ok (max abs err {:.2e})", c.elements, c.max_abs_err)
                } else {
                    let (i, got, want) = c.first_bad.clone().unwrap_or((0, "?".into(), "?".into()));
                    format!(
                        "`{n}` {} mismatched, {} unwritten, {} NaN of {} (first at {i}: got {got}, reference {want})",
                        c.mismatches, c.unwritten, c.nan, c.elements
                    )
                }
            })
            .collect::<Vec<_>>()
            .join("; ");
        match &self.note {
            Some(n) => format!("{checks} ({n})"),
            None => checks,
        }
    }
}

/// The workloads to emulate a task's kernels of `backend` on: its `emulate` list, else its
/// held-out ones.
pub fn emulate_workloads(task: &Task, backend: Backend) -> Vec<Workload> {
    match task.backend(backend) {
        Some(b) if !b.emulate.is_empty() => b.emulate.clone(),
        Some(b) => b.heldout.clone(),
        None => Vec::new(),
    }
}

/// The configurations of `k` worth emulating: the defaults, then each other value of each
/// tunable alone; where no workload admits a value alone (e.g. f16 tiles need larger tiles), the
/// first configuration with that value that one of them admits.
pub fn emulate_configs(k: &KernelSpec, workloads: &[Workload]) -> Vec<BTreeMap<String, i64>> {
    let base = k.default_config();
    let admitted = |c: &BTreeMap<String, i64>| workloads.iter().any(|w| k.specialise(c, w).is_some());
    let mut out = vec![base.clone()];
    for (ti, t) in k.tunables.iter().enumerate() {
        for (vi, v) in t.values.iter().enumerate() {
            if *v == t.default_value() {
                continue;
            }
            let mut c = base.clone();
            c.insert(t.name.clone(), *v);
            if !admitted(&c)
                && let Some(other) = first_admitted_with(k, ti, vi, &admitted)
            {
                c = other;
            }
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// The first configuration in the order of the tunables' product (the last tunable fastest) whose
/// tunable `ti` takes its value `vi` and which `admitted` accepts. Walked one configuration at a
/// time: the product itself (millions of configurations for a kernel with many tunables) is never
/// held.
fn first_admitted_with(
    k: &KernelSpec,
    ti: usize,
    vi: usize,
    admitted: &dyn Fn(&BTreeMap<String, i64>) -> bool,
) -> Option<BTreeMap<String, i64>> {
    let ts = &k.tunables;
    let mut idx = vec![0usize; ts.len()];
    idx[ti] = vi;
    loop {
        let c: BTreeMap<String, i64> = ts.iter().zip(&idx).map(|(t, &i)| (t.name.clone(), t.values[i])).collect();
        if admitted(&c) {
            return Some(c);
        }
        // The next configuration: the last digit other than `ti` that can move, the ones after it reset.
        let mut j = ts.len();
        loop {
            if j == 0 {
                return None;
            }
            j -= 1;
            if j == ti {
                continue;
            }
            idx[j] += 1;
            if idx[j] < ts[j].values.len() {
                break;
            }
            idx[j] = 0;
        }
    }
}

/// Run kernel `k` of the task's `mlx-metal` back-end in `config` on workload `w` (inputs from
/// `seed`). `Ok(None)`: the kernel does not admit the workload in this configuration (its
/// constraints). `Err`: the build, the executor or the reference failed (a one-line reason).
pub fn emulate_kernel(
    task: &Task,
    k: &KernelSpec,
    config: &BTreeMap<String, i64>,
    w: &Workload,
    seed: u64,
    limit: Duration,
) -> Result<Option<EmuOutcome>, String> {
    let backend = Backend::MlxMetal;
    let Some(config) = k.specialise(config, w) else {
        return Ok(None);
    };
    let reference = builtin_reference(task)?;
    // MLX's template parameters: every axis (task order), then every define.
    let env = env_of(w, &config);
    let mut sig = BodySig::from_task(task, backend, Some(&k.file));
    sig.template_params = task
        .axes
        .iter()
        .map(|a| (a.clone(), w.get(a).copied().unwrap_or(0)))
        .chain(config.iter().map(|(a, b)| (a.clone(), *b)))
        .collect();
    sig.launches = ksearch_core::mlx::launch_io(task, backend, k);
    let eval = |e: &str, what: &str| -> Result<u32, String> {
        let v = expr::eval_i64(e, &env).map_err(|err| format!("{what} `{e}`: {err}"))?;
        u32::try_from(v).map_err(|_| format!("{what} `{e}` = {v}"))
    };
    let mut launches = Vec::new();
    for l in &k.launches {
        let g = |i: usize| eval(&l.grid[i], &format!("launch `{}` grid", l.entry));
        let b = |i: usize| eval(&l.block[i], &format!("launch `{}` block", l.entry));
        launches.push(EmuLaunch {
            entry: l.entry.clone(),
            grid: [g(0)?, g(1)?, g(2)?],
            threadgroup: [b(0)?, b(1)?, b(2)?],
        });
    }
    let mut run = Prepared::new(task, backend, w, seed)?;
    run.add_scratch(k, &env, seed)?;
    metal_run(&k.source, &sig, &launches, &mut run.buffers, limit)?;
    let checks = run.check(task, w, reference)?;
    Ok(Some(EmuOutcome {
        config,
        checks,
        note: None,
    }))
}

/// A workload's buffers for one emulated run: inputs drawn as the judge draws them, outputs
/// poisoned with a fresh random NaN.
struct Prepared {
    backend: Backend,
    buffers: Vec<EmuBuffer>,
    inputs: Vec<Vec<f64>>,
    poisons: Vec<Vec<u8>>,
}

impl Prepared {
    fn new(task: &Task, backend: Backend, w: &Workload, seed: u64) -> Result<Prepared, String> {
        let mut rng = Rng::new(seed);
        let (mut buffers, mut inputs, mut poisons) = (Vec::new(), Vec::new(), Vec::new());
        for (i, t) in task.inputs.iter().enumerate() {
            let shape = shape_of(t, w)?;
            let dt = task.dtype_on(backend, t);
            let vals = data::draw(&t.init, dt, shape.iter().product(), data::sub_seed(seed, i));
            buffers.push(EmuBuffer {
                name: t.name.clone(),
                shape,
                bytes: data::encode(&vals, dt),
            });
            inputs.push(vals);
        }
        for t in &task.outputs {
            let shape = shape_of(t, w)?;
            let dt = task.dtype_on(backend, t);
            let p = data::random_poison(dt, &mut rng);
            let mut bytes = vec![0u8; shape.iter().product::<usize>() * dt.size()];
            data::fill_pattern(&mut bytes, &p);
            buffers.push(EmuBuffer {
                name: t.name.clone(),
                shape,
                bytes,
            });
            poisons.push(p);
        }
        Ok(Prepared {
            backend,
            buffers,
            inputs,
            poisons,
        })
    }

    /// The kernel's scratch buffers, filled with a random poison.
    fn add_scratch(&mut self, k: &KernelSpec, env: &BTreeMap<String, i64>, seed: u64) -> Result<(), String> {
        let mut rng = Rng::new(seed ^ 0x9e37_79b9_7f4a_7c15);
        for sc in &k.scratch {
            let n = expr::eval_i64(&sc.bytes, env).map_err(|e| format!("scratch `{}`: {e}", sc.name))?;
            let dt = sc.dtype.unwrap_or(ksearch_core::task::DType::F32);
            let n = usize::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_BUFFER)
                .ok_or_else(|| format!("scratch `{}`: {n} bytes", sc.name))?;
            let mut bytes = vec![0u8; n];
            data::fill_pattern(&mut bytes, &data::random_poison(dt, &mut rng));
            self.buffers.push(EmuBuffer {
                name: sc.name.clone(),
                shape: vec![n / dt.size()],
                bytes,
            });
        }
        Ok(())
    }

    /// Every output element against the reference, with the task's tolerance for its dtype.
    fn check(&self, task: &Task, w: &Workload, reference: reference::RefFn) -> Result<Vec<(String, Check)>, String> {
        let backend = self.backend;
        let refs = reference(&reference::RefArgs {
            axes: w,
            constants: &task.constants,
            inputs: self.inputs.iter().map(|v| v.as_slice()).collect(),
        });
        let mut checks = Vec::new();
        for (i, t) in task.outputs.iter().enumerate() {
            let dt = task.dtype_on(backend, t);
            let tol = task.tolerance_of(dt);
            let out = &self.buffers[task.inputs.len() + i].bytes;
            let r = refs
                .get(i)
                .ok_or_else(|| format!("the reference gave no output `{}`", t.name))?;
            checks.push((t.name.clone(), data::check_with_poison(out, dt, r, tol, &self.poisons[i])));
        }
        Ok(checks)
    }
}

/// The bytes one emulated buffer may have: emulation is for small workloads.
const MAX_BUFFER: usize = 1 << 30;

fn env_of(w: &Workload, config: &BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    let mut env: BTreeMap<String, i64> = w.clone();
    env.extend(config.iter().map(|(a, b)| (a.clone(), *b)));
    env
}

/// Compiles a kernel's source for a configuration to PTX text.
pub type PtxOf<'a> = dyn Fn(&BTreeMap<String, i64>) -> Result<String, String> + 'a;

/// Run kernel `k` of the task's `cuda` back-end (or a whole CUDA unit of its `mlx-cuda` one) in
/// `config` on workload `w` through the PTX interpreter. `ptx` compiles the kernel's source for a configuration (the build's defines) to
/// PTX text (NVRTC's output for a virtual architecture). The kernel's launches run in order, its
/// arguments as the CUDA back-end passes them: inputs, outputs, scratch, then every axis as a
/// 64-bit integer. `Ok(None)`: the kernel does not admit the workload in this configuration.
#[allow(clippy::too_many_arguments)]
pub fn emulate_cuda_kernel(
    task: &Task,
    backend: Backend,
    k: &KernelSpec,
    config: &BTreeMap<String, i64>,
    w: &Workload,
    seed: u64,
    limit: Duration,
    ptx: &PtxOf<'_>,
) -> Result<Option<EmuOutcome>, String> {
    let Some(config) = k.specialise(config, w) else {
        return Ok(None);
    };
    builtin_reference(task)?;
    let env = env_of(w, &config);
    let text = ptx(&config)?;
    let module = ksearch_ptx::load(&text).map_err(|e| format!("PTX: {e}"))?;
    // A kernel that executes mbarrier or wgmma instructions runs twice on the same inputs:
    // asynchronous results landing at issue (warps in order), then as late as they may (warps in
    // reverse), since each misses a different missing wait. Other kernels, and calls whose path
    // executes none (a kernel's short-call path), run once, the order by the seed's parity.
    let might = text.contains("mbarrier.") || text.contains("wgmma.");
    let mut modes: Vec<bool> = if might { vec![false] } else { vec![seed % 2 == 1] };
    let mut both = false;
    let mut passed = None;
    while let Some(late) = modes.pop() {
        let (checks, asynchronous) = emulate_cuda_once(task, backend, k, w, seed, limit, &module, &env, late).map_err(|e| {
            if both && late && !e.starts_with("PTX: ") {
                format!("with late results: {e}")
            } else {
                e
            }
        })?;
        if might && !late && asynchronous > 0 {
            both = true;
            modes.push(true);
        }
        let note = both.then(|| {
            if late {
                "with results landing late and warps in reverse"
            } else {
                "with results landing at issue"
            }
            .to_string()
        });
        let o = EmuOutcome {
            config: config.clone(),
            checks,
            note,
        };
        if !o.passed() {
            return Ok(Some(o));
        }
        passed = Some(o);
    }
    let mut o = passed.expect("at least one mode");
    if both {
        o.note = Some("with results landing at issue and late".into());
    }
    Ok(Some(o))
}

/// One run of `emulate_cuda_kernel`: the launches on fresh inputs of `seed`, asynchronous
/// results landing late and warps in reverse order where `late`.
#[allow(clippy::too_many_arguments)]
fn emulate_cuda_once(
    task: &Task,
    backend: Backend,
    k: &KernelSpec,
    w: &Workload,
    seed: u64,
    limit: Duration,
    module: &ksearch_ptx::Module,
    env: &BTreeMap<String, i64>,
    late: bool,
) -> Result<(Vec<(String, Check)>, u64), String> {
    let reference = builtin_reference(task)?;
    let mut run = Prepared::new(task, backend, w, seed)?;
    run.add_scratch(k, env, seed)?;
    let nbuf = run.buffers.len();
    let axes = task
        .axes
        .iter()
        .map(|a| ksearch_ptx::Arg::Word(w.get(a).copied().unwrap_or(0) as u64));
    // The CUDA back-end passes every buffer (inputs, outputs, scratch) to every launch, then the
    // axes as 64-bit integers; MLX passes a launch its own inputs and outputs by name, then the
    // axes as 32-bit ints (`-DKS_AXIS=int`; a parameter takes the low bytes of its word).
    let names: Vec<String> = run.buffers.iter().map(|b| b.name.clone()).collect();
    let args_of = |l: &ksearch_core::task::LaunchSpec| -> Result<Vec<ksearch_ptx::Arg>, String> {
        if backend != Backend::MlxCuda {
            return Ok((0..nbuf).map(ksearch_ptx::Arg::Buffer).chain(axes.clone()).collect());
        }
        let io = ksearch_core::mlx::launch_io(task, backend, k);
        let me = io
            .iter()
            .find(|x| x.entry == l.entry)
            .ok_or_else(|| format!("launch `{}` has no inputs and outputs", l.entry))?;
        let mut v = Vec::new();
        for (n, _) in me.inputs.iter().chain(&me.outputs) {
            let i = names
                .iter()
                .position(|b| b == n)
                .ok_or_else(|| format!("launch `{}` names no tensor or scratch `{n}`", l.entry))?;
            v.push(ksearch_ptx::Arg::Buffer(i));
        }
        v.extend(axes.clone());
        Ok(v)
    };
    let eval = |e: &str, what: &str| -> Result<u32, String> {
        let v = expr::eval_i64(e, env).map_err(|err| format!("{what} `{e}`: {err}"))?;
        u32::try_from(v).map_err(|_| format!("{what} `{e}` = {v}"))
    };
    let deadline = std::time::Instant::now() + limit;
    let mut asynchronous = 0u64;
    let mut bufs: Vec<Vec<u8>> = run.buffers.iter_mut().map(|b| std::mem::take(&mut b.bytes)).collect();
    for l in &k.launches {
        let b = |i: usize| eval(&l.block[i], &format!("launch `{}` block", l.entry));
        let block = [b(0)?, b(1)?, b(2)?];
        // MLX's grid counts threads (as its worker launches a unit); the CUDA back-end's, blocks.
        let g = |i: usize| -> Result<u32, String> {
            let v = eval(&l.grid[i], &format!("launch `{}` grid", l.entry))?;
            if backend != Backend::MlxCuda {
                return Ok(v);
            }
            if block[i] == 0 {
                return Err(format!("launch `{}` block `{}` = 0", l.entry, l.block[i]));
            }
            Ok(v.div_ceil(block[i]))
        };
        let launch = ksearch_ptx::Launch {
            entry: l.entry.clone(),
            grid: [g(0)?, g(1)?, g(2)?],
            block,
            dynamic_shared: eval(&l.shared, &format!("launch `{}` shared", l.entry))?,
        };
        let lim = ksearch_ptx::Limits {
            deadline: Some(deadline),
            reverse: late,
            late_copies: late,
            ..Default::default()
        };
        let args = args_of(l)?;
        let stats = ksearch_ptx::run(module, &launch, &args, &mut bufs, &lim).map_err(|mut e| {
            // A thread reached an instruction outside the interpreted subset: a limit of the
            // interpreter on this path (`PTX: line N ...`, as a refusal at load reads), not a fault.
            if let Some(i) = e.find("unsupported instruction `") {
                let at = e[..i].find("line ").unwrap_or(i);
                return format!("PTX: {}", &e[at..]);
            }
            // Buffers by their tensors' names.
            for (i, b) in run.buffers.iter().enumerate().rev() {
                e = e.replace(&format!("of buffer {i},"), &format!("of `{}`,", b.name));
            }
            format!("launch `{}`: {e}", l.entry)
        })?;
        asynchronous += stats.asynchronous;
    }
    for (b, bytes) in run.buffers.iter_mut().zip(bufs) {
        b.bytes = bytes;
    }
    Ok((run.check(task, w, reference)?, asynchronous))
}

fn builtin_reference(task: &Task) -> Result<reference::RefFn, String> {
    let name = task
        .reference
        .name()
        .ok_or_else(|| format!("task `{}`: the executor checks against built-in references only", task.name))?;
    reference::lookup(name).ok_or_else(|| format!("unknown reference `{name}`"))
}

/// Run a whole Metal file (one `[[kernel]]` function) on workload `w` of `task`: its pointer
/// parameters bound to the task's tensors of the same names, its `constant T&` parameters to the
/// axes of the same names; `grid` (threads) and `threadgroup` are expressions over the axes.
pub fn emulate_file(
    task: &Task,
    src: &str,
    grid: &[String; 3],
    threadgroup: &[String; 3],
    w: &Workload,
    seed: u64,
    limit: Duration,
) -> Result<EmuOutcome, String> {
    let reference = builtin_reference(task)?;
    let eval = |e: &str, what: &str| -> Result<u32, String> {
        let v = expr::eval_i64(e, w).map_err(|err| format!("{what} `{e}`: {err}"))?;
        u32::try_from(v)
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| format!("{what} `{e}` = {v}"))
    };
    let launch = EmuLaunch {
        entry: "kernel".into(),
        grid: [eval(&grid[0], "grid")?, eval(&grid[1], "grid")?, eval(&grid[2], "grid")?],
        threadgroup: [
            eval(&threadgroup[0], "threadgroup")?,
            eval(&threadgroup[1], "threadgroup")?,
            eval(&threadgroup[2], "threadgroup")?,
        ],
    };
    let mut run = Prepared::new(task, Backend::MlxMetal, w, seed)?;
    metal_run_file(src, &launch, &mut run.buffers, w, limit)?;
    Ok(EmuOutcome {
        config: BTreeMap::new(),
        checks: run.check(task, w, reference)?,
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_no_workload_admits_alone_takes_the_first_admitted_configuration_with_it() {
        // A = 1 needs B = 3; 18 more tunables of four values each make a product of 6 * 4^18
        // configurations, which the search for that configuration walks rather than holds.
        let mut text = String::from("file = \"k.cu\"\nconstraints = [\"A >= 2 || B == 3\"]\n");
        text.push_str("[[tunables]]\nname = \"A\"\nvalues = [1, 2]\ndefault = 2\n");
        for i in 0..18 {
            text.push_str(&format!(
                "[[tunables]]\nname = \"F{i:02}\"\nvalues = [5, 6, 7, 8]\ndefault = 6\n"
            ));
        }
        text.push_str("[[tunables]]\nname = \"B\"\nvalues = [1, 2, 3]\ndefault = 1\n");
        let k: KernelSpec = toml::from_str(&text).unwrap();
        let w: Workload = [("N".to_string(), 1)].into_iter().collect();
        let configs = emulate_configs(&k, &[w]);
        let with_a1: Vec<_> = configs.iter().filter(|c| c["A"] == 1).collect();
        assert_eq!(with_a1.len(), 1, "{configs:?}");
        let c = with_a1[0];
        assert_eq!(c["B"], 3, "{c:?}");
        // The first such configuration in the product's order: every other tunable at its first value.
        assert!((0..18).all(|i| c[&format!("F{i:02}")] == 5), "{c:?}");
        // The defaults, then each other value alone: 1 + 1 (A) + 18 * 3 (F) + 2 (B).
        assert_eq!(configs.len(), 58, "{configs:?}");
    }
}
