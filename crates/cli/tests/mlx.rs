//! The MLX back-end from the Rust side, with the real Python worker (`python/ksearch_mlx`) on
//! MLX's CPU back-end: the worker's references against the host f64 references on the inputs
//! it drew, the clear refusal when MLX cannot run custom kernels, and `ksearch export --mlx`.
//! `KSEARCH_PYTHON` names an interpreter with MLX (scripts/mlx-venv.sh makes one); without one
//! the tests skip, unless `KSEARCH_REQUIRE_MLX=1` (as in scripts/test.sh), where they fail.

use assert_cmd::Command;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

use ksearch_core::protocol::Candidate;
use ksearch_core::task::{Task, Workload};
use ksearch_core::tree::{Action, Assessment, Node, NodeStatus};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// An interpreter that imports MLX, or `None` (skip) when none is configured and none is required.
fn python() -> Option<String> {
    let py = std::env::var("KSEARCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&py)
        .args(["-c", "import mlx.core"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        return Some(py);
    }
    if std::env::var("KSEARCH_REQUIRE_MLX").as_deref() == Ok("1") {
        panic!("KSEARCH_REQUIRE_MLX=1 but `{py}` cannot import mlx (run scripts/mlx-venv.sh)");
    }
    eprintln!("skipping: `{py}` has no MLX (set KSEARCH_PYTHON)");
    None
}

/// Can MLX run CUDA custom kernels with this interpreter (i.e. are we on the GPU machine)?
fn mlx_has_cuda(py: &str) -> bool {
    std::process::Command::new(py)
        .args([
            "-c",
            "import mlx.core as mx, sys; sys.exit(0 if hasattr(mx, 'cuda') and mx.cuda.is_available() else 1)",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn task(name: &str) -> Task {
    Task::load(&repo().join("tasks").join(name).join("task.toml")).unwrap()
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Worker {
    fn start(py: &str, backend: &str) -> Worker {
        let mut child = std::process::Command::new(py)
            .args(["-m", "ksearch_mlx.worker", "--backend", backend])
            .env("PYTHONPATH", repo().join("python"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Worker { child, stdin, out }
    }
    fn line(&mut self) -> serde_json::Value {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("unreadable worker line {l:?}: {e}"))
    }
    /// Send one request and return the first non-progress reply.
    fn ask(&mut self, req: &serde_json::Value) -> serde_json::Value {
        writeln!(self.stdin, "{req}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let r = self.line();
            if r["reply"] != "progress" {
                return r;
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", serde_json::json!({"op": "shutdown"}));
        let _ = self.child.wait();
    }
}

/// A task kernel at its default configuration, as the planner would send it.
fn candidate_of(k: &ksearch_core::KernelSpec) -> Candidate {
    Candidate {
        lang: ksearch_core::Lang::MlxCuda,
        source: k.source.clone(),
        launches: k.launches.clone(),
        scratch: k.scratch.clone(),
        defines: k.default_config(),
        options: BTreeMap::new(),
    }
}

/// `ksearch --store STORE --quiet run ARGS…` with the MLX worker on interpreter `py`.
fn ksearch_run(py: &str, store: &Path, args: &[&str]) -> std::process::Output {
    Command::cargo_bin("ksearch")
        .unwrap()
        .current_dir(repo())
        .env("KSEARCH_PYTHON", py)
        .args(["--store", store.to_str().unwrap(), "--quiet", "run"])
        .args(args)
        .output()
        .unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn workload(pairs: &[(&str, i64)]) -> Workload {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn mlx_references_match_the_host_f64_references_on_the_inputs_the_worker_drew() {
    let Some(py) = python() else { return };
    let mut w = Worker::start(&py, "mlx-cuda");
    let hello = w.line();
    assert_eq!(hello["reply"], "hello", "{hello}");
    assert_eq!(hello["backend"], "mlx-cuda");
    let cases: Vec<(&str, Workload)> = vec![
        ("softmax", workload(&[("rows", 5), ("cols", 33)])),
        ("rmsnorm", workload(&[("rows", 4), ("cols", 40)])),
        (
            "attention",
            workload(&[("B", 1), ("H", 2), ("Hkv", 2), ("L", 9), ("D", 8), ("causal", 0)]),
        ),
        (
            "attention",
            workload(&[("B", 2), ("H", 4), ("Hkv", 2), ("L", 7), ("D", 16), ("causal", 1)]),
        ),
        ("mamba_scan", workload(&[("batch", 2), ("L", 37), ("D", 6), ("N", 4)])),
        ("mamba_step", workload(&[("batch", 3), ("D", 5), ("N", 4)])),
    ];
    for (i, (name, axes)) in cases.iter().enumerate() {
        let t = task(name);
        let req = |seed: u64| {
            serde_json::json!({"op": "reference", "id": i, "task": t, "backend": "mlx-cuda",
                "workload": {"label": "small", "axes": axes, "seed": seed}})
        };
        let r = w.ask(&req(1234 + i as u64));
        assert_eq!(r["reply"], "reference", "{name}: {r}");
        // The inputs the worker drew: right sizes, inside their distributions' supports, and
        // a function of the seed alone.
        let mut ins: Vec<Vec<f64>> = Vec::new();
        for spec in &t.inputs {
            let v = floats(&r["inputs"][&spec.name]);
            let n: usize = ksearch_core::task::shape_of(spec, axes).unwrap().iter().product();
            assert_eq!(v.len(), n, "{name}.{}", spec.name);
            if let ksearch_core::task::Init::Uniform { lo, hi } = spec.init {
                let tol = 1e-3 * (hi - lo).abs().max(1.0);
                assert!(
                    v.iter().all(|x| *x >= lo - tol && *x <= hi + tol),
                    "{name}.{} outside [{lo}, {hi}]",
                    spec.name
                );
            }
            assert!(v.iter().any(|x| *x != v[0]), "{name}.{} is constant", spec.name);
            ins.push(v);
        }
        let again = w.ask(&req(1234 + i as u64));
        assert_eq!(again["inputs"], r["inputs"], "{name}: same seed, other inputs");
        let other = w.ask(&req(99));
        assert_ne!(other["inputs"], r["inputs"], "{name}: other seed, same inputs");
        // The host reference on exactly those inputs.
        let f = ksearch_core::reference::lookup(t.reference.name().unwrap()).unwrap();
        let host = f(&ksearch_core::reference::RefArgs {
            axes,
            constants: &t.constants,
            inputs: ins.iter().map(|v| v.as_slice()).collect(),
        });
        for (spec, h) in t.outputs.iter().zip(&host) {
            let m = floats(&r["outputs"][&spec.name]);
            assert_eq!(m.len(), h.len(), "{name}.{}", spec.name);
            let tol = t.tolerance[&ksearch_core::DType::F32];
            for (j, (a, b)) in m.iter().zip(h).enumerate() {
                assert!(
                    (a - b).abs() <= tol.atol + tol.rtol * b.abs(),
                    "{name}.{}[{j}]: MLX f32 reference {a} vs host f64 {b}",
                    spec.name
                );
            }
        }
    }
}

#[test]
fn a_run_on_mlx_without_a_gpu_back_end_is_refused_with_the_reason_and_records_nothing() {
    let Some(py) = python() else { return };
    if mlx_has_cuda(&py) {
        eprintln!("skipping: MLX has a CUDA back-end here");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s.db");
    let o = ksearch_run(&py, &store, &["softmax", "--backend", "mlx", "--rounds", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("cannot run kernels here") && err.contains("no CUDA back-end"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let runs = Command::cargo_bin("ksearch")
        .unwrap()
        .current_dir(repo())
        .args(["--store", store.to_str().unwrap(), "runs"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&runs.stdout).contains("no runs yet"),
        "a run was recorded"
    );
}

#[test]
fn an_eval_on_the_cpu_back_end_fails_as_infra_and_the_worker_keeps_serving() {
    let Some(py) = python() else { return };
    if mlx_has_cuda(&py) {
        return;
    }
    let t = task("softmax");
    let k = &t
        .backend(ksearch_core::Backend::MlxCuda)
        .expect("softmax has an mlx-cuda section")
        .seed;
    let cand = candidate_of(k);
    let mut w = Worker::start(&py, "mlx-cuda");
    let hello = w.line();
    assert_eq!(hello["kernels"], false, "{hello}");
    for id in 0..2 {
        let r = w.ask(
            &serde_json::json!({"op": "eval", "id": id, "task": t, "backend": "mlx-cuda", "candidate": cand,
            "workloads": [{"label": "w", "axes": {"rows": 4, "cols": 64}, "seed": 5}],
            "timing": {"warmup": 1, "min_reps": 1, "max_reps": 2, "target_ms": 1.0, "flush": false}}),
        );
        assert_eq!(r["reply"], "eval", "{r}");
        assert_eq!(r["id"], id);
        assert_eq!(r["failure"]["class"], "infra", "{r}");
        assert!(r["failure"]["message"].as_str().unwrap().contains("no CUDA back-end"), "{r}");
    }
}

#[test]
fn the_worker_subcommand_points_to_the_python_worker() {
    let o = Command::cargo_bin("ksearch")
        .unwrap()
        .args(["worker", "--backend", "mlx-cuda"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("ksearch_mlx.worker"));
}

/// A run of the MLX scan as a search would leave it (the store API, since MLX cannot run
/// kernels on this machine), exported and loaded by Python: the module carries the kernel,
/// the task and the runtime, and plans the launches for a new shape.
#[test]
fn export_writes_a_self_contained_module_of_the_best_kernel() {
    let Some(py) = python() else { return };
    let d = tempfile::tempdir().unwrap();
    let db = d.path().join("s.db");
    let t = task("mamba_scan");
    let b = t
        .backend(ksearch_core::Backend::MlxCuda)
        .expect("mamba_scan has an mlx-cuda section");
    let k = b.kernels.first().unwrap_or(&b.seed);
    let cand = candidate_of(k);
    {
        let store = ksearch_store::Store::open(&db).unwrap();
        let cfg = serde_json::json!({
            "task": "mamba_scan", "task_path": repo().join("tasks/mamba_scan/task.toml"), "backend": "mlx-cuda",
            "planner": "offline", "rounds": 1, "patience": 1, "seed": 1, "context": "full", "workers": 1,
            "devices": [0], "compile_timeout_s": 60.0, "run_timeout_s": 60.0, "mem_limit_bytes": 1u64 << 30,
            "timing": {"warmup": 1, "min_reps": 1, "max_reps": 1, "target_ms": 1.0, "flush": false},
            "kb_dir": null, "cache_dir": d.path()
        });
        let run = store
            .create_run("mamba_scan", ksearch_core::Backend::MlxCuda, "offline", 1, "test", &cfg)
            .unwrap();
        let key = store.put_candidate(&k.name, &cand).unwrap();
        let mut n = Node::new(1, None, Action::Seed, None, Assessment::default(), 0);
        n.status = NodeStatus::Solved;
        n.candidate = Some(key);
        n.speedup = Some(1.0);
        store.insert_node(run, &n).unwrap();
    }
    let out = d.path().join("scan_mlx.py");
    let o = Command::cargo_bin("ksearch")
        .unwrap()
        .current_dir(repo())
        .args([
            "--store",
            db.to_str().unwrap(),
            "export",
            "1",
            "--mlx",
            "-o",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.starts_with("# Generated by ksearch") && text.contains("from run 1 "),
        "no provenance header"
    );
    // Loadable on its own (no ksearch_mlx on the path), with the kernel and task inside.
    let script = format!(
        "import importlib.util, sys\n\
         spec = importlib.util.spec_from_file_location('scan_mlx', {out:?})\n\
         m = importlib.util.module_from_spec(spec); sys.modules['scan_mlx'] = m; spec.loader.exec_module(m)\n\
         assert 'ksearch_mlx' not in sys.modules\n\
         assert m.TASK['name'] == 'mamba_scan' and m.BACKEND == 'mlx-cuda'\n\
         assert callable(m.mamba_scan) and callable(m.patch_mlx_lm) and not hasattr(m, 'patch_mlx_lm_llama')\n\
         import json; print(json.dumps(m.CANDIDATE))\n",
        out = out.display().to_string(),
    );
    let p = std::process::Command::new(&py)
        .arg("-c")
        .arg(&script)
        .current_dir(d.path())
        .output()
        .unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let back: Candidate = serde_json::from_slice(&p.stdout).unwrap();
    assert_eq!(back, cand, "the exported candidate differs from the stored one");
    // A run on another back-end is not exported for MLX.
    let o = Command::cargo_bin("ksearch")
        .unwrap()
        .args(["--store", db.to_str().unwrap(), "export", "1", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

/// An interpreter without MLX: one line that names the interpreter and what to install, exit 2,
/// no run recorded. (`python3 -S` hides site-packages, so MLX cannot be imported.)
#[test]
fn a_python_without_mlx_is_reported_in_one_line() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let py = d.path().join("python-without-site");
    std::fs::write(&py, "#!/bin/sh\nexec python3 -S \"$@\"\n").unwrap();
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    let store = d.path().join("s.db");
    let o = ksearch_run(py.to_str().unwrap(), &store, &["mamba_scan", "--backend", "mlx-cuda"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("MLX cannot be imported") && err.contains("KSEARCH_PYTHON"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// A store whose run 1 (task `task_name` on mlx-cuda) has `cand` as its solved seed node.
fn store_with_best(db: &Path, cache: &Path, task_name: &str, kernel: &str, cand: &Candidate) {
    let store = ksearch_store::Store::open(db).unwrap();
    let cfg = serde_json::json!({
        "task": task_name, "task_path": repo().join("tasks").join(task_name).join("task.toml"), "backend": "mlx-cuda",
        "planner": "offline", "rounds": 1, "patience": 1, "seed": 1, "context": "full", "workers": 1,
        "devices": [0], "compile_timeout_s": 60.0, "run_timeout_s": 60.0, "mem_limit_bytes": 1u64 << 30,
        "timing": {"warmup": 1, "min_reps": 1, "max_reps": 1, "target_ms": 1.0, "flush": false},
        "kb_dir": null, "cache_dir": cache
    });
    let run = store
        .create_run(task_name, ksearch_core::Backend::MlxCuda, "offline", 1, "test", &cfg)
        .unwrap();
    let key = store.put_candidate(kernel, cand).unwrap();
    let mut n = Node::new(1, None, Action::Seed, None, Assessment::default(), 0);
    n.status = NodeStatus::Solved;
    n.candidate = Some(key);
    n.speedup = Some(1.0);
    store.insert_node(run, &n).unwrap();
}

/// A store whose run's best is the attention task's wgmma kernel for MLX CUDA at its defaults,
/// exported with `ksearch export 1 --mlx` into `dir`: (the candidate's form, the module's path,
/// the command's output).
fn export_wgmma_attention(dir: &Path) -> (Option<String>, PathBuf, std::process::Output) {
    let db = dir.join("s.db");
    let t = task("attention");
    let k = t.kernel(ksearch_core::Backend::MlxCuda, "flash_wgmma").unwrap();
    let cand = ksearch_search::planner::instantiate(ksearch_core::Backend::MlxCuda, k, &k.default_config());
    let form = cand.options.get("form").and_then(|v| v.as_str()).map(str::to_string);
    store_with_best(&db, dir, "attention", &k.name, &cand);
    let out = dir.join("attention_mlx.py");
    let o = Command::cargo_bin("ksearch")
        .unwrap()
        .current_dir(repo())
        .args([
            "--store",
            db.to_str().unwrap(),
            "export",
            "1",
            "--mlx",
            "-o",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    (form, out, o)
}

/// The best kernel is a whole CUDA translation unit (attention's wgmma kernel, `form = "cuda"`):
/// the module carries its source, the NVRTC helpers and its builds for the other head sizes,
/// picks a build per call's shape and builds it for sm_90a on first use, without ksearch and
/// without a GPU (the architecture given by KSEARCH_CUDA_ARCH). Needs NVRTC
/// 13 for the interpreter (pip's nvidia-cuda-nvrtc); skips without it unless
/// KSEARCH_REQUIRE_NVRTC=1.
#[test]
fn export_of_a_whole_cuda_unit_builds_it_with_nvrtc_on_first_use() {
    let Some(py) = python() else { return };
    let d = tempfile::tempdir().unwrap();
    let (form, out, o) = export_wgmma_attention(d.path());
    assert_eq!(form.as_deref(), Some("cuda"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.contains("# The kernel is a whole CUDA translation unit"),
        "no note on NVRTC"
    );
    let script = format!(
        "import importlib.util, os, sys\n\
         spec = importlib.util.spec_from_file_location('attention_mlx', {out:?})\n\
         m = importlib.util.module_from_spec(spec); sys.modules['attention_mlx'] = m; spec.loader.exec_module(m)\n\
         assert 'ksearch_mlx' not in sys.modules and 'ksearch_nvrtc' not in sys.modules\n\
         assert m.CANDIDATE['options'] == {{'form': 'cuda', 'file': 'cuda/flash_wgmma.cu'}}, m.CANDIDATE['options']\n\
         assert sorted(b['HD'] for b in m.CANDIDATE['builds']) == [64, 96] and m.CANDIDATE['defines']['HD'] == 128\n\
         ax = {{'B': 1, 'H': 4, 'Hkv': 2, 'L': 33, 'causal': 1}}\n\
         assert [m._tail_build_for(m.CANDIDATE, {{**ax, 'D': d}})['HD'] for d in (128, 64, 96)] == [128, 64, 96]\n\
         try:\n    m._tail_build_for(m.CANDIDATE, {{**ax, 'D': 80}}); sys.exit('D = 80 was accepted')\n\
         except ValueError as e:\n    assert 'HD == D' in str(e), e\n\
         try:\n    m.nvrtc_library()\n\
         except m.CompileError as e:\n    print('NO-NVRTC', e); sys.exit(0)\n\
         os.environ['KSEARCH_CUDA_ARCH'] = 'sm_90'\n\
         k = m._tail_kernel()\n\
         u, u64 = k.kernel_for({{**ax, 'D': 128}}).unit(), k.kernel_for({{**ax, 'D': 64}}).unit()\n\
         assert u.arch == 'sm_90a' and len(u.cubin) > 10000 and u.names['attention'].startswith('ks_attention_'), u.names\n\
         assert u64.names != u.names and len(k.compiled) == 2\n\
         print('BUILT', u.arch, len(u.cubin))\n",
        out = out.display().to_string(),
    );
    let p = std::process::Command::new(&py)
        .arg("-c")
        .arg(&script)
        .current_dir(d.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&p.stdout);
    assert!(p.status.success(), "{stdout}{}", String::from_utf8_lossy(&p.stderr));
    if stdout.contains("NO-NVRTC") {
        assert!(
            std::env::var("KSEARCH_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "KSEARCH_REQUIRE_NVRTC=1 but the interpreter finds no NVRTC: {stdout}"
        );
        eprintln!("skipping the build: {stdout}");
        return;
    }
    assert!(stdout.contains("BUILT sm_90a"), "{stdout}");
}

/// The attention task's module also carries `patch_mlx_lm_llama` (python/ksearch_mlx/export_llama.py):
/// by default it patches mlx-lm's Llama attention with the module's own kernel where the kernel's
/// builds admit the shape. Here KERNEL is replaced by attention in MLX ops (MLX's CPU back-end
/// cannot run the CUDA unit): a tiny GQA Llama's prefill runs it in both layers and gives stock's
/// logits, decode runs stock, and unpatching restores stock. Skips without mlx-lm.
#[test]
fn the_attention_export_patches_mlx_lm_llama_with_its_own_kernel() {
    let Some(py) = python() else { return };
    let has_mlx_lm = std::process::Command::new(&py)
        .args(["-c", "import mlx_lm"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_mlx_lm {
        eprintln!("skipping: `{py}` has no mlx-lm");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (_, out, o) = export_wgmma_attention(d.path());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("patch_mlx_lm_llama()"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text.matches("def patch_mlx_lm_llama(").count(), 1);
    let script = format!(
        "import importlib.util, math, sys\n\
         import mlx.core as mx\n\
         from mlx_lm.models import llama, cache\n\
         spec = importlib.util.spec_from_file_location('attention_mlx', {out:?})\n\
         m = importlib.util.module_from_spec(spec); sys.modules['attention_mlx'] = m; spec.loader.exec_module(m)\n\
         assert 'ksearch_mlx' not in sys.modules\n\
         assert 'patch_mlx_lm_llama' in m.__all__ and 'patch_mlx_lm' not in m.__all__\n\
         calls = []\n\
         def kernel(inputs, axes):\n\
         \x20   calls.append(dict(axes))\n\
         \x20   q, k, v = (inputs[n].astype(mx.float32) for n in 'qkv')\n\
         \x20   r = axes['H'] // axes['Hkv']\n\
         \x20   k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)\n\
         \x20   s = (q @ k.swapaxes(-1, -2)) / math.sqrt(axes['D'])\n\
         \x20   L = axes['L']\n\
         \x20   s = mx.where(mx.arange(L)[:, None] >= mx.arange(L)[None], s, -mx.inf) if axes['causal'] else s\n\
         \x20   return {{'o': (mx.softmax(s, axis=-1) @ v).astype(mx.float16)}}\n\
         m.KERNEL = kernel\n\
         mx.random.seed(0)\n\
         a = llama.ModelArgs(model_type='llama', hidden_size=128, num_hidden_layers=2, intermediate_size=256,\n\
         \x20   num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=101)\n\
         model = llama.Model(a); model.set_dtype(mx.float16)\n\
         ids = mx.random.randint(0, 101, (1, 40))\n\
         def run():\n\
         \x20   c = cache.make_prompt_cache(model)\n\
         \x20   out = [model(ids, cache=c)]\n\
         \x20   out.append(model(mx.argmax(out[0][:, -1:], axis=-1), cache=c))\n\
         \x20   mx.eval(out); return out\n\
         stock = llama.Attention.__call__\n\
         ref = run()\n\
         unpatch = m.patch_mlx_lm_llama(min_len=32, choose='always')\n\
         got = run()\n\
         unpatch()\n\
         assert llama.Attention.__call__ is stock\n\
         assert unpatch.stats == {{'kernel': 2, 'stock': 2}} and unpatch.reasons == {{'short': 2}}, (unpatch.stats, unpatch.reasons)\n\
         # both layers through the kernel (stats), traced once for their shared shape (mx.compile)\n\
         assert calls == [{{'B': 1, 'H': 4, 'Hkv': 2, 'L': 40, 'D': 64, 'causal': 1}}], calls\n\
         for x, y in zip(got, ref):\n\
         \x20   x, y = x.astype(mx.float32), y.astype(mx.float32)\n\
         \x20   assert mx.all(mx.abs(x - y) <= 2e-2 + 2e-2 * mx.abs(y)).item(), mx.max(mx.abs(x - y)).item()\n\
         print('PATCHED-OK')\n",
        out = out.display().to_string(),
    );
    let p = std::process::Command::new(&py)
        .arg("-c")
        .arg(&script)
        .current_dir(d.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&p.stdout);
    assert!(p.status.success(), "{stdout}{}", String::from_utf8_lossy(&p.stderr));
    assert!(stdout.contains("PATCHED-OK"), "{stdout}");
}
