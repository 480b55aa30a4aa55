//! `ksearch translate`: an LLM carries a task's CUDA kernel (an `mlx-cuda` body or a `cuda`
//! kernel) into an MLX Metal body, with the translation layer's knowledge in the prompt, and the
//! result is checked before it is kept: the Metal rules, Linux's syntax check and the Metal
//! executor on the task's `emulate` workloads, every output element against the reference, in the
//! default configuration and with each other tunable value. What fails goes back to the model for
//! another round. Correctness only: the translation is timed on a Mac (`ksearch run --backend mlx`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ksearch_core::task::{KernelSpec, Task};
use ksearch_core::{Backend, Lang};
use ksearch_kb::{CheckOptions, ContextLevel, Kb, SourceLang, emulate_configs, emulate_kernel, emulate_workloads};
use ksearch_llm::{ChatRequest, LlmClient, Message, OpenAiCompatible, extract_code};

pub struct TranslateArgs {
    pub task: String,
    pub kernel: String,
    pub from: Option<String>,
    pub like: Option<String>,
    pub out: PathBuf,
    pub rounds: u32,
    pub timeout: u64,
}

/// The source kernel and the Metal kernel spec (launches, tunables, constraints, scratch) the
/// translation must fit.
fn pick<'a>(task: &'a Task, a: &TranslateArgs) -> Result<(Backend, &'a KernelSpec, KernelSpec)> {
    let find = |b: Backend, name: &str| -> Option<&'a KernelSpec> {
        let spec = task.backend(b)?;
        if name == "seed" {
            return Some(&spec.seed);
        }
        spec.kernels.iter().find(|k| k.name == name)
    };
    let from = match a.from.as_deref() {
        Some(f) => f.parse::<Backend>().map_err(|e| anyhow::anyhow!("--from: {e}"))?,
        None if find(Backend::MlxCuda, &a.kernel).is_some() => Backend::MlxCuda,
        None => Backend::Cuda,
    };
    if !matches!(from, Backend::MlxCuda | Backend::Cuda) {
        bail!("--from {}: translate takes a CUDA kernel (mlx-cuda or cuda)", from.name());
    }
    let src = find(from, &a.kernel).with_context(|| match a.from {
        Some(_) => format!("task `{}` has no {} kernel `{}`", task.name, from.name(), a.kernel),
        None => format!("task `{}` has no mlx-cuda or cuda kernel `{}`", task.name, a.kernel),
    })?;
    if src.options.get("form").and_then(|v| v.as_str()) == Some("cuda") {
        bail!(
            "{} kernel `{}` is a whole CUDA translation unit (sm_90a): translate an MLX body or a cuda kernel",
            from.name(),
            a.kernel
        );
    }
    // The Metal launches: --like, else the Metal kernel of the same name, else (an mlx-cuda body,
    // whose grid counts threads as Metal's does) the source's own when it asks no dynamic shared memory.
    let like = a.like.as_deref().unwrap_or(&a.kernel);
    let target = match find(Backend::MlxMetal, like) {
        Some(k) => k.clone(),
        None if a.like.is_some() => bail!("task `{}` has no mlx-metal kernel `{like}` (--like)", task.name),
        None if from == Backend::MlxCuda && src.launches.iter().all(|l| l.shared.trim() == "0") => src.clone(),
        None => bail!(
            "no launch geometry for a Metal `{}`: name an mlx-metal kernel of task `{}` whose launches fit with --like",
            a.kernel,
            task.name
        ),
    };
    Ok((from, src, target))
}

fn prompt(task: &Task, kb: &Kb, from: Backend, src: &KernelSpec, target: &KernelSpec) -> Result<Vec<Message>> {
    let profile = kb
        .profile("generic-apple")
        .context("the knowledge base has no generic-apple profile")?;
    let context = ksearch_kb::render_context(kb, ContextLevel::Full, Lang::MlxMetal, profile, Some(task));
    let io = ksearch_core::mlx::launch_io(task, Backend::MlxMetal, target);
    let mut iface = String::new();
    for l in &io {
        let spec = target.launches.iter().find(|x| x.entry == l.entry);
        let grid: Vec<&str> = spec.map(|x| x.grid.iter().map(String::as_str).collect()).unwrap_or_default();
        let block: Vec<&str> = spec.map(|x| x.block.iter().map(String::as_str).collect()).unwrap_or_default();
        let list = |v: &[(String, String)]| v.iter().map(|(n, t)| format!("{n} ({t})")).collect::<Vec<_>>().join(", ");
        iface.push_str(&format!(
            "- launch `{}`: grid ({}) threads, threadgroup ({}); reads {}; writes {}\n",
            l.entry,
            grid.join(", "),
            block.join(", "),
            list(&l.inputs),
            list(&l.outputs)
        ));
    }
    let tunables: Vec<String> = target
        .tunables
        .iter()
        .map(|t| format!("{} in {:?} (default {})", t.name, t.values, t.default_value()))
        .collect();
    let scratch: Vec<String> = target
        .scratch
        .iter()
        .map(|s| format!("{} ({} bytes)", s.name, s.bytes))
        .collect();
    let sections = if io.len() > 1 || ksearch_core::mlx::has_sections(&src.source) {
        format!(
            "The file has one section per launch, each starting with a `// @kernel NAME` line ({}); text before the first is a header for helper functions.",
            io.iter().map(|l| l.entry.as_str()).collect::<Vec<_>>().join(", ")
        )
    } else {
        "The file is the body of the one launch (no `// @kernel` line needed); helper functions may go in a header before a `// @kernel NAME` line.".to_string()
    };
    let lang = if from == Backend::Cuda {
        "CUDA kernel"
    } else {
        "MLX CUDA-dialect body"
    };
    let system = "You translate GPU kernels for ksearch from CUDA to MLX's Metal dialect (mx.fast.metal_kernel bodies) for Apple GPUs. \
                  Keep the algorithm and its numerics; use Metal's own primitives (simd_shuffle_xor, simd_sum, threadgroup_barrier, \
                  threadgroup arrays, fast::exp2 ...). Reply with the whole body in exactly one ```metal fenced block.";
    let user = format!(
        "Task `{name}`: {desc}\n\nTranslate the {lang} `{kernel}` below into an MLX Metal-dialect body computing the same outputs.\n\n\
         ## The Metal body's interface (as MLX wraps it)\n\
         - Inputs are `const device T*` named as below, each with `NAME_shape` (int*), `NAME_strides` (int64_t*) and `NAME_ndim`; \
           outputs are `device T*`; f16 is `half`.\n\
         - Compile-time int constants: the axes {axes}; the tunables {tun}; the task's constants as `KS_<NAME>` floats.\n\
         - Thread positions by attribute name: thread_position_in_grid, threads_per_grid, thread_position_in_threadgroup, \
           threads_per_threadgroup, threadgroup_position_in_grid, threadgroups_per_grid (uint3); thread_index_in_threadgroup, \
           thread_index_in_simdgroup, simdgroup_index_in_threadgroup, simdgroups_per_threadgroup, threads_per_simdgroup (uint).\n\
         - Grids count threads (MLX's dispatchThreads); a threadgroup at the grid's edge may be smaller.\n\
         {iface}{scr}\
         - Threadgroup memory is declared in the body (`threadgroup float buf[N];`), at most 32 KB in all.\n\
         - {sections}\n\
         - Constraints the configurations meet: {cons}\n\n\
         ## Translation-layer knowledge (Metal)\n{context}\n\n\
         ## The {lang} to translate\n```cuda\n{source}\n```\n",
        name = task.name,
        desc = task.description,
        kernel = src.name_or_seed(),
        axes = task.axes.join(", "),
        tun = if tunables.is_empty() {
            "(none)".to_string()
        } else {
            tunables.join("; ")
        },
        scr = if scratch.is_empty() {
            String::new()
        } else {
            format!("- Scratch buffers (f32 unless stated): {}\n", scratch.join(", "))
        },
        cons = if target.constraints.is_empty() {
            "(none)".to_string()
        } else {
            target.constraints.join("; ")
        },
        source = src.source.trim_end(),
    );
    Ok(vec![Message::system(system), Message::user(user)])
}

/// What a model's body may not do before it is even compiled: include anything but Metal's own
/// headers (a diagnostic would quote the file back to the model) or use inline assembly (which
/// could embed a file). Metal has neither.
fn foreign(body: &str) -> Option<String> {
    for line in body.lines() {
        let t = line.trim_start();
        let Some(rest) = t.strip_prefix('#') else { continue };
        let Some(target) = rest.trim_start().strip_prefix("include") else {
            continue;
        };
        let target = target.trim();
        let metal = target
            .strip_prefix("<metal_")
            .and_then(|x| x.strip_suffix('>'))
            .is_some_and(|x| !x.is_empty() && x.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        if !metal {
            return Some(format!(
                "`#include {target}`: a Metal body includes Metal's own headers (<metal_stdlib>) only"
            ));
        }
    }
    let mut words = body.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    if words.any(|w| matches!(w, "asm" | "__asm" | "__asm__")) {
        return Some("inline assembly (`asm`): Metal has none".into());
    }
    // GNU attributes (a constructor or initialisation priority would run code before the
    // executor confines its process)
    if body.contains("__attribute__") || body.contains("gnu::") || body.contains("[[using") {
        return Some("GNU attributes (`__attribute__`, `[[gnu::…]]`): Metal has none".into());
    }
    None
}

/// What is wrong with a translation, for the model's next round; None when it passes.
fn verify(task: &Task, kb: &Kb, target: &KernelSpec, body: &str, timeout: u64) -> Result<Option<String>, String> {
    if let Some(why) = foreign(body) {
        return Ok(Some(why));
    }
    let profile = kb
        .profile("generic-apple")
        .ok_or("the knowledge base has no generic-apple profile")?;
    let v = ksearch_kb::check(kb, body, SourceLang::MlxMetal, profile, &CheckOptions::default());
    if ksearch_kb::rejected(&v) {
        let lines: Vec<String> = v.iter().map(|x| x.to_string()).collect();
        return Ok(Some(format!(
            "the translation layer's rules rejected it:\n{}",
            lines.join("\n")
        )));
    }
    let mut k = target.clone();
    k.source = body.to_string();
    let workloads = emulate_workloads(task, ksearch_core::Backend::MlxMetal);
    let mut failures = Vec::new();
    let mut ran = 0;
    for c in emulate_configs(&k, &workloads) {
        for (i, w) in workloads.iter().enumerate() {
            let show = |m: &std::collections::BTreeMap<String, i64>| {
                m.iter().map(|(a, b)| format!("{a}={b}")).collect::<Vec<_>>().join(",")
            };
            match emulate_kernel(task, &k, &c, w, 0x7a11 + i as u64, std::time::Duration::from_secs(timeout)) {
                Ok(None) => {}
                Ok(Some(o)) => {
                    ran += 1;
                    if !o.passed() {
                        failures.push(format!("[{}] on {}: {}", show(&o.config), show(w), o.summary()));
                    }
                }
                Err(e) if e.contains("rejected the source") => {
                    let diag: Vec<&str> = e.lines().take(30).collect();
                    return Ok(Some(format!("it does not compile:\n{}", diag.join("\n"))));
                }
                Err(e) => {
                    ran += 1;
                    failures.push(format!(
                        "[{}] on {}: {}",
                        show(&c),
                        show(w),
                        e.lines().next().unwrap_or_default()
                    ));
                }
            }
            if failures.len() >= 4 {
                break;
            }
        }
        if failures.len() >= 4 {
            break;
        }
    }
    if ran == 0 && failures.is_empty() {
        return Err("no configuration of the kernel admits any workload to emulate".into());
    }
    Ok((!failures.is_empty()).then(|| {
        format!(
            "run on the task's workloads (every output element against the reference), it failed:\n{}",
            failures.join("\n")
        )
    }))
}

pub fn run(tasks_dir: &Path, kb: &Kb, llm: Option<serde_json::Value>, a: &TranslateArgs) -> Result<i32> {
    let task = ksearch_core::task::find(tasks_dir, &a.task)?;
    if task.backend(Backend::MlxMetal).is_none() {
        bail!(
            "task `{}` has no mlx-metal back-end (its workloads and tolerances for Metal)",
            task.name
        );
    }
    let (from, src, target) = pick(&task, a)?;
    let settings = ksearch_search::llm_planner::settings(llm.as_ref())?;
    let client = OpenAiCompatible::new(settings.coder.clone()).map_err(|e| anyhow::anyhow!("LLM: {e}"))?;
    let mut messages = prompt(&task, kb, from, src, &target)?;
    // Nothing that goes back to the model, or to the terminal, carries a secret of the
    // environment (the executor's own environment is cleared besides).
    let scrub = ksearch_eval::scrub::Scrubber::from_env(&ksearch_search::llm_planner::settings_keys(llm.as_ref()));
    let rejected = a.out.with_extension("rejected.metal");
    for round in 1..=a.rounds.max(1) {
        let reply = client
            .chat(&ChatRequest::new(messages.clone()))
            .map_err(|e| anyhow::anyhow!("LLM call (round {round}): {e}"))?;
        let feedback = match extract_code(&reply.content, Some("metal")) {
            Err(e) => format!("no Metal body could be read from the reply ({e})"),
            Ok(body) => match verify(&task, kb, &target, &body, a.timeout) {
                Err(e) => bail!("{e}"),
                Ok(None) => {
                    std::fs::write(&a.out, format!("{}\n", body.trim_end())).with_context(|| a.out.display().to_string())?;
                    println!(
                        "translated {} `{}` of task `{}` to Metal in {round} round(s): {} (rules, syntax and every output element on the executor's workloads checked; not timed)",
                        from.name(),
                        src.name_or_seed(),
                        task.name,
                        a.out.display()
                    );
                    return Ok(0);
                }
                Ok(Some(why)) => {
                    std::fs::write(&rejected, format!("{}\n", body.trim_end()))
                        .with_context(|| rejected.display().to_string())?;
                    scrub.text(&why)
                }
            },
        };
        println!("round {round}: {}", feedback.lines().next().unwrap_or_default());
        messages.push(Message::assistant(reply.content));
        messages.push(Message::user(format!(
            "The body failed: {feedback}\n\nReply with the whole corrected body in one ```metal block."
        )));
    }
    println!(
        "not translated: no verified body after {} round(s); the last attempt is in {}",
        a.rounds.max(1),
        rejected.display()
    );
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::foreign;

    #[test]
    fn only_metal_headers_and_no_assembly_reach_the_compiler() {
        assert_eq!(foreign("#include <metal_stdlib>\nusing namespace metal;\ny[0] = 1;\n"), None);
        assert_eq!(foreign("  #  include <metal_simdgroup>\nconst float asmx = 1.0f;\n"), None);
        for bad in [
            "#include \"/home/u/.ssh/id_rsa\"\n",
            "#include </etc/passwd>\n",
            "#define F \"x\"\n#include F\n",
            "# include <cstdlib>\n",
        ] {
            let why = foreign(bad).unwrap_or_default();
            assert!(why.contains("Metal's own headers"), "{bad}: {why}");
        }
        assert!(
            foreign("asm(\".incbin \\\"/etc/passwd\\\"\");\n")
                .unwrap_or_default()
                .contains("assembly")
        );
        assert!(foreign("__asm__ volatile(\"\");\n").is_some());
        assert!(
            foreign("__attribute__((constructor(1))) void f() {}\n")
                .unwrap_or_default()
                .contains("GNU attributes")
        );
        assert!(foreign("[[gnu::constructor]] void f() {}\n").is_some());
        assert_eq!(foreign("[[kernel]] void k(uint i [[thread_position_in_grid]]) {}\n"), None);
    }
}
