//! Prompt context for the LLM planner and coder, in three levels for ablation:
//! `none` (nothing), `generic` (hardware figures) and `full` (figures, rules, primitive map,
//! patterns and the task's CUDA knowledge-base kernels). Rendered from `kb/templates/*.j2`.

use minijinja::{Environment, Value, context};
use std::collections::BTreeMap;
use std::str::FromStr;

use ksearch_core::backend::Dialect;
use ksearch_core::{Lang, Task};

use crate::{Kb, Profile, SourceLang};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextLevel {
    None,
    Generic,
    Full,
}

impl FromStr for ContextLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<ContextLevel, String> {
        match s {
            "none" => Ok(ContextLevel::None),
            "generic" => Ok(ContextLevel::Generic),
            "full" => Ok(ContextLevel::Full),
            _ => Err(format!("unknown context level `{s}` (expected none, generic or full)")),
        }
    }
}

fn env(kb: &Kb) -> Result<Environment<'_>, String> {
    let mut env = Environment::new();
    for (name, text) in &kb.templates {
        env.add_template(name, text).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(env)
}

pub(crate) fn compile_templates(kb: &Kb) -> Result<(), String> {
    env(kb).map(|_| ())
}

struct KernelCtx {
    path: String,
    name: String,
    pattern: String,
    description: String,
    source: String,
}

fn task_cuda_kernels(task: &Task) -> Vec<KernelCtx> {
    let mut v = Vec::new();
    for k in task.kernels(ksearch_core::Backend::Cuda) {
        let source = if k.source.is_empty() {
            std::fs::read_to_string(task.dir.join(&k.file)).unwrap_or_default()
        } else {
            k.source.clone()
        };
        if source.trim().is_empty() {
            continue;
        }
        v.push(KernelCtx {
            path: format!("tasks/{}/{}", task.name, k.file),
            name: k.name.clone(),
            pattern: k.pattern.clone().unwrap_or_default(),
            description: k.description.clone(),
            source: source.trim_end().to_string(),
        });
    }
    v
}

/// The context for a target. `none` is the empty string.
pub fn render_context(kb: &Kb, level: ContextLevel, lang: Lang, profile: &Profile, task: Option<&Task>) -> String {
    if level == ContextLevel::None {
        return String::new();
    }
    let sl = SourceLang::from(lang);
    let metal = match sl.dialect() {
        Dialect::Metal => true,
        Dialect::Cuda | Dialect::Cpp => false,
    } || profile.vendor == "apple";
    let apple = profile.vendor == "apple";
    let ridge = profile
        .peak("f32")
        .map(|p| format!("{:.1}", p * 1e12 / (profile.mem_bandwidth_gbs * 1e9)))
        .unwrap_or_else(|| "n/a".into());
    let rules: Vec<Value> = kb
        .rules
        .iter()
        .filter(|r| r.applies(sl, &profile.vendor))
        .map(|r| {
            context! { id => r.id.clone(), severity => if r.severity == crate::Severity::Error { "error" } else { "warning" }, summary => r.summary.clone() }
        })
        .collect();
    let mut patterns: Vec<&crate::Pattern> = kb.patterns.iter().collect();
    patterns.sort_by(|a, b| b.prior.total_cmp(&a.prior).then(a.name.cmp(&b.name)));
    let patterns: Vec<Value> = patterns
        .iter()
        .map(|p| {
            context! {
                name => p.name.clone(), title => p.title.clone(), when => p.when.clone(), cuda => p.cuda.clone(), metal => p.metal.clone(),
                prior => p.prior, difficulty => p.difficulty, bandwidth => p.bandwidth,
                registers => p.registers, fit => p.hw_fit_for(&profile.vendor),
            }
        })
        .collect();
    let kernels: Vec<Value> = task
        .map(task_cuda_kernels)
        .unwrap_or_default()
        .into_iter()
        .map(|k| {
            context! { path => k.path.clone(), name => k.name.clone(), pattern => k.pattern.clone(), description => k.description.clone(), source => k.source.clone() }
        })
        .collect();
    let ctx = context! {
        p => profile_value(profile),
        lang => sl.name(),
        metal => metal,
        body => sl.is_body(),
        ridge => ridge,
        exp_rate => profile.exp_per_s.map(|r| format!("{r:.2e}")).unwrap_or_default(),
        shared_name => if apple { "threadgroup" } else if profile.vendor == "nvidia" { "shared" } else { "block-shared" },
        block_name => if apple { "threadgroup" } else { "block" },
        simd_name => if apple { "SIMD-group" } else if profile.vendor == "nvidia" { "warp" } else { "SIMD" },
        unit_name => if apple { "GPU cores" } else { "SMs" },
        unit_one => if apple { "core" } else { "SM" },
        cache_name => if apple { "system-level cache" } else { "L2 cache" },
        rules => rules,
        primitives => primitives_value(kb),
        patterns => patterns,
        kernels => kernels,
    };
    let name = if level == ContextLevel::Generic {
        "generic.md.j2"
    } else {
        "full.md.j2"
    };
    let rendered = env(kb).and_then(|e| {
        e.get_template(name)
            .and_then(|t| t.render(ctx))
            .map_err(|e| format!("{name}: {e}"))
    });
    match rendered {
        Ok(s) => squeeze_blank_lines(&s),
        Err(e) => format!("(knowledge-base context unavailable: {e})\n"),
    }
}

/// Collapse runs of blank lines (left by block tags) into one.
fn squeeze_blank_lines(s: &str) -> String {
    let mut out = String::new();
    let mut blank = 0;
    for l in s.trim().lines() {
        let l = l.trim_end();
        if l.is_empty() {
            blank += 1;
            if blank > 1 {
                continue;
            }
        } else {
            blank = 0;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

fn num(x: f64) -> Value {
    Value::from(x)
}

/// The profile as a template value (built by hand so it renders the same with any minijinja).
fn profile_value(p: &Profile) -> Value {
    let mut m: BTreeMap<String, Value> = BTreeMap::new();
    for (k, v) in [
        ("name", &p.name),
        ("display_name", &p.display_name),
        ("vendor", &p.vendor),
        ("arch", &p.arch),
        ("notes", &p.notes),
    ] {
        m.insert(k.into(), Value::from(v.clone()));
    }
    m.insert("mem_bandwidth_gbs".into(), num(p.mem_bandwidth_gbs));
    m.insert("shared_per_block_kb".into(), num(p.shared_per_block_kb));
    m.insert("max_threads_per_block".into(), Value::from(p.max_threads_per_block));
    m.insert("simd_width".into(), Value::from(p.simd_width));
    for (k, v) in [
        ("shared_optin_kb", p.shared_optin_kb),
        ("clock_ghz", p.clock_ghz),
        ("register_file_kb", p.register_file_kb),
        ("l2_mb", p.l2_mb),
        ("exp_per_s", p.exp_per_s),
        ("memory_gb", p.memory_gb),
    ] {
        if let Some(v) = v {
            m.insert(k.into(), num(v));
        }
    }
    if let Some(c) = p.compute_units {
        m.insert("compute_units".into(), Value::from(c));
    }
    let peaks: BTreeMap<String, Value> = p.peak_tflops.iter().map(|(k, v)| (k.clone(), num(*v))).collect();
    m.insert("peak_tflops".into(), Value::from(peaks));
    Value::from(m)
}

fn primitives_value(kb: &Kb) -> Value {
    let v: Vec<Value> = kb
        .primitives
        .iter()
        .map(|p| {
            let mut m: BTreeMap<String, Value> = BTreeMap::new();
            m.insert("id".into(), Value::from(p.id.clone()));
            m.insert(
                "cuda".into(),
                Value::from(p.cuda.iter().cloned().map(Value::from).collect::<Vec<Value>>()),
            );
            m.insert("metal".into(), Value::from(p.metal.clone()));
            m.insert("note".into(), Value::from(p.note.clone()));
            Value::from(m)
        })
        .collect();
    Value::from(v)
}
