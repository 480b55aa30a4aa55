//! A small expression language for launch sizes, constraints and cost formulas.
//!
//! Integers (`i64`) with `+ - * / %`, comparisons, `&& || !`, parentheses and the functions
//! `ceil_div`, `min`, `max`. Identifiers are looked up in an environment (axes, tunables).
//! [`eval_f64`] evaluates the same syntax in floating point, for `flops` formulas.

use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExprError {
    #[error("expression `{expr}`: {reason}")]
    Parse { expr: String, reason: String },
    #[error("expression `{expr}`: unknown name `{name}`")]
    Unknown { expr: String, name: String },
    #[error("expression `{expr}`: division by zero")]
    DivZero { expr: String },
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(f64, bool),
    Ident(String),
    Op(&'static str),
    LParen,
    RParen,
    Comma,
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i] as char;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            let st = i;
            while i < b.len()
                && ((b[i] as char).is_ascii_alphanumeric()
                    || b[i] == b'.'
                    || ((b[i] == b'-' || b[i] == b'+') && (b[i - 1] == b'e' || b[i - 1] == b'E')))
            {
                i += 1;
            }
            let t = &s[st..i];
            let is_int = t.bytes().all(|c| c.is_ascii_digit());
            let v: f64 = t.parse().map_err(|_| format!("bad number `{t}`"))?;
            out.push(Tok::Num(v, is_int));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let st = i;
            while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(s[st..i].to_string()));
        } else {
            let two = if i + 1 < b.len() { &s[i..i + 2] } else { "" };
            let op2 = ["<=", ">=", "==", "!=", "&&", "||"].into_iter().find(|o| *o == two);
            if let Some(o) = op2 {
                out.push(Tok::Op(o));
                i += 2;
                continue;
            }
            let t = match c {
                '(' => Tok::LParen,
                ')' => Tok::RParen,
                ',' => Tok::Comma,
                '+' => Tok::Op("+"),
                '-' => Tok::Op("-"),
                '*' => Tok::Op("*"),
                '/' => Tok::Op("/"),
                '%' => Tok::Op("%"),
                '<' => Tok::Op("<"),
                '>' => Tok::Op(">"),
                '!' => Tok::Op("!"),
                _ => return Err(format!("unexpected character `{c}`")),
            };
            out.push(t);
            i += 1;
        }
    }
    Ok(out)
}

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Num(f64),
    Var(String),
    Neg(Box<Expr>),
    Not(Box<Expr>),
    Bin(&'static str, Box<Expr>, Box<Expr>),
    Call(String, Vec<Expr>),
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    depth: u32,
}

/// Bounds on an expression, so a hostile task file cannot exhaust the stack.
const MAX_DEPTH: u32 = 200;
const MAX_TOKENS: usize = 4096;

fn prec(op: &str) -> u8 {
    match op {
        "||" => 1,
        "&&" => 2,
        "==" | "!=" => 3,
        "<" | "<=" | ">" | ">=" => 4,
        "+" | "-" => 5,
        "*" | "/" | "%" => 6,
        _ => 0,
    }
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn expr(&mut self, min: u8) -> Result<Expr, String> {
        let mut lhs = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Tok::Op(o)) if prec(o) >= min && prec(o) > 0 => *o,
                _ => break,
            };
            self.next();
            let rhs = self.expr(prec(op) + 1)?;
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(rhs));
        }
        Ok(lhs)
    }
    fn unary(&mut self) -> Result<Expr, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH} levels"));
        }
        let r = self.unary_inner();
        self.depth -= 1;
        r
    }
    fn unary_inner(&mut self) -> Result<Expr, String> {
        match self.next() {
            Some(Tok::Op("-")) => Ok(Expr::Neg(Box::new(self.unary()?))),
            Some(Tok::Op("!")) => Ok(Expr::Not(Box::new(self.unary()?))),
            Some(Tok::Num(v, _)) => Ok(Expr::Num(v)),
            Some(Tok::LParen) => {
                let e = self.expr(1)?;
                match self.next() {
                    Some(Tok::RParen) => Ok(e),
                    _ => Err("missing `)`".into()),
                }
            }
            Some(Tok::Ident(name)) => {
                if let Some(Tok::LParen) = self.peek() {
                    self.next();
                    let mut args = Vec::new();
                    if let Some(Tok::RParen) = self.peek() {
                        self.next();
                    } else {
                        loop {
                            args.push(self.expr(1)?);
                            match self.next() {
                                Some(Tok::Comma) => continue,
                                Some(Tok::RParen) => break,
                                _ => return Err(format!("bad argument list for `{name}`")),
                            }
                        }
                    }
                    let want = match name.as_str() {
                        "ceil_div" | "min" | "max" => 2,
                        "sqrt" | "log2" => 1,
                        _ => return Err(format!("unknown function `{name}`")),
                    };
                    if args.len() != want {
                        return Err(format!("`{name}` takes {want} arguments"));
                    }
                    Ok(Expr::Call(name, args))
                } else {
                    Ok(Expr::Var(name))
                }
            }
            Some(t) => Err(format!("unexpected token {t:?}")),
            None => Err("unexpected end".into()),
        }
    }
}

impl Expr {
    pub fn parse(s: &str) -> Result<Expr, ExprError> {
        let perr = |reason: String| ExprError::Parse {
            expr: if s.len() > 200 {
                format!("{}...", s.chars().take(200).collect::<String>())
            } else {
                s.to_string()
            },
            reason,
        };
        let toks = lex(s).map_err(perr)?;
        if toks.is_empty() {
            return Err(perr("empty expression".into()));
        }
        if toks.len() > MAX_TOKENS {
            return Err(perr(format!("longer than {MAX_TOKENS} tokens")));
        }
        let mut p = Parser { toks, pos: 0, depth: 0 };
        let e = p.expr(1).map_err(perr)?;
        if p.pos < p.toks.len() {
            return Err(perr(format!("trailing input at token {}", p.pos + 1)));
        }
        Ok(e)
    }

    /// Names this expression refers to.
    pub fn vars(&self, out: &mut Vec<String>) {
        match self {
            Expr::Num(_) => {}
            Expr::Var(v) => out.push(v.clone()),
            Expr::Neg(e) | Expr::Not(e) => e.vars(out),
            Expr::Bin(_, a, b) => {
                a.vars(out);
                b.vars(out);
            }
            Expr::Call(_, a) => a.iter().for_each(|e| e.vars(out)),
        }
    }

    fn ev(&self, env: &dyn Fn(&str) -> Option<f64>, int: bool, src: &str) -> Result<f64, ExprError> {
        let b = |x: bool| if x { 1.0 } else { 0.0 };
        Ok(match self {
            Expr::Num(v) => *v,
            Expr::Var(n) => env(n).ok_or_else(|| ExprError::Unknown {
                expr: src.into(),
                name: n.clone(),
            })?,
            Expr::Neg(e) => -e.ev(env, int, src)?,
            Expr::Not(e) => b(e.ev(env, int, src)? == 0.0),
            Expr::Bin(op, x, y) => {
                let a = x.ev(env, int, src)?;
                let c = y.ev(env, int, src)?;
                match *op {
                    "+" => a + c,
                    "-" => a - c,
                    "*" => a * c,
                    "/" | "%" => {
                        // Integer division and remainder work on the truncated operands: a
                        // divisor that truncates to 0 is a division by zero too.
                        let (ai, ci) = (a as i64, c as i64);
                        if c == 0.0 || ((*op == "%" || int) && ci == 0) {
                            return Err(ExprError::DivZero { expr: src.into() });
                        }
                        if *op == "%" {
                            ai.wrapping_rem(ci) as f64
                        } else if int {
                            ai.wrapping_div(ci) as f64
                        } else {
                            a / c
                        }
                    }
                    "<" => b(a < c),
                    "<=" => b(a <= c),
                    ">" => b(a > c),
                    ">=" => b(a >= c),
                    "==" => b(a == c),
                    "!=" => b(a != c),
                    "&&" => b(a != 0.0 && c != 0.0),
                    "||" => b(a != 0.0 || c != 0.0),
                    _ => unreachable!("operator set is closed"),
                }
            }
            Expr::Call(f, args) => {
                let a = args[0].ev(env, int, src)?;
                match f.as_str() {
                    "sqrt" => a.sqrt(),
                    "log2" => a.log2(),
                    _ => {
                        let c = args[1].ev(env, int, src)?;
                        match f.as_str() {
                            "min" => a.min(c),
                            "max" => a.max(c),
                            _ => {
                                let (ai, ci) = (a as i64, c as i64);
                                if ci == 0 {
                                    return Err(ExprError::DivZero { expr: src.into() });
                                }
                                (ai.wrapping_add(ci).wrapping_sub(1).wrapping_div_euclid(ci)) as f64
                            }
                        }
                    }
                }
            }
        })
    }
}

/// Evaluate `src` with integer semantics (`/` truncates).
pub fn eval_i64(src: &str, env: &BTreeMap<String, i64>) -> Result<i64, ExprError> {
    let e = Expr::parse(src)?;
    let f = |n: &str| env.get(n).map(|v| *v as f64);
    Ok(e.ev(&f, true, src)? as i64)
}

/// Evaluate `src` in floating point.
pub fn eval_f64(src: &str, env: &BTreeMap<String, i64>) -> Result<f64, ExprError> {
    let e = Expr::parse(src)?;
    let f = |n: &str| env.get(n).map(|v| *v as f64);
    e.ev(&f, false, src)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn env() -> BTreeMap<String, i64> {
        [("L".to_string(), 4096), ("CHUNK".to_string(), 64)].into_iter().collect()
    }
    #[test]
    fn hostile_expressions_are_errors_not_panics() {
        for e in ["L % 0.5", "ceil_div(L, 0.5)", "L / 0.25"] {
            assert!(matches!(eval_i64(e, &env()), Err(ExprError::DivZero { .. })), "{e}");
        }
        let r = eval_i64("(0 - 9223372036854775807 - 1) / (0 - 1)", &env());
        assert!(r.is_ok(), "{r:?}");
        let deep = format!("{}1{}", "-(".repeat(300), ")".repeat(300));
        assert!(Expr::parse(&deep).unwrap_err().to_string().contains("nested deeper than"));
        let long = vec!["1"; 10_000].join("+");
        assert!(Expr::parse(&long).unwrap_err().to_string().contains("longer than"));
        assert_eq!(eval_i64(&vec!["1"; 2000].join("+"), &env()).unwrap(), 2000);
    }

    #[test]
    fn arithmetic_and_functions() {
        assert_eq!(eval_i64("L / CHUNK", &env()).unwrap(), 64);
        assert_eq!(eval_i64("ceil_div(L + 1, CHUNK)", &env()).unwrap(), 65);
        assert_eq!(eval_i64("2 + 3 * 4", &env()).unwrap(), 14);
        assert_eq!(eval_i64("(2 + 3) * 4", &env()).unwrap(), 20);
        assert_eq!(eval_i64("-L % 3", &env()).unwrap(), -1);
        assert_eq!(eval_i64("min(L, 100) + max(1, CHUNK)", &env()).unwrap(), 164);
        assert_eq!(eval_i64("CHUNK <= 64 && L > 1", &env()).unwrap(), 1);
        assert_eq!(eval_i64("!(CHUNK == 64) || 0", &env()).unwrap(), 0);
        assert!((eval_f64("5 * L / 2", &env()).unwrap() - 10240.0).abs() < 1e-9);
        assert!((eval_f64("1e3 * 2", &env()).unwrap() - 2000.0).abs() < 1e-9);
    }
    #[test]
    fn errors_are_clear() {
        assert!(matches!(eval_i64("L / X", &env()), Err(ExprError::Unknown { .. })));
        assert!(matches!(eval_i64("L / (CHUNK - 64)", &env()), Err(ExprError::DivZero { .. })));
        assert!(matches!(eval_i64("L +", &env()), Err(ExprError::Parse { .. })));
        assert!(matches!(eval_i64("foo(1)", &env()), Err(ExprError::Parse { .. })));
        assert!(matches!(eval_i64("", &env()), Err(ExprError::Parse { .. })));
        assert!(matches!(eval_i64("1 2", &env()), Err(ExprError::Parse { .. })));
    }
}
