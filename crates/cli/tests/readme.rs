//! The README's shell examples paste into a shell as written: every command line in a ```sh
//! block is a command of its own (no `kb …` after a pipe as if it were a program), has no
//! unquoted brackets (a shell glob), and every `ksearch` line names a real subcommand and
//! parses with the real binary.

use std::path::Path;

fn readme() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap();
    std::fs::read_to_string(root.join("README.md")).unwrap()
}

/// Lines of the ```sh blocks, comments removed.
fn sh_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for l in text.lines() {
        if l.trim_start().starts_with("```") {
            inside = !inside && l.trim() == "```sh";
            continue;
        }
        if inside {
            let code = strip_comment(l).trim().to_string();
            if !code.is_empty() {
                out.push(code);
            }
        }
    }
    out
}

/// The line up to an unquoted `#` that starts a word.
fn strip_comment(l: &str) -> &str {
    let (mut q, mut prev) = (None, ' ');
    for (i, c) in l.char_indices() {
        match (q, c) {
            (None, '"' | '\'') => q = Some(c),
            (Some(o), c) if c == o => q = None,
            (None, '#') if prev.is_whitespace() => return &l[..i],
            _ => {}
        }
        prev = c;
    }
    l
}

/// Split on unquoted whitespace (quotes removed).
fn words(l: &str) -> Vec<String> {
    let (mut out, mut cur, mut q) = (Vec::new(), String::new(), None);
    for c in l.chars() {
        match (q, c) {
            (None, '"' | '\'') => q = Some(c),
            (Some(o), c) if c == o => q = None,
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[test]
fn readme_shell_examples_paste_as_written() {
    let lines = sh_lines(&readme());
    assert!(lines.len() >= 15, "only {} shell lines found", lines.len());
    let subcommands = [
        "run",
        "resume",
        "runs",
        "tree",
        "best",
        "export",
        "bench",
        "tasks",
        "log",
        "kb",
        "report",
        "translate",
    ];
    let mut ksearch_lines = 0;
    for l in &lines {
        let w = words(l);
        for seg in l.split('|').skip(1) {
            let first = words(seg).into_iter().next().unwrap_or_default();
            assert!(
                !subcommands.contains(&first.as_str()),
                "`{l}`: after the pipe `{first}` would run as a program of its own"
            );
        }
        for word in &w {
            assert!(
                !word.contains('[') && !word.contains(']'),
                "`{l}`: `{word}` is a shell glob, not an argument"
            );
            assert!(!word.contains('…'), "`{l}`: an ellipsis does not paste");
        }
        if w.first().map(String::as_str) != Some("ksearch") {
            continue;
        }
        ksearch_lines += 1;
        let sub = w.get(1).map(String::as_str).unwrap_or("");
        assert!(subcommands.contains(&sub), "`{l}`: no subcommand `{sub}`");
        // The arguments parse: with an unknown flag appended, the real binary complains about
        // that flag only when everything before it parsed (and runs nothing).
        let o = std::process::Command::new(assert_cmd::cargo::cargo_bin("ksearch"))
            .args(&w[1..])
            .arg("--this-flag-does-not-exist")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("unexpected argument '--this-flag-does-not-exist'"),
            "`{l}`: its own arguments do not parse: {err}"
        );
    }
    assert!(ksearch_lines >= 15, "only {ksearch_lines} ksearch lines checked");
}

#[test]
fn readme_says_how_to_install_and_where_the_binary_lands() {
    let r = readme();
    assert!(r.contains("cargo install --path crates/cli"), "no install command");
    assert!(r.contains("~/.cargo/bin/ksearch"), "where the binary lands is not said");
    assert!(r.contains("export PATH=\"$HOME/.cargo/bin:$PATH\""), "no PATH line");
}
