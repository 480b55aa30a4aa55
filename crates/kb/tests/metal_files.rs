//! Every `*.metal` file in the repository passes the rules and the Linux syntax check (files
//! under a `reject/` directory must be rejected). `scripts/check-metal.sh` runs this when the
//! `ksearch kb` subcommand is not available.

use std::path::{Path, PathBuf};

use ksearch_kb::{BodySig, CheckOptions, Kb, SourceLang, check, find_cxx, metal_syntax_check, rejected};

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.filter_map(|e| e.ok()) {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                walk(&p, out);
            }
        } else if name.ends_with(".metal") {
            out.push(p);
        }
    }
}

fn is_kernel_file(src: &str) -> bool {
    src.lines().any(|l| {
        let l = l.trim_start();
        !l.starts_with("//") && (l.contains("[[kernel") || l.contains("kernel void"))
    })
}

fn sig_for(path: &Path, src: &str) -> BodySig {
    if let Some(s) = BodySig::from_comments(src) {
        return s;
    }
    let dir = path.parent().unwrap();
    let toml = dir.parent().unwrap().join("task.toml");
    if let Ok(task) = ksearch_core::Task::load(&toml) {
        let rel = format!(
            "{}/{}",
            dir.file_name().unwrap().to_string_lossy(),
            path.file_name().unwrap().to_string_lossy()
        );
        let backend = [ksearch_core::Backend::MlxMetal, ksearch_core::Backend::MlxCuda]
            .into_iter()
            .find(|b| task.backend(*b).is_some())
            .unwrap_or(ksearch_core::Backend::MlxMetal);
        return BodySig::from_task(&task, backend, Some(&rel));
    }
    BodySig::default()
}

#[test]
fn every_metal_file_in_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let kb = Kb::load(&root.join("kb")).unwrap();
    let profile = kb.profile("generic-apple").unwrap();
    let mut files = Vec::new();
    walk(&root, &mut files);
    files.sort();
    assert!(files.iter().any(|f| f.ends_with("kb/examples/softmax_rows.metal")));
    let cxx = find_cxx().is_some();
    if !cxx {
        eprintln!("warning: no C++ compiler: rules only");
    }
    let mut failures = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        let whole = is_kernel_file(&src);
        let lang = if whole { SourceLang::Metal } else { SourceLang::MlxMetal };
        let v = check(&kb, &src, lang, profile, &CheckOptions::default());
        let mut bad = rejected(&v);
        let mut why: Vec<String> = v.iter().map(|v| v.to_string()).collect();
        if cxx {
            let sig = (!whole).then(|| sig_for(f, &src));
            if let Err(e) = metal_syntax_check(&src, sig.as_ref()) {
                bad = true;
                why.push(e);
            }
        }
        let expect_reject = f.components().any(|c| c.as_os_str() == "reject");
        eprintln!("{} {}", if bad { "rejected" } else { "accepted" }, f.display());
        if bad != expect_reject {
            failures.push(format!(
                "{}: expected {}: {}",
                f.display(),
                if expect_reject { "rejection" } else { "acceptance" },
                why.join("; ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
