//! PTX text to a decoded module: directives, variables, functions and their instructions, with
//! registers numbered per function, labels resolved to instruction indices and every opcode's
//! modifiers decoded once (an unknown modifier is an error, never ignored).

use std::collections::HashMap;

use crate::op::{Op, decode_op};

/// A PTX state space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Generic,
    Global,
    /// `.shared` / `.shared::cta`: the block's own shared memory.
    Shared,
    /// `.shared::cluster`: the shared memory of any block of the cluster (an address of the
    /// block's own shared memory is one too).
    SharedCluster,
    Local,
    Param,
    Const,
}

/// An operand, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum Opd {
    Reg(u32),
    /// `!%p`: a negated predicate.
    NotReg(u32),
    Int(i64),
    /// A floating-point literal given as an exact f32 (`0f...`).
    F32(u32),
    /// A floating-point literal given as an exact f64 (`0d...`, or decimal).
    F64(u64),
    Special(Special),
    /// A variable's address in its own state space.
    Sym(u32),
    /// `[base + off]`.
    Addr(AddrBase, i64),
    /// `{a, b, ...}`.
    Vec(Vec<Opd>),
    /// `d|p`: a result and a predicate result.
    Pair(u32, u32),
    Label(u32),
    /// `_`: a discarded result.
    Sink,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AddrBase {
    None,
    Reg(u32),
    Sym(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
    LaneId,
    WarpId,
    NWarpId,
    SmId,
    NSmId,
    GridId,
    LaneMask(u8),
    Clock,
    Clock64,
    GlobalTimer,
    DynSmem,
    TotalSmem,
    /// `%cluster_ctarank`, `%cluster_nctarank`.
    ClusterCtaRank,
    ClusterNCtaRank,
    /// `%clusterid`, `%nclusterid`, `%cluster_ctaid`, `%cluster_nctaid`.
    ClusterId(u8),
    NClusterId(u8),
    ClusterCtaid(u8),
    ClusterNCtaid(u8),
    IsExplicitCluster,
}

/// One instruction.
#[derive(Debug, Clone)]
pub struct Instr {
    pub op: Op,
    /// `@%p` (false) or `@!%p` (true).
    pub guard: Option<(u32, bool)>,
    pub args: Vec<Opd>,
    /// The PTX line, for messages.
    pub line: u32,
}

/// A variable of the module or of a function.
#[derive(Debug, Clone)]
pub struct Symbol {
    pub name: String,
    pub space: Space,
    pub size: u64,
    pub align: u64,
    /// Its address in its state space (params: the offset in the parameter block).
    pub addr: u64,
    /// Initial bytes (module `.global` / `.const` with an initialiser).
    pub init: Vec<u8>,
    /// `.extern .shared` (dynamic shared memory).
    pub dynamic: bool,
}

#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    pub entry: bool,
    /// Parameter symbols in order.
    pub params: Vec<u32>,
    pub param_bytes: u64,
    pub instrs: Vec<Instr>,
    pub nregs: u32,
    /// Bytes of `.local` variables per thread.
    pub local_bytes: u64,
    /// `.reqntid` / `.maxntid`.
    pub max_threads: Option<u32>,
    /// `.reqnctapercluster`: the cluster shape the kernel is launched with.
    pub cluster: Option<[u32; 3]>,
    /// `.explicitcluster`.
    pub explicit_cluster: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Module {
    pub symbols: Vec<Symbol>,
    pub functions: Vec<Function>,
    /// Bytes of static `.shared` variables (dynamic shared memory starts after them).
    pub static_shared: u64,
    /// Bytes of `.global` and `.const` variables, laid out in one window.
    pub global_bytes: u64,
}

impl Module {
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }
    pub fn entries(&self) -> Vec<&str> {
        self.functions.iter().filter(|f| f.entry).map(|f| f.name.as_str()).collect()
    }
}

// ---- lexing ----

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Str(String),
    P(char),
}

struct Lexed {
    toks: Vec<Tok>,
    lines: Vec<u32>,
}

fn word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '%' | '.')
}

fn lex(src: &str) -> Result<Lexed, String> {
    let b: Vec<char> = src.chars().collect();
    let (mut toks, mut lines) = (Vec::new(), Vec::new());
    let (mut i, mut line) = (0usize, 1u32);
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                if b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            let s = i + 1;
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += 1;
            }
            toks.push(Tok::Str(b[s..i.min(b.len())].iter().collect()));
            lines.push(line);
            i += 1;
        } else if word_char(c) || (c == '-' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            let s = i;
            i += 1;
            loop {
                if i < b.len() && word_char(b[i]) {
                    i += 1;
                } else if i + 2 < b.len() && b[i] == ':' && b[i + 1] == ':' && word_char(b[i + 2]) {
                    i += 2;
                } else {
                    break;
                }
            }
            toks.push(Tok::Word(b[s..i].iter().collect()));
            lines.push(line);
        } else if "{}[](),;:|!@+-<>=".contains(c) {
            toks.push(Tok::P(c));
            lines.push(line);
            i += 1;
        } else {
            return Err(format!("line {line}: unexpected character {c:?}"));
        }
    }
    Ok(Lexed { toks, lines })
}

// ---- parsing ----

struct P<'a> {
    t: &'a [Tok],
    lines: &'a [u32],
    i: usize,
}

impl P<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.i)
    }
    fn line(&self) -> u32 {
        self.lines
            .get(self.i.min(self.lines.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.t.get(self.i).cloned();
        self.i += 1;
        t
    }
    fn is_p(&self, c: char) -> bool {
        self.peek() == Some(&Tok::P(c))
    }
    fn eat_p(&mut self, c: char) -> bool {
        if self.is_p(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect_p(&mut self, c: char) -> Result<(), String> {
        if self.eat_p(c) {
            Ok(())
        } else {
            Err(format!("line {}: expected `{c}`, found {:?}", self.line(), self.peek()))
        }
    }
    fn word(&mut self) -> Result<String, String> {
        match self.next() {
            Some(Tok::Word(w)) => Ok(w),
            t => Err(format!("line {}: expected a name, found {t:?}", self.line())),
        }
    }
    fn is_word(&self, w: &str) -> bool {
        matches!(self.peek(), Some(Tok::Word(x)) if x == w)
    }
    /// Skip to just past the next `;`.
    fn skip_stmt(&mut self) {
        while let Some(t) = self.next() {
            if t == Tok::P(';') {
                break;
            }
        }
    }
}

fn parse_int(w: &str) -> Option<i64> {
    let w = w.trim_end_matches(['U', 'u']);
    let (neg, w) = match w.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, w),
    };
    let v = if let Some(h) = w.strip_prefix("0x").or_else(|| w.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()? as i64
    } else if w.len() > 1 && w.starts_with('0') && w.chars().all(|c| c.is_ascii_digit()) {
        u64::from_str_radix(&w[1..], 8).ok()? as i64
    } else if w.chars().all(|c| c.is_ascii_digit()) && !w.is_empty() {
        w.parse::<u64>().ok()? as i64
    } else {
        return None;
    };
    Some(if neg { v.wrapping_neg() } else { v })
}

fn type_size(t: &str) -> Option<u64> {
    Some(match t {
        ".b8" | ".u8" | ".s8" => 1,
        ".b16" | ".u16" | ".s16" | ".f16" | ".bf16" => 2,
        ".b32" | ".u32" | ".s32" | ".f32" | ".f16x2" | ".bf16x2" => 4,
        ".b64" | ".u64" | ".s64" | ".f64" => 8,
        ".pred" => 1,
        _ => return None,
    })
}

/// A variable declaration after its state space: `.align N .type name[...] = {...};`.
struct Decl {
    names: Vec<(String, u64)>,
    align: u64,
    init: Vec<u8>,
    /// `name<N>`: a range of registers.
    range: Option<u32>,
}

/// The qualifiers before a declared name: `.align N`, a type (or `.vN .type`), others skipped.
/// (alignment, 0 when not given; element bytes, 0 when no type).
fn type_prefix(p: &mut P) -> Result<(u64, u64), String> {
    let mut align = 0u64;
    let mut elem = 0u64;
    loop {
        if p.is_word(".align") {
            p.next();
            let w = p.word()?;
            align = parse_int(&w).ok_or_else(|| format!("line {}: bad alignment {w}", p.line()))? as u64;
        } else if let Some(Tok::Word(w)) = p.peek() {
            if let Some(s) = type_size(w) {
                elem = s;
                p.next();
            } else if w.starts_with(".v") && w.len() == 3 {
                let n: u64 = w[2..].parse().unwrap_or(1);
                p.next();
                let t = p.word()?;
                elem = type_size(&t).ok_or_else(|| format!("line {}: unknown type {t}", p.line()))? * n;
            } else if w.starts_with('.') {
                // .ptr / .global qualifiers and the like
                p.next();
            } else {
                break;
            }
        } else {
            break;
        }
    }
    Ok((align, elem))
}

fn parse_decl(p: &mut P) -> Result<Decl, String> {
    let (align, elem) = type_prefix(p)?;
    if elem == 0 {
        return Err(format!("line {}: a declaration without a type", p.line()));
    }
    let mut names = Vec::new();
    let mut range = None;
    let mut init = Vec::new();
    loop {
        let name = p.word()?;
        let mut count = 1u64;
        if p.eat_p('<') {
            let w = p.word()?;
            range = Some(parse_int(&w).ok_or_else(|| format!("line {}: bad register count {w}", p.line()))? as u32);
            p.expect_p('>')?;
        }
        while p.eat_p('[') {
            if p.eat_p(']') {
                count = 0;
                continue;
            }
            let w = p.word()?;
            count *= parse_int(&w).ok_or_else(|| format!("line {}: bad array size {w}", p.line()))? as u64;
            p.expect_p(']')?;
        }
        if p.eat_p('=') {
            let mut vals = Vec::new();
            let braced = p.eat_p('{');
            loop {
                if p.eat_p('{') || p.eat_p('}') || p.eat_p(',') {
                    continue;
                }
                if p.is_p(';') {
                    break;
                }
                let w = p.word()?;
                let v = if let Some(h) = w.strip_prefix("0f") {
                    u32::from_str_radix(h, 16).map(|x| x as i64).ok()
                } else if let Some(h) = w.strip_prefix("0d") {
                    u64::from_str_radix(h, 16).map(|x| x as i64).ok()
                } else {
                    parse_int(&w)
                }
                .ok_or_else(|| format!("line {}: bad initialiser {w}", p.line()))?;
                vals.push(v);
            }
            let _ = braced;
            for v in vals {
                init.extend_from_slice(&v.to_le_bytes()[..elem as usize]);
            }
        }
        names.push((name, count * elem));
        if !p.eat_p(',') {
            break;
        }
    }
    p.expect_p(';')?;
    Ok(Decl {
        names,
        align: if align == 0 { elem } else { align },
        init,
        range,
    })
}

fn space_of(w: &str) -> Option<Space> {
    Some(match w {
        ".global" => Space::Global,
        ".shared" => Space::Shared,
        ".local" => Space::Local,
        ".param" => Space::Param,
        ".const" => Space::Const,
        _ => return None,
    })
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a.max(1)) * a.max(1)
}

/// Parse a PTX module.
pub fn parse(src: &str) -> Result<Module, String> {
    let lx = lex(src)?;
    let mut p = P {
        t: &lx.toks,
        lines: &lx.lines,
        i: 0,
    };
    let mut m = Module::default();
    let mut globals: HashMap<String, u32> = HashMap::new();
    let mut pending_dynamic = Vec::new();
    while let Some(t) = p.peek().cloned() {
        let Tok::Word(w) = t else {
            return Err(format!("line {}: unexpected {t:?} at module level", p.line()));
        };
        match w.as_str() {
            ".version" | ".target" | ".address_size" | ".file" | ".loc" | ".pragma" => {
                p.next();
                // these end at the line's end, not at `;` (except .pragma)
                let l = p.line();
                if w == ".pragma" {
                    p.skip_stmt();
                } else {
                    while p.peek().is_some() && p.line() == l && !p.is_word(".version") {
                        p.next();
                    }
                }
            }
            ".visible" | ".weak" | ".extern" | ".entry" | ".func" | ".global" | ".shared" | ".const" => {
                let mut is_extern = false;
                while p.is_word(".visible") || p.is_word(".weak") || p.is_word(".extern") {
                    is_extern |= p.is_word(".extern");
                    p.next();
                }
                let kw = p.word()?;
                if kw == ".entry" || kw == ".func" {
                    if let Some(f) = parse_function(&mut p, &mut m, &globals, kw == ".entry")? {
                        m.functions.push(f);
                    }
                    continue;
                }
                let space = space_of(&kw).ok_or_else(|| format!("line {}: unsupported directive {kw}", p.line()))?;
                let d = parse_decl(&mut p)?;
                for (name, size) in d.names {
                    let dynamic = is_extern && space == Space::Shared;
                    let id = m.symbols.len() as u32;
                    let mut init = d.init.clone();
                    let addr = match space {
                        Space::Shared if !dynamic => {
                            let a = align_up(m.static_shared, d.align);
                            m.static_shared = a + size;
                            a
                        }
                        Space::Shared => {
                            pending_dynamic.push(id);
                            0
                        }
                        _ => {
                            let a = align_up(m.global_bytes, d.align);
                            m.global_bytes = a + size;
                            init.resize(size as usize, 0);
                            a
                        }
                    };
                    m.symbols.push(Symbol {
                        name: name.clone(),
                        space,
                        size,
                        align: d.align,
                        addr,
                        init,
                        dynamic,
                    });
                    globals.insert(name, id);
                }
            }
            _ => return Err(format!("line {}: unsupported directive {w}", p.line())),
        }
    }
    // Dynamic shared memory starts after the static variables, aligned for the strictest.
    let mut start = m.static_shared;
    for id in &pending_dynamic {
        start = align_up(start, m.symbols[*id as usize].align.max(16));
    }
    for id in pending_dynamic {
        m.symbols[id as usize].addr = start;
    }
    m.static_shared = start;
    Ok(m)
}

/// Per-function names: registers (scoped), parameters, locals, labels.
struct Scope {
    frames: Vec<HashMap<String, u32>>,
    nregs: u32,
}

impl Scope {
    fn reg(&self, n: &str) -> Option<u32> {
        self.frames.iter().rev().find_map(|f| f.get(n).copied())
    }
    fn declare(&mut self, n: String) -> u32 {
        let id = self.nregs;
        self.nregs += 1;
        self.frames.last_mut().expect("a frame").insert(n, id);
        id
    }
}

fn special(name: &str) -> Option<Special> {
    let dim = |s: &str| match s {
        "x" => Some(0u8),
        "y" => Some(1),
        "z" => Some(2),
        _ => None,
    };
    if let Some((a, b)) = name.split_once('.') {
        let d = dim(b)?;
        return Some(match a {
            "%tid" => Special::Tid(d),
            "%ntid" => Special::Ntid(d),
            "%ctaid" => Special::Ctaid(d),
            "%nctaid" => Special::Nctaid(d),
            "%clusterid" => Special::ClusterId(d),
            "%nclusterid" => Special::NClusterId(d),
            "%cluster_ctaid" => Special::ClusterCtaid(d),
            "%cluster_nctaid" => Special::ClusterNCtaid(d),
            _ => return None,
        });
    }
    Some(match name {
        "%laneid" => Special::LaneId,
        "%warpid" => Special::WarpId,
        "%nwarpid" => Special::NWarpId,
        "%smid" => Special::SmId,
        "%nsmid" => Special::NSmId,
        "%gridid" => Special::GridId,
        "%lanemask_eq" => Special::LaneMask(0),
        "%lanemask_le" => Special::LaneMask(1),
        "%lanemask_lt" => Special::LaneMask(2),
        "%lanemask_ge" => Special::LaneMask(3),
        "%lanemask_gt" => Special::LaneMask(4),
        "%clock" => Special::Clock,
        "%clock64" => Special::Clock64,
        "%globaltimer" => Special::GlobalTimer,
        "%dynamic_smem_size" => Special::DynSmem,
        "%total_smem_size" => Special::TotalSmem,
        "%cluster_ctarank" => Special::ClusterCtaRank,
        "%cluster_nctarank" => Special::ClusterNCtaRank,
        "%is_explicit_cluster" => Special::IsExplicitCluster,
        "%tid" | "%ntid" | "%ctaid" | "%nctaid" => return None,
        _ => return None,
    })
}

struct FnCtx<'a> {
    scope: Scope,
    locals: HashMap<String, u32>,
    globals: &'a HashMap<String, u32>,
    labels: HashMap<String, u32>,
    /// (instruction, operand path) waiting for a label.
    fixups: Vec<(usize, usize, String)>,
}

impl FnCtx<'_> {
    fn sym(&self, n: &str) -> Option<u32> {
        self.locals.get(n).or_else(|| self.globals.get(n)).copied()
    }
}

fn parse_function(p: &mut P, m: &mut Module, globals: &HashMap<String, u32>, entry: bool) -> Result<Option<Function>, String> {
    // `.func (.param .b32 ret) name (params)`: return parameters first.
    let mut ret_params = false;
    if p.is_p('(') {
        ret_params = true;
        let mut depth = 0;
        while let Some(t) = p.next() {
            match t {
                Tok::P('(') => depth += 1,
                Tok::P(')') => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    let name = p.word()?;
    let mut f = Function {
        name: name.clone(),
        entry,
        params: Vec::new(),
        param_bytes: 0,
        instrs: Vec::new(),
        nregs: 0,
        local_bytes: 0,
        max_threads: None,
        cluster: None,
        explicit_cluster: false,
    };
    let mut cx = FnCtx {
        scope: Scope {
            frames: vec![HashMap::new()],
            nregs: 0,
        },
        locals: HashMap::new(),
        globals,
        labels: HashMap::new(),
        fixups: Vec::new(),
    };
    if p.eat_p('(') {
        while !p.eat_p(')') {
            if p.eat_p(',') {
                continue;
            }
            let kw = p.word()?;
            if kw != ".param" && kw != ".reg" {
                return Err(format!("line {}: unsupported parameter kind {kw} in {name}", p.line()));
            }
            let (align, elem) = type_prefix(p)?;
            let pname = p.word()?;
            let mut count = 1u64;
            while p.eat_p('[') {
                count *= parse_int(&p.word()?).unwrap_or(1) as u64;
                p.expect_p(']')?;
            }
            let size = elem * count;
            let align = if align == 0 { elem.max(1) } else { align };
            let off = align_up(f.param_bytes, align);
            f.param_bytes = off + size;
            let id = m.symbols.len() as u32;
            m.symbols.push(Symbol {
                name: pname.clone(),
                space: Space::Param,
                size,
                align,
                addr: off,
                init: Vec::new(),
                dynamic: false,
            });
            cx.locals.insert(pname, id);
            f.params.push(id);
        }
    }
    // Performance directives up to the body.
    while let Some(Tok::Word(w)) = p.peek().cloned() {
        p.next();
        let mut nums = Vec::new();
        while let Some(Tok::Word(v)) = p.peek().cloned() {
            match parse_int(&v) {
                Some(n) => {
                    nums.push(n);
                    p.next();
                    p.eat_p(',');
                }
                None => break,
            }
        }
        if w == ".maxntid" || w == ".reqntid" {
            f.max_threads = Some(nums.iter().product::<i64>().max(1) as u32);
        }
        if w == ".reqnctapercluster" {
            let mut c = [1u32; 3];
            for (d, n) in c.iter_mut().zip(&nums) {
                *d = u32::try_from(*n).map_err(|_| format!("line {}: bad cluster shape {nums:?}", p.line()))?;
            }
            f.cluster = Some(c);
        }
        f.explicit_cluster |= w == ".explicitcluster";
    }
    if p.eat_p(';') {
        // A declaration only (`.extern .func`).
        return Ok(None);
    }
    if ret_params {
        return Err(format!("function `{name}` returns values: calls are not supported"));
    }
    p.expect_p('{')?;
    let mut depth = 1;
    while depth > 0 {
        let line = p.line();
        let Some(t) = p.peek().cloned() else {
            return Err(format!("function `{name}`: unexpected end of the module"));
        };
        match t {
            Tok::P('{') => {
                p.next();
                depth += 1;
                cx.scope.frames.push(HashMap::new());
            }
            Tok::P('}') => {
                p.next();
                depth -= 1;
                if depth > 0 {
                    cx.scope.frames.pop();
                }
            }
            Tok::Word(w) if p.t.get(p.i + 1) == Some(&Tok::P(':')) && !w.starts_with('.') => {
                p.next();
                p.next();
                cx.labels.insert(w, f.instrs.len() as u32);
            }
            Tok::Word(w) if w == ".reg" => {
                p.next();
                let d = parse_decl(p)?;
                for (n, _) in d.names {
                    match d.range {
                        Some(k) => {
                            for i in 0..k {
                                cx.scope.declare(format!("{n}{i}"));
                            }
                        }
                        None => {
                            cx.scope.declare(n);
                        }
                    }
                }
            }
            Tok::Word(w) if w == ".local" || w == ".shared" || w == ".param" || w == ".const" || w == ".global" => {
                p.next();
                let space = space_of(&w).expect("a space");
                let d = parse_decl(p)?;
                for (n, size) in d.names {
                    let addr = match space {
                        Space::Local => {
                            let a = align_up(f.local_bytes, d.align);
                            f.local_bytes = a + size;
                            a
                        }
                        Space::Shared => {
                            let a = align_up(m.static_shared, d.align);
                            m.static_shared = a + size;
                            a
                        }
                        _ => return Err(format!("line {line}: {w} variables inside a function are not supported")),
                    };
                    let id = m.symbols.len() as u32;
                    m.symbols.push(Symbol {
                        name: n.clone(),
                        space,
                        size,
                        align: d.align,
                        addr,
                        init: Vec::new(),
                        dynamic: false,
                    });
                    cx.locals.insert(n, id);
                }
            }
            Tok::Word(w) if w == ".pragma" || w == ".loc" || w == ".file" => {
                p.next();
                if w == ".pragma" {
                    p.skip_stmt();
                } else {
                    while p.peek().is_some() && p.line() == line {
                        p.next();
                    }
                }
            }
            _ => {
                let ins = parse_instr(p, &mut cx, f.instrs.len())?;
                f.instrs.push(ins);
            }
        }
    }
    for (ii, ai, l) in cx.fixups {
        let pc = *cx
            .labels
            .get(&l)
            .ok_or_else(|| format!("function `{name}`: unknown label {l}"))?;
        f.instrs[ii].args[ai] = Opd::Label(pc);
    }
    f.nregs = cx.scope.nregs;
    Ok(Some(f))
}

fn parse_operand(p: &mut P, cx: &mut FnCtx, ii: usize, ai: usize) -> Result<Opd, String> {
    let line = p.line();
    if p.eat_p('[') {
        let mut base = AddrBase::None;
        let mut off = 0i64;
        let mut neg = false;
        while !p.eat_p(']') {
            match p.next() {
                Some(Tok::P('+')) => neg = false,
                Some(Tok::P('-')) => neg = true,
                Some(Tok::Word(w)) => {
                    if let Some(v) = parse_int(&w) {
                        off += if neg { -v } else { v };
                    } else if let Some(r) = cx.scope.reg(&w) {
                        base = AddrBase::Reg(r);
                    } else if let Some(s) = cx.sym(&w) {
                        base = AddrBase::Sym(s);
                    } else {
                        return Err(format!("line {line}: unknown name {w} in an address"));
                    }
                    neg = false;
                }
                Some(Tok::P(',')) => {
                    // `[map, {c0, c1, ...}]` (a tensor copy's map and coordinates): the address,
                    // then the list.
                    let coords = parse_operand(p, cx, ii, ai)?;
                    if !p.eat_p(']') {
                        return Err(format!("line {line}: expected `]` after a tensor copy's coordinates"));
                    }
                    return Ok(Opd::Vec(vec![Opd::Addr(base, off), coords]));
                }
                t => return Err(format!("line {line}: unexpected {t:?} in an address")),
            }
        }
        return Ok(Opd::Addr(base, off));
    }
    if p.eat_p('{') {
        let mut v = Vec::new();
        while !p.eat_p('}') {
            if p.eat_p(',') {
                continue;
            }
            v.push(parse_operand(p, cx, ii, ai)?);
        }
        return Ok(Opd::Vec(v));
    }
    if p.eat_p('!') {
        let w = p.word()?;
        let r = cx.scope.reg(&w).ok_or_else(|| format!("line {line}: unknown register {w}"))?;
        return Ok(Opd::NotReg(r));
    }
    if p.eat_p('-') {
        // `-%r` is not PTX; a negative number was lexed with its sign.
        return Err(format!("line {line}: unexpected `-`"));
    }
    let w = p.word()?;
    if w == "_" {
        return Ok(Opd::Sink);
    }
    if let Some(r) = cx.scope.reg(&w) {
        if p.eat_p('|') {
            let w2 = p.word()?;
            let r2 = cx
                .scope
                .reg(&w2)
                .ok_or_else(|| format!("line {line}: unknown register {w2}"))?;
            return Ok(Opd::Pair(r, r2));
        }
        return Ok(Opd::Reg(r));
    }
    if let Some(h) = w.strip_prefix("0f").or_else(|| w.strip_prefix("0F")) {
        return u32::from_str_radix(h, 16)
            .map(Opd::F32)
            .map_err(|_| format!("line {line}: bad float {w}"));
    }
    if let Some(h) = w.strip_prefix("0d").or_else(|| w.strip_prefix("0D")) {
        return u64::from_str_radix(h, 16)
            .map(Opd::F64)
            .map_err(|_| format!("line {line}: bad double {w}"));
    }
    if let Some(v) = parse_int(&w) {
        return Ok(Opd::Int(v));
    }
    if w.contains('.')
        && !w.starts_with('%')
        && !w.starts_with('$')
        && let Ok(v) = w.parse::<f64>()
    {
        return Ok(Opd::F64(v.to_bits()));
    }
    if let Some(s) = special(&w) {
        return Ok(Opd::Special(s));
    }
    if let Some(s) = cx.sym(&w) {
        // `var+imm` (mapa, getctarank, mov): the variable's address plus the offset.
        if p.is_p('+')
            && let Some(Tok::Word(n)) = p.t.get(p.i + 1)
            && let Some(v) = parse_int(n)
        {
            p.i += 2;
            return Ok(Opd::Addr(AddrBase::Sym(s), v));
        }
        return Ok(Opd::Sym(s));
    }
    // Anything else that is a name is a label, resolved (or refused) at the function's end.
    if w.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
    {
        cx.fixups.push((ii, ai, w));
        return Ok(Opd::Label(u32::MAX));
    }
    Err(format!("line {line}: unknown operand {w}"))
}

fn parse_instr(p: &mut P, cx: &mut FnCtx, ii: usize) -> Result<Instr, String> {
    let line = p.line();
    let mut guard = None;
    if p.eat_p('@') {
        let neg = p.eat_p('!');
        let w = p.word()?;
        let r = cx
            .scope
            .reg(&w)
            .ok_or_else(|| format!("line {line}: unknown predicate {w}"))?;
        guard = Some((r, neg));
    }
    let opname = p.word()?;
    let Ok(op) = decode_op(&opname) else {
        // Outside the interpreted subset: skipped to its `;`, refused only if a thread reaches it.
        while !p.eat_p(';') {
            if p.next().is_none() {
                return Err(format!("line {line}: `{opname}` is not terminated"));
            }
        }
        return Ok(Instr {
            op: crate::op::unsupported(&opname),
            guard,
            args: Vec::new(),
            line,
        });
    };
    let mut args = Vec::new();
    // `call` has parenthesised lists; not supported (rejected by decode_op).
    while !p.eat_p(';') {
        if p.peek().is_none() {
            return Err(format!("line {line}: `{opname}` is not terminated"));
        }
        if p.eat_p(',') {
            continue;
        }
        let ai = args.len();
        args.push(parse_operand(p, cx, ii, ai)?);
    }
    let need = crate::op::min_operands(&op);
    if args.len() < need {
        return Err(format!("line {line}: `{opname}` needs {need} operands, has {}", args.len()));
    }
    Ok(Instr { op, guard, args, line })
}
