//! `ksearch export <run> --torch`: a run's best CUDA kernel as a self-contained Python module for
//! PyTorch. The module is a docstring, one generated line (`SPEC`: the task, the kernel source,
//! its constraints, the dispatch table of builds per shape class with their launches, NVRTC
//! options and what the run measured) and the body `python/ksearch_torch/export_module.py`,
//! which is compiled into this binary.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

use ksearch_core::protocol::{Candidate, Lang};
use ksearch_core::task::{KernelSpec, Task};
use ksearch_core::tree::Tree;
use ksearch_store::Store;

use ksearch_search::{Report, RunConfig};

/// The module's body (its tests live in python/tests/test_torch_export.py).
const BODY: &str = include_str!("../../../python/ksearch_torch/export_module.py");
/// NVRTC through ctypes, shared with the MLX worker and `export --mlx`; written before the body.
const NVRTC: &str = include_str!("../../../python/ksearch_nvrtc.py");
/// Builds enumerated from the shape-tied tunables' values; beyond this many, only the builds
/// the run measured and the candidate's own are exported.
const MAX_BUILDS: usize = 64;
/// Evaluations whose workload times describe the candidate itself.
const MEASURING: [&str; 5] = ["search", "retime", "final", "heldout", "heldout-again"];

/// The drop-in a task gets, by its reference and tensor layout.
fn peer_of(task: &Task) -> Option<(&'static str, &'static str)> {
    // A task that brings its own reference file has no drop-in: it gets the generic function.
    let reference = task.reference.name().unwrap_or_default();
    let sig = |ts: &[ksearch_core::task::TensorSpec]| -> Vec<(String, Vec<String>)> {
        ts.iter().map(|t| (t.name.clone(), t.shape.clone())).collect()
    };
    let own = |v: &[(&str, &[&str])]| -> Vec<(String, Vec<String>)> {
        v.iter()
            .map(|(n, s)| (n.to_string(), s.iter().map(|x| x.to_string()).collect()))
            .collect()
    };
    let (ins, outs) = (sig(&task.inputs), sig(&task.outputs));
    match reference {
        "attention"
            if ins
                == own(&[
                    ("q", &["B", "H", "L", "D"]),
                    ("k", &["B", "Hkv", "L", "D"]),
                    ("v", &["B", "Hkv", "L", "D"]),
                ])
                && outs == own(&[("o", &["B", "H", "L", "D"])])
                && task.axes.iter().any(|a| a == "causal") =>
        {
            Some(("attention", "torch.nn.functional.scaled_dot_product_attention"))
        }
        "mamba_scan"
            if ins
                == own(&[
                    ("u", &["batch", "L", "D"]),
                    ("delta", &["batch", "L", "D"]),
                    ("A", &["D", "N"]),
                    ("Bm", &["batch", "L", "N"]),
                    ("Cm", &["batch", "L", "N"]),
                    ("Dv", &["D"]),
                ])
                && outs == own(&[("y", &["batch", "L", "D"]), ("state", &["batch", "D", "N"])]) =>
        {
            Some(("mamba_scan", "mamba_ssm's selective_scan_fn"))
        }
        _ => None,
    }
}

/// The dispatch-table key of a build: its shape-tied tunables (`HD=128`), as the module computes it.
fn class_of(spec: &[(String, Vec<i64>)], defines: &BTreeMap<String, i64>) -> String {
    let parts: Vec<String> = spec
        .iter()
        .filter_map(|(n, _)| defines.get(n).map(|v| format!("{n}={v}")))
        .collect();
    if parts.is_empty() { "default".into() } else { parts.join(",") }
}

/// Every combination of the shape-tied tunables' values applied to `free` (at most `MAX_BUILDS`).
fn enumerate_builds(spec: &[(String, Vec<i64>)], free: &BTreeMap<String, i64>) -> Vec<BTreeMap<String, i64>> {
    let total: usize = spec.iter().map(|(_, v)| v.len().max(1)).product();
    if spec.is_empty() || total > MAX_BUILDS {
        return vec![free.clone()];
    }
    let mut out = Vec::new();
    let mut idx = vec![0usize; spec.len()];
    loop {
        let mut c = free.clone();
        for ((n, vals), i) in spec.iter().zip(&idx) {
            c.insert(n.clone(), vals[*i]);
        }
        out.push(c);
        let mut j = 0;
        loop {
            if j == idx.len() {
                return out;
            }
            idx[j] += 1;
            if idx[j] < spec[j].1.len() {
                break;
            }
            idx[j] = 0;
            j += 1;
        }
    }
}

/// A JSON value as a Python expression: `_json.loads("…")` (JSON string escapes are valid
/// Python string escapes).
fn py_json(v: &Value) -> Result<String> {
    let text = serde_json::to_string(v)?;
    Ok(format!("_json.loads({})", serde_json::to_string(&text)?))
}

/// Text safe inside a Python docstring.
fn doc_text(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control())
        .collect::<String>()
        .replace('\\', "/")
        .replace("\"\"\"", "'''")
}

pub fn export(store: &Store, run_id: i64, output: &Path) -> Result<i32> {
    let row = store.run(run_id)?;
    if row.backend != ksearch_core::Backend::Cuda {
        bail!(
            "run {run_id} searched the {} back-end; --torch exports runs of the cuda back-end (ksearch run {} --backend cuda, on a machine with an NVIDIA GPU)",
            row.backend,
            row.task
        );
    }
    let cfg: RunConfig = serde_json::from_value(row.config.clone()).context("run configuration unreadable")?;
    let task = Task::load(&cfg.task_path).with_context(|| format!("task of run {run_id}"))?;
    let t = Tree::from_nodes(store.nodes(run_id)?);
    let report: Option<Report> = row.report.clone().and_then(|v| serde_json::from_value(v).ok());
    let node = report
        .as_ref()
        .and_then(|r| r.best_node)
        .or_else(|| t.best().map(|b| b.id))
        .and_then(|id| t.get(id))
        .with_context(|| format!("run {run_id} has no measured kernel yet"))?;
    let key = node.candidate.clone().context("the best node has no candidate")?;
    let (kernel, cand): (String, Candidate) = store.candidate(&key)?.context("candidate missing from the store")?;
    if cand.lang != Lang::Cuda {
        bail!("run {run_id}: the best candidate is not CUDA C++ ({:?})", cand.lang);
    }
    let backend = task
        .backend(ksearch_core::Backend::Cuda)
        .with_context(|| format!("task {} has no cuda section any more", task.name))?;
    // The kernel family's constraints and shape-tied tunables; a candidate the LLM coder wrote
    // has no family of its own: it keeps the seed's constraints (those of the task's shapes).
    let family: Option<&KernelSpec> = task.kernel(ksearch_core::Backend::Cuda, &kernel);
    let llm_written = family.is_none();
    let constraints = family.unwrap_or(&backend.seed).constraints.clone();
    let spec: Vec<(String, Vec<i64>)> = family
        .map(|k| {
            k.tunables
                .iter()
                .filter(|t| t.pattern.as_deref() == Some("specialisation"))
                .map(|t| (t.name.clone(), t.values.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut builds = enumerate_builds(&spec, &cand.defines);
    if !builds.contains(&cand.defines) {
        builds.push(cand.defines.clone());
    }

    // What the run measured of this candidate, per build and workload (the latest evaluation wins:
    // the final re-timing and the held-out validation come after the search's).
    let mut measured: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
    for e in store.evaluations(run_id, None)? {
        if e.candidate.as_deref() != Some(key.as_str()) || !MEASURING.contains(&e.purpose.as_str()) {
            continue;
        }
        for w in &e.reply.workloads {
            let (Some(tm), None, true) = (&w.timing, &w.failure, w.check.passed()) else {
                continue;
            };
            let defs = w.defines.clone().unwrap_or_else(|| cand.defines.clone());
            if !builds.contains(&defs) {
                builds.push(defs.clone());
            }
            measured.entry(class_of(&spec, &defs)).or_default().insert(
                w.label.clone(),
                json!({"label": w.label, "axes": w.axes, "purpose": e.purpose, "median_us": tm.median_us,
                       "min_us": tm.min_us, "spread": tm.spread}),
            );
        }
    }

    let extra: Vec<String> = cand
        .options
        .get("nvrtc_flags")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let mut dispatch = serde_json::Map::new();
    for defs in &builds {
        let cls = class_of(&spec, defs);
        let opts: Vec<String> =
            ksearch_eval::cuda::nvrtc_options("@ARCH@", &ksearch_eval::cuda::candidate_defines(&task, defs), &extra)
                .into_iter()
                .filter(|o| !o.starts_with("--include-path="))
                .collect();
        let launches: Vec<Value> = cand
            .launches
            .iter()
            .map(|l| json!({"entry": l.entry, "grid": l.grid, "block": l.block, "shared": l.shared}))
            .collect();
        let scratch: Vec<Value> = cand
            .scratch
            .iter()
            .map(|s| json!({"name": s.name, "bytes": s.bytes}))
            .collect();
        let m: Vec<Value> = measured.get(&cls).map(|m| m.values().cloned().collect()).unwrap_or_default();
        dispatch.insert(
            cls,
            json!({"defines": defs, "launches": launches, "scratch": scratch, "nvrtc_options": opts, "measured": m}),
        );
    }

    let peer = peer_of(&task);
    let tensors = |ts: &[ksearch_core::task::TensorSpec]| -> Vec<Value> {
        ts.iter()
            .map(|t| {
                let dt = backend.dtypes.get(&t.name).copied().unwrap_or(t.dtype);
                json!({"name": t.name, "shape": t.shape, "dtype": dt.name()})
            })
            .collect()
    };
    let fixed_arch = cand.options.get("arch").and_then(|v| v.as_str()).map(String::from);
    let specific = ksearch_eval::cuda::candidate_arch((9, 0), &cand.source, &cand.options).ends_with('a');
    let speedup = report.as_ref().and_then(|r| r.speedup).or(node.speedup);
    let spec_json = json!({
        "ksearch_version": env!("CARGO_PKG_VERSION"),
        "run": run_id,
        "node": node.id,
        "device": row.device,
        "kernel": kernel,
        "llm_written": llm_written,
        "candidate_key": key,
        "speedup": speedup,
        "task": {
            "name": task.name, "description": task.description, "axes": task.axes,
            "constants": task.constants, "inputs": tensors(&task.inputs), "outputs": tensors(&task.outputs),
        },
        "source": cand.source,
        "arch": {"fixed": fixed_arch, "specific": specific},
        "constraints": constraints,
        "defines": cand.defines,
        "specialise": spec.iter().map(|(n, v)| json!({"name": n, "values": v})).collect::<Vec<_>>(),
        "dispatch": dispatch,
        "peer": peer.map(|p| p.0),
        "peer_name": peer.map(|p| p.1),
    });

    let classes: Vec<String> = dispatch_summary(&spec_json);
    let free: Vec<String> = cand
        .defines
        .iter()
        .filter(|(k, _)| !spec.iter().any(|(n, _)| n == *k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let usage = match peer.map(|p| p.0) {
        Some("attention") => {
            "    o = m.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # q [B,H,L,D], k/v [B,Hkv,L,D] f16".to_string()
        }
        Some("mamba_scan") => "    y = m.selective_scan(u, delta, A, B, C, D, z=z, delta_bias=b, delta_softplus=True)   # as mamba_ssm's selective_scan_fn".to_string(),
        _ => format!(
            "    outs = m.{}({})",
            task.name,
            task.inputs.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    };
    let mut text = format!(
        "\"\"\"ksearch: the best CUDA kernel of run {run_id} ({task}, on {device}) as a PyTorch function.\n\n\
         Generated by ksearch {ver} from run {run_id}: best node {node}, kernel `{kernel}`{free}{speed}.\n\
         Builds per shape class: {classes}.\n{llm}\n\
         \x20   import torch, <this module> as m\n{usage}\n\n\
         Needs torch, CuPy (cupy-cuda13x) and NVRTC 13 (pip's nvidia-cuda-nvrtc) at run time; a call the\n\
         kernel does not take falls back to {peer} (warned once, counted in m.STATS). Works inside\n\
         torch.compile through a torch.library custom op. Change the search, not this file.\n\"\"\"\n",
        task = doc_text(&task.name),
        device = doc_text(&row.device),
        ver = env!("CARGO_PKG_VERSION"),
        node = node.id,
        kernel = doc_text(&kernel),
        free = if free.is_empty() {
            String::new()
        } else {
            format!(" ({})", free.join(", "))
        },
        speed = speedup.map(|s| format!(", {s:.2}x the seed")).unwrap_or_default(),
        classes = classes.join("; "),
        llm = if llm_written {
            "Written by the LLM coder: checked only on the run's workloads; it keeps the seed's constraints.\n"
        } else {
            ""
        },
        peer = peer.map(|p| p.1).unwrap_or("nothing (it raises)"),
    );
    text.push_str("import json as _json\n");
    text.push_str(&format!("SPEC = {}\n\n", py_json(&spec_json)?));
    text.push_str(NVRTC);
    text.push('\n');
    text.push_str(BODY);
    std::fs::write(output, text).with_context(|| format!("cannot write {}", output.display()))?;
    println!(
        "run {run_id} · node {} · kernel {kernel} → {} ({}; builds: {})",
        node.id,
        output.display(),
        match peer.map(|p| p.0) {
            Some("attention") => "scaled_dot_product_attention(q, k, v, …)".to_string(),
            Some("mamba_scan") => "selective_scan(u, delta, A, B, C, D, …)".to_string(),
            _ => format!("{}(…)", task.name),
        },
        classes.join("; ")
    );
    Ok(0)
}

/// `HD=128 (measured on 2 workloads)` for every build of the exported table.
fn dispatch_summary(spec: &Value) -> Vec<String> {
    spec["dispatch"]
        .as_object()
        .map(|d| {
            d.iter()
                .map(|(cls, e)| {
                    let n = e["measured"].as_array().map(|a| a.len()).unwrap_or(0);
                    if n == 0 {
                        format!("{cls} (not measured by the run)")
                    } else {
                        format!("{cls} (measured on {n} workload{})", if n == 1 { "" } else { "s" })
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(v: &[(&str, i64)]) -> BTreeMap<String, i64> {
        v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
    }

    #[test]
    fn builds_vary_the_shape_tied_tunables_only() {
        let spec = vec![("HD".to_string(), vec![64, 96, 128])];
        let free = m(&[("HD", 128), ("BLOCK_N", 64)]);
        let b = enumerate_builds(&spec, &free);
        assert_eq!(b.len(), 3);
        assert!(b.iter().all(|d| d["BLOCK_N"] == 64));
        assert_eq!(
            b.iter().map(|d| class_of(&spec, d)).collect::<Vec<_>>(),
            ["HD=64", "HD=96", "HD=128"]
        );
        assert_eq!(enumerate_builds(&[], &free), vec![free.clone()]);
        assert_eq!(class_of(&[], &free), "default");
    }

    #[test]
    fn docstrings_cannot_be_closed_early() {
        assert_eq!(doc_text("a\"\"\"b\\c\n"), "a'''b/c");
    }
}
