//! Tolerant parsing of model replies: JSON, fenced code, language detection, repair prompts.

use serde_json::Value;

use crate::error::ParseError;

/// Most start positions tried when hunting for bare JSON in prose.
const MAX_JSON_STARTS: usize = 256;

/// Remove `<think>…</think>` reasoning sections that some models put into the content.
pub fn strip_think(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("<think>") {
        out.push_str(&rest[..i]);
        match rest[i..].find("</think>") {
            Some(j) => rest = &rest[i + j + "</think>".len()..],
            None => {
                // Unclosed: keep it (the answer may be inside).
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// A fenced block of a Markdown reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Fence {
    /// The info string (`cuda`, `json`, `c++ title="x"`…), trimmed; empty if none.
    pub info: String,
    pub body: String,
    /// False when the reply ended before the closing fence.
    pub closed: bool,
}

impl Fence {
    /// The first word of the info string, lowercased.
    pub fn lang(&self) -> String {
        self.info
            .split(|c: char| c.is_whitespace() || c == '{' || c == ',')
            .next()
            .unwrap_or("")
            .to_ascii_lowercase()
    }
}

/// All fenced blocks (``` or ~~~, three or more, at the start of a line), in order.
pub fn fences(text: &str) -> Vec<Fence> {
    let mut out = Vec::new();
    let mut open: Option<(char, usize, String, Vec<&str>)> = None;
    for line in text.lines() {
        let t = line.trim_start();
        match &mut open {
            None => {
                if let Some((ch, n)) = fence_marker(t) {
                    let info = t[n..].trim().to_string();
                    // A backtick fence's info string may not contain backticks (inline code).
                    if ch == '`' && info.contains('`') {
                        continue;
                    }
                    open = Some((ch, n, info, Vec::new()));
                }
            }
            Some((ch, n, _, body)) => {
                let tt = t.trim_end();
                let closes = fence_marker(tt).is_some_and(|(c2, n2)| c2 == *ch && n2 >= *n && tt.len() == n2);
                if !closes {
                    body.push(line);
                } else if let Some((_, _, info, body)) = open.take() {
                    out.push(Fence {
                        info,
                        body: join_lines(&body),
                        closed: true,
                    });
                }
            }
        }
    }
    if let Some((_, _, info, body)) = open {
        out.push(Fence {
            info,
            body: join_lines(&body),
            closed: false,
        });
    }
    out
}

fn join_lines(lines: &[&str]) -> String {
    let mut s = lines.join("\n");
    if !s.is_empty() {
        s.push('\n');
    }
    s
}

fn fence_marker(t: &str) -> Option<(char, usize)> {
    let ch = t.chars().next()?;
    if ch != '`' && ch != '~' {
        return None;
    }
    let n = t.chars().take_while(|c| *c == ch).count();
    (n >= 3).then_some((ch, n))
}

// ---------------------------------------------------------------------------------------------
// JSON

/// Extract one JSON value from a reply: from a ```json fence, else bare in the text (leading and
/// trailing prose allowed). Trailing commas, comments and Python literals are repaired; JSON that
/// ends before its brackets close is reported as [`ParseError::TruncatedJson`].
pub fn extract_json(text: &str) -> Result<Value, ParseError> {
    let text = strip_think(text);
    let mut state = JsonHunt::default();
    let fenced: Vec<Fence> = fences(&text)
        .into_iter()
        .filter(|f| {
            let l = f.lang();
            l == "json" || l == "jsonc" || l == "json5" || (l.is_empty() && f.body.trim_start().starts_with(['{', '[']))
        })
        .collect();
    for f in &fenced {
        state.hunt(&f.body, !f.closed);
    }
    if let Some(v) = state.best.take() {
        return Ok(v.1);
    }
    state.hunt(&text, false);
    if let Some(v) = state.best {
        return Ok(v.1);
    }
    if let Some(tail) = state.truncated {
        return Err(ParseError::TruncatedJson { tail });
    }
    if let Some(message) = state.invalid {
        return Err(ParseError::InvalidJson { message });
    }
    Err(ParseError::NoJson)
}

#[derive(Default)]
struct JsonHunt {
    /// (span length, value) of the largest value parsed.
    best: Option<(usize, Value)>,
    truncated: Option<String>,
    invalid: Option<String>,
}

impl JsonHunt {
    fn hunt(&mut self, s: &str, unclosed_fence: bool) {
        let bytes = s.as_bytes();
        let mut i = 0;
        let mut starts = 0;
        while i < bytes.len() && starts < MAX_JSON_STARTS {
            let c = bytes[i];
            if c != b'{' && c != b'[' {
                i += 1;
                continue;
            }
            starts += 1;
            match balanced_end(&bytes[i..]) {
                Some(len) => {
                    let slice = &s[i..i + len];
                    match parse_lenient(slice) {
                        Ok(v) => {
                            let better = self.best.as_ref().is_none_or(|(l, _)| len > *l);
                            // Scalars-in-brackets like "[1]" in prose are weak; keep the largest.
                            if better {
                                self.best = Some((len, v));
                            }
                            i += len;
                            continue;
                        }
                        Err(m) => {
                            if looks_like_json_start(&s[i..]) && self.invalid.as_ref().is_none() {
                                self.invalid = Some(m);
                            }
                        }
                    }
                }
                None => {
                    if (looks_like_json_start(&s[i..]) || unclosed_fence) && self.truncated.is_none() {
                        let tail: String = {
                            let t = s.trim_end();
                            let n = t.chars().count();
                            t.chars().skip(n.saturating_sub(60)).collect()
                        };
                        self.truncated = Some(tail);
                    }
                }
            }
            i += 1;
        }
    }
}

/// Whether text at a `{`/`[` plausibly opens JSON (not prose like `{x}` or `a[i]`).
fn looks_like_json_start(s: &str) -> bool {
    let mut it = s.chars();
    let open = it.next();
    let next = it.find(|c| !c.is_whitespace());
    match (open, next) {
        (Some('{'), Some(c)) => c == '"' || c == '}',
        (Some('['), Some(c)) => matches!(c, '{' | '[' | '"' | ']' | '-' | '0'..='9'),
        _ => false,
    }
}

/// Length of the bracket-balanced span starting at `b[0]` (`{` or `[`), string-aware; None if
/// the text ends first.
fn balanced_end(b: &[u8]) -> Option<usize> {
    let mut depth = 0i64;
    let mut in_str = false;
    let mut esc = false;
    for (i, &c) in b.iter().enumerate() {
        if in_str {
            if esc {
                esc = false;
            } else if c == b'\\' {
                esc = true;
            } else if c == b'"' {
                in_str = false;
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
                if depth < 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

fn parse_lenient(s: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(s) {
        Ok(v) => Ok(v),
        Err(e) => {
            // Twice: a comma before a comment is only trailing once the comment is gone.
            let fixed = repair_json(&repair_json(s));
            serde_json::from_str::<Value>(&fixed).map_err(|_| e.to_string())
        }
    }
}

/// Outside strings: drop `//` and `/* */` comments and trailing commas; map True/False/None.
fn repair_json(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    let mut in_str = false;
    let mut esc = false;
    while i < chars.len() {
        let c = chars[i];
        if in_str {
            out.push(c);
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                in_str = false;
            }
            i += 1;
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                out.push(c);
                i += 1;
            }
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            ',' => {
                let mut j = i + 1;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                if !matches!(chars.get(j), Some('}') | Some(']')) {
                    out.push(',');
                }
                i += 1;
            }
            c if c.is_ascii_alphabetic() => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                let w: String = chars[start..i].iter().collect();
                out.push_str(match w.as_str() {
                    "True" => "true",
                    "False" => "false",
                    "None" | "NaN" | "undefined" => "null",
                    _ => &w,
                });
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Code

/// Info strings of blocks that are never the candidate source.
const NOT_SOURCE: &[&str] = &[
    "bash", "sh", "shell", "console", "text", "txt", "output", "log", "json", "yaml", "toml", "diff", "patch", "markdown", "md",
];

/// Extract the candidate source from a reply: the largest fenced block (the last one if it is
/// nearly as large), preferring blocks tagged with the asked language. With `lang_hint`
/// (`cuda`, `cpp`, `metal`, `mlx_metal`, `python`…), code in an incompatible language is an error.
pub fn extract_code(text: &str, lang_hint: Option<&str>) -> Result<String, ParseError> {
    let text = strip_think(text);
    let hint = lang_hint.and_then(normalize_lang);
    let all = fences(&text);
    let mut cands: Vec<&Fence> = all.iter().filter(|f| !NOT_SOURCE.contains(&f.lang().as_str())).collect();
    if cands.is_empty() {
        return bare_code(&text, hint, lang_hint);
    }
    if let Some(h) = hint {
        let tagged: Vec<&Fence> = cands
            .iter()
            .copied()
            .filter(|f| normalize_lang(&f.lang()).is_some_and(|l| compatible(h, l)))
            .collect();
        if !tagged.is_empty() {
            cands = tagged;
        }
    }
    let size = |f: &Fence| f.body.trim().len();
    let largest = cands.iter().copied().max_by_key(|f| size(f)).ok_or(ParseError::NoCodeBlock)?;
    let last = cands[cands.len() - 1];
    let chosen = if size(last) * 5 >= size(largest) * 4 { last } else { largest };
    let body = chosen.body.trim_matches('\n').trim_end().to_string();
    if body.trim().is_empty() {
        return Err(ParseError::EmptyCode);
    }
    let info_lang = normalize_lang(&chosen.lang());
    if let Some(h) = hint {
        if let Some(l) = info_lang
            && !compatible(h, l)
        {
            return Err(ParseError::WrongLanguage {
                expected: lang_hint.unwrap_or(h).to_string(),
                found: l.to_string(),
            });
        }
        if let Some(l) = detect_lang(&body)
            && !compatible(h, l)
        {
            return Err(ParseError::WrongLanguage {
                expected: lang_hint.unwrap_or(h).to_string(),
                found: l.to_string(),
            });
        }
    }
    if !chosen.closed && hint != Some("python") && !braces_balanced(&body) {
        return Err(ParseError::TruncatedCode);
    }
    Ok(body + "\n")
}

/// A reply with no fence that is nothing but code.
fn bare_code(text: &str, hint: Option<&'static str>, raw_hint: Option<&str>) -> Result<String, ParseError> {
    let t = text.trim();
    let first = t.lines().next().unwrap_or("").trim_start();
    const STARTS: &[&str] = &[
        "#include",
        "#pragma",
        "#define",
        "#if",
        "//",
        "/*",
        "template",
        "extern",
        "__global__",
        "__device__",
        "using ",
        "namespace",
        "import ",
        "from ",
        "def ",
        "kernel ",
        "static ",
        "struct ",
        "typedef",
        "constexpr",
        "inline",
        "void ",
        "#import",
    ];
    if t.is_empty() || !STARTS.iter().any(|s| first.starts_with(s)) {
        return Err(ParseError::NoCodeBlock);
    }
    let Some(found) = detect_lang(t) else {
        return Err(ParseError::NoCodeBlock);
    };
    if let Some(h) = hint
        && !compatible(h, found)
    {
        return Err(ParseError::WrongLanguage {
            expected: raw_hint.unwrap_or(h).to_string(),
            found: found.to_string(),
        });
    }
    if found != "python" && !braces_balanced(t) {
        return Err(ParseError::TruncatedCode);
    }
    Ok(format!("{t}\n"))
}

/// Canonical language name for an info string or a hint.
pub fn normalize_lang(s: &str) -> Option<&'static str> {
    Some(match s.trim().to_ascii_lowercase().as_str() {
        "cuda" | "cu" | "cuh" | "nvrtc" | "mlx_cuda" | "mlx-cuda" => "cuda",
        "cpp" | "c++" | "cxx" | "cc" | "hpp" | "hxx" | "h" => "cpp",
        "c" => "c",
        "metal" | "msl" | "mlx_metal" | "mlx-metal" => "metal",
        "python" | "py" | "python3" => "python",
        "rust" | "rs" => "rust",
        _ => return None,
    })
}

/// Whether code detected as `found` can serve where `hint` was asked (C-family code without
/// dialect markers is accepted for every C dialect).
pub fn compatible(hint: &str, found: &str) -> bool {
    match hint {
        "cuda" => matches!(found, "cuda" | "cpp" | "c"),
        "cpp" | "c" => matches!(found, "cpp" | "c"),
        "metal" => matches!(found, "metal" | "cpp" | "c"),
        h => h == found,
    }
}

/// Heuristic language of a piece of code: `cuda`, `metal`, `cpp`, `c`, `python`, `rust`, or None.
pub fn detect_lang(code: &str) -> Option<&'static str> {
    let stripped = strip_c_comments(code);
    let lines: Vec<&str> = stripped.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if lines.is_empty() {
        return None;
    }
    let mut py = 0usize;
    let mut clike = 0usize;
    for l in &lines {
        let pyish = l.starts_with("def ")
            || l.starts_with("class ") && l.ends_with(':')
            || (l.starts_with("import ") || l.starts_with("from ")) && !l.ends_with(';')
            || l.starts_with("elif ")
            || l.starts_with("if __name__")
            || (l.ends_with(':')
                && (l.starts_with("for ") || l.starts_with("if ") || l.starts_with("while ") || l.starts_with("with ")))
            || l.starts_with("return ") && !l.ends_with(';') && !l.ends_with('{');
        let cish = l.ends_with(';')
            || l.ends_with('{')
            || l.ends_with('}')
            || l.starts_with("#include")
            || l.starts_with("#define")
            || l.starts_with("#pragma");
        py += pyish as usize;
        clike += cish as usize;
    }
    let has = |pats: &[&str]| pats.iter().filter(|p| stripped.contains(*p)).count();
    if py > 0 && py * 2 >= clike {
        return Some("python");
    }
    if clike == 0 {
        return None;
    }
    let metal = has(&[
        "metal_stdlib",
        "using namespace metal",
        "[[thread_position_in_grid]]",
        "thread_position_in_grid",
        "threadgroup_position_in_grid",
        "thread_position_in_threadgroup",
        "threads_per_threadgroup",
        "thread_index_in_simdgroup",
        "threadgroup_barrier",
        "threadgroup ",
        "simd_shuffle",
        "simd_sum",
        "simd_max",
        "mem_flags::",
        "kernel void",
        "[[buffer(",
        "device const ",
        "device float",
        "device half",
        "metal::",
    ]);
    let cuda = has(&[
        "__global__",
        "__device__",
        "__shared__",
        "__syncthreads",
        "threadIdx.",
        "blockIdx.",
        "blockDim.",
        "gridDim.",
        "__shfl",
        "<<<",
        "cuda_runtime",
        "cuda_fp16",
        "__half",
        "__restrict__",
        "cooperative_groups",
        "atomicAdd",
        "__ldg",
    ]);
    let rust = has(&[
        "fn ",
        "let mut ",
        "let ",
        "pub fn",
        "use std::",
        "impl ",
        "&mut ",
        "#[",
        "-> Self",
        "Vec<",
    ]);
    let has_include = stripped.contains("#include");
    if rust >= 3 && !has_include && cuda == 0 && metal == 0 {
        return Some("rust");
    }
    // `__restrict__` alone is common in CPU C++; require a real CUDA marker besides it.
    let cuda_real = cuda > usize::from(stripped.contains("__restrict__"));
    if metal > 0 && (metal > cuda || !cuda_real) {
        return Some("metal");
    }
    if cuda_real {
        return Some("cuda");
    }
    let cpp = has(&[
        "std::",
        "template",
        "namespace",
        "extern \"C\"",
        "#include <c",
        "constexpr",
        "auto ",
        "class ",
        "::",
        "nullptr",
    ]);
    if cpp > 0 { Some("cpp") } else { Some("c") }
}

fn strip_c_comments(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    loop {
        let a = rest.find("//");
        let b = rest.find("/*");
        match (a, b) {
            (Some(i), b) if b.is_none_or(|j| i < j) => {
                out.push_str(&rest[..i]);
                rest = rest[i..].find('\n').map(|k| &rest[i + k..]).unwrap_or("");
            }
            (_, Some(j)) => {
                out.push_str(&rest[..j]);
                rest = rest[j + 2..].find("*/").map(|k| &rest[j + 2 + k + 2..]).unwrap_or("");
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// Braces/parentheses balanced, ignoring comments and string/char literals.
fn braces_balanced(code: &str) -> bool {
    let s = strip_c_comments(code);
    let mut depth = [0i64; 2];
    let mut quote: Option<char> = None;
    let mut esc = false;
    for c in s.chars() {
        if let Some(q) = quote {
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == q || c == '\n' {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            '{' => depth[0] += 1,
            '}' => depth[0] -= 1,
            '(' => depth[1] += 1,
            ')' => depth[1] -= 1,
            _ => {}
        }
    }
    depth == [0, 0]
}

// ---------------------------------------------------------------------------------------------
// Repair

impl ParseError {
    /// A short instruction that tells the model how to fix its reply.
    pub fn guidance(&self) -> String {
        match self {
            ParseError::NoJson => "Your reply contained no JSON object. Reply with exactly one JSON object, in a ```json fenced block, and nothing else.".into(),
            ParseError::TruncatedJson { .. } => "Your JSON was cut off before it was complete. Reply again with the complete JSON object; be more concise (shorter notes and descriptions) so that it fits.".into(),
            ParseError::InvalidJson { message } => format!("Your JSON could not be parsed ({message}). Reply with one valid JSON object: double-quoted keys and strings, no comments, no trailing commas."),
            ParseError::Schema { message } => format!("Your JSON did not have the required structure: {message}. Reply with a JSON object that follows the schema exactly."),
            ParseError::Truncated { .. } => "Your reply was cut off because it reached the token limit. Reply again, complete and shorter: leave out explanations, comments and anything not asked for.".into(),
            ParseError::NoCodeBlock => "Your reply contained no fenced code block. Reply with the complete source in exactly one fenced code block.".into(),
            ParseError::TruncatedCode => "Your code block was cut off before the end. Reply with the complete source in one fenced code block; drop comments and explanations so that it fits.".into(),
            ParseError::EmptyCode => "Your code block was empty. Reply with the complete source in one fenced code block.".into(),
            ParseError::WrongLanguage { expected, found } => format!("You wrote {found} code, but the target needs {expected}. Rewrite the complete candidate in {expected}, in one fenced code block."),
            ParseError::Refused { reason } => format!("Your code was refused before compiling: {reason}. Rewrite the complete candidate without it, in one fenced code block."),
        }
    }

    /// Short machine name of the error kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ParseError::NoJson => "no_json",
            ParseError::TruncatedJson { .. } => "truncated_json",
            ParseError::InvalidJson { .. } => "invalid_json",
            ParseError::Schema { .. } => "schema",
            ParseError::Truncated { .. } => "truncated",
            ParseError::NoCodeBlock => "no_code_block",
            ParseError::TruncatedCode => "truncated_code",
            ParseError::EmptyCode => "empty_code",
            ParseError::WrongLanguage { .. } => "wrong_language",
            ParseError::Refused { .. } => "refused",
        }
    }
}

/// The follow-up user message after an unparseable reply (the embedded `repair.j2`).
pub fn repair_prompt(error: &ParseError) -> String {
    crate::prompts::Prompts::embedded()
        .repair(error, None)
        .unwrap_or_else(|_| error.guidance())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_parsing() {
        let f = fences("a\n```cuda\nx;\n```\nb\n~~~\ny\n~~~\n```py\nz");
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].lang(), "cuda");
        assert_eq!(f[0].body, "x;\n");
        assert!(f[1].closed && f[1].info.is_empty());
        assert!(!f[2].closed);
    }

    #[test]
    fn think_is_stripped() {
        assert_eq!(strip_think("<think>{\"a\":1}</think>ok"), "ok");
    }

    #[test]
    fn repair_json_fixes() {
        assert_eq!(
            repair_json("{\"a\": [1,2,], // c\n \"b\": True,}"),
            "{\"a\": [1,2], \n \"b\": true}"
        );
        assert_eq!(parse_lenient("{\"a\": 1, // c\n}").unwrap(), serde_json::json!({"a": 1}));
    }

    #[test]
    fn balanced() {
        assert!(braces_balanced("void f() { if (x) { s = \"}\"; } }"));
        assert!(!braces_balanced("void f() { if (x) {"));
    }
}
