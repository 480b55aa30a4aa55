//! `ksearch report <run> -o run.html`: one self-contained HTML page for a run of the store (the
//! header with the verified figure, the search tree, the best speed-up over evaluations and over
//! time, a roofline of every evaluated candidate, the failure classes and the LLM calls).
//!
//! The page needs no network: Chart.js (vendored under `assets/`, see `assets/README.md`), the
//! page's own script and style and the run's data are all inlined. The tree, the header and the
//! tables are HTML written here, readable without scripts; the plots are drawn by the script from
//! the data embedded as JSON (`<script type="application/json" id="ksearch-data">`).

use anyhow::{Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use ksearch_core::protocol::EvalReply;
use ksearch_core::tree::{Node, NodeStatus, Tree};
use ksearch_store::{EvalRow, LlmCallRow, RunRow, Store, StoreError};
use serde_json::{Value, json};

use ksearch_search::{Report, noise_line};

const CHART_JS: &str = include_str!("../assets/chart.umd.min.js");
const PAGE_JS: &str = include_str!("../assets/report.js");
const PAGE_CSS: &str = include_str!("../assets/report.css");

/// How often `--watch` rewrites the page, and the page's refresh interval while the run runs.
const WATCH_EVERY: Duration = Duration::from_secs(3);

/// Evaluations that are points of the plots: the seed's and the search's (one per tried node);
/// re-timings, the final back-to-back pairs and held-out runs are not new candidates.
fn plotted(purpose: &str) -> bool {
    matches!(purpose, "seed" | "search")
}

/// Write the report of `run_id` to `output`; with `watch`, again every few seconds while the run
/// is `running`, and once more after it ends.
pub fn run(store_path: &Path, kb_dir: Option<&Path>, run_id: i64, output: &Path, watch: bool) -> Result<i32> {
    let kb = kb_dir.and_then(|d| match ksearch_kb::Kb::load(d) {
        Ok(k) => Some(k),
        Err(e) => {
            eprintln!("warning: knowledge base not loaded (no roofs on the roofline plot): {e}");
            None
        }
    });
    let mut announced = false;
    loop {
        // Opened afresh each time: a store read as an immutable file does not see new rows.
        let store = Store::open_read_only(store_path)?;
        let row = store.run(run_id).map_err(|e| match e {
            StoreError::NoRun(n) => anyhow::anyhow!("no run {n} in {}", store_path.display()),
            e => e.into(),
        })?;
        // `running` that nobody drives: its process died; there is nothing more to watch.
        let orphan = row.status == "running" && !store.run_is_driven(run_id);
        let running = row.status == "running" && !orphan;
        let html = render(&store, &row, kb.as_ref(), watch && running)?;
        write_atomically(output, &html)?;
        if !watch || !running {
            let status = if orphan {
                "interrupted: no process drives it; `ksearch resume` goes on"
            } else {
                &row.status
            };
            println!("run {run_id} ({status}): report written to {}", output.display());
            return Ok(0);
        }
        if !announced {
            eprintln!(
                "run {run_id} is running: rewriting {} every {}s until it ends (Ctrl-C stops)",
                output.display(),
                WATCH_EVERY.as_secs()
            );
            announced = true;
        }
        drop(store);
        std::thread::sleep(WATCH_EVERY);
    }
}

/// The page goes to a temporary file beside `output` and is renamed over it, so a browser
/// reloading it never reads half a page.
fn write_atomically(output: &Path, html: &str) -> Result<()> {
    // Only a regular file (or a new one) is replaced: a device, a pipe or a symbolic link at the
    // path is written through, never replaced by a file.
    if let Ok(m) = std::fs::symlink_metadata(output)
        && !m.file_type().is_file()
    {
        return std::fs::write(output, html).with_context(|| format!("cannot write {}", output.display()));
    }
    let name = output
        .file_name()
        .with_context(|| format!("cannot write {}: not a file name", output.display()))?;
    let tmp = output.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, html).with_context(|| format!("cannot write {}", output.display()))?;
    std::fs::rename(&tmp, output).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("cannot write {}: {e}", output.display())
    })
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn x(v: Option<f64>) -> String {
    v.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into())
}

fn first_line(s: &str) -> &str {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("")
}

/// The line that says what went wrong: the first naming an error (a compiler's `In function
/// …:` context comes before it), else the first line.
fn failure_line(s: &str) -> &str {
    s.lines()
        .map(str::trim)
        .find(|l| l.to_ascii_lowercase().contains("error"))
        .unwrap_or_else(|| first_line(s))
}

/// At most this many characters of a failure message are shown in full.
const MESSAGE_CHARS: usize = 4000;

fn geomean(v: &[f64]) -> Option<f64> {
    if v.is_empty() || v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
        return None;
    }
    Some((v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
}

/// Median times of a reply that passed on every workload.
fn medians(r: &EvalReply) -> Option<Vec<f64>> {
    if !r.ok() {
        return None;
    }
    r.workloads.iter().map(|w| w.timing.as_ref().map(|t| t.median_us)).collect()
}

/// A point of the roofline: (flop per byte, GFLOP/s) over all workloads of a passing reply.
fn roofline_point(r: &EvalReply) -> Option<(f64, f64)> {
    let m = medians(r)?;
    let flops: f64 = r.workloads.iter().map(|w| w.flops).sum();
    let bytes: f64 = r.workloads.iter().map(|w| w.bytes).sum();
    let secs: f64 = m.iter().sum::<f64>() * 1e-6;
    (flops > 0.0 && bytes > 0.0 && secs > 0.0).then(|| (flops / bytes, flops / secs / 1e9))
}

/// The failure of a reply: whole-candidate first, else its first failing workload's.
fn failure_of(r: &EvalReply) -> Option<(String, String)> {
    if let Some(f) = &r.failure {
        return Some((f.class.name().to_string(), f.message.clone()));
    }
    r.workloads
        .iter()
        .find_map(|w| w.failure.as_ref())
        .map(|f| (f.class.name().to_string(), f.message.clone()))
        .or_else(|| {
            r.workloads
                .iter()
                .find(|w| !w.check.passed())
                .map(|w| ("check".to_string(), format!("{}: {} mismatches", w.label, w.check.mismatches)))
        })
}

/// The compute roofs drawn (GFLOP/s): the profile's f32 peak, and the peak of the task's own
/// dtype (its tensor units where the profile has them, e.g. `f16_tensor` for an f16 task) when
/// that is another; without a known dtype, the profile's highest peak. An f16 kernel is not held
/// against an fp8 roof it could never reach.
fn compute_roofs(p: &ksearch_kb::Profile, dtype: Option<&str>) -> Vec<(String, f64)> {
    let mut v = Vec::new();
    if let Some(f) = p.peak_tflops.get("f32") {
        v.push(("f32".to_string(), f * 1e3));
    }
    let own = dtype.and_then(|d| {
        [format!("{d}_tensor"), d.to_string()]
            .into_iter()
            .filter_map(|k| p.peak_tflops.get(&k).map(|t| (k, *t)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    });
    let other = match dtype {
        Some(_) => own,
        None => p
            .peak_tflops
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(d, t)| (d.clone(), *t)),
    };
    if let Some((d, t)) = other
        && v.first().is_none_or(|(_, g)| t * 1e3 > *g)
    {
        v.push((d, t * 1e3));
    }
    v
}

/// The dtype of the run's task (its first input), from the task file the run recorded, or the
/// shipped task of that name when the store came from another machine.
fn task_dtype(row: &RunRow) -> Option<String> {
    let recorded = row
        .config
        .get("task_path")
        .and_then(|p| p.as_str())
        .map(std::path::PathBuf::from);
    let shipped = Path::new("tasks").join(&row.task).join("task.toml");
    let task = recorded
        .into_iter()
        .chain([shipped])
        .find_map(|p| ksearch_core::Task::load(&p).ok())?;
    task.inputs.first().map(|t| t.dtype.name().to_string())
}

/// A figure without a needless `.0`.
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The copy bandwidth a CPU worker measured and put in its device name (`… copy 15.1 GB/s)`).
fn measured_copy_gbs(device: &str) -> Option<f64> {
    let rest = &device[device.find("copy ")? + 5..];
    let num = rest.split_whitespace().next()?;
    rest[num.len()..]
        .trim_start()
        .starts_with("GB/s")
        .then(|| num.parse().ok())
        .flatten()
}

struct Data {
    /// The embedded JSON (plots, counts the page checks itself against).
    json: Value,
    nodes: Vec<Node>,
    /// Per failed node: its last failure's line and whole message.
    failure_lines: HashMap<i64, (String, String)>,
    retimed: HashMap<i64, Option<f64>>,
    failures: BTreeMap<String, usize>,
    calls: Vec<LlmCallRow>,
}

fn collect(store: &Store, row: &RunRow, kb: Option<&ksearch_kb::Kb>, report: Option<&Report>) -> Result<Data> {
    let nodes = store.nodes(row.id)?;
    let evals: Vec<EvalRow> = store.evaluations(row.id, None)?;
    let calls = store.llm_calls(row.id, None)?;
    let by_id: HashMap<i64, &Node> = nodes.iter().map(|n| (n.id, n)).collect();

    // The first line of each node's last failure, from its evaluations.
    let mut failure_lines = HashMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for e in evals.iter().filter(|e| plotted(&e.purpose)) {
        if let Some((class, msg)) = failure_of(&e.reply) {
            *failures.entry(class).or_default() += 1;
            if let Some(n) = e.node_id {
                failure_lines.insert(n, (failure_line(&msg).to_string(), msg));
            }
        }
    }

    let seed = evals.iter().find(|e| e.purpose == "seed").and_then(|e| medians(&e.reply));
    let mut best: Option<f64> = None;
    let mut points = Vec::new();
    for e in evals.iter().filter(|e| plotted(&e.purpose)) {
        let ok = e.reply.ok();
        // The node's figure where it has one (a new best is re-timed and keeps the re-timed
        // figure), else this reply's times over the seed's.
        let speedup = if !ok {
            None
        } else if e.purpose == "seed" {
            Some(1.0)
        } else {
            e.node_id
                .and_then(|n| by_id.get(&n))
                .filter(|n| n.status == NodeStatus::Solved)
                .and_then(|n| n.speedup)
                .or_else(|| {
                    let (s, c) = (seed.as_ref()?, medians(&e.reply)?);
                    (s.len() == c.len())
                        .then(|| geomean(&s.iter().zip(&c).map(|(s, c)| s / c).collect::<Vec<_>>()))
                        .flatten()
                })
        };
        if let Some(s) = speedup.filter(|s| s.is_finite()) {
            best = Some(best.map_or(s, |b: f64| b.max(s)));
        }
        let roof = roofline_point(&e.reply);
        points.push(json!({
            "eval": e.id,
            "node": e.node_id,
            "purpose": e.purpose,
            "round": e.round,
            "at": e.created_at,
            "ok": ok,
            "speedup": speedup,
            "best": best,
            "intensity": roof.map(|r| r.0),
            "gflops": roof.map(|r| r.1),
            "failure": failure_of(&e.reply).map(|f| f.0),
        }));
    }

    let roofs = kb.map(|kb| {
        let (p, _) = kb.detect(row.backend, &row.device);
        json!({
            "profile": p.name,
            "display_name": p.display_name,
            "bandwidth_gbs": p.mem_bandwidth_gbs,
            "peaks": compute_roofs(p, task_dtype(row).as_deref()).iter().map(|(d, g)| json!({"dtype": d, "gflops": g})).collect::<Vec<_>>(),
            "measured_bandwidth_gbs": measured_copy_gbs(&row.device),
        })
    });

    let retimed: HashMap<i64, Option<f64>> = report
        .map(|r| r.retimed.iter().map(|t| (t.node, t.verified)).collect())
        .unwrap_or_default();
    let total_cost: f64 = calls.iter().map(|c| c.cost_usd).sum();
    let json = json!({
        "run": row.id,
        "task": row.task,
        "backend": row.backend,
        "device": row.device,
        "status": row.status,
        "node_count": nodes.len(),
        "evaluations": points,
        "roofs": roofs,
        "failures": failures,
        "llm_calls": calls.len(),
        "llm_cost_usd": total_cost,
    });
    Ok(Data {
        json,
        nodes,
        failure_lines,
        retimed,
        failures,
        calls,
    })
}

/// The whole page for one run.
pub fn render(store: &Store, row: &RunRow, kb: Option<&ksearch_kb::Kb>, refresh: bool) -> Result<String> {
    let report: Option<Report> = row.report.clone().and_then(|v| serde_json::from_value(v).ok());
    let d = collect(store, row, kb, report.as_ref())?;
    let mut h = String::new();
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    if refresh {
        let _ = writeln!(h, "<meta http-equiv=\"refresh\" content=\"{}\">", WATCH_EVERY.as_secs());
    }
    let _ = writeln!(
        h,
        "<title>ksearch run {} · {} on {}</title>\n<style>\n{PAGE_CSS}</style>\n</head>\n<body>",
        row.id,
        esc(&row.task),
        esc(row.backend.name())
    );
    header(&mut h, row, report.as_ref());
    h.push_str("<section id=\"progress\"><h2>Best speed-up so far</h2>\n<div class=\"plots\">\n");
    h.push_str("<div class=\"plot\"><canvas id=\"chart-evals\"></canvas></div>\n");
    h.push_str("<div class=\"plot\"><canvas id=\"chart-time\"></canvas></div>\n</div>\n");
    h.push_str("<p class=\"note\">One point per evaluation (the seed and each tried node); failed evaluations keep the best so far.</p></section>\n");
    roofline_section(&mut h, &d);
    tree_section(&mut h, &d);
    failures_section(&mut h, &d);
    llm_section(&mut h, &d, &row.planner);
    let data = serde_json::to_string(&d.json)?.replace('<', "\\u003c");
    let _ = write!(
        h,
        "<script type=\"application/json\" id=\"ksearch-data\">{data}</script>\n<script>\n{CHART_JS}\n</script>\n<script>\n{PAGE_JS}</script>\n</body>\n</html>\n"
    );
    Ok(h)
}

fn header(h: &mut String, row: &RunRow, report: Option<&Report>) {
    let (status, figure) = crate::commands::run_figure(&row.status, row.best_speedup, report);
    let _ = writeln!(
        h,
        "<header><h1>Run {} · {}</h1>\n<table class=\"facts\">",
        row.id,
        esc(&row.task)
    );
    let mut fact = |k: &str, v: &str| {
        let _ = writeln!(h, "<tr><th>{k}</th><td>{v}</td></tr>");
    };
    fact("task", &esc(&row.task));
    fact("back-end", &esc(row.backend.name()));
    fact("device", &esc(if row.device.is_empty() { "-" } else { &row.device }));
    fact("planner", &esc(&row.planner));
    fact("status", &format!("<span id=\"run-status\">{}</span>", esc(&status)));
    fact("stop reason", &esc(row.stop_reason.as_deref().unwrap_or("-")));
    fact("rounds", &row.round.to_string());
    fact("figure", &format!("<span id=\"run-figure\">{}</span>", esc(&figure)));
    match report {
        Some(r) => {
            let verified = match (r.no_result(), r.speedup) {
                (None, Some(sp)) => format!(
                    "{sp:.2}x over the naive seed (final re-timing, back to back, geometric mean over {} search workloads)",
                    r.workloads.len()
                ),
                (Some(why), _) => format!("no result: {why}"),
                (None, None) => "no result".into(),
            };
            fact("verified", &format!("<span id=\"verified\">{}</span>", esc(&verified)));
            fact(
                "in search",
                &esc(&format!(
                    "{} (as measured during the search; not verified)",
                    x(r.search_speedup.or(row.best_speedup))
                )),
            );
            if let Some(hd) = &r.heldout {
                let line = match (hd.passed, hd.speedup) {
                    (true, Some(hs)) if hs > 1.0 => format!("passed on {} workloads ({hs:.2}x)", hd.workloads.len()),
                    (true, Some(hs)) if hd.noisy() => format!(
                        "passed on {} workloads; their timings are too noisy to compare with the seed ({hs:.2}x, spread {:.0}%)",
                        hd.workloads.len(),
                        hd.spread.unwrap_or(0.0) * 100.0
                    ),
                    (true, Some(hs)) => format!(
                        "correct on {} workloads but slower than the seed ({hs:.2}x)",
                        hd.workloads.len()
                    ),
                    (true, None) => format!("passed ({})", hd.message.clone().unwrap_or_default()),
                    (false, _) => format!("FAILED: {}", hd.message.clone().unwrap_or_default()),
                };
                fact("held-out", &esc(&line));
            }
            if let Some(l) = noise_line(r.spread) {
                fact("timings", &format!("<span id=\"noise\">{}</span>", esc(&l)));
            }
        }
        None => {
            fact(
                "verified",
                "<span id=\"verified\">not yet: the run has no final re-timing</span>",
            );
            fact(
                "in search",
                &esc(&format!(
                    "{} (as measured during the search; not verified)",
                    x(row.best_speedup)
                )),
            );
        }
    }
    let _ = writeln!(
        h,
        "<tr><th>started</th><td>{}</td></tr>\n<tr><th>updated</th><td>{}</td></tr>\n</table></header>",
        esc(&row.created_at),
        esc(&row.updated_at)
    );
    if let Some(r) = report
        && r.speedup.is_some()
        && !r.workloads.is_empty()
    {
        h.push_str("<details class=\"workloads\"><summary>Final re-timing per workload</summary>\n<table><tr><th>workload</th><th>seed (us)</th><th>best (us)</th><th>speed-up</th></tr>\n");
        for ((w, s), b) in r.workloads.iter().zip(&r.seed_us).zip(&r.best_us) {
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{s:.1}</td><td>{b:.1}</td><td>{:.2}x</td></tr>",
                esc(w),
                s / b
            );
        }
        h.push_str("</table></details>\n");
    }
}

fn roofline_section(h: &mut String, d: &Data) {
    h.push_str("<section id=\"roofline\"><h2>Roofline</h2>\n");
    match d.json.get("roofs").filter(|r| !r.is_null()) {
        Some(r) => {
            let peaks: Vec<String> = r["peaks"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| {
                            format!(
                                "{} GFLOP/s ({})",
                                num(p["gflops"].as_f64().unwrap_or(0.0)),
                                esc(p["dtype"].as_str().unwrap_or(""))
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let _ = writeln!(
                h,
                "<p class=\"note\">Each evaluated candidate that passed: arithmetic intensity (the task's flops over its bytes, summed over the search workloads) against achieved throughput (those flops over the summed median times). Roofs of the hardware profile <code>{}</code> ({}): memory bandwidth {} GB/s; peak {}.</p>",
                esc(r["profile"].as_str().unwrap_or("")),
                esc(r["display_name"].as_str().unwrap_or("")),
                num(r["bandwidth_gbs"].as_f64().unwrap_or(0.0)),
                peaks.join(", ")
            );
            if let Some(m) = r["measured_bandwidth_gbs"].as_f64() {
                let _ = writeln!(
                    h,
                    "<p class=\"note\">Dashed: the copy bandwidth the worker measured on this machine ({m} GB/s), a more realistic memory roof than the profile's.</p>"
                );
            }
        }
        None => h.push_str(
            "<p class=\"note\">No hardware profile (knowledge base not found): the candidates are shown without roofs.</p>\n",
        ),
    }
    h.push_str("<div class=\"plot wide\"><canvas id=\"chart-roofline\"></canvas></div></section>\n");
}

fn tree_section(h: &mut String, d: &Data) {
    let tree = Tree::from_nodes(d.nodes.clone());
    let _ = writeln!(
        h,
        "<section id=\"tree\"><h2>Search tree ({} nodes)</h2>\n<p class=\"note\">Speed-ups as measured in the search; <em>re-timed</em>: the final back-to-back re-timing. Ratings 0-10 and confidence 0-1 are the world model's; open nodes are untried.</p>",
        d.nodes.len()
    );
    let known: std::collections::HashSet<i64> = d.nodes.iter().map(|n| n.id).collect();
    // Roots: nodes without a parent, and any whose parent is not in the run.
    let roots: Vec<i64> = d
        .nodes
        .iter()
        .filter(|n| n.parent.is_none_or(|p| !known.contains(&p)))
        .map(|n| n.id)
        .collect();
    for r in roots {
        node_html(h, &tree, d, r);
    }
    h.push_str("</section>\n");
}

fn node_html(h: &mut String, t: &Tree, d: &Data, id: i64) {
    let Some(n) = t.get(id) else { return };
    let a = &n.assessment;
    let figure = match (n.status, n.speedup) {
        (NodeStatus::Solved, Some(s)) => {
            let mut f = format!("{s:.2}x");
            if let Some(v) = d.retimed.get(&n.id) {
                let _ = write!(
                    f,
                    " (re-timed {})",
                    v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "failed".into())
                );
            }
            f
        }
        (NodeStatus::Failed, _) => format!("FAILED {}", n.failure.map(|f| f.name()).unwrap_or("")),
        (s, _) => s.name().to_string(),
    };
    let kids = t.children(id);
    let _ = writeln!(
        h,
        "<details class=\"node status-{}\" id=\"node-{}\" data-node=\"{}\"{}>\n<summary><b>#{}</b> {} <span class=\"fig\">{}</span> <span class=\"rating\">rating {:.1} · conf {:.2}</span></summary>",
        n.status.name(),
        n.id,
        n.id,
        if n.status == NodeStatus::Open { "" } else { " open" },
        n.id,
        esc(&n.action.summary()),
        esc(&figure),
        a.overall,
        a.confidence
    );
    h.push_str("<table class=\"nodefacts\">\n");
    let mut row = |k: &str, v: String| {
        let _ = writeln!(h, "<tr><th>{k}</th><td>{v}</td></tr>");
    };
    row("status", esc(n.status.name()));
    if let Some(p) = &n.pattern {
        row("pattern", esc(p));
    }
    row(
        "rating",
        format!(
            "{:.1} / 10 · confidence {:.2} · difficulty {} · prior {:.2} · visits {}",
            a.overall, a.confidence, a.difficulty, a.prior, n.visits
        ),
    );
    for (k, imp) in [
        ("memory bandwidth", &a.bandwidth),
        ("register pressure", &a.registers),
        ("hardware fit", &a.hw_fit),
    ] {
        row(
            k,
            format!(
                "{:.1}{}",
                imp.rating,
                if imp.note.is_empty() {
                    String::new()
                } else {
                    format!(" · {}", esc(&imp.note))
                }
            ),
        );
    }
    if n.speedup.is_some() || n.time_us.is_some() {
        row(
            "measured",
            format!(
                "{} · {} (geometric mean of the medians)",
                esc(&x(n.speedup)),
                n.time_us.map(|t| format!("{t:.1} us")).unwrap_or_else(|| "-".into())
            ),
        );
    }
    if let Some(f) = n.failure {
        let (line, msg) = d
            .failure_lines
            .get(&n.id)
            .map(|(l, m)| (l.as_str(), m.as_str()))
            .unwrap_or(("", ""));
        let mut cell = format!("<code>{}</code> {}", f.name(), esc(line));
        if msg.trim() != line {
            let cut = &msg[..msg.floor_char_boundary(MESSAGE_CHARS)];
            let _ = write!(
                cell,
                "<details class=\"msg\"><summary>whole message</summary><pre>{}{}</pre></details>",
                esc(cut),
                if cut.len() < msg.len() { "\n…" } else { "" }
            );
        }
        row("failure", cell);
    }
    row(
        "rounds",
        format!(
            "created {}{}",
            n.round_created,
            n.round_evaluated.map(|r| format!(", evaluated {r}")).unwrap_or_default()
        ),
    );
    h.push_str("</table>\n");
    if !kids.is_empty() {
        h.push_str("<div class=\"kids\">\n");
        let ids: Vec<i64> = kids.iter().map(|k| k.id).collect();
        for k in ids {
            node_html(h, t, d, k);
        }
        h.push_str("</div>\n");
    }
    h.push_str("</details>\n");
}

fn failures_section(h: &mut String, d: &Data) {
    h.push_str("<section id=\"failures\"><h2>Failure classes</h2>\n");
    if d.failures.is_empty() && d.nodes.iter().all(|n| n.failure.is_none()) {
        h.push_str("<p>none: every evaluated candidate passed.</p>\n");
    } else {
        // Nodes count too: a node can fail without an evaluation (a duplicate of a failed one).
        let mut nodes: BTreeMap<&str, usize> = BTreeMap::new();
        for n in &d.nodes {
            if let Some(f) = n.failure {
                *nodes.entry(f.name()).or_default() += 1;
            }
        }
        h.push_str("<div class=\"plots\"><div class=\"plot\"><canvas id=\"chart-failures\"></canvas></div>\n<table class=\"counts\"><tr><th>class</th><th>failed evaluations</th><th>failed nodes</th></tr>\n");
        let classes: std::collections::BTreeSet<&str> =
            d.failures.keys().map(String::as_str).chain(nodes.keys().copied()).collect();
        for c in classes {
            let _ = writeln!(
                h,
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                esc(c),
                d.failures.get(c).copied().unwrap_or(0),
                nodes.get(c).copied().unwrap_or(0)
            );
        }
        h.push_str("</table></div>\n");
    }
    h.push_str("</section>\n");
}

fn llm_section(h: &mut String, d: &Data, planner: &str) {
    h.push_str("<section id=\"llm\"><h2>LLM calls</h2>\n");
    if d.calls.is_empty() {
        let _ = writeln!(
            h,
            "<p id=\"llm-none\">none{}</p>",
            if planner == "llm" { "" } else { " (offline planner)" }
        );
        h.push_str("</section>\n");
        return;
    }
    let total: f64 = d.calls.iter().map(|c| c.cost_usd).sum();
    let tokens: u64 = d.calls.iter().map(|c| c.prompt_tokens + c.completion_tokens).sum();
    let _ = writeln!(
        h,
        "<p>{} calls · {tokens} tokens · total cost <b id=\"llm-cost\">${total:.4}</b></p>\n<table class=\"calls\"><tr><th>#</th><th>round</th><th>node</th><th>role</th><th>model</th><th>tokens (prompt + completion)</th><th>cost</th><th>latency</th><th>outcome</th></tr>",
        d.calls.len()
    );
    for c in &d.calls {
        let outcome = match &c.error {
            Some(e) => format!("error: {}", first_line(e)),
            None => format!("ok ({} attempt{})", c.attempts, if c.attempts == 1 { "" } else { "s" }),
        };
        let _ = writeln!(
            h,
            "<tr class=\"call\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} + {}</td><td>${:.4}</td><td>{:.1} s</td><td>{}</td></tr>",
            c.id,
            c.round,
            c.node_id.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            esc(&c.role),
            esc(&c.model),
            c.prompt_tokens,
            c.completion_tokens,
            c.cost_usd,
            c.latency_s,
            esc(&outcome)
        );
    }
    h.push_str("</table></section>\n");
}

#[cfg(test)]
mod tests {
    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            super::esc("<a href=\"x\">&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn the_measured_copy_bandwidth_is_read_from_the_device_name() {
        assert_eq!(super::measured_copy_gbs("AMD EPYC (2 threads, copy 15.1 GB/s)"), Some(15.1));
        assert_eq!(super::measured_copy_gbs("NVIDIA H200"), None);
        assert_eq!(super::measured_copy_gbs("copy x GB/s"), None);
    }

    #[test]
    fn roofs_are_the_f32_peak_and_the_tasks_own() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kb/profiles");
        let h200 = ksearch_kb::Profile::load(&dir.join("h200.toml")).unwrap();
        let top = h200.peak_tflops.values().copied().fold(0.0, f64::max);
        let roofs = super::compute_roofs(&h200, None);
        assert_eq!(roofs.len(), 2, "{roofs:?}");
        assert_eq!(roofs[0], ("f32".to_string(), h200.peak_tflops["f32"] * 1e3));
        assert_eq!(roofs[1].1, top * 1e3);
        let f16 = super::compute_roofs(&h200, Some("f16"));
        assert_eq!(f16[1], ("f16_tensor".to_string(), h200.peak_tflops["f16_tensor"] * 1e3));
        assert!(f16[1].1 < top * 1e3, "an f16 task is not drawn against the fp8 roof");
        assert_eq!(
            super::compute_roofs(&h200, Some("f32")).len(),
            1,
            "f32 has no tensor peak of its own in the profile (tf32 is another dtype)"
        );
        let cpu = ksearch_kb::Profile::load(&dir.join("cpu.toml")).unwrap();
        assert_eq!(
            super::compute_roofs(&cpu, Some("f32")),
            vec![("f32".to_string(), cpu.peak_tflops["f32"] * 1e3)]
        );
    }

    #[test]
    fn the_failure_line_is_the_one_naming_the_error() {
        let gcc = "kernel.cpp: In function 'void f()':\nkernel.cpp:2:3: error: 'g' was not declared\n  2 | g();\n";
        assert_eq!(super::failure_line(gcc), "kernel.cpp:2:3: error: 'g' was not declared");
        assert_eq!(super::failure_line("\n  timed out after 60 s\nmore"), "timed out after 60 s");
    }

    #[test]
    fn geomean_refuses_non_positive_times() {
        assert_eq!(super::geomean(&[2.0, 8.0]).map(|g| (g * 1e9).round() / 1e9), Some(4.0));
        assert_eq!(super::geomean(&[2.0, 0.0]), None);
        assert_eq!(super::geomean(&[]), None);
    }
}
