//! Static checks run on every candidate before it is compiled. A rejection cites the rule id:
//! `rule apple.threadgroup-32k: threadgroup memory 40960 B exceeds 32768 B on m3-max (line 7)`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

use ksearch_core::backend::Dialect;
use ksearch_core::{Backend, Lang};

use crate::{Kb, Profile, Rule};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: String,
    pub message: String,
    pub line: Option<usize>,
    pub severity: Severity,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {}: {}", self.rule, self.message)?;
        if let Some(l) = self.line {
            write!(f, " (line {l})")?;
        }
        Ok(())
    }
}

/// Does any violation reject the candidate?
pub fn rejected(v: &[Violation]) -> bool {
    v.iter().any(|x| x.severity == Severity::Error)
}

/// What a source is: a whole file in a dialect, or an MLX kernel body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceLang {
    Cpp,
    Cuda,
    /// A whole Metal source (with `[[kernel]]` signatures).
    Metal,
    /// An MLX `metal_kernel` body (no signature).
    MlxMetal,
    /// An MLX `cuda_kernel` body.
    MlxCuda,
}

impl SourceLang {
    pub const ALL: [SourceLang; 5] = [
        SourceLang::Cpp,
        SourceLang::Cuda,
        SourceLang::Metal,
        SourceLang::MlxMetal,
        SourceLang::MlxCuda,
    ];

    /// The spelling of `kb/rules.toml` and of `ksearch kb check --lang`.
    pub fn name(self) -> &'static str {
        match self {
            SourceLang::Cpp => "cpp",
            SourceLang::Cuda => "cuda",
            SourceLang::Metal => "metal",
            SourceLang::MlxMetal => "mlx-metal",
            SourceLang::MlxCuda => "mlx-cuda",
        }
    }

    pub fn dialect(self) -> Dialect {
        match self {
            SourceLang::Cpp => Dialect::Cpp,
            SourceLang::Cuda | SourceLang::MlxCuda => Dialect::Cuda,
            SourceLang::Metal | SourceLang::MlxMetal => Dialect::Metal,
        }
    }

    pub fn is_body(self) -> bool {
        match self {
            SourceLang::Cpp | SourceLang::Cuda | SourceLang::Metal => false,
            SourceLang::MlxMetal | SourceLang::MlxCuda => true,
        }
    }

    fn unknown(s: &str) -> String {
        let names: Vec<&str> = SourceLang::ALL.iter().map(|l| l.name()).collect();
        format!("unknown language `{s}` (known: {})", names.join(", "))
    }
}

/// A candidate's source on a back-end.
impl From<Backend> for SourceLang {
    fn from(b: Backend) -> SourceLang {
        b.lang().into()
    }
}

/// In data files only the exact spellings of [`SourceLang::name`].
impl Serialize for SourceLang {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for SourceLang {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SourceLang, D::Error> {
        let s = String::deserialize(d)?;
        SourceLang::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| serde::de::Error::custom(SourceLang::unknown(&s)))
    }
}

impl From<Lang> for SourceLang {
    fn from(l: Lang) -> SourceLang {
        match l {
            Lang::Cpp => SourceLang::Cpp,
            Lang::Cuda => SourceLang::Cuda,
            Lang::MlxCuda => SourceLang::MlxCuda,
            Lang::MlxMetal => SourceLang::MlxMetal,
        }
    }
}

impl std::str::FromStr for SourceLang {
    type Err = String;
    fn from_str(s: &str) -> Result<SourceLang, String> {
        Ok(match s {
            "cpp" | "c++" | "cpu" => SourceLang::Cpp,
            "cuda" | "cu" => SourceLang::Cuda,
            "metal" => SourceLang::Metal,
            "mlx-metal" | "mlx_metal" => SourceLang::MlxMetal,
            "mlx-cuda" | "mlx_cuda" => SourceLang::MlxCuda,
            _ => return Err(SourceLang::unknown(s)),
        })
    }
}

/// Inputs of a check beyond the source.
#[derive(Debug, Clone, Default)]
pub struct CheckOptions {
    /// Library calls the task forbids.
    pub forbid: Vec<String>,
    /// Dynamic shared / threadgroup bytes the launch requests.
    pub dynamic_shared_bytes: Option<u64>,
    /// Compile-time values (tunables, MLX template parameters) used to size arrays.
    pub defines: BTreeMap<String, i64>,
    /// The launch's block / threadgroup size, when known.
    pub block: Option<[u64; 3]>,
    /// Checking the header of a sectioned MLX file: body-only rules do not apply.
    pub header: bool,
}

/// Check a candidate: the signature the search engine uses.
pub fn check_source(
    kb: &Kb,
    src: &str,
    lang: Lang,
    profile: &Profile,
    forbid: &[String],
    dynamic_shared_bytes: Option<u64>,
) -> Vec<Violation> {
    let opts = CheckOptions {
        forbid: forbid.to_vec(),
        dynamic_shared_bytes,
        ..Default::default()
    };
    check(kb, src, lang.into(), profile, &opts)
}

/// Check a launch's block size and shared bytes against a profile (no source needed).
pub fn check_launch(kb: &Kb, profile: &Profile, lang: SourceLang, block: [u64; 3], shared_bytes: u64) -> Vec<Violation> {
    let opts = CheckOptions {
        dynamic_shared_bytes: Some(shared_bytes),
        block: Some(block),
        ..Default::default()
    };
    check(kb, "", lang, profile, &opts)
}

/// Run every rule that applies to `lang` on `profile`.
pub fn check(kb: &Kb, src: &str, lang: SourceLang, profile: &Profile, opts: &CheckOptions) -> Vec<Violation> {
    // A sectioned MLX file (`// @kernel <entry>`): every body is checked as a body, the header
    // without the body-only rules; line numbers stay the file's own.
    if lang.is_body() && !opts.header && ksearch_core::mlx::has_sections(src) {
        let mut out = Vec::new();
        for part in ksearch_core::mlx::split(src) {
            let o = CheckOptions {
                header: part.entry.is_none(),
                ..opts.clone()
            };
            out.extend(check(kb, &part.masked, lang, profile, &o));
        }
        return out;
    }
    let clean = strip_comments_and_strings(src);
    let env = constants(&clean, &opts.defines);
    let mut out = Vec::new();
    for rule in kb.rules.iter().filter(|r| r.applies(lang, &profile.vendor)) {
        run_rule(kb, rule, &clean, lang, profile, opts, &env, &mut out);
    }
    out
}

fn violation(rule: &Rule, message: String, line: Option<usize>) -> Violation {
    Violation {
        rule: rule.id.clone(),
        message,
        line,
        severity: rule.severity,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_rule(
    kb: &Kb,
    rule: &Rule,
    clean: &str,
    lang: SourceLang,
    profile: &Profile,
    opts: &CheckOptions,
    env: &BTreeMap<String, i64>,
    out: &mut Vec<Violation>,
) {
    let dynamic = opts.dynamic_shared_bytes.unwrap_or(0);
    if opts.header && rule.kind.starts_with("mlx-") {
        return;
    }
    match rule.kind.as_str() {
        "threadgroup-limit" => {
            let limit = (profile.shared_per_block_kb * 1024.0) as u64;
            if limit == 0 {
                return;
            }
            let decls = shared_decls(clean, "threadgroup", lang, env);
            if let Some((total, line)) = crossing(&decls, dynamic, limit) {
                out.push(violation(
                    rule,
                    format!("threadgroup memory {total} B exceeds {limit} B on {}", profile.name),
                    line,
                ));
            }
        }
        "static-shared-limit" => {
            let limit = (profile.shared_per_block_kb * 1024.0) as u64;
            if limit == 0 {
                return;
            }
            let decls = shared_decls(clean, "__shared__", lang, env);
            if let Some((total, line)) = crossing(&decls, 0, limit) {
                out.push(violation(
                    rule,
                    format!(
                        "static __shared__ memory {total} B exceeds {limit} B on {}; above 48 KB declare `extern __shared__` and request dynamic shared memory",
                        profile.name
                    ),
                    line,
                ));
            }
        }
        "shared-optin-limit" => {
            let Some(kb_) = profile.shared_optin_kb else { return };
            let limit = (kb_ * 1024.0) as u64;
            let decls = shared_decls(clean, "__shared__", lang, env);
            let stat: u64 = decls.iter().map(|d| d.0).sum();
            if stat + dynamic > limit {
                let line = if dynamic > limit {
                    None
                } else {
                    crossing(&decls, dynamic, limit).and_then(|c| c.1)
                };
                out.push(violation(
                    rule,
                    format!(
                        "shared memory {} B (static {stat} + dynamic {dynamic}) exceeds the {limit} B opt-in maximum per block on {}",
                        stat + dynamic,
                        profile.name
                    ),
                    line,
                ));
            }
        }
        "threads-limit" => {
            let max = profile.max_threads_per_block as i64;
            if max <= 1 {
                return;
            }
            let re = crate::cached_regex(r"(__launch_bounds__|max_total_threads_per_threadgroup)\s*\(\s*([^,)]+)");
            for c in re.captures_iter(clean) {
                let m = c.get(0).unwrap();
                if let Some(n) = eval(&c[2], env)
                    && n > max
                {
                    out.push(violation(
                        rule,
                        format!("{} of {n} threads exceeds {max} on {}", &c[1], profile.name),
                        Some(line_at(clean, m.start())),
                    ));
                }
            }
            if let Some(b) = opts.block {
                let n = b.iter().product::<u64>();
                if n as i64 > max {
                    out.push(violation(
                        rule,
                        format!(
                            "a block of {}x{}x{} = {n} threads exceeds {max} on {}",
                            b[0], b[1], b[2], profile.name
                        ),
                        None,
                    ));
                }
            }
        }
        "tokens" => {
            let to = lang.dialect();
            for tok in &rule.tokens {
                if let Some((line, found)) = find_token(clean, tok) {
                    let suggestion = kb
                        .map(&found, to)
                        .first()
                        .and_then(|p| p.spelling(to).map(|s| (*p, s)))
                        .map(|(p, s)| {
                            if s == "none" {
                                format!(" (no direct equivalent: {})", p.note)
                            } else {
                                format!("; use `{s}`")
                            }
                        })
                        .unwrap_or_default();
                    let msg = rule.message.replace("{token}", &found).replace("{suggestion}", &suggestion);
                    out.push(violation(rule, msg, Some(line)));
                }
            }
        }
        "task-forbid" => {
            for f in &opts.forbid {
                if let Some((line, _)) = find_token(clean, f) {
                    out.push(violation(
                        rule,
                        format!("`{f}` is forbidden by the task: write the kernel instead of calling the library"),
                        Some(line),
                    ));
                }
            }
        }
        "mlx-signature" if lang.is_body() => {
            let re = crate::cached_regex(r"\[\[\s*kernel|\bkernel\s+void\b|__global__|\[\[\s*buffer\s*\(");
            if let Some(m) = re.find(clean) {
                out.push(violation(
                    rule,
                    "an MLX body has no function signature: MLX generates it from input_names/output_names; write only the statements".into(),
                    Some(line_at(clean, m.start())),
                ));
            }
        }
        "mlx-include" if lang.is_body() => {
            let re = crate::cached_regex(r"(?m)^\s*#\s*include\b");
            if let Some(m) = re.find(clean) {
                out.push(violation(
                    rule,
                    "`#include` cannot appear in an MLX body; pass includes and helpers through `header=`".into(),
                    Some(line_at(clean, m.start())),
                ));
            }
        }
        "mlx-bounds-check" if lang.is_body() => {
            let uses = crate::cached_regex(r"\bthread_position_in_grid\b|\bblockIdx\b|\bthreadIdx\b");
            let guard = crate::cached_regex(r"\b(?:if|while)\s*\([^;{]*[<>]|\bfor\s*\([^;]*;[^;]*[<>]|\bmin\s*\(|[<>]=?[^;?]*\?");
            if let Some(m) = uses.find(clean)
                && !guard.is_match(clean)
            {
                out.push(violation(
                    rule,
                    "no bounds check: MLX's grid counts threads and may exceed the data; guard with `if (i >= n) return;` before touching memory".into(),
                    Some(line_at(clean, m.start())),
                ));
            }
        }
        _ => {}
    }
}

/// The first point where the cumulative bytes pass `limit`: (total, line of that declaration).
fn crossing(decls: &[(u64, usize)], dynamic: u64, limit: u64) -> Option<(u64, Option<usize>)> {
    let total: u64 = decls.iter().map(|d| d.0).sum::<u64>() + dynamic;
    if total <= limit {
        return None;
    }
    let mut acc = dynamic;
    let mut line = None;
    for (b, l) in decls {
        acc += b;
        if acc > limit {
            line = Some(*l);
            break;
        }
    }
    Some((total, line))
}

fn line_at(text: &str, offset: usize) -> usize {
    crate::line_of_offset(text, offset)
}

/// The first occurrence of a token: `name` (whole identifier), `name*` (prefix), `name(` (a call).
/// Returns the line and the text matched.
fn find_token(clean: &str, tok: &str) -> Option<(usize, String)> {
    let (body, suffix) = if let Some(p) = tok.strip_suffix('*') {
        (p, r"\w*")
    } else if let Some(p) = tok.strip_suffix('(') {
        (p, r"\s*\(")
    } else {
        (tok, "")
    };
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut pat = String::new();
    if body.starts_with(word) {
        pat.push_str(r"\b");
    }
    pat.push_str(&regex::escape(body));
    if suffix.is_empty() {
        if body.ends_with(word) {
            pat.push_str(r"\b");
        }
    } else {
        pat.push_str(suffix);
    }
    let re = crate::try_cached_regex(&pat)?;
    // `::name` (a qualified name such as `std::printf` handled by its own token) is not a bare call
    re.find_iter(clean).find(|m| !clean[..m.start()].ends_with('.')).map(|m| {
        let found = m
            .as_str()
            .trim_end_matches(|c: char| c == '(' || c.is_whitespace())
            .to_string();
        (line_at(clean, m.start()), found)
    })
}

/// Replace comments and string / character literals by spaces, keeping line breaks.
pub(crate) fn strip_comments_and_strings(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            out.extend_from_slice(b"  ");
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                out.push(if b[i] == b'\n' { b'\n' } else { b' ' });
                i += 1;
            }
            if i < b.len() {
                out.extend_from_slice(b"  ");
                i += 2;
            }
        } else if b[i] == b'"' || (b[i] == b'\'' && !(i > 0 && b[i - 1].is_ascii_hexdigit())) {
            let q = b[i];
            out.push(q);
            i += 1;
            while i < b.len() && b[i] != q && b[i] != b'\n' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    out.push(b' ');
                    i += 1;
                }
                out.push(b' ');
                i += 1;
            }
            if i < b.len() && b[i] == q {
                out.push(q);
                i += 1;
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_default()
}

/// Named integer constants: the given defines, then `#define NAME value`, `constexpr`/`const`/
/// `constant` integer declarations, in source order (a given define wins over `#define`).
fn constants(clean: &str, given: &BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    let mut env = given.clone();
    let def = crate::cached_regex(r"^\s*#\s*define\s+([A-Za-z_]\w*)\s+(.+?)\s*$");
    let decl = crate::cached_regex(
        r"\b(?:static\s+)?(?:constexpr|const|constant)\s+(?:static\s+)?(?:constexpr\s+)?(?:unsigned\s+)?(?:int|uint|short|ushort|long|size_t|int32_t|uint32_t|int64_t|uint64_t|unsigned)\s+([A-Za-z_]\w*)\s*=\s*([^;,]+)[;,]",
    );
    for line in clean.lines() {
        if let Some(c) = def.captures(line) {
            if !env.contains_key(&c[1])
                && let Some(v) = eval(&c[2], &env)
            {
                env.insert(c[1].to_string(), v);
            }
            continue;
        }
        for c in decl.captures_iter(line) {
            if !env.contains_key(&c[1])
                && let Some(v) = eval(&c[2], &env)
            {
                env.insert(c[1].to_string(), v);
            }
        }
    }
    env
}

/// Evaluate a C integer expression: literal suffixes, `sizeof(type)` and casts are handled.
fn eval(expr: &str, env: &BTreeMap<String, i64>) -> Option<i64> {
    let sizeof = crate::cached_regex(r"sizeof\s*\(\s*([A-Za-z_][\w:]*)\s*\)");
    let mut e = sizeof
        .replace_all(expr, |c: &regex::Captures| {
            type_size(&c[1], SourceLang::Cuda)
                .map(|s| s.to_string())
                .unwrap_or_else(|| "x_unknown".into())
        })
        .into_owned();
    let suffix = crate::cached_regex(r"\b(\d+)[uUlL]+\b");
    e = suffix.replace_all(&e, "$1").into_owned();
    let cast = crate::cached_regex(r"\(\s*(?:unsigned|int|uint|size_t|long|short|int32_t|uint32_t|int64_t)\s*\)");
    e = cast.replace_all(&e, "").into_owned();
    let e = e.trim();
    if e.is_empty() {
        return None;
    }
    ksearch_core::expr::eval_i64(e, env).ok()
}

fn type_size(t: &str, lang: SourceLang) -> Option<u64> {
    let metal = match lang.dialect() {
        Dialect::Metal => true,
        Dialect::Cuda | Dialect::Cpp => false,
    };
    Some(match t {
        "float" | "int" | "uint" | "unsigned" | "unsigned int" | "int32_t" | "uint32_t" | "atomic_int" | "atomic_uint"
        | "atomic_float" => 4,
        "half" | "__half" | "bfloat" | "bfloat16_t" | "__nv_bfloat16" | "short" | "ushort" | "int16_t" | "uint16_t"
        | "unsigned short" => 2,
        "double" | "long" | "ulong" | "int64_t" | "uint64_t" | "size_t" | "long long" | "unsigned long long" => 8,
        "char" | "uchar" | "bool" | "int8_t" | "uint8_t" | "unsigned char" => 1,
        "float2" | "int2" | "uint2" | "half4" | "bfloat4" => 8,
        "float3" | "int3" | "uint3" => {
            if metal {
                16
            } else {
                12
            }
        }
        "packed_float3" => 12,
        "float4" | "int4" | "uint4" => 16,
        "half2" | "__half2" | "bfloat2" | "__nv_bfloat162" | "short2" | "ushort2" => 4,
        "half3" => {
            if metal {
                8
            } else {
                6
            }
        }
        _ => return None,
    })
}

/// Statically declared shared / threadgroup arrays: (bytes, line) for each declarator whose
/// type and sizes are known. `extern __shared__` and pointer parameters are dynamic: skipped.
fn shared_decls(clean: &str, keyword: &str, lang: SourceLang, env: &BTreeMap<String, i64>) -> Vec<(u64, usize)> {
    let kw = crate::cached_regex(&format!(r"\b{}\b", regex::escape(keyword)));
    let dims_re = crate::cached_regex(r"\[([^\]]*)\]");
    let align = crate::cached_regex(r"__align__\s*\(\s*\d+\s*\)|alignas\s*\(\s*\d+\s*\)");
    let mut out = Vec::new();
    for m in kw.find_iter(clean) {
        let before = clean[..m.start()].trim_end();
        if before.ends_with("extern") {
            continue;
        }
        let rest = &clean[m.end()..];
        let Some(end) = rest.find(';') else { continue };
        let stmt = &rest[..end];
        if stmt.contains(['(', ')', '{', '}']) && !align.is_match(stmt) {
            continue;
        }
        let stmt = align.replace_all(stmt, " ");
        // split the type from the declarators: the type is the words before the first declarator
        let mut words: Vec<&str> = Vec::new();
        let mut tail = stmt.trim();
        loop {
            let w_end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            if w_end == 0 {
                break;
            }
            let w = &tail[..w_end];
            let after = tail[w_end..].trim_start();
            let is_qual = matches!(w, "const" | "volatile" | "static" | "unsigned" | "signed" | "long" | "short");
            // a word followed by `[`, `,`, `=` or the end is the first declarator's name
            if !words.is_empty() && !is_qual && (after.is_empty() || after.starts_with(['[', ',', '='])) {
                break;
            }
            words.push(w);
            tail = after;
            if tail.starts_with('*') || tail.starts_with('&') {
                words.clear();
                break;
            }
        }
        let ty: Vec<&str> = words
            .iter()
            .copied()
            .filter(|w| !matches!(*w, "const" | "volatile" | "static" | "signed"))
            .collect();
        if ty.is_empty() {
            continue;
        }
        let ty = ty.join(" ");
        let ty = ty.trim_start_matches("metal::");
        let Some(elem) = type_size(ty, lang) else { continue };
        let line = line_at(clean, m.start());
        for decl in tail.split(',') {
            let decl = decl.split('=').next().unwrap_or("").trim();
            if decl.is_empty() || decl.starts_with('*') {
                continue;
            }
            let mut n: Option<u64> = Some(elem);
            for c in dims_re.captures_iter(decl) {
                n = match (n, eval(&c[1], env)) {
                    (Some(a), Some(d)) if d >= 0 => Some(a * d as u64),
                    _ => None,
                };
            }
            if let Some(bytes) = n {
                out.push((bytes, line));
            }
        }
    }
    out
}

/// Static threadgroup (Metal) or `__shared__` (CUDA) bytes a source declares.
pub fn threadgroup_bytes(src: &str, lang: SourceLang, defines: &BTreeMap<String, i64>) -> u64 {
    let clean = strip_comments_and_strings(src);
    let env = constants(&clean, defines);
    let kw = match lang.dialect() {
        Dialect::Metal => "threadgroup",
        Dialect::Cuda | Dialect::Cpp => "__shared__",
    };
    shared_decls(&clean, kw, lang, &env).iter().map(|d| d.0).sum()
}
