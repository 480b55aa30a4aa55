//! The repository's tasks with the CPU softmax at smaller shapes, for the tests whose subject is
//! the search's machinery (planners, resume, signals, locks, reports) rather than the kernels'
//! speed: the same task, kernels, references and judge, at an eighth of the elements, so a
//! search evaluates in milliseconds instead of seconds on a busy machine; the seed slowed by
//! kept work, so the search's course (a faster candidate, a final phase) does not hang on
//! noise. The copy lives under Cargo's per-target temporary directory, one per content, shared
//! by every test process.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The softmax CPU workloads of the quick tasks: (rows, cols) searched, then held out.
pub const SEARCH: [(i64, i64); 2] = [(64, 4096), (256, 1024)];
pub const HELDOUT: [(i64, i64); 2] = [(37, 3000), (77, 1001)];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &Path, base: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("tasks dir")
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            files(&p, base, out);
        } else {
            out.push((p.strip_prefix(base).unwrap().to_path_buf(), std::fs::read(&p).unwrap()));
        }
    }
}

fn shapes(v: &[(i64, i64)]) -> toml::Value {
    toml::Value::Array(
        v.iter()
            .map(|(r, c)| {
                let mut t = toml::Table::new();
                t.insert("rows".into(), toml::Value::Integer(*r));
                t.insert("cols".into(), toml::Value::Integer(*c));
                toml::Value::Table(t)
            })
            .collect(),
    )
}

/// The quick tasks directory (made on first use).
pub fn tasks() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let src = repo().join("tasks");
        let mut all = Vec::new();
        files(&src, &src, &mut all);
        let softmax = Path::new("softmax").join("task.toml");
        let seed = Path::new("softmax").join("cpu").join("naive.cpp");
        for (rel, bytes) in all.iter_mut() {
            if *rel == seed {
                // The seed made slower by work the compiler must keep (volatile), so the library's
                // kernel beats it even on a loaded machine: every search has a faster candidate,
                // follow-ups that do not regress, and a final phase to reach.
                let src = String::from_utf8(bytes.clone()).unwrap();
                let tail = "        for (int64_t c = 0; c < cols; c++) yr[c] /= s;\n";
                assert!(src.contains(tail), "the softmax seed changed");
                let slow = format!(
                    "{tail}        volatile float sink = 0.0f;\n        for (int64_t c = 0; c < 3 * cols; c++) sink = sink + 1.0f;\n"
                );
                *bytes = src.replace(tail, &slow).into_bytes();
            }
            if *rel == softmax {
                let mut t: toml::Table = toml::from_str(std::str::from_utf8(bytes).unwrap()).unwrap();
                let cpu = t["backends"]
                    .as_table_mut()
                    .and_then(|b| b.get_mut("cpu"))
                    .and_then(|c| c.as_table_mut())
                    .expect("softmax has a cpu back-end");
                cpu.insert("search".into(), shapes(&SEARCH));
                cpu.insert("heldout".into(), shapes(&HELDOUT));
                *bytes = toml::to_string(&t).unwrap().into_bytes();
            }
        }
        let mut h = Sha256::new();
        for (rel, bytes) in &all {
            h.update(rel.to_string_lossy().as_bytes());
            h.update([0]);
            h.update(bytes);
        }
        let hex: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("quick-tasks-{hex}"));
        if !dir.exists() {
            // Written beside, then renamed: a test process never sees half a copy.
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("quick-tasks-{hex}.{}", std::process::id()));
            for (rel, bytes) in &all {
                let p = tmp.join(rel);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(&p, bytes).unwrap();
            }
            if std::fs::rename(&tmp, &dir).is_err() {
                // Another process made it first.
                let _ = std::fs::remove_dir_all(&tmp);
            }
        }
        dir
    })
    .clone()
}
