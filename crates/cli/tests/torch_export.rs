//! `ksearch export <run> --torch`: a CUDA run as a search leaves it in the store (recorded here
//! through the store API, since no GPU runs in CI), exported and loaded by Python without torch:
//! the module carries the kernel, its constraints and a build per shape class with what the run
//! measured, plans launches for new shapes and falls back outside them; with NVRTC (pip's
//! nvidia-cuda-nvrtc seen by `python3`) every build of the exported table is compiled for sm_90.
//! `KSEARCH_REQUIRE_NVRTC=1` (scripts/test.sh) turns a missing NVRTC into a failure.

use assert_cmd::Command;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ksearch_core::data::Check;
use ksearch_core::protocol::{Candidate, EvalReply, Lang, Timing, WorkloadResult};
use ksearch_core::task::{Task, Workload};
use ksearch_core::tree::{Action, Assessment, Node, NodeStatus};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn task(name: &str) -> Task {
    Task::load(&repo().join("tasks").join(name).join("task.toml")).unwrap()
}

fn w(v: &[(&str, i64)]) -> Workload {
    v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
}

/// A workload row as the judge leaves it: checked, timed, with the build it ran.
fn row(task: &Task, axes: &Workload, defines: Option<BTreeMap<String, i64>>, us: f64) -> WorkloadResult {
    WorkloadResult {
        label: task
            .axes
            .iter()
            .map(|a| format!("{a}={}", axes[a]))
            .collect::<Vec<_>>()
            .join(","),
        axes: axes.clone(),
        seed: 1,
        check: Check {
            elements: 100,
            ..Check::default()
        },
        timing: Some(Timing {
            median_us: us,
            min_us: us * 0.98,
            spread: 0.02,
            reps: 20,
        }),
        bytes: 1.0,
        flops: 1.0,
        floor_us: None,
        failure: None,
        defines,
    }
}

/// A finished search of `kernel` (at its default tunables) on `backend`, with a "final"
/// evaluation of `workloads` (each with the build it ran and its time), recorded the way the
/// search records one. Returns nothing: the run is run 1, 2, … in creation order.
fn record_run(db: &Path, task_name: &str, backend: &str, kernel: &str, workloads: &[(Workload, Option<i64>, f64)]) {
    let t = task(task_name);
    let b = t.backend(backend.parse().unwrap()).unwrap();
    let k = if kernel == "seed" {
        &b.seed
    } else {
        b.kernels.iter().find(|k| k.name == kernel).unwrap()
    };
    let cand = Candidate {
        lang: if backend == "cuda" { Lang::Cuda } else { Lang::Cpp },
        source: k.source.clone(),
        launches: k.launches.clone(),
        scratch: k.scratch.clone(),
        defines: k.default_config(),
        options: BTreeMap::new(),
    };
    let store = ksearch_store::Store::open(db).unwrap();
    let cfg = serde_json::json!({
        "task": task_name, "task_path": repo().join("tasks").join(task_name).join("task.toml"), "backend": backend,
        "planner": "offline", "rounds": 1, "patience": 1, "seed": 1, "context": "full", "workers": 1,
        "devices": [0], "compile_timeout_s": 60.0, "run_timeout_s": 60.0, "mem_limit_bytes": 1u64 << 30,
        "timing": {"warmup": 1, "min_reps": 1, "max_reps": 1, "target_ms": 1.0, "flush": false},
        "kb_dir": null, "cache_dir": db.parent().unwrap()
    });
    let run = store
        .create_run(task_name, backend.parse().unwrap(), "offline", 1, "NVIDIA H200", &cfg)
        .unwrap();
    let key = store.put_candidate(&k.name, &cand).unwrap();
    let mut n = Node::new(1, None, Action::Seed, None, Assessment::default(), 0);
    n.status = NodeStatus::Solved;
    n.candidate = Some(key.clone());
    n.speedup = Some(1.5);
    let id = store.insert_node(run, &n).unwrap();
    let shape_tied = k
        .tunables
        .iter()
        .find(|t| t.pattern.as_deref() == Some("specialisation"))
        .map(|t| t.name.clone());
    let reply = EvalReply {
        workloads: workloads
            .iter()
            .map(|(axes, spec, us)| {
                let defines = spec.map(|v| {
                    let mut d = cand.defines.clone();
                    d.insert(shape_tied.clone().unwrap(), v);
                    d
                });
                row(&t, axes, defines, *us)
            })
            .collect(),
        ..EvalReply::default()
    };
    store
        .insert_evaluation(run, Some(id), Some(&key), 1, "final", &reply, 1.0)
        .unwrap();
    // An evaluation of another purpose and a failed workload say nothing about the kernel's time.
    let mut failed = reply.clone();
    for x in &mut failed.workloads {
        x.check.mismatches = 3;
        x.timing = Some(Timing {
            median_us: 1.0,
            ..Timing::default()
        });
    }
    store
        .insert_evaluation(run, Some(id), Some(&key), 1, "search", &failed, 1.0)
        .unwrap();
}

fn export(db: &Path, args: &[&str]) -> std::process::Output {
    Command::cargo_bin("ksearch")
        .unwrap()
        .current_dir(repo())
        .args(["--store", db.to_str().unwrap(), "export"])
        .args(args)
        .output()
        .unwrap()
}

/// Run `script` with `python3`, the exported module importable as `m` (its path in `MODULE`).
fn python(module: &Path, script: &str) -> std::process::Output {
    let head = format!(
        "import importlib.util, sys, json, warnings\n\
         spec = importlib.util.spec_from_file_location('exported', {p:?})\n\
         m = importlib.util.module_from_spec(spec); sys.modules['exported'] = m; spec.loader.exec_module(m)\n",
        p = module.display().to_string()
    );
    std::process::Command::new("python3")
        .arg("-c")
        .arg(format!("{head}{script}"))
        .output()
        .expect("python3")
}

fn ok(o: &std::process::Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{out}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Compile every build of the exported table for sm_90 through the module's own NVRTC path;
/// skipped when `python3` finds no NVRTC, unless KSEARCH_REQUIRE_NVRTC=1.
fn compile_all(module: &Path, want: &[&str]) {
    let p = python(
        module,
        "try:\n    m.nvrtc_library()\nexcept m.CompileError as e:\n    print('NO-NVRTC', e); sys.exit(0)\n\
         print(json.dumps(m.compile_all((9, 0))))\n",
    );
    let out = ok(&p);
    if out.starts_with("NO-NVRTC") {
        if std::env::var("KSEARCH_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("KSEARCH_REQUIRE_NVRTC=1 but python3 finds no NVRTC: {out}");
        }
        eprintln!("skipping the NVRTC compile of the exported builds: {out}");
        return;
    }
    let sizes: BTreeMap<String, u64> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(sizes.keys().map(String::as_str).collect::<Vec<_>>(), want);
    assert!(sizes.values().all(|n| *n > 1000), "{sizes:?}");
}

#[test]
fn attention_exports_a_drop_in_with_a_build_per_head_size() {
    let d = tempfile::tempdir().unwrap();
    let db = d.path().join("s.db");
    let ws = vec![
        (
            w(&[("B", 2), ("H", 16), ("Hkv", 16), ("L", 3072), ("D", 128), ("causal", 1)]),
            Some(128),
            655.0,
        ),
        (
            w(&[("B", 4), ("H", 32), ("Hkv", 8), ("L", 2048), ("D", 128), ("causal", 0)]),
            Some(128),
            620.0,
        ),
        (
            w(&[("B", 3), ("H", 32), ("Hkv", 32), ("L", 777), ("D", 64), ("causal", 0)]),
            Some(64),
            90.0,
        ),
    ];
    record_run(&db, "attention", "cuda", "flash_wgmma", &ws);
    let out = d.path().join("attn.py");
    let o = export(&db, &["1", "--torch", "-o", out.to_str().unwrap()]);
    let said = ok(&o);
    assert!(
        said.contains("kernel flash_wgmma") && said.contains("scaled_dot_product_attention") && said.contains("HD=96"),
        "{said}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.starts_with("\"\"\"ksearch: the best CUDA kernel of run 1 (attention"),
        "{}",
        &text[..200]
    );
    let p = python(
        &out,
        r#"
assert 'torch' not in sys.modules and 'cupy' not in sys.modules
S = m.SPEC
assert S['run'] == 1 and S['kernel'] == 'flash_wgmma' and S['peer'] == 'attention', S['peer']
assert sorted(S['dispatch']) == ['HD=128', 'HD=64', 'HD=96'], sorted(S['dispatch'])
# what the run measured, per build; the failed search rows are not among them
meas = {c: sorted(x['median_us'] for x in e['measured']) for c, e in S['dispatch'].items()}
assert meas == {'HD=128': [620.0, 655.0], 'HD=64': [90.0], 'HD=96': []}, meas
assert all(o.startswith('--gpu-architecture=@ARCH@') for o in [S['dispatch']['HD=64']['nvrtc_options'][0]])
assert '-DHD=64' in S['dispatch']['HD=64']['nvrtc_options'] and S['arch']['specific'] is True
assert m.arch_for((9, 0)) == 'sm_90a'
# a ragged, grouped-query shape: the D=64 build, its launch sizes evaluated here
p = m.plan(dict(B=1, H=32, Hkv=8, L=1000, D=64, causal=1))
# (the head-size-64 class's own tiling: NWG_D64=2, BLOCK_N_D64=64, STAGES_D64=4, MBAR=1)
assert p.cls == 'HD=64' and p.launches == [('attention', (8, 32, 1), (256, 1, 1), 128 * 2 * 64 + 4 * 4 * 64 * 64 + 1024 + 128)], p
assert p.axis_values == (1, 32, 8, 1000, 64, 1)
for axes, why in [(dict(B=1, H=32, Hkv=8, L=100, D=80, causal=0), 'no build'),
                  (dict(B=1, H=32, Hkv=5, L=100, D=64, causal=0), 'no build')]:
    try:
        m.plan(axes); raise SystemExit('accepted %s' % axes)
    except m.Unsupported as e:
        assert why in str(e), e
# a CPU stand-in for the kernel and the peer (numpy arrays): the dispatch and its fall-back
import types
class Arr:
    def __init__(self, *shape, dtype='float16'):
        self.shape, self.dtype = shape, dtype
ran = []
class StandIn:
    def check(self, arrays): return None
    def limits(self, arrays): return m.DEFAULT_LIMITS
    def launch(self, p, arrays): ran.append(('kernel', p.cls)); return ['o']
def peer(arrays, axes): ran.append(('peer', axes['D'])); return ['o-peer']
m.configure(launcher=StandIn(), peer=peer)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    assert m.attention(Arr(1, 32, 1000, 64), Arr(1, 8, 1000, 64), Arr(1, 8, 1000, 64), causal=1) == 'o'
    assert m.attention(Arr(1, 4, 10, 80), Arr(1, 4, 10, 80), Arr(1, 4, 10, 80)) == 'o-peer'
    assert m.attention(Arr(1, 4, 10, 64, dtype='float32'), Arr(1, 4, 10, 64), Arr(1, 4, 10, 64)) == 'o-peer'
assert ran == [('kernel', 'HD=64'), ('peer', 80), ('peer', 64)], ran
assert len(caught) == 1 and 'falling back' in str(caught[0].message), [str(c.message) for c in caught]
assert m.STATS['kernel'] == 1 and m.STATS['fallback'] == 2
print('ok')
"#,
    );
    assert_eq!(ok(&p).trim(), "ok");
    compile_all(&out, &["HD=128", "HD=64", "HD=96"]);
}

#[test]
fn mamba_scan_exports_the_selective_scan_drop_in() {
    let d = tempfile::tempdir().unwrap();
    let db = d.path().join("s.db");
    let ws = vec![(w(&[("batch", 4), ("L", 1000), ("D", 2048), ("N", 16)]), None, 120.0)];
    record_run(&db, "mamba_scan", "cuda", "seq_scan", &ws);
    let out = d.path().join("scan.py");
    let said = ok(&export(&db, &["1", "--torch", "-o", out.to_str().unwrap()]));
    assert!(
        said.contains("selective_scan(") && said.contains("NS=16 (measured on 1 workload)"),
        "{said}"
    );
    let p = python(
        &out,
        r#"
S = m.SPEC
assert S['peer'] == 'mamba_scan' and callable(m.selective_scan) and m.selective_scan_fn is m.selective_scan
assert not hasattr(m, 'scaled_dot_product_attention')
assert sorted(S['dispatch']) == ['NS=16', 'NS=8']
p = m.plan(dict(batch=3, L=777, D=1536, N=8))
assert p.cls == 'NS=8' and p.defines['NS'] == 8, p
try:
    m.plan(dict(batch=1, L=10, D=20, N=16)); raise SystemExit('D=20 accepted')
except m.Unsupported as e:
    assert 'D % 8 == 0' in str(e), e
print('ok')
"#,
    );
    assert_eq!(ok(&p).trim(), "ok");
    compile_all(&out, &["NS=16", "NS=8"]);
}

#[test]
fn other_tasks_get_the_generic_function() {
    let d = tempfile::tempdir().unwrap();
    let db = d.path().join("s.db");
    record_run(&db, "softmax", "cuda", "block_row", &[]);
    let out = d.path().join("softmax.py");
    let said = ok(&export(&db, &["1", "--torch", "-o", out.to_str().unwrap()]));
    assert!(
        said.contains("softmax(…)") && said.contains("default (not measured by the run)"),
        "{said}"
    );
    let p = python(
        &out,
        r#"
assert m.SPEC['peer'] is None and not hasattr(m, 'selective_scan')
assert m.softmax.inputs == ['x']
p = m.plan(dict(rows=300, cols=3000))
assert p.launches == [('softmax', (300, 1, 1), (128, 1, 1), 0)], p
class Arr:
    def __init__(self, *shape): self.shape, self.dtype = shape, 'float32'
class StandIn:
    def check(self, arrays): return None
    def limits(self, arrays): return m.DEFAULT_LIMITS
    def launch(self, p, arrays): return ['y']
m.configure(launcher=StandIn())
assert m.softmax(Arr(4, 8)) == 'y'
try:
    m.softmax(Arr(4, 7)); raise SystemExit('cols=7 accepted')   # cols % VEC == 0 fails: no peer
except RuntimeError as e:
    assert 'no peer' in str(e) and 'cols % VEC == 0' in str(e), e
print('ok')
"#,
    );
    assert_eq!(ok(&p).trim(), "ok");
    compile_all(&out, &["default"]);
}

#[test]
fn export_refuses_what_it_cannot_export_in_one_line() {
    let d = tempfile::tempdir().unwrap();
    let db = d.path().join("s.db");
    record_run(&db, "softmax", "cpu", "seed", &[]);
    let out = d.path().join("x.py");
    let o = export(&db, &["1", "--torch", "-o", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("run 1 searched the cpu back-end; --torch exports runs of the cuda back-end"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());
    // No target, an unknown run, an unwritable output, both targets.
    for (args, needle) in [
        (vec!["1", "-o", "x.py"], "say what to export for: --mlx"),
        (vec!["7", "--torch", "-o", "x.py"], "no run 7 in the store"),
    ] {
        let o = export(&db, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(needle) && err.trim().lines().count() == 1, "{err}");
    }
    let db2 = d.path().join("c.db");
    record_run(&db2, "softmax", "cuda", "block_row", &[]);
    let o = export(&db2, &["1", "--torch", "-o", "/nonexistent-dir/x.py"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot write /nonexistent-dir/x.py") && err.trim().lines().count() == 1,
        "{err}"
    );
    let o = export(&db2, &["1", "--torch", "--mlx", "-o", "x.py"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
}
