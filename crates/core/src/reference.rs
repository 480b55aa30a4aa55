//! Host references, in f64. They define what a task computes; every back-end's results and
//! trusted device references are checked against them.

use std::collections::BTreeMap;

/// What a reference sees: axis values, constants, inputs (in declared order, as f64).
pub struct RefArgs<'a> {
    pub axes: &'a BTreeMap<String, i64>,
    pub constants: &'a BTreeMap<String, f64>,
    pub inputs: Vec<&'a [f64]>,
}

impl RefArgs<'_> {
    pub fn axis(&self, n: &str) -> usize {
        self.axes.get(n).copied().unwrap_or(0).max(0) as usize
    }
    pub fn constant(&self, n: &str, default: f64) -> f64 {
        self.constants.get(n).copied().unwrap_or(default)
    }
}

/// Outputs in declared order.
pub type RefFn = fn(&RefArgs) -> Vec<Vec<f64>>;

const TABLE: &[(&str, RefFn)] = &[
    ("softmax", softmax),
    ("rmsnorm", rmsnorm),
    ("attention", attention),
    ("mamba_scan", mamba_scan),
    ("mamba_step", mamba_step),
];

pub fn lookup(name: &str) -> Option<RefFn> {
    TABLE.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// What built-in reference `name` needs of a workload's axes beyond its tensors' shapes, checked
/// on every workload when a task loads (the reference itself asserts the same).
pub fn precondition(name: &str, axes: &BTreeMap<String, i64>) -> Result<(), String> {
    if name == "attention" {
        let h = axes.get("H").copied().unwrap_or(0);
        // No Hkv axis (or 0): multi-head, as the reference reads it.
        let hkv = match axes.get("Hkv") {
            Some(&n) if n != 0 => n,
            _ => h,
        };
        if hkv <= 0 || h % hkv != 0 {
            return Err(format!("attention: H = {h} is not a multiple of Hkv = {hkv}"));
        }
    }
    Ok(())
}

pub fn names() -> Vec<&'static str> {
    TABLE.iter().map(|(n, _)| *n).collect()
}

/// `y[r, :] = softmax(x[r, :])`, x: [rows, cols].
pub fn softmax(a: &RefArgs) -> Vec<Vec<f64>> {
    let (rows, cols) = (a.axis("rows"), a.axis("cols"));
    let x = a.inputs[0];
    let mut y = vec![0.0; rows * cols];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for c in 0..cols {
            y[r * cols + c] = (row[c] - m).exp() / s;
        }
    }
    vec![y]
}

/// `y = x / sqrt(mean(x^2) + eps) * w`, x: [rows, cols], w: [cols].
pub fn rmsnorm(a: &RefArgs) -> Vec<Vec<f64>> {
    let (rows, cols) = (a.axis("rows"), a.axis("cols"));
    let eps = a.constant("eps", 1e-5);
    let (x, w) = (a.inputs[0], a.inputs[1]);
    let mut y = vec![0.0; rows * cols];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let ms: f64 = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for c in 0..cols {
            y[r * cols + c] = row[c] * inv * w[c];
        }
    }
    vec![y]
}

/// Scaled dot-product attention with grouped-query heads. q, o: [B, H, L, D]; k, v:
/// [B, Hkv, L, D]; query head h reads key/value head h / (H / Hkv) (Hkv = H: multi-head,
/// Hkv = 1: multi-query; a missing or zero `Hkv` axis means H). Scale 1/sqrt(D); `causal` 0/1.
pub fn attention(a: &RefArgs) -> Vec<Vec<f64>> {
    let (b, h, l, d) = (a.axis("B"), a.axis("H"), a.axis("L"), a.axis("D"));
    if let Err(e) = precondition("attention", a.axes) {
        panic!("{e}");
    }
    let hkv = match a.axis("Hkv") {
        0 => h,
        n => n,
    };
    let group = h / hkv;
    let causal = a.axes.get("causal").copied().unwrap_or(0) != 0;
    let (q, k, v) = (a.inputs[0], a.inputs[1], a.inputs[2]);
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; b * h * l * d];
    let mut s = vec![0.0; l];
    for bh in 0..b * h {
        let base = bh * l * d;
        let kvbase = ((bh / h) * hkv + (bh % h) / group) * l * d;
        for i in 0..l {
            let qi = &q[base + i * d..base + (i + 1) * d];
            let n = if causal { i + 1 } else { l };
            let mut m = f64::NEG_INFINITY;
            for j in 0..n {
                let kj = &k[kvbase + j * d..kvbase + (j + 1) * d];
                s[j] = qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>() * scale;
                m = m.max(s[j]);
            }
            let mut sum = 0.0;
            for sj in s.iter_mut().take(n) {
                *sj = (*sj - m).exp();
                sum += *sj;
            }
            let oi = &mut o[base + i * d..base + (i + 1) * d];
            for j in 0..n {
                let p = s[j] / sum;
                let vj = &v[kvbase + j * d..kvbase + (j + 1) * d];
                for (oo, vv) in oi.iter_mut().zip(vj) {
                    *oo += p * vv;
                }
            }
        }
    }
    vec![o]
}

/// Mamba-1 selective scan (prefill), channels last as in mlx-lm.
/// Inputs: u [batch, L, D], delta [batch, L, D] (already softplus'ed), A [D, N], Bm [batch, L, N],
/// Cm [batch, L, N], Dv [D]. Outputs: y [batch, L, D], state [batch, D, N] (final state).
/// h_t = exp(delta_t * A) * h_{t-1} + delta_t * Bm_t * u_t;  y_t = <Cm_t, h_t> + Dv * u_t.
pub fn mamba_scan(a: &RefArgs) -> Vec<Vec<f64>> {
    let (bt, l, dn, n) = (a.axis("batch"), a.axis("L"), a.axis("D"), a.axis("N"));
    let (u, delta, am, bm, cm, dv) = (a.inputs[0], a.inputs[1], a.inputs[2], a.inputs[3], a.inputs[4], a.inputs[5]);
    let mut y = vec![0.0; bt * l * dn];
    let mut state = vec![0.0; bt * dn * n];
    for b in 0..bt {
        for c in 0..dn {
            let h = &mut state[(b * dn + c) * n..(b * dn + c + 1) * n];
            for t in 0..l {
                let i = (b * l + t) * dn + c;
                let (dt, ut) = (delta[i], u[i]);
                let bc = (b * l + t) * n;
                let mut acc = 0.0;
                for s in 0..n {
                    h[s] = (dt * am[c * n + s]).exp() * h[s] + dt * bm[bc + s] * ut;
                    acc += cm[bc + s] * h[s];
                }
                y[i] = acc + dv[c] * ut;
            }
        }
    }
    vec![y, state]
}

/// Mamba-1 decode step. Inputs: u [batch, D], delta [batch, D], A [D, N], Bm [batch, N],
/// Cm [batch, N], Dv [D], state_in [batch, D, N]. Outputs: y [batch, D], state_out [batch, D, N].
pub fn mamba_step(a: &RefArgs) -> Vec<Vec<f64>> {
    let (bt, dn, n) = (a.axis("batch"), a.axis("D"), a.axis("N"));
    let (u, delta, am, bm, cm, dv, s0) = (
        a.inputs[0],
        a.inputs[1],
        a.inputs[2],
        a.inputs[3],
        a.inputs[4],
        a.inputs[5],
        a.inputs[6],
    );
    let mut y = vec![0.0; bt * dn];
    let mut s1 = vec![0.0; bt * dn * n];
    for b in 0..bt {
        for c in 0..dn {
            let i = b * dn + c;
            let mut acc = 0.0;
            for s in 0..n {
                let j = i * n + s;
                s1[j] = (delta[i] * am[c * n + s]).exp() * s0[j] + delta[i] * bm[b * n + s] * u[i];
                acc += cm[b * n + s] * s1[j];
            }
            y[i] = acc + dv[c] * u[i];
        }
    }
    vec![y, s1]
}

#[cfg(test)]
mod tests {
    use super::*;
    fn axes(v: &[(&str, i64)]) -> BTreeMap<String, i64> {
        v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
    }
    #[test]
    fn softmax_rows_sum_to_one() {
        let ax = axes(&[("rows", 2), ("cols", 3)]);
        let c = BTreeMap::new();
        let x = [1.0, 2.0, 3.0, -1.0, 0.0, 1000.0];
        let y = softmax(&RefArgs {
            axes: &ax,
            constants: &c,
            inputs: vec![&x],
        });
        assert!((y[0][..3].iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((y[0][5] - 1.0).abs() < 1e-12);
        assert!((y[0][1] / y[0][0] - 1f64.exp()).abs() < 1e-12);
    }
    #[test]
    fn attention_with_one_key_returns_value() {
        let ax = axes(&[("B", 1), ("H", 1), ("L", 2), ("D", 2), ("causal", 1)]);
        let c = BTreeMap::new();
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [1.0, 0.0, 0.0, 1.0];
        let v = [3.0, 4.0, 5.0, 6.0];
        let o = attention(&RefArgs {
            axes: &ax,
            constants: &c,
            inputs: vec![&q, &k, &v],
        });
        // Row 0 sees only key 0 under the causal mask.
        assert_eq!(&o[0][..2], &[3.0, 4.0]);
        let w = 1.0 / (1.0 + (-(0.5f64).sqrt()).exp()); // softmax weight of key 1 for row 1
        assert!((o[0][2] - (3.0 * (1.0 - w) + 5.0 * w)).abs() < 1e-12);
    }
    #[test]
    fn grouped_query_heads_read_their_shared_kv_head() {
        // B = 2, H = 4, Hkv = 2 (groups of 2), L = 3, D = 2: the result equals multi-head
        // attention with each kv head repeated for the query heads of its group.
        let (b, h, hkv, l, d) = (2usize, 4usize, 2usize, 3usize, 2usize);
        let f = |i: usize| ((i * 7919) % 17) as f64 / 17.0 - 0.5;
        let q: Vec<f64> = (0..b * h * l * d).map(f).collect();
        let k: Vec<f64> = (0..b * hkv * l * d).map(|i| f(i + 3)).collect();
        let v: Vec<f64> = (0..b * hkv * l * d).map(|i| f(i + 7)).collect();
        let rep = |x: &[f64]| -> Vec<f64> {
            let mut r = Vec::new();
            for bi in 0..b {
                for hi in 0..h {
                    let src = (bi * hkv + hi / (h / hkv)) * l * d;
                    r.extend_from_slice(&x[src..src + l * d]);
                }
            }
            r
        };
        let (kr, vr) = (rep(&k), rep(&v));
        let c = BTreeMap::new();
        for causal in [0, 1] {
            let gax = axes(&[("B", 2), ("H", 4), ("Hkv", 2), ("L", 3), ("D", 2), ("causal", causal)]);
            let got = attention(&RefArgs {
                axes: &gax,
                constants: &c,
                inputs: vec![&q, &k, &v],
            });
            let max = axes(&[("B", 2), ("H", 4), ("Hkv", 4), ("L", 3), ("D", 2), ("causal", causal)]);
            let want = attention(&RefArgs {
                axes: &max,
                constants: &c,
                inputs: vec![&q, &kr, &vr],
            });
            for (x, y) in got[0].iter().zip(&want[0]) {
                assert!((x - y).abs() < 1e-12);
            }
            // Without the Hkv axis, k and v have H heads.
            let old = axes(&[("B", 2), ("H", 4), ("L", 3), ("D", 2), ("causal", causal)]);
            let same = attention(&RefArgs {
                axes: &old,
                constants: &c,
                inputs: vec![&q, &kr, &vr],
            });
            assert_eq!(same[0], want[0]);
        }
        // Multi-query (Hkv = 1): every head of a batch reads the one kv head.
        let one = axes(&[("B", 1), ("H", 3), ("Hkv", 1), ("L", 1), ("D", 2), ("causal", 0)]);
        let o = attention(&RefArgs {
            axes: &one,
            constants: &c,
            inputs: vec![&q[..6], &k[..2], &v[..2]],
        });
        for hi in 0..3 {
            assert_eq!(&o[0][hi * 2..hi * 2 + 2], &v[..2]);
        }
    }
    #[test]
    fn scan_matches_repeated_steps() {
        let (l, dn, n) = (5usize, 3usize, 2usize);
        let ax = axes(&[("batch", 1), ("L", l as i64), ("D", dn as i64), ("N", n as i64)]);
        let c = BTreeMap::new();
        let f = |i: usize| ((i * 7919) % 13) as f64 / 13.0 - 0.4;
        let u: Vec<f64> = (0..l * dn).map(f).collect();
        let dl: Vec<f64> = (0..l * dn).map(|i| 0.05 + f(i + 3).abs()).collect();
        let am: Vec<f64> = (0..dn * n).map(|i| -1.0 - i as f64).collect();
        let bm: Vec<f64> = (0..l * n).map(|i| f(i + 5)).collect();
        let cm: Vec<f64> = (0..l * n).map(|i| f(i + 11)).collect();
        let dv = vec![0.5, 1.0, 1.5];
        let out = mamba_scan(&RefArgs {
            axes: &ax,
            constants: &c,
            inputs: vec![&u, &dl, &am, &bm, &cm, &dv],
        });
        let sax = axes(&[("batch", 1), ("D", dn as i64), ("N", n as i64)]);
        let mut st = vec![0.0; dn * n];
        for t in 0..l {
            let r = mamba_step(&RefArgs {
                axes: &sax,
                constants: &c,
                inputs: vec![
                    &u[t * dn..(t + 1) * dn],
                    &dl[t * dn..(t + 1) * dn],
                    &am,
                    &bm[t * n..(t + 1) * n],
                    &cm[t * n..(t + 1) * n],
                    &dv,
                    &st,
                ],
            });
            for ch in 0..dn {
                assert!((r[0][ch] - out[0][t * dn + ch]).abs() < 1e-12);
            }
            st = r[1].clone();
        }
        for (a, b) in st.iter().zip(&out[1]) {
            assert!((a - b).abs() < 1e-12);
        }
    }
}
