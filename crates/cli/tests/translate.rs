//! `ksearch translate` end to end: the real binary against a scripted OpenAI-compatible server on
//! 127.0.0.1; every reply is checked by the Metal rules, the syntax check and the executor before
//! it is kept, and what fails goes back to the model.

mod support;

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use support::{Reply, Server};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ksearch() -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(root()).env_remove("OPENAI_API_KEY");
    c
}

/// The softmax Metal seed, as a model would write it.
fn good_body() -> String {
    std::fs::read_to_string(root().join("tasks/softmax/mlx/naive.metal")).unwrap()
}

fn fenced(body: &str) -> String {
    format!("Here is the Metal body.\n\n```metal\n{body}\n```\n")
}

/// `ksearch translate softmax --kernel seed` against `srv`, writing to `out`, with `extra` flags.
fn translate(srv: &Server, out: &Path, extra: &[&str]) -> std::process::Output {
    ksearch()
        .args([
            "translate",
            "softmax",
            "--kernel",
            "seed",
            "--model",
            "scripted",
            "--base-url",
            &srv.base_url(),
            "-o",
        ])
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn a_wrong_translation_goes_back_to_the_model_and_the_verified_one_is_kept() {
    // Round 1 forgets to normalise (y = exp(x - m)); round 2 is right.
    let wrong = good_body().replace("* inv;", ";");
    assert_ne!(wrong, good_body());
    let (w, g) = (fenced(&wrong), fenced(&good_body()));
    let srv = Server::new(move |_, i| Reply::completion(if i == 0 { &w } else { &g }));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("softmax.metal");
    let o = translate(&srv, &out, &[]);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("round 1: run on the task's workloads"), "{text}");
    assert!(
        text.contains("translated mlx-cuda `seed` of task `softmax` to Metal in 2 round(s)"),
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim_end(), good_body().trim_end());
    // The prompt carries the source, the interface and the translation layer's Metal knowledge;
    // the second request carries the first reply and what was wrong with it.
    let reqs = srv.requests();
    assert_eq!(reqs.len(), 2);
    let first = reqs[0].body["messages"][1]["content"].as_str().unwrap().to_string();
    assert!(
        first.contains("__syncthreads") && first.contains("simd_shuffle_xor"),
        "{first}"
    );
    assert!(first.contains("grid (rows * 256, 1, 1) threads"), "{first}");
    let msgs = reqs[1].body["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 4);
    assert_eq!(msgs[2]["role"], "assistant");
    assert!(
        msgs[3]["content"].as_str().unwrap().contains("mismatched"),
        "{}",
        msgs[3]["content"]
    );
}

#[test]
fn no_verified_translation_after_the_rounds_is_exit_1_with_the_last_attempt_kept_aside() {
    // A body with Metal's 32 KB limit broken, then one that does not compile.
    let big = fenced("threadgroup float t[16384];\nt[0] = 1.0f;\ny[0] = t[0];\n");
    let broken = fenced("y[thread_position_in_grid.x] = undeclared_value;\n");
    let srv = Server::new(move |_, i| Reply::completion(if i == 0 { &big } else { &broken }));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("softmax.metal");
    let o = translate(&srv, &out, &["--rounds", "2"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(1), "{text}{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("round 1: the translation layer's rules rejected it"), "{text}");
    assert!(text.contains("round 2: it does not compile"), "{text}");
    assert!(!out.exists());
    let kept = dir.path().join("softmax.rejected.metal");
    assert!(std::fs::read_to_string(kept).unwrap().contains("undeclared_value"));
    // The second prompt told the model about the 32 KB rule.
    let reqs = srv.requests();
    let last = reqs[1].body["messages"][3]["content"].as_str().unwrap().to_string();
    assert!(last.contains("threadgroup memory 65536 B exceeds 32768 B"), "{last}");
}

#[test]
fn usage_errors_are_one_line() {
    for (args, want) in [
        (
            vec!["translate", "softmax", "--kernel", "nope", "--model", "m", "-o", "x.metal"],
            "no mlx-cuda or cuda kernel `nope`",
        ),
        (
            vec![
                "translate",
                "softmax",
                "--kernel",
                "seed",
                "--from",
                "cpu",
                "--model",
                "m",
                "-o",
                "x.metal",
            ],
            "translate takes a CUDA kernel",
        ),
        (
            vec!["translate", "softmax", "--kernel", "seed", "-o", "x.metal"],
            "no model configured",
        ),
    ] {
        let o = ksearch().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{args:?}: {err}");
    }
}
