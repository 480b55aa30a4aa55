//! The "Adding your own op" walkthrough of `docs/task-format.md`, built from the doc's own text:
//! every fenced block whose info string says `file=PATH` becomes that file in a temporary
//! folder, and the commands of its ```` ```sh walkthrough ```` block run there with the real
//! binary. Then the task's own reference is shown to be the one that judges: a wrong kernel
//! fails against it, the right seed fails against a changed reference, and a broken or missing
//! reference is one clear line.

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn doc() -> String {
    std::fs::read_to_string(repo().join("docs/task-format.md")).unwrap()
}

/// Every fenced block of `text` with its info string.
fn fenced(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(String, String)> = None;
    for line in text.lines() {
        match (&mut cur, line.strip_prefix("```")) {
            (None, Some(info)) => cur = Some((info.trim().to_string(), String::new())),
            (Some(_), Some(rest)) if rest.trim().is_empty() => out.push(cur.take().unwrap()),
            (Some((_, body)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// The walkthrough's files: (path, text) for every block whose info string has `file=PATH`.
fn files(text: &str) -> Vec<(String, String)> {
    fenced(text)
        .into_iter()
        .filter_map(|(info, body)| {
            info.split_whitespace()
                .find_map(|w| w.strip_prefix("file="))
                .map(|p| (p.to_string(), body))
        })
        .collect()
}

/// The walkthrough's commands, each split into words (comments dropped).
fn commands(text: &str) -> Vec<Vec<String>> {
    let (_, body) = fenced(text)
        .into_iter()
        .find(|(info, _)| info == "sh walkthrough")
        .expect("the doc has a ```sh walkthrough block");
    body.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

/// The walkthrough's files written under `root`; the path of its task folder.
fn build(root: &Path) -> PathBuf {
    let fs = files(&doc());
    for (path, body) in &fs {
        assert!(!path.contains(".."), "{path}");
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, body).unwrap();
    }
    let paths: Vec<&str> = fs.iter().map(|(p, _)| p.as_str()).collect();
    for want in [
        "tasks/layernorm/task.toml",
        "tasks/layernorm/reference.cpp",
        "tasks/layernorm/cpu/naive.cpp",
    ] {
        assert!(paths.contains(&want), "the walkthrough has no block for {want}: {paths:?}");
    }
    root.join("tasks/layernorm")
}

/// The binary, run in `dir` (where the walkthrough's `tasks/` is), with its store there too.
fn ks(dir: &Path) -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(dir).env_remove("KSEARCH_TASKS").arg("--quiet");
    c
}

fn out(o: &std::process::Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Where pip's NVRTC 13 lives (`nvidia-cuda-nvrtc`, as `scripts/nvrtc-check.sh` installs it):
/// (LD_LIBRARY_PATH, include folder).
fn nvrtc_env() -> Option<(String, String)> {
    // scripts/test.sh exports where it installed NVRTC.
    if let Ok(inc) = std::env::var("KSEARCH_CUDA_INCLUDE")
        && PathBuf::from(&inc).join("cuda_fp16.h").exists()
    {
        return Some((std::env::var("LD_LIBRARY_PATH").unwrap_or_default(), inc));
    }
    let py = std::env::var("KSEARCH_PYTHON")
        .or_else(|_| std::env::var("PYTHON"))
        .unwrap_or_else(|_| "python3".into());
    let o = std::process::Command::new(py)
        .args([
            "-c",
            "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    if !dir.join("lib/libnvrtc.so.13").exists() || !dir.join("include/cuda_fp16.h").exists() {
        return None;
    }
    let mut ld = dir.join("lib").display().to_string();
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        ld = format!("{ld}:{old}");
    }
    Some((ld, dir.join("include").display().to_string()))
}

#[test]
fn the_walkthrough_builds_a_task_that_benches_and_searches() {
    let d = tempfile::tempdir().unwrap();
    build(d.path());
    let cmds = commands(&doc());
    let sub: Vec<&str> = cmds.iter().map(|c| c.get(1).map(String::as_str).unwrap_or("")).collect();
    for want in ["tasks", "bench", "run"] {
        assert!(sub.contains(&want), "the walkthrough runs no `ksearch {want}`: {cmds:?}");
    }
    for c in &cmds {
        assert_eq!(c[0], "ksearch", "a walkthrough command that is not ksearch: {c:?}");
        let mut cmd = ks(d.path());
        cmd.args(&c[1..]);
        match c[1].as_str() {
            "tasks" => {
                let o = cmd.output().unwrap();
                assert!(o.status.success(), "{c:?}: {}", out(&o));
                assert!(String::from_utf8_lossy(&o.stdout).contains("layernorm"), "{c:?}: {}", out(&o));
            }
            "bench" => {
                let o = cmd.output().unwrap();
                assert!(o.status.success(), "{c:?}: {}", out(&o));
                let so = String::from_utf8_lossy(&o.stdout);
                assert!(so.contains("max err") && !so.contains("FAILED"), "{c:?}: {}", out(&o));
            }
            "run" => {
                // Short timing: the search itself is as the doc says.
                let o = cmd.args(["--max-reps", "3"]).output().unwrap();
                assert!(o.status.success(), "{c:?}: {}", out(&o));
                let so = String::from_utf8_lossy(&o.stdout);
                assert!(so.contains("speed-up over the naive seed"), "{c:?}: {}", out(&o));
                assert!(so.contains("held-out validation: passed"), "{c:?}: {}", out(&o));
            }
            "nvrtc-check" => {
                let env = nvrtc_env();
                if let Some((ld, inc)) = &env {
                    cmd.env("LD_LIBRARY_PATH", ld).env("KSEARCH_CUDA_INCLUDE", inc);
                }
                let o = cmd.output().unwrap();
                let text = out(&o);
                if !o.status.success() && text.contains("libnvrtc not found") && std::env::var("KSEARCH_REQUIRE_NVRTC").is_err() {
                    eprintln!("skipping {c:?}: NVRTC is not installed (pip install nvidia-cuda-nvrtc==13.0.*)");
                    continue;
                }
                assert!(o.status.success(), "{c:?}: {text}");
                assert!(text.contains("layernorm/seed") && text.contains(" 0 failed"), "{c:?}: {text}");
            }
            other => {
                let o = cmd.output().unwrap();
                assert!(o.status.success(), "{c:?} ({other}): {}", out(&o));
            }
        }
    }
}

/// A copy of the walkthrough's task under `root/<name>/tasks/layernorm`, with `edit` applied to
/// its files; the tasks folder.
fn variant(root: &Path, name: &str, edit: impl Fn(&str, String) -> String) -> PathBuf {
    let base = root.join(name);
    for (path, body) in files(&doc()) {
        let p = base.join(&path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, edit(&path, body)).unwrap();
    }
    base.join("tasks")
}

/// `text` with `from` replaced by `to`, which must occur.
fn replaced(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "`{from}` not found in:\n{text}");
    text.replacen(from, to, 1)
}

#[test]
fn the_tasks_own_reference_judges_and_a_broken_one_is_one_line() {
    let d = tempfile::tempdir().unwrap();
    let task = build(d.path());
    let seed = std::fs::read_to_string(task.join("cpu/naive.cpp")).unwrap();

    // A kernel that forgets beta fails against the walkthrough's reference.
    let wrong = d.path().join("wrong.cpp");
    std::fs::write(&wrong, replaced(&seed, "+ beta[c]", "")).unwrap();
    let o = ks(d.path())
        .args(["bench", "layernorm", wrong.to_str().unwrap(), "--backend", "cpu"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("FAILED (wrong)"), "{}", out(&o));

    // The right seed fails against a reference that subtracts beta: the file is what judges.
    let tasks = variant(d.path(), "minus", |p, b| {
        if p.ends_with("reference.cpp") {
            replaced(&b, "+ beta[c]", "- beta[c]")
        } else {
            b
        }
    });
    let o = ks(d.path())
        .arg("--tasks-dir")
        .arg(&tasks)
        .args([
            "bench",
            "layernorm",
            task.join("cpu/naive.cpp").to_str().unwrap(),
            "--backend",
            "cpu",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("FAILED (wrong)"), "{}", out(&o));

    // Broken references: (what, edit, command, words the one line names).
    type Edit = Box<dyn Fn(&str, String) -> String>;
    let cases: Vec<(&str, Edit, &str, Vec<&str>)> = vec![
        (
            "does not compile",
            Box::new(|p, b| {
                if p.ends_with("reference.cpp") {
                    replaced(&b, "mean /= cols;", "mean /= cols")
                } else {
                    b
                }
            }),
            "bench",
            vec!["task.toml", "reference.cpp", "does not compile", "error"],
        ),
        (
            "wrong signature",
            Box::new(|p, b| {
                if p.ends_with("reference.cpp") {
                    replaced(&b, "const double* const* inputs", "const float* const* inputs")
                } else {
                    b
                }
            }),
            "bench",
            vec!["reference.cpp", "does not compile", "layernorm_ref"],
        ),
        (
            "unknown entry",
            Box::new(|p, b| {
                if p.ends_with("task.toml") {
                    replaced(&b, "entry = \"layernorm_ref\"", "entry = \"layer_norm\"")
                } else {
                    b
                }
            }),
            "tasks",
            vec!["task.toml:3:", "layer_norm", "not found", "reference.cpp"],
        ),
        (
            "missing file",
            Box::new(|p, b| {
                if p.ends_with("task.toml") {
                    replaced(&b, "file = \"reference.cpp\"", "file = \"ref.cpp\"")
                } else {
                    b
                }
            }),
            "tasks",
            vec!["task.toml:3:", "ref.cpp"],
        ),
    ];
    for (i, (what, edit, command, words)) in cases.into_iter().enumerate() {
        let tasks = variant(d.path(), &format!("case{i}"), edit);
        let mut c = ks(d.path());
        c.arg("--tasks-dir").arg(&tasks).arg(command);
        if command == "bench" {
            c.args(["layernorm", task.join("cpu/naive.cpp").to_str().unwrap(), "--backend", "cpu"]);
        }
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{what}: {}", out(&o));
        assert_eq!(err.trim().lines().count(), 1, "{what}: one line expected: {err}");
        for w in words {
            assert!(err.contains(w), "{what}: `{w}` missing from: {err}");
        }
    }

    // The MLX back-ends do not run a reference the task brings: one line says so.
    let tasks = variant(d.path(), "mlx", |p, b| {
        if p.ends_with("task.toml") {
            b + "\n[backends.mlx-cuda]\nsearch = [{ rows = 4, cols = 256 }]\n[backends.mlx-cuda.seed]\nfile = \"cuda/naive.cu\"\nentry = \"layernorm\"\n"
        } else {
            b
        }
    });
    let o = ks(d.path())
        .arg("--tasks-dir")
        .arg(&tasks)
        .args(["run", "layernorm", "--backend", "mlx-cuda", "--rounds", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{}", out(&o));
    assert!(err.contains("MLX back-ends do not run"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
