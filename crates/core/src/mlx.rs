//! MLX kernel files: an optional header followed by one body per launch, each introduced by a
//! `// @kernel <entry>` line (see `docs/mlx.md`). A file without such a line is one body.

/// One part of a kernel file. `masked` is the whole file with every other line blanked, so
/// diagnostics on it carry the file's own line numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// `None` for the header, else the launch entry the body belongs to.
    pub entry: Option<String>,
    pub text: String,
    pub masked: String,
}

fn marker(line: &str) -> Option<&str> {
    let name = line.trim().strip_prefix("//")?.trim_start().strip_prefix("@kernel")?;
    let name = name.trim();
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(name)
}

/// Does `src` use `// @kernel` sections?
pub fn has_sections(src: &str) -> bool {
    src.lines().any(|l| marker(l).is_some())
}

/// Split a kernel file into its header (entry `None`) and bodies, in file order. Without
/// sections the whole file is one body whose entry is `None`.
pub fn split(src: &str) -> Vec<Part> {
    let lines: Vec<&str> = src.lines().collect();
    let mut starts: Vec<(usize, Option<String>)> = vec![(0, None)];
    for (i, l) in lines.iter().enumerate() {
        if let Some(n) = marker(l) {
            starts.push((i, Some(n.to_string())));
        }
    }
    let mut parts = Vec::new();
    for (k, (start, entry)) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map(|s| s.0).unwrap_or(lines.len());
        // The marker line itself belongs to no part.
        let first = if entry.is_some() { start + 1 } else { *start };
        let text = lines[first.min(end)..end].join("\n");
        let masked = lines
            .iter()
            .enumerate()
            .map(|(i, l)| if i >= first && i < end { *l } else { "" })
            .collect::<Vec<_>>()
            .join("\n");
        parts.push(Part {
            entry: entry.clone(),
            text,
            masked,
        });
    }
    parts
}

/// The header and the body of launch `entry` (or the whole file as the body when it has no
/// sections).
pub fn body_of(src: &str, entry: &str) -> Option<(String, String)> {
    if !has_sections(src) {
        return Some((String::new(), src.to_string()));
    }
    let parts = split(src);
    let header = parts
        .iter()
        .find(|p| p.entry.is_none())
        .map(|p| p.text.clone())
        .unwrap_or_default();
    let body = parts.iter().find(|p| p.entry.as_deref() == Some(entry))?.text.clone();
    Some((header, body))
}

/// What an MLX CUDA-dialect kernel file is: a body MLX wraps in a signature (`mx.fast.cuda_kernel`,
/// the default), or a whole CUDA translation unit the worker compiles with NVRTC and runs with
/// `mx.fast.precompiled_cuda_kernel` (`options = { form = "cuda" }` in `task.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Body,
    Cuda,
}

impl Form {
    /// The form a kernel's `options` declare (`form`, absent: a body).
    pub fn of_options(options: &std::collections::BTreeMap<String, toml::Value>) -> Result<Form, String> {
        match options.get("form") {
            None => Ok(Form::Body),
            Some(toml::Value::String(s)) => Form::parse(s),
            Some(v) => Err(format!("options.form must be a string (\"body\" or \"cuda\"), not {v}")),
        }
    }

    /// The form of a candidate (its options, passed through from the task as JSON).
    pub fn of_candidate(c: &crate::Candidate) -> Form {
        match c.options.get("form").and_then(|v| v.as_str()) {
            Some("cuda") => Form::Cuda,
            _ => Form::Body,
        }
    }

    fn parse(s: &str) -> Result<Form, String> {
        match s {
            "body" => Ok(Form::Body),
            "cuda" => Ok(Form::Cuda),
            other => Err(format!("options.form `{other}` is unknown (known: body, cuda)")),
        }
    }
}

/// What one launch of an MLX kernel reads and writes, with dtype names (`f32`, `f16`…).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchIo {
    pub entry: String,
    pub inputs: Vec<(String, String)>,
    pub outputs: Vec<(String, String)>,
}

/// The launches of `k` on `backend`: task tensors with the back-end's dtypes, scratch buffers
/// with their own (f32 by default); empty lists mean every task input / output.
pub fn launch_io(task: &crate::Task, backend: crate::Backend, k: &crate::KernelSpec) -> Vec<LaunchIo> {
    let dtype_of = |n: &str| -> String {
        if let Some(t) = task.inputs.iter().chain(&task.outputs).find(|t| t.name == n) {
            return task.dtype_on(backend, t).name().to_string();
        }
        k.scratch
            .iter()
            .find(|s| s.name == n)
            .and_then(|s| s.dtype)
            .map(|d| d.name().to_string())
            .unwrap_or_else(|| "f32".into())
    };
    let all_in: Vec<String> = task.inputs.iter().map(|t| t.name.clone()).collect();
    let all_out: Vec<String> = task.outputs.iter().map(|t| t.name.clone()).collect();
    k.launches
        .iter()
        .map(|l| {
            let ins = if l.inputs.is_empty() { &all_in } else { &l.inputs };
            let outs = if l.outputs.is_empty() { &all_out } else { &l.outputs };
            LaunchIo {
                entry: l.entry.clone(),
                inputs: ins.iter().map(|n| (n.clone(), dtype_of(n))).collect(),
                outputs: outs.iter().map(|n| (n.clone(), dtype_of(n))).collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sections_split_with_their_line_numbers() {
        let src = "inline int f() { return 1; }\n// @kernel a\nx[0] = 1;\n//   @kernel   b_2\ny[0] = 2;\nz[0] = 3;";
        assert!(has_sections(src));
        let p = split(src);
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].entry, None);
        assert_eq!(p[0].text, "inline int f() { return 1; }");
        assert_eq!(p[1].entry.as_deref(), Some("a"));
        assert_eq!(p[1].text, "x[0] = 1;");
        assert_eq!(p[2].entry.as_deref(), Some("b_2"));
        assert_eq!(p[2].text, "y[0] = 2;\nz[0] = 3;");
        // masked parts keep line numbers: body b starts on line 5
        assert_eq!(p[2].masked.lines().position(|l| l == "y[0] = 2;"), Some(4));
        assert_eq!(
            body_of(src, "a"),
            Some(("inline int f() { return 1; }".into(), "x[0] = 1;".into()))
        );
        assert_eq!(body_of(src, "c"), None);
    }
    #[test]
    fn forms_come_from_the_options() {
        let mut o = std::collections::BTreeMap::new();
        assert_eq!(Form::of_options(&o), Ok(Form::Body));
        o.insert("form".to_string(), toml::Value::String("cuda".into()));
        assert_eq!(Form::of_options(&o), Ok(Form::Cuda));
        o.insert("form".to_string(), toml::Value::String("ptx".into()));
        assert!(Form::of_options(&o).unwrap_err().contains("`ptx` is unknown"));
        o.insert("form".to_string(), toml::Value::Integer(1));
        assert!(Form::of_options(&o).unwrap_err().contains("must be a string"));
    }
    #[test]
    fn a_file_without_markers_is_one_body() {
        let src = "out[0] = 1; // @kernels are not markers\n// @kernel\n";
        assert!(!has_sections(src));
        assert_eq!(body_of(src, "anything"), Some((String::new(), src.to_string())));
    }
}
