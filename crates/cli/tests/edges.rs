//! The rough edges of a first hour: every error is one line naming the file and its cause
//! once, commands that only read create nothing, a closed pipe ends quietly, broken tasks are
//! caught at load without hiding the others.

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn ks() -> Command {
    let mut c = Command::cargo_bin("ksearch").unwrap();
    c.current_dir(repo()).arg("--quiet");
    c
}

fn err(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
fn out(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A one-line error (exit 2) that contains every one of `needles`.
fn one_line_error(o: &std::process::Output, needles: &[&str]) {
    let e = err(o);
    assert_eq!(o.status.code(), Some(2), "{}{e}", out(o));
    assert_eq!(e.trim().lines().count(), 1, "one line expected: {e}");
    for n in needles {
        assert!(e.contains(n), "`{n}` missing from: {e}");
    }
}

/// Names, sizes and a checksum of the files in `dir`.
fn listing(dir: &Path) -> Vec<(String, usize, u64)> {
    let mut v: Vec<(String, usize, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let data = if e.path().is_file() {
                std::fs::read(e.path()).unwrap()
            } else {
                vec![]
            };
            let sum = data
                .iter()
                .fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3));
            (e.file_name().to_string_lossy().into_owned(), data.len(), sum)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn read_only_commands_create_nothing_and_name_a_missing_store() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("no/such/dir/store.db");
    for args in [vec!["runs"], vec!["tree", "1"], vec!["best", "1"], vec!["log", "1"]] {
        let o = ks().arg("--store").arg(&missing).args(&args).output().unwrap();
        one_line_error(&o, &[&missing.display().to_string(), "no such file"]);
        assert!(!d.path().join("no").exists(), "{args:?} created a folder");
    }
    // Without --store: the default store is not created either.
    let cwd = tempfile::tempdir().unwrap();
    let o = ks().current_dir(cwd.path()).arg("runs").output().unwrap();
    one_line_error(&o, &[".ksearch/store.db", "no such file"]);
    assert!(listing(cwd.path()).is_empty(), "{:?}", listing(cwd.path()));

    // An existing store is read without a byte changed or a file added.
    let s = d.path().join("s.db");
    {
        let st = ksearch_store::Store::open(&s).unwrap();
        let run = st
            .create_run(
                "softmax",
                ksearch_core::Backend::Cpu,
                "offline",
                1,
                "",
                &serde_json::json!({}),
            )
            .unwrap();
        let seed = ksearch_core::tree::Node::new(0, None, ksearch_core::tree::Action::Seed, None, Default::default(), 0);
        st.insert_node(run, &seed).unwrap();
    }
    let before = listing(d.path());
    for args in [vec!["runs"], vec!["tree", "1"], vec!["best", "1"], vec!["log", "1"]] {
        let o = ks().arg("--store").arg(&s).args(&args).output().unwrap();
        assert!(matches!(o.status.code(), Some(0) | Some(1)), "{args:?}: {}", err(&o));
        assert_eq!(listing(d.path()), before, "{args:?} changed the store's folder");
    }
}

#[test]
fn a_file_that_is_not_a_store_is_named_with_its_cause_once() {
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("notes.db");
    std::fs::write(&s, "this is not a database, just some text that is long enough").unwrap();
    for args in [vec!["runs"], vec!["run", "softmax", "--rounds", "1"]] {
        let o = ks().arg("--store").arg(&s).args(&args).output().unwrap();
        one_line_error(&o, &[&s.display().to_string(), "file is not a database"]);
        assert_eq!(err(&o).matches("not a database").count(), 1, "{}", err(&o));
        assert!(!err(&o).contains("Error code"), "{}", err(&o));
    }
}

#[test]
fn a_closed_pipe_ends_quietly() {
    for args in [vec!["kb", "rules"], vec!["tasks"]] {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ksearch"))
            .current_dir(repo())
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before the first line is written (`| head -0`).
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        assert_ne!(o.status.code(), Some(101), "{args:?} panicked: {}", err(&o));
        assert!(!err(&o).contains("panicked"), "{args:?}: {}", err(&o));
        assert!(err(&o).trim().is_empty(), "{args:?}: {}", err(&o));
    }
}

#[test]
fn a_run_whose_reader_went_away_still_runs_to_the_end() {
    // `ksearch run … | head -0`: the run's lines go nowhere, its work is still done and kept.
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.db");
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ksearch"))
        .current_dir(repo())
        .arg("--store")
        .arg(&s)
        .args(["run", "softmax", "--backend", "cpu", "--rounds", "1", "--max-reps", "3"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    // 0 with a result, 1 where the search validated none (a one-round search on a noisy machine may
    // not): either way the run ended as it would have with a reader, not with a broken pipe.
    assert!(matches!(o.status.code(), Some(0 | 1)), "{:?}: {}", o.status, err(&o));
    assert!(
        !err(&o).contains("panicked") && !err(&o).contains("Broken pipe"),
        "{}",
        err(&o)
    );
    let st = ksearch_store::Store::open_read_only(&s).unwrap();
    let run = st.run(1).unwrap();
    assert!(run.status == "done" || run.status == "done_no_result", "{run:?}");
    assert!(run.stop_reason.is_some(), "{run:?}");
}

/// Copy a folder tree (a task and its kernels).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), &dst).unwrap();
        }
    }
}

#[test]
fn task_expressions_are_checked_at_load_and_a_broken_task_hides_no_other() {
    for (flops, needle) in [
        ("5 * rows * colz", "unknown axis `colz`"),
        ("5 * rows / (cols - cols)", "division by zero"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let tasks = d.path().join("tasks");
        copy_dir(&repo().join("tasks/softmax"), &tasks.join("softmax"));
        copy_dir(&repo().join("tasks/rmsnorm"), &tasks.join("rmsnorm"));
        let f = tasks.join("softmax/task.toml");
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(text.contains("flops = \"5 * rows * cols\""), "the softmax task changed");
        std::fs::write(
            &f,
            text.replace("flops = \"5 * rows * cols\"", &format!("flops = \"{flops}\"")),
        )
        .unwrap();

        let o = ks().arg("--tasks-dir").arg(&tasks).arg("tasks").output().unwrap();
        one_line_error(&o, &["softmax/task.toml:5:", needle]);
        assert!(out(&o).contains("rmsnorm"), "the good task is still listed: {}", out(&o));
        assert!(!out(&o).contains("softmax"), "{}", out(&o));

        let s = d.path().join("s.db");
        let o = ks()
            .arg("--tasks-dir")
            .arg(&tasks)
            .arg("--store")
            .arg(&s)
            .args(["run", "softmax", "--rounds", "1"])
            .output()
            .unwrap();
        one_line_error(&o, &["softmax/task.toml:5:", needle]);
        assert!(!s.exists(), "no run recorded for a broken task");
    }
}

#[test]
fn emulated_workloads_belong_to_the_emulated_back_ends_only() {
    let d = tempfile::tempdir().unwrap();
    let tasks = d.path().join("tasks");
    copy_dir(&repo().join("tasks/softmax"), &tasks.join("softmax"));
    let f = tasks.join("softmax/task.toml");
    let text = std::fs::read_to_string(&f).unwrap();
    let anchor = "[backends.cpu]\nsearch = [";
    assert!(text.contains(anchor), "the softmax task changed");
    std::fs::write(
        &f,
        text.replacen(anchor, "[backends.cpu]\nemulate = [{ rows = 2, cols = 3 }]\nsearch = [", 1),
    )
    .unwrap();
    let o = ks().arg("--tasks-dir").arg(&tasks).arg("tasks").output().unwrap();
    one_line_error(
        &o,
        &[
            "softmax/task.toml:",
            "backends.cpu.emulate: only the mlx-metal, cuda and mlx-cuda back-ends",
        ],
    );
}

#[test]
fn a_compile_time_out_too_short_to_mean_anything_is_refused_in_one_line() {
    let d = tempfile::tempdir().unwrap();
    let o = ks()
        .arg("--store")
        .arg(d.path().join("s.db"))
        .args([
            "run",
            "softmax",
            "--backend",
            "cpu",
            "--rounds",
            "1",
            "--compile-timeout",
            "1ms",
        ])
        .output()
        .unwrap();
    one_line_error(&o, &["compile time-out 1ms is too short", "at least 1s"]);
    assert!(!err(&o).contains("worker did not start"), "{}", err(&o));
}

#[test]
fn a_define_the_kernel_file_makes_itself_is_an_error_not_ignored() {
    let d = tempfile::tempdir().unwrap();
    let k = d.path().join("k.cpp");
    std::fs::write(
        &k,
        "#include <cstdint>\n#define VEC 8\nextern \"C\" void softmax_naive() {}\n",
    )
    .unwrap();
    let o = ks()
        .arg("--store")
        .arg(d.path().join("s.db"))
        .args(["bench", "softmax", k.to_str().unwrap(), "--backend", "cpu", "-D", "VEC=16"])
        .output()
        .unwrap();
    one_line_error(&o, &[&format!("{}:2:", k.display()), "defines VEC itself", "#ifndef VEC"]);
}

#[test]
fn a_compile_error_in_a_benched_file_names_that_file_and_line() {
    let d = tempfile::tempdir().unwrap();
    let k = d.path().join("mine.cpp");
    std::fs::write(
        &k,
        "#include <cstdint>\nextern \"C\" void softmax(void** bufs, const int64_t* dims) {\n  undefined_thing = 1;\n}\n",
    )
    .unwrap();
    let o = ks()
        .arg("--store")
        .arg(d.path().join("s.db"))
        .args(["bench", "softmax", k.to_str().unwrap(), "--backend", "cpu"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}{}", out(&o), err(&o));
    let text = out(&o);
    assert!(text.contains(&format!("{}:3:", k.display())), "{text}");
    assert!(!text.contains("kernel.cpp"), "{text}");
    assert!(!text.contains("timings noisy"), "no figures, no noise line: {text}");
}

#[test]
fn resume_refuses_a_task_changed_since_the_run_started_and_a_new_seed_or_back_end() {
    let d = tempfile::tempdir().unwrap();
    let tasks = d.path().join("tasks");
    copy_dir(&repo().join("tasks/softmax"), &tasks.join("softmax"));
    let store = d.path().join("s.db");
    let o = ks()
        .arg("--tasks-dir")
        .arg(&tasks)
        .arg("--store")
        .arg(&store)
        .args(["run", "softmax", "--backend", "cpu", "--rounds", "1", "--max-reps", "3"])
        .output()
        .unwrap();
    assert!(o.status.code().is_some_and(|c| c <= 1), "{}{}", out(&o), err(&o));
    let resume = |extra: &[&str]| {
        ks().arg("--tasks-dir")
            .arg(&tasks)
            .arg("--store")
            .arg(&store)
            .args(["resume", "1", "--rounds", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    one_line_error(
        &resume(&["--seed", "99"]),
        &["run 1 draws its inputs with seed", "keeps its seed"],
    );
    one_line_error(&resume(&["--backend", "cuda"]), &["run 1 runs on cpu", "keeps its back-end"]);
    // A kernel file edited since: the seed would be measured against a different task.
    let seed = tasks.join("softmax/cpu/naive.cpp");
    let mut text = std::fs::read_to_string(&seed).unwrap();
    text.push_str("\n// edited\n");
    std::fs::write(&seed, text).unwrap();
    one_line_error(
        &resume(&[]),
        &["task `softmax` changed since run 1 started", "start a new run"],
    );
    // A run whose process died says `running` in the store; nobody holds its lock, so the list
    // calls it interrupted.
    ksearch_store::Store::open(&store)
        .unwrap()
        .set_run_status(1, "running", None)
        .unwrap();
    let o = ks().arg("--store").arg(&store).arg("runs").output().unwrap();
    assert!(
        out(&o).contains(" interrupted ") && !out(&o).contains(" running "),
        "{}",
        out(&o)
    );
}

#[test]
fn task_file_mistakes_are_named_at_load_not_blamed_on_a_kernel() {
    // (task, text in its task.toml, what replaces it, what the one-line error must say). The
    // last three: a held-out workload no machine addresses, one the reference does not define
    // (H not a multiple of Hkv) and one the seed cannot run (its constraint) are named at load,
    // not after the whole search.
    let cases: &[(&str, &str, &str, &[&str])] = &[
        (
            "softmax",
            "f32 = { atol = 1e-6, rtol = 1e-4 }",
            "f32 = { atol = nan, rtol = 1e-4 }",
            &["atol and rtol must be finite"],
        ),
        (
            "softmax",
            "heldout = [\n",
            "heldout = [\n    { rows = 0, cols = 100 },\n",
            &["has shape [0, 100]"],
        ),
        (
            "softmax",
            "name = \"VEC\"",
            "name = \"V EC; rm -rf /\"",
            &["a tunable's name is an identifier"],
        ),
        (
            "softmax",
            "name = \"rows_simd\"",
            "name = \"seed\"",
            &["two kernels are named `seed`"],
        ),
        (
            "softmax",
            "heldout = [\n",
            "heldout = [\n    { rows = 4294967296, cols = 4294967296 },\n",
            &["more bytes than a 64-bit machine addresses"],
        ),
        (
            "attention",
            "heldout = [\n",
            "heldout = [\n    { B = 1, H = 6, Hkv = 4, L = 17, D = 32, causal = 0 },\n",
            &[
                "heldout[0] (B=1,H=6,Hkv=4,L=17,D=32,causal=0)",
                "H = 6 is not a multiple of Hkv = 4",
            ],
        ),
        (
            "attention",
            "constraints = [\"H % Hkv == 0\"]",
            "constraints = [\"H % Hkv == 0\", \"D <= 64\"]",
            &[
                "heldout[1] (B=2,H=2,Hkv=2,L=129,D=80,causal=0)",
                "the seed's constraint `D <= 64`",
            ],
        ),
    ];
    for (task, from, to, want) in cases {
        let base = std::fs::read_to_string(repo().join(format!("tasks/{task}/task.toml"))).unwrap();
        let d = tempfile::tempdir().unwrap();
        let tasks = d.path().join("tasks");
        copy_dir(&repo().join("tasks").join(task), &tasks.join(task));
        assert!(base.contains(from), "{task}'s task.toml changed: {from}");
        std::fs::write(tasks.join(task).join("task.toml"), base.replacen(from, to, 1)).unwrap();
        let o = ks()
            .arg("--tasks-dir")
            .arg(&tasks)
            .args(["run", task, "--backend", "cpu"])
            .output()
            .unwrap();
        let file = format!("{task}/task.toml");
        let mut needles = vec![file.as_str()];
        needles.extend_from_slice(want);
        one_line_error(&o, &needles);
    }
}

#[test]
fn unusable_flags_and_settings_are_one_line_errors_before_any_run() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("s.db");
    let cases: &[(&[&str], &[&str])] = &[
        (&["--time-budget", "300000000000years"], &["longer than a year"]),
        (&["--run-timeout", "18446744073709551615s"], &["longer than a year"]),
        (&["--mem-limit", "1KiB"], &["too small for a runner"]),
        (&["--max-reps", "0"], &["a kernel is timed at least once"]),
        (&["--patience", "0"], &["patience 0"]),
        (&["--rounds", "0"], &["rounds 0", "at least 1"]),
        (
            &[
                "--planner",
                "llm",
                "--model",
                "m",
                "--base-url",
                "https://u:pw@example.invalid/v1",
            ],
            &["carries credentials"],
        ),
        (
            &[
                "--planner",
                "llm",
                "--model",
                "m",
                "--base-url",
                "https://example.invalid/v1?key=abc",
            ],
            &["carries a key in its query"],
        ),
    ];
    for (extra, want) in cases {
        let o = ks()
            .arg("--store")
            .arg(&store)
            .args(["run", "softmax", "--backend", "cpu"])
            .args(*extra)
            .output()
            .unwrap();
        one_line_error(&o, want);
    }
    // A held-out workload no worker can hold is refused before the search, not after it.
    let tasks = d.path().join("tasks");
    copy_dir(&repo().join("tasks/softmax"), &tasks.join("softmax"));
    let toml = std::fs::read_to_string(tasks.join("softmax/task.toml")).unwrap();
    assert!(toml.contains("heldout = [\n"));
    std::fs::write(
        tasks.join("softmax/task.toml"),
        toml.replacen("heldout = [\n", "heldout = [\n    { rows = 65536, cols = 2048 },\n", 1),
    )
    .unwrap();
    let o = ks()
        .arg("--store")
        .arg(&store)
        .arg("--tasks-dir")
        .arg(&tasks)
        .args(["run", "softmax", "--backend", "cpu", "--mem-limit", "512MiB"])
        .output()
        .unwrap();
    one_line_error(
        &o,
        &["heldout[0] (rows=65536,cols=2048)", "1.0 GiB", "512.0 MiB", "--mem-limit"],
    );
    let o = ks().arg("--kb-dir").arg(d.path()).args(["kb", "profiles"]).output().unwrap();
    one_line_error(&o, &["--kb-dir"]);
    let o = ks().arg("--config").arg(d.path()).arg("runs").output().unwrap();
    one_line_error(&o, &["not a regular file"]);
    // Nothing was recorded for any of them.
    assert!(!store.exists() || ksearch_store::Store::open(&store).unwrap().runs().unwrap().is_empty());
}

#[test]
fn task_and_source_files_that_cannot_be_read_are_named_not_skipped_or_read_forever() {
    let d = tempfile::tempdir().unwrap();
    let tasks = d.path().join("tasks");
    copy_dir(&repo().join("tasks/softmax"), &tasks.join("softmax"));
    // A task.toml that is a folder, and one that is a link to itself.
    std::fs::create_dir_all(tasks.join("folder/task.toml")).unwrap();
    std::fs::create_dir_all(tasks.join("looped")).unwrap();
    std::os::unix::fs::symlink("task.toml", tasks.join("looped/task.toml")).unwrap();
    // A folder without a task.toml is not a task and not an error.
    std::fs::create_dir_all(tasks.join("notes")).unwrap();

    let o = ks().arg("--tasks-dir").arg(&tasks).arg("tasks").output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}{}", out(&o), err(&o));
    assert!(out(&o).starts_with("softmax"), "the good task is still listed: {}", out(&o));
    let e = err(&o);
    assert_eq!(e.trim().lines().count(), 2, "one line per broken task: {e}");
    assert!(e.contains("folder/task.toml: not a regular file"), "{e}");
    assert!(e.contains("looped/task.toml") && e.contains("symbolic links"), "{e}");
    assert!(!e.contains("notes"), "{e}");

    let s = d.path().join("s.db");
    let o = ks()
        .arg("--tasks-dir")
        .arg(&tasks)
        .arg("--store")
        .arg(&s)
        .args(["run", "looped", "--rounds", "1"])
        .output()
        .unwrap();
    one_line_error(&o, &["looped/task.toml", "symbolic links"]);

    // Sources are read only from regular files of at most 8 MiB.
    let big = d.path().join("big.cpp");
    std::fs::File::create(&big).unwrap().set_len(9 << 20).unwrap();
    for (file, why) in [
        ("/dev/zero", "not a regular file"),
        (big.to_str().unwrap(), "larger than 8 MiB"),
    ] {
        let o = ks().arg("--store").arg(&s).args(["bench", "softmax", file]).output().unwrap();
        one_line_error(&o, &[file, why]);
    }
    assert!(!s.exists(), "nothing recorded");
}
