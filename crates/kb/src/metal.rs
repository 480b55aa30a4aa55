//! Linux-side check of Metal sources: a C++17 compiler (clang++, else g++) in syntax-only mode
//! with the shim in `kb/metal-shim/`, which models Metal's address spaces, attributes, types and
//! built-ins. MLX bodies are wrapped into a kernel the way MLX's `metal_kernel` does it. The
//! executor that runs them is `metal_exec.rs`.

use std::path::Path;
use std::process::Command;

const SHIM: &str = include_str!("../../../kb/metal-shim/metal_stdlib.h");
const FORWARDS: &[&str] = &[
    "metal_stdlib",
    "metal_math",
    "metal_compute",
    "metal_simdgroup",
    "metal_simdgroup_matrix",
    "metal_atomic",
    "metal_integer",
    "metal_common",
];

/// What MLX knows about a body: its inputs and outputs (name, dtype such as `f32` or `float`),
/// integer template parameters, whether outputs are atomic, and the `header=` text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BodySig {
    pub inputs: Vec<(String, String)>,
    pub outputs: Vec<(String, String)>,
    pub template_params: Vec<(String, i64)>,
    pub atomic_outputs: bool,
    pub header: String,
    /// Sectioned files (`// @kernel <entry>`): each launch's own inputs and outputs.
    pub launches: Vec<ksearch_core::mlx::LaunchIo>,
}

/// A dtype name (`f32`, `float16`, `half`, ...) as a Metal type.
pub(crate) fn metal_type(dtype: &str) -> String {
    match dtype {
        "f32" | "float32" | "float" => "float",
        "f16" | "float16" | "half" => "half",
        "bf16" | "bfloat16" | "bfloat" => "bfloat",
        "i32" | "int32" | "int" => "int",
        "u32" | "uint32" | "uint" => "uint",
        "i64" | "int64" => "int64_t",
        "bool" => "bool",
        "f64" | "float64" | "double" => "double",
        other => other,
    }
    .to_string()
}

/// The position attributes of the kernel MLX builds around a body, in order, with their types.
pub(crate) const MLX_ATTRS: [(&str, &str); 11] = [
    ("thread_position_in_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threads_per_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("threads_per_simdgroup", "uint"),
];

/// The Metal kernel MLX would build around `body`: inputs as `const device T*` with their
/// `_shape`/`_strides`/`_ndim` companions, outputs as `device T*`, template parameters as
/// constants and every thread-position attribute under its own name. A `#line` directive keeps
/// diagnostics in the body's own line numbers.
pub fn wrap_body(body: &str, sig: &BodySig) -> String {
    let mut s = String::from("#include <metal_stdlib>\nusing namespace metal;\n");
    for (n, v) in &sig.template_params {
        s.push_str(&format!("constant constexpr int {n} = {v};\n"));
    }
    if !sig.header.is_empty() {
        s.push_str(&sig.header);
        s.push('\n');
    }
    let mut params = Vec::new();
    let mut slot = 0;
    for (n, d) in &sig.inputs {
        params.push(format!("const device {}* {n} [[buffer({slot})]]", metal_type(d)));
        params.push(format!("const constant int* {n}_shape [[buffer({})]]", slot + 1));
        params.push(format!("const constant int64_t* {n}_strides [[buffer({})]]", slot + 2));
        params.push(format!("const constant int& {n}_ndim [[buffer({})]]", slot + 3));
        slot += 4;
    }
    for (n, d) in &sig.outputs {
        let t = metal_type(d);
        let t = if sig.atomic_outputs { format!("atomic<{t}>") } else { t };
        params.push(format!("device {t}* {n} [[buffer({slot})]]"));
        slot += 1;
    }
    for (a, t) in MLX_ATTRS {
        params.push(format!("{t} {a} [[{a}]]"));
    }
    s.push_str("[[kernel]] void ksearch_body(\n    ");
    s.push_str(&params.join(",\n    "));
    s.push_str(") {\n#line 1 \"body.metal\"\n");
    s.push_str(body);
    s.push_str("\n}\n");
    s
}

/// Metal-only spellings the C++ compiler cannot take, rewritten with line numbers kept:
/// `[[threadgroup(i)]]` (the macro would erase the word), half literals `1.0h`, and swizzles of
/// two to four components (`v.xy`, `c.bgr`: the shim's `v.template ks_sw<0, 1>()`).
pub(crate) fn rewrite(src: &str) -> String {
    let tg = crate::cached_regex(r"\[\[\s*threadgroup\s*\(");
    let s = tg.replace_all(src, "[[ks_threadgroup_index(");
    let half = crate::cached_regex(r"\b(\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+)[hH]\b");
    let s = half.replace_all(&s, "half($1)");
    let swizzle = crate::cached_regex(r"([\w\)\]])\.([xyzw]{2,4}|[rgba]{2,4})\b");
    swizzle
        .replace_all(&s, |c: &regex::Captures| {
            let idx: Vec<&str> = c[2]
                .chars()
                .map(|ch| match ch {
                    'x' | 'r' => "0",
                    'y' | 'g' => "1",
                    'z' | 'b' => "2",
                    _ => "3",
                })
                .collect();
            format!("{}.template ks_sw<{}>()", &c[1], idx.join(", "))
        })
        .into_owned()
}

/// The C++ compiler to use: `$KSEARCH_CXX`, else clang++, else g++, else c++.
pub fn find_cxx() -> Option<String> {
    let works = |c: &str| {
        Command::new(c)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if let Ok(c) = std::env::var("KSEARCH_CXX")
        && !c.is_empty()
    {
        return works(&c).then_some(c);
    }
    ["clang++", "g++", "c++"].into_iter().find(|c| works(c)).map(str::to_string)
}

/// The C++ text of a Metal source for the shim: the kernels MLX would build around each body
/// (one per `// @kernel` section, the header once) or the file as it is; and its file name.
pub(crate) fn shim_text(src: &str, body: Option<&BodySig>) -> (String, &'static str) {
    match body {
        Some(sig) if ksearch_core::mlx::has_sections(src) => {
            // One kernel per section, each with its launch's signature; the header once, in
            // front of the first. Bodies keep the file's line numbers.
            let parts = ksearch_core::mlx::split(src);
            let header = parts
                .iter()
                .find(|p| p.entry.is_none())
                .map(|p| p.text.clone())
                .unwrap_or_default();
            let mut text = String::new();
            for (i, p) in parts.iter().filter(|p| p.entry.is_some()).enumerate() {
                let entry = p.entry.as_deref().unwrap_or_default();
                let mut s = sig.clone();
                if let Some(l) = sig.launches.iter().find(|l| l.entry == entry) {
                    s.inputs = l.inputs.clone();
                    s.outputs = l.outputs.clone();
                }
                s.header = if i == 0 {
                    format!("{}\n{}", sig.header, rewrite(&header))
                } else {
                    String::new()
                };
                let mut k = wrap_body(&rewrite(&p.masked), &s).replace("ksearch_body(", &format!("ksearch_{entry}("));
                if i > 0 {
                    // the includes and template constants are already there
                    k = k.split_once("[[kernel]]").map(|(_, b)| format!("[[kernel]]{b}")).unwrap_or(k);
                }
                text.push_str(&k);
            }
            (text, "body.metal")
        }
        Some(sig) => (wrap_body(&rewrite(src), sig), "body.metal"),
        None => (rewrite(src), "source.metal"),
    }
}

/// A temporary directory holding the shim (`shim/`).
pub(crate) fn shim_dir() -> Result<tempfile::TempDir, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let shim_dir = dir.path().join("shim");
    std::fs::create_dir_all(&shim_dir).map_err(|e| format!("{}: {e}", shim_dir.display()))?;
    write(&shim_dir.join("metal_stdlib.h"), SHIM)?;
    for f in FORWARDS {
        write(&shim_dir.join(f), "#include \"metal_stdlib.h\"\n")?;
    }
    Ok(dir)
}

pub(crate) fn write(p: &Path, text: &str) -> Result<(), String> {
    std::fs::write(p, text).map_err(|e| format!("{}: {e}", p.display()))
}

/// The compiler's diagnostics without the temporary directory's path.
pub(crate) fn diagnostics(out: &std::process::Output, dir: &Path) -> String {
    String::from_utf8_lossy(&out.stderr)
        .replace(&format!("{}/", dir.display()), "")
        .replace(&dir.display().to_string(), "")
        .trim_end()
        .to_string()
}

/// Syntax- and type-check a Metal source (or, with `body`, an MLX body) on Linux.
/// `Err` carries the compiler's diagnostics, or says that no compiler was found.
pub fn metal_syntax_check(src: &str, body: Option<&BodySig>) -> Result<(), String> {
    let cxx = find_cxx().ok_or_else(|| "no C++ compiler found (install clang++ or g++, or set KSEARCH_CXX)".to_string())?;
    let dir = shim_dir()?;
    let (text, name) = shim_text(src, body);
    let file = dir.path().join(name);
    write(&file, &text)?;
    let out = Command::new(&cxx)
        .args(["-fsyntax-only", "-std=c++17", "-x", "c++", "-w", "-I"])
        .arg(dir.path().join("shim"))
        .arg(&file)
        .current_dir(dir.path())
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{cxx} (Metal shim) rejected the source:\n{}",
        diagnostics(&out, dir.path())
    ))
}

impl BodySig {
    /// A signature from `// inputs: a:f32, b:f16` and `// outputs: y:f32` comment lines (and
    /// `// template: N=64, ...`), for bodies checked outside a task.
    pub fn from_comments(src: &str) -> Option<BodySig> {
        let mut sig = BodySig::default();
        let mut found = false;
        let pairs = |s: &str| -> Vec<(String, String)> {
            s.split([',', ' '])
                .filter(|p| !p.is_empty())
                .filter_map(|p| p.split_once(':').map(|(a, b)| (a.trim().to_string(), b.trim().to_string())))
                .collect()
        };
        for l in src.lines() {
            let l = l.trim();
            if let Some(r) = l.strip_prefix("// inputs:") {
                sig.inputs = pairs(r);
                found = true;
            } else if let Some(r) = l.strip_prefix("// outputs:") {
                sig.outputs = pairs(r);
                found = true;
            } else if let Some(r) = l.strip_prefix("// template:") {
                for p in r.split(',') {
                    if let Some((a, b)) = p.split_once('=')
                        && let Ok(v) = b.trim().parse()
                    {
                        sig.template_params.push((a.trim().to_string(), v));
                    }
                }
            }
        }
        found.then_some(sig)
    }

    /// The signature MLX would give a body of `task` on `backend` (`mlx` or `mlx-metal`): the
    /// task's inputs and outputs with the back-end's dtypes, and the kernel's tunables (default
    /// values) and the first search workload's axes as template parameters.
    pub fn from_task(task: &ksearch_core::Task, backend: ksearch_core::Backend, kernel_file: Option<&str>) -> BodySig {
        let dt = |t: &ksearch_core::task::TensorSpec| task.dtype_on(backend, t).name().to_string();
        let mut sig = BodySig {
            inputs: task.inputs.iter().map(|t| (t.name.clone(), dt(t))).collect(),
            outputs: task.outputs.iter().map(|t| (t.name.clone(), dt(t))).collect(),
            // the task's constants, as the MLX worker puts them in front of the header
            header: task
                .constants
                .iter()
                .map(|(k, v)| format!("constant float KS_{} = {v:?}f;\n", k.to_uppercase()))
                .collect(),
            ..Default::default()
        };
        if let Some(b) = task.backend(backend) {
            if let Some(w) = b.search.first() {
                sig.template_params.extend(w.iter().map(|(k, v)| (k.clone(), *v)));
            }
            let kernels = std::iter::once(&b.seed).chain(b.kernels.iter());
            for k in kernels.filter(|k| kernel_file.is_none_or(|f| k.file == f)) {
                if sig.launches.is_empty() {
                    sig.launches = ksearch_core::mlx::launch_io(task, backend, k);
                }
                for (n, v) in k.default_config() {
                    if !sig.template_params.iter().any(|(m, _)| *m == n) {
                        sig.template_params.push((n, v));
                    }
                }
            }
        }
        sig
    }
}
