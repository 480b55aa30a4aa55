//! References a task brings (`reference = { file = "reference.cpp", entry = "my_ref" }`):
//! plain C++ in f64, compiled with the host compiler through the CPU back-end's verified
//! compile cache and called in the worker, the trusted judge, after the candidate's runs;
//! never in the candidate's runner. It is the task author's code, as trusted as the task file.
//!
//! The ABI (`docs/task-format.md`):
//! `extern "C" void ENTRY(const double* const* inputs, double* const* outputs, const int64_t* dims)`
//! with the inputs and outputs in declared order (outputs zero-filled before the call), `dims`
//! the axis values in declared order, the task's constants as `-DKS_NAME=value` and
//! `-DKS_REFERENCE=1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ksearch_core::task::{FileReference, Task, shape_of};

/// Flags a reference is compiled with: no fast-math, no OpenMP (a reference is plain serial
/// code, read for its clarity).
pub const REFERENCE_FLAGS: &[&str] = &["-O2", "-std=c++17", "-shared", "-fPIC"];

type Entry = unsafe extern "C" fn(*const *const f64, *const *mut f64, *const i64);

struct State {
    cache: Option<PathBuf>,
    /// Loaded references by the hash of source, entry and flags; never unloaded.
    loaded: BTreeMap<String, (libloading::Library, Entry)>,
}

static STATE: Mutex<State> = Mutex::new(State {
    cache: None,
    loaded: BTreeMap::new(),
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The compile cache references of this process use (the back-end's own cache folder).
pub fn set_cache_dir(dir: PathBuf) {
    state().cache = Some(dir);
}

fn cache_dir() -> PathBuf {
    let mut st = state();
    if let Some(c) = &st.cache {
        return c.clone();
    }
    // No back-end set one (a library caller): a folder of this process's own.
    let d = std::env::temp_dir().join(format!("ksearch-reference-{}", std::process::id()));
    st.cache = Some(d.clone());
    d
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Compiler arguments for `task`'s reference.
fn args(task: &Task) -> Vec<String> {
    let mut a: Vec<String> = REFERENCE_FLAGS.iter().map(|s| s.to_string()).collect();
    if cfg!(target_os = "linux") {
        // An entry that is declared but defined nowhere fails here, not at load.
        a.push("-Wl,--no-undefined".into());
    }
    a.push("-DKS_REFERENCE=1".into());
    for (k, v) in &task.constants {
        a.push(format!("-DKS_{}={v:?}", k.to_uppercase()));
    }
    a
}

/// The source as compiled: a declaration of the entry with the ABI's exact signature (a
/// definition with another signature is a compile error) and a use of it (so a missing
/// definition is a link error), then the file, its lines numbered as in the file.
fn full_source(r: &FileReference) -> String {
    let shown = r.file.replace(['"', '\\', '\n'], "_");
    format!(
        "#include <cstdint>\n\
         extern \"C\" void {e}(const double* const* inputs, double* const* outputs, const int64_t* dims);\n\
         __attribute__((used)) static void (*const ks_reference_entry_)(const double* const*, double* const*, const int64_t*) = &{e};\n\
         #line 1 \"{shown}\"\n{src}\n",
        e = r.entry,
        src = r.source
    )
}

/// The compiler's first error line (a linker's undefined symbol included), else its first line.
fn first_error(log: &str) -> String {
    let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    for l in &lines {
        if let Some(i) = l.find("undefined reference to") {
            return l[i..].to_string();
        }
        if l.contains("error") && !l.contains("ld returned") && !l.contains("linker command failed") {
            return l.to_string();
        }
    }
    lines
        .first()
        .map(|l| l.to_string())
        .unwrap_or_else(|| "no compiler output".into())
}

/// The shared object of `task`'s reference, compiled or from the verified cache in `cache`.
/// An error is one line naming the file and the compiler's first error.
pub fn compile(task: &Task, cache: &Path) -> Result<Vec<u8>, String> {
    let r = task
        .reference
        .file()
        .ok_or_else(|| format!("task {} has no reference file", task.name))?;
    let path = task.dir.join(&r.file);
    crate::cpu::compile_cached(cache, &compiler(), &args(task), &full_source(r), &r.file)
        .map(|(so, _)| so)
        .map_err(|f| match f.class {
            ksearch_core::FailureClass::Compile => {
                format!("reference {} does not compile: {}", path.display(), first_error(&f.message))
            }
            _ => format!("reference {}: {}", path.display(), f.message),
        })
}

fn key(task: &Task, r: &FileReference) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(full_source(r).as_bytes());
    h.update(args(task).join(" ").as_bytes());
    h.update(compiler().as_bytes());
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Load a verified shared object from its bytes (not from the cache file, which may have
/// changed since it was verified).
fn load(so: &[u8], entry: &str) -> Result<(libloading::Library, Entry), String> {
    use std::io::Write;
    #[cfg(target_os = "linux")]
    let (path, _keep) = {
        use std::os::fd::FromRawFd;
        // SAFETY: a fresh anonymous file; the name is NUL-terminated.
        let fd = unsafe { libc::memfd_create(c"ksearch-reference.so".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is ours and open.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.write_all(so).map_err(|e| format!("writing the reference: {e}"))?;
        (PathBuf::from(format!("/proc/self/fd/{fd}")), f)
    };
    #[cfg(not(target_os = "linux"))]
    let (path, _keep) = {
        let d = cache_dir();
        std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        let p = d.join(format!("reference.{}.{}.so", std::process::id(), state().loaded.len()));
        let mut f = std::fs::File::create(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        f.write_all(so).map_err(|e| format!("writing the reference: {e}"))?;
        (p.clone(), TempFile(p))
    };
    // SAFETY: the task's reference, trusted as the task file is; its initialisers run here.
    let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| format!("cannot load the reference: {e}"))?;
    // SAFETY: the compile step declared the entry with exactly this signature.
    let f: Entry = unsafe { lib.get::<Entry>(entry.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("reference entry `{entry}`: {e}"))?;
    Ok((lib, f))
}

#[cfg(not(target_os = "linux"))]
struct TempFile(PathBuf);
#[cfg(not(target_os = "linux"))]
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `task`'s reference on `inputs` (f64, declared order) for the workload `axes`: the outputs in
/// declared order. Compiled (or taken from the cache) and loaded on first use.
pub fn run(task: &Task, axes: &BTreeMap<String, i64>, inputs: &[&[f64]]) -> Result<Vec<Vec<f64>>, String> {
    let r = task
        .reference
        .file()
        .ok_or_else(|| format!("task {} has no reference file", task.name))?;
    if inputs.len() != task.inputs.len() {
        return Err(format!(
            "reference: {} inputs given, the task declares {}",
            inputs.len(),
            task.inputs.len()
        ));
    }
    for (t, x) in task.inputs.iter().zip(inputs) {
        let n: usize = shape_of(t, axes)?.iter().product();
        if x.len() != n {
            return Err(format!("reference: input `{}` has {} values, its shape {n}", t.name, x.len()));
        }
    }
    let k = key(task, r);
    let found = state().loaded.get(&k).map(|(_, f)| *f);
    let f = match found {
        Some(f) => f,
        None => {
            let so = compile(task, &cache_dir())?;
            let (lib, f) = load(&so, &r.entry)?;
            state().loaded.insert(k, (lib, f));
            f
        }
    };
    let mut outs: Vec<Vec<f64>> = task
        .outputs
        .iter()
        .map(|t| shape_of(t, axes).map(|s| vec![0.0; s.iter().product()]))
        .collect::<Result<_, _>>()?;
    let dims: Vec<i64> = task.axes.iter().map(|a| axes.get(a).copied().unwrap_or(0)).collect();
    let ins: Vec<*const f64> = inputs.iter().map(|x| x.as_ptr()).collect();
    let mut optrs: Vec<*mut f64> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
    // SAFETY: every input and output holds the elements of its declared shape for these axes,
    // `dims` one value per axis; the function has the ABI's signature (checked at compile).
    unsafe { f(ins.as_ptr(), optrs.as_mut_ptr() as *const *mut f64, dims.as_ptr()) };
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_error_picks_the_compiler_error_or_the_undefined_symbol() {
        let gcc = "reference.cpp: In function 'void f()':\nreference.cpp:3:5: error: 'x' was not declared in this scope\n    3 |     x = 1;\n";
        assert_eq!(
            first_error(gcc),
            "reference.cpp:3:5: error: 'x' was not declared in this scope"
        );
        let ld = "/usr/bin/ld: /tmp/a.o:(.data.rel.ro.local+0x0): undefined reference to `my_ref'\ncollect2: error: ld returned 1 exit status\n";
        assert_eq!(first_error(ld), "undefined reference to `my_ref'");
        assert_eq!(first_error("\n"), "no compiler output");
    }

    /// A task with a reference of its own, loaded from a folder of this test's.
    fn scaled_task(dir: &Path) -> Task {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("task.toml"),
            r#"name = "scaled"
reference = { file = "ref.cpp", entry = "scaled_ref" }
axes = ["n"]
[constants]
scale = 2.5
[[inputs]]
name = "a"
shape = ["n"]
dtype = "f32"
[[inputs]]
name = "b"
shape = ["n"]
dtype = "f32"
[[outputs]]
name = "y"
shape = ["n"]
dtype = "f32"
[[outputs]]
name = "total"
shape = ["1"]
dtype = "f32"
[tolerance]
f32 = { atol = 1e-5, rtol = 1e-4 }
[backends.cpu]
search = [{ n = 3 }]
[backends.cpu.seed]
file = "ref.cpp"
entry = "unused"
"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("ref.cpp"),
            r#"#include <cstdint>
extern "C" void scaled_ref(const double* const* in, double* const* out, const int64_t* dims) {
    for (int64_t i = 0; i < dims[0]; i++) {
        out[0][i] = KS_SCALE * in[0][i] + in[1][i];
        out[1][0] += out[0][i];  // outputs start at zero
    }
}
"#,
        )
        .unwrap();
        Task::load(&dir.join("task.toml")).unwrap()
    }

    #[test]
    fn a_tasks_reference_is_compiled_cached_and_called_with_its_constants() {
        let root = std::env::temp_dir().join(format!("ksearch-task-ref-test-{}", std::process::id()));
        let task = scaled_task(&root.join("task"));
        let cache = root.join("cache");
        set_cache_dir(cache.clone());
        let axes: BTreeMap<String, i64> = [("n".to_string(), 3)].into();
        let (a, b) = ([1.0, 2.0, -4.0], [0.5, 0.0, 1.0]);
        let want = vec![vec![3.0, 5.0, -9.0], vec![-1.0]];
        assert_eq!(run(&task, &axes, &[&a, &b]).unwrap(), want);
        // As a worker receives it: the task as JSON, without its folder; the source travels.
        let sent: Task = serde_json::from_str(&serde_json::to_string(&task).unwrap()).unwrap();
        assert_eq!(sent.dir, PathBuf::new());
        assert_eq!(run(&sent, &axes, &[&a, &b]).unwrap(), want);
        // The shared object is in the cache, with its hash beside it.
        let entries: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            entries.iter().any(|e| e.ends_with(".so")) && entries.iter().any(|e| e.ends_with(".so.sha256")),
            "{entries:?}"
        );
        // Wrong input sizes are an error, not a call.
        assert!(run(&task, &axes, &[&a[..2], &b]).unwrap_err().contains("input `a`"));
        let _ = std::fs::remove_dir_all(&root);
    }
}
