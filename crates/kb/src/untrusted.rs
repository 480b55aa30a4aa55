//! What model-written source may not do before it is compiled: read files of the machine at
//! compile time. A compiler's diagnostics quote what it read (and the search feeds diagnostics
//! back to the model, stores them and shows them), and an assembler's `.incbin` puts a file's
//! bytes into the kernel, which can then write them out as results. So a candidate may include
//! only system headers by name (`<cmath>`, `<cuda_fp16.h>`), never a path, a quoted file or a
//! macro, and may not use `#embed`, `__has_include`, `_Pragma`, `#pragma GCC dependency` or, in
//! C++ for the CPU, inline assembly. The check runs on the source as the preprocessor sees it:
//! comments removed, continued lines joined, digraphs and trigraphs for `#` read as `#`.

/// The reason `src` (in `lang`: `cpp`, `cuda`, `metal`...) is refused, or None.
pub fn refusal(lang: &str, src: &str) -> Option<String> {
    let text = preprocessed_view(src);
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        let rest = rest.trim_start();
        let word: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let target = rest[word.len()..].trim();
        match word.as_str() {
            "include" | "include_next" | "import" if !system_header(target) => {
                return Some(format!(
                    "`#{word} {}`: a candidate includes system headers by name only (e.g. <cmath>), never a path, a quoted file or a macro",
                    short(target)
                ));
            }
            "embed" => return Some("`#embed` reads a file at compile time".into()),
            "pragma" if target.split_whitespace().any(|w| w == "dependency") => {
                return Some("`#pragma GCC dependency` reads a file at compile time".into());
            }
            _ => {}
        }
    }
    let words: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    for w in &words {
        match *w {
            "__has_include" | "__has_include_next" | "__has_embed" => {
                return Some(format!("`{w}` probes the machine's files"));
            }
            "_Pragma" | "__pragma" => return Some(format!("`{w}`: pragmas are written as `#pragma` lines")),
            "asm" | "__asm" | "__asm__" if lang == "cpp" || lang == "c++" => {
                return Some(
                    "inline assembly (`asm`): a CPU candidate is C++ only (an assembler directive could embed a file)".into(),
                );
            }
            _ => {}
        }
    }
    None
}

fn short(s: &str) -> String {
    let s: String = s.chars().take(60).collect();
    s.replace('`', "'")
}

/// `<name>` with a relative, upward-free path of plain characters.
fn system_header(target: &str) -> bool {
    let Some(inner) = target.strip_prefix('<').and_then(|t| t.strip_suffix('>')) else {
        return false;
    };
    !inner.is_empty()
        && !inner.starts_with('/')
        && !inner.split('/').any(|p| p == ".." || p.is_empty())
        && inner
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-' | '+'))
}

/// The source with comments removed (strings kept), `\`-continued lines joined, and the
/// digraph `%:` and trigraph `??=` written as `#`.
fn preprocessed_view(src: &str) -> String {
    let joined = src.replace("\\\r\n", "").replace("\\\n", "");
    let b: Vec<char> = joined.chars().collect();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i < b.len() && !(b[i] == '*' && b.get(i + 1) == Some(&'/')) {
                if b[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else if c == '"' || c == '\'' {
            // A literal, kept as written (escapes included).
            out.push(c);
            i += 1;
            while i < b.len() && b[i] != c && b[i] != '\n' {
                if b[i] == '\\' && i + 1 < b.len() {
                    out.push(b[i]);
                    i += 1;
                }
                out.push(b[i]);
                i += 1;
            }
            if i < b.len() && b[i] == c {
                out.push(c);
                i += 1;
            }
        } else if c == '%' && next == Some(':') {
            out.push('#');
            i += 2;
        } else if c == '?' && next == Some('?') && b.get(i + 2) == Some(&'=') {
            out.push('#');
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn system_headers_pass_and_files_do_not() {
        let ok =
            "#include <cmath>\n#include <cstdint>\n# include <immintrin.h>\n#include <cuda/pipeline>\nint x; // see \"a.h\"\n";
        assert_eq!(refusal("cpp", ok), None);
        assert_eq!(
            refusal("cuda", "#include <cuda_fp16.h>\nasm volatile(\"ex2.approx.f32 %0, %1;\");\n"),
            None
        );
        for bad in [
            "#include \"/etc/passwd\"\n",
            "#include </etc/passwd>\n",
            "#include <../../etc/passwd>\n",
            "#include <bits/../../x>\n",
            "#define F <cstdio>\n#include F\n",
            "#/**/include \"x.h\"\n",
            "#\\\ninclude \"x.h\"\n",
            "%:include \"/proc/self/cwd/.env\"\n",
            "??=include \"x\"\n",
            "#include_next \"x\"\n",
            "#import \"x\"\n",
            "#embed \"/etc/passwd\"\n",
            "#pragma GCC dependency \"/etc/passwd\"\n",
            "#if __has_include(\"/etc/shadow\")\n#endif\n",
            "_Pragma(\"GCC dependency \\\"/etc/passwd\\\"\")\n",
        ] {
            assert!(refusal("cuda", bad).is_some(), "{bad:?} passed");
            assert!(refusal("cpp", bad).is_some(), "{bad:?} passed");
        }
        let asm = "void f() { asm(\".inc\" \"bin \\\"/etc/passwd\\\"\"); }\n";
        assert!(refusal("cpp", asm).unwrap().contains("inline assembly"));
        assert!(refusal("cpp", "void f() { __asm__ volatile(\"\"); }\n").is_some());
        // Words inside comments and other identifiers are not the keyword.
        assert_eq!(refusal("cpp", "// asm\nint asmx = 0; /* #include \"x\" */\n"), None);
        assert!(!refusal("cpp", "#include \"x\"\n").unwrap().contains('\n'));
    }
}
