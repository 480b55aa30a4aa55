//! Seeded random inputs, poison patterns and element-wise checks shared by every back-end.

use crate::task::{DType, Init, Tolerance};

/// xoshiro256** seeded through splitmix64: small, fast, and stable across versions and
/// languages, so any worker can regenerate an evaluation's inputs from its seed.
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }
    pub fn next_u64(&mut self) -> u64 {
        let r = self.0[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        step_state(&mut self.0);
        r
    }
    /// Skip `n` outputs: the generator is where `n` calls of [`Rng::next_u64`] would leave it,
    /// in O(log n) steps instead of n. The state transition is linear over GF(2), so `n` steps
    /// are the product of precomputed powers T^(2^i) of the one-step matrix T for the bits of
    /// `n`; this lets parallel parts of one long stream start where they begin.
    pub fn advance(&mut self, n: u64) {
        if n < 64 {
            // Short skips: stepping is cheaper than 256-column products.
            for _ in 0..n {
                step_state(&mut self.0);
            }
            return;
        }
        let powers = jump_powers();
        for (i, m) in powers.iter().enumerate() {
            if n >> i & 1 == 1 {
                self.0 = m.apply(&self.0);
            }
        }
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform in [0, 1) with f32's 24 bits.
    pub fn uniform_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }
    /// Two independent standard normals from two outputs (Box-Muller: `r cos t`, `r sin t`),
    /// in f64 arithmetic when `wide`, else in f32 (returned widened).
    pub fn normal_pair(&mut self, wide: bool) -> (f64, f64) {
        if wide {
            let u1 = 1.0 - self.uniform();
            let u2 = self.uniform();
            let r = (-2.0 * u1.ln()).sqrt();
            let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
            (r * c, r * s)
        } else {
            let u1 = 1.0 - self.uniform_f32();
            let u2 = self.uniform_f32();
            let r = (-2.0 * u1.ln()).sqrt();
            let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
            ((r * c) as f64, (r * s) as f64)
        }
    }
    pub fn normal(&mut self) -> f64 {
        // Box-Muller; 1 - u keeps the logarithm finite.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// One step of xoshiro256**'s state (its output aside): linear over GF(2).
fn step_state(s: &mut [u64; 4]) {
    let t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = s[3].rotate_left(45);
}

/// A linear map of the 256-bit state, by its columns: `cols[j]` is the image of bit `j`.
struct BitMatrix(Box<[[u64; 4]; 256]>);

impl BitMatrix {
    fn apply(&self, v: &[u64; 4]) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (w, &word) in v.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                let c = &self.0[w * 64 + b];
                for (o, x) in out.iter_mut().zip(c) {
                    *o ^= x;
                }
                bits &= bits - 1;
            }
        }
        out
    }
    /// `self` applied twice.
    fn squared(&self) -> BitMatrix {
        let mut cols = Box::new([[0u64; 4]; 256]);
        for (j, c) in cols.iter_mut().enumerate() {
            *c = self.apply(&self.0[j]);
        }
        BitMatrix(cols)
    }
}

/// T^(2^i) for i in 0..64, T the one-step state transition; made once per process (~10 ms).
fn jump_powers() -> &'static [BitMatrix] {
    static POWERS: std::sync::OnceLock<Vec<BitMatrix>> = std::sync::OnceLock::new();
    POWERS.get_or_init(|| {
        let mut cols = Box::new([[0u64; 4]; 256]);
        for (j, c) in cols.iter_mut().enumerate() {
            let mut s = [0u64; 4];
            s[j / 64] = 1u64 << (j % 64);
            step_state(&mut s);
            *c = s;
        }
        let mut powers = vec![BitMatrix(cols)];
        for _ in 1..64 {
            let next = powers.last().expect("one power at least").squared();
            powers.push(next);
        }
        powers
    })
}

/// Derive a per-tensor seed from an evaluation seed and the tensor's index.
pub fn sub_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03)
}

/// `n` values drawn from `init`, already rounded to what `dtype` can hold (so the reference
/// sees exactly the values the kernel sees).
pub fn draw(init: &Init, dtype: DType, n: usize, seed: u64) -> Vec<f64> {
    let mut vals = vec![0.0; n];
    let mut bytes = vec![0u8; n * dtype.size()];
    draw_range(init, dtype, seed, 0, &mut bytes, Some(&mut vals));
    vals
}

/// The stream [`draw`] makes, from position `start` on: the values at `start..start + n`
/// encoded into `bytes` (n = the elements it holds) and, when given, stored into `kept` as
/// the dtype holds them. Parts of one stream can be drawn in parallel: a part starts by
/// skipping ahead ([`Rng::advance`]), so the stream does not depend on how it is cut.
///
/// Normal values come in Box-Muller pairs: position 2q is `r cos t`, position 2q + 1 is
/// `r sin t`, from the generator's outputs 2q and 2q + 1. Values for f16, bf16 and f32
/// tensors are computed in f32 (as the MLX worker draws them), f64 and i32 ones in f64.
pub fn draw_range(init: &Init, dtype: DType, seed: u64, start: usize, bytes: &mut [u8], mut kept: Option<&mut [f64]>) {
    let mut rng = Rng::new(seed);
    let size = dtype.size();
    let wide = matches!(dtype, DType::F64 | DType::I32);
    match *init {
        Init::Uniform { lo, hi } => {
            rng.advance(start as u64);
            for (i, b) in bytes.chunks_exact_mut(size).enumerate() {
                let v = if wide {
                    lo + (hi - lo) * rng.uniform()
                } else {
                    (lo as f32 + (hi - lo) as f32 * rng.uniform_f32()) as f64
                };
                let stored = encode_into(v, dtype, b);
                if let Some(k) = kept.as_deref_mut() {
                    k[i] = stored;
                }
            }
        }
        Init::Normal { mean, std } => {
            // Two generator outputs per pair of values.
            rng.advance((start / 2 * 2) as u64);
            let mut pending: Option<f64> = None;
            if start % 2 == 1 {
                pending = Some(rng.normal_pair(wide).1);
            }
            for (i, b) in bytes.chunks_exact_mut(size).enumerate() {
                let z = match pending.take() {
                    Some(z) => z,
                    None => {
                        let (c, s) = rng.normal_pair(wide);
                        pending = Some(s);
                        c
                    }
                };
                let v = if wide {
                    mean + std * z
                } else {
                    (mean as f32 + std as f32 * z as f32) as f64
                };
                let stored = encode_into(v, dtype, b);
                if let Some(k) = kept.as_deref_mut() {
                    k[i] = stored;
                }
            }
        }
    }
}

pub fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::Bf16 => half::bf16::from_f64(v).to_f64(),
        DType::F64 => v,
        DType::I32 => v.round(),
    }
}

/// Encode one value into `out` (its `dtype.size()` little-endian bytes) and return the value
/// as stored: `encode(&[round_to(v, dtype)], dtype)` and `round_to(v, dtype)` in one conversion.
pub fn encode_into(v: f64, dtype: DType, out: &mut [u8]) -> f64 {
    match dtype {
        DType::F32 => {
            let x = v as f32;
            out.copy_from_slice(&x.to_le_bytes());
            x as f64
        }
        DType::F16 => {
            let x = half::f16::from_f64(v);
            out.copy_from_slice(&x.to_le_bytes());
            x.to_f64()
        }
        DType::Bf16 => {
            let x = half::bf16::from_f64(v);
            out.copy_from_slice(&x.to_le_bytes());
            x.to_f64()
        }
        DType::F64 => {
            out.copy_from_slice(&v.to_le_bytes());
            v
        }
        DType::I32 => {
            let r = v.round();
            out.copy_from_slice(&(r as i32).to_le_bytes());
            r
        }
    }
}

/// Encode values as little-endian bytes of `dtype`.
pub fn encode(vals: &[f64], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        }
    }
    out
}

/// The poison written into every output element before a run: a NaN with a payload no
/// arithmetic produces, so "never written" and "wrote NaN" can be told apart.
pub fn poison_bytes(dtype: DType) -> &'static [u8] {
    match dtype {
        DType::F32 => &[0xA5, 0xA5, 0xA5, 0x7F],
        DType::F16 => &[0x5A, 0x7D],
        DType::Bf16 => &[0xA5, 0x7F],
        DType::F64 => &[0xA5, 0xA5, 0xA5, 0xA5, 0xA5, 0xA5, 0xF5, 0x7F],
        DType::I32 => &[0xA5, 0xA5, 0xA5, 0x7F],
    }
}

pub fn fill_poison(buf: &mut [u8], dtype: DType) {
    let p = poison_bytes(dtype);
    for ch in buf.chunks_exact_mut(p.len()) {
        ch.copy_from_slice(p);
    }
}

fn decode_one(b: &[u8], dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::F64 => f64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
    }
}

pub fn decode(buf: &[u8], dtype: DType) -> Vec<f64> {
    buf.chunks_exact(dtype.size()).map(|c| decode_one(c, dtype)).collect()
}

/// What comparing one output with its reference found.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Check {
    pub elements: usize,
    pub mismatches: usize,
    pub unwritten: usize,
    pub nan: usize,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    /// First offending element (index, value, reference), for the failure message. Values
    /// are kept as text so NaN and infinities survive JSON.
    pub first_bad: Option<(usize, String, String)>,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.unwritten == 0 && self.nan == 0
    }
    pub fn merge(&mut self, o: &Check) {
        self.elements += o.elements;
        self.mismatches += o.mismatches;
        self.unwritten += o.unwritten;
        self.nan += o.nan;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
        self.max_rel_err = self.max_rel_err.max(o.max_rel_err);
        if self.first_bad.is_none() {
            self.first_bad = o.first_bad.clone();
        }
    }
}

/// A fresh poison for one run: a NaN of `dtype` with a random payload (never the quiet NaN
/// that arithmetic produces), so a kernel cannot recognise the outputs of checked runs by
/// their pattern. Integers get a random value.
pub fn random_poison(dtype: DType, rng: &mut Rng) -> Vec<u8> {
    // (exponent and sign-free bits of the pattern, mantissa bits, quiet bit)
    let (exp, mbits, quiet): (u64, u32, u64) = match dtype {
        DType::F32 => (0x7F80_0000, 23, 1 << 22),
        DType::F16 => (0x7C00, 10, 1 << 9),
        DType::Bf16 => (0x7F80, 7, 1 << 6),
        DType::F64 => (0x7FF0_0000_0000_0000, 52, 1 << 51),
        DType::I32 => return (rng.next_u64() as u32).to_le_bytes().to_vec(),
    };
    let mask = (1u64 << mbits) - 1;
    let m = loop {
        let m = rng.next_u64() & mask;
        if m != 0 && m != quiet {
            break m;
        }
    };
    let sign = (rng.next_u64() & 1) << (dtype.size() * 8 - 1);
    let v = sign | exp | m;
    v.to_le_bytes()[..dtype.size()].to_vec()
}

/// Fill `buf` with copies of `pattern`.
pub fn fill_pattern(buf: &mut [u8], pattern: &[u8]) {
    for ch in buf.chunks_exact_mut(pattern.len()) {
        ch.copy_from_slice(pattern);
    }
}

/// Compare every element of `out` (raw bytes of `dtype`) with `reference`.
pub fn check(out: &[u8], dtype: DType, reference: &[f64], tol: Tolerance) -> Check {
    check_with_poison(out, dtype, reference, tol, poison_bytes(dtype))
}

/// As `check`, for outputs that were poisoned with `p` before the run.
pub fn check_with_poison(out: &[u8], dtype: DType, reference: &[f64], tol: Tolerance, p: &[u8]) -> Check {
    let mut c = Check {
        elements: reference.len(),
        ..Check::default()
    };
    for (i, (bytes, &r)) in out.chunks_exact(dtype.size()).zip(reference).enumerate() {
        if bytes == p {
            c.unwritten += 1;
            c.first_bad.get_or_insert((i, "never written".into(), format!("{r}")));
            continue;
        }
        let v = decode_one(bytes, dtype);
        if !v.is_finite() {
            if !(v.is_infinite() && v == r) {
                c.nan += 1;
                c.first_bad.get_or_insert((i, format!("{v}"), format!("{r}")));
            }
            continue;
        }
        let abs = (v - r).abs();
        let rel = abs / r.abs().max(f64::MIN_POSITIVE);
        c.max_abs_err = c.max_abs_err.max(abs);
        if r.abs() > tol.atol {
            c.max_rel_err = c.max_rel_err.max(rel);
        }
        if abs > tol.atol + tol.rtol * r.abs() {
            c.mismatches += 1;
            c.first_bad.get_or_insert((i, format!("{v}"), format!("{r}")));
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The stream does not depend on where parts of it start (odd starts split a Box-Muller
    /// pair), and its values have the distribution the task asks for.
    #[test]
    fn draws_are_one_stream_with_the_asked_distribution() {
        for (init, dtype) in [
            (Init::Normal { mean: 0.5, std: 2.0 }, DType::F16),
            (Init::Normal { mean: 0.0, std: 1.0 }, DType::F64),
            (Init::Uniform { lo: -1.0, hi: 3.0 }, DType::Bf16),
            (Init::Uniform { lo: -4.0, hi: 4.0 }, DType::I32),
        ] {
            let n = 200_001;
            let whole = draw(&init, dtype, n, 99);
            for (start, len) in [(0, 10), (1, 9), (7, 1000), (123_457, 3)] {
                let mut bytes = vec![0u8; len * dtype.size()];
                let mut kept = vec![0.0; len];
                draw_range(&init, dtype, 99, start, &mut bytes, Some(&mut kept));
                assert_eq!(kept, whole[start..start + len], "{init:?} {dtype:?} from {start}");
                assert_eq!(bytes, encode(&kept, dtype));
            }
            let mean = whole.iter().sum::<f64>() / n as f64;
            let var = whole.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            let (want_mean, want_var) = match init {
                Init::Normal { mean, std } => (mean, std * std),
                Init::Uniform { lo, hi } if dtype == DType::I32 => ((lo + hi) / 2.0, (hi - lo).powi(2) / 12.0 + 1.0 / 12.0),
                Init::Uniform { lo, hi } => ((lo + hi) / 2.0, (hi - lo).powi(2) / 12.0),
            };
            assert!(
                (mean - want_mean).abs() < 0.02 * want_var.sqrt().max(1.0),
                "{init:?}: mean {mean}"
            );
            assert!(
                (var / want_var - 1.0).abs() < 0.03,
                "{init:?}: variance {var} against {want_var}"
            );
            if let Init::Uniform { lo, hi } = init {
                assert!(whole.iter().all(|v| (lo..=hi).contains(v)), "{init:?}: a value outside");
            }
        }
    }
    #[test]
    fn advance_lands_where_stepping_does() {
        for n in [0u64, 1, 63, 64, 65, 1000, 4097, 123_457] {
            let mut stepped = Rng::new(0xC0FFEE ^ n);
            for _ in 0..n {
                stepped.next_u64();
            }
            let mut jumped = Rng::new(0xC0FFEE ^ n);
            jumped.advance(n);
            let a: Vec<u64> = (0..8).map(|_| stepped.next_u64()).collect();
            let b: Vec<u64> = (0..8).map(|_| jumped.next_u64()).collect();
            assert_eq!(a, b, "advance({n})");
        }
        // Jumps compose: 2^40 in two halves equals 2^40 at once.
        let (mut x, mut y) = (Rng::new(5), Rng::new(5));
        x.advance(1 << 40);
        y.advance(1 << 39);
        y.advance(1 << 39);
        assert_eq!(x.next_u64(), y.next_u64());
    }
    #[test]
    fn rng_is_deterministic_and_spread() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = Rng::new(7);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        let v = draw(&Init::Normal { mean: 0.0, std: 1.0 }, DType::F32, 20000, 3);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        assert_ne!(
            draw(&Init::default(), DType::F32, 8, 1),
            draw(&Init::default(), DType::F32, 8, 2)
        );
    }
    #[test]
    fn poison_is_detected_as_unwritten_and_nan_as_nan() {
        for dt in [DType::F32, DType::F16, DType::Bf16, DType::F64] {
            let r = vec![1.0, 2.0, 3.0];
            let mut out = encode(&r, dt);
            let s = dt.size();
            fill_poison(&mut out[..s], dt);
            out[s..2 * s].copy_from_slice(&encode(&[f64::NAN], dt));
            let c = check(&out, dt, &r, Tolerance { atol: 1e-3, rtol: 1e-3 });
            assert_eq!((c.unwritten, c.nan, c.mismatches), (1, 1, 0), "{dt}");
            assert!(!c.passed());
            assert!(decode(poison_bytes(dt), dt)[0].is_nan(), "{dt} poison must be a NaN");
        }
    }
    #[test]
    fn random_poison_is_a_rare_nan_that_changes() {
        let mut rng = Rng::new(5);
        for dt in [DType::F32, DType::F16, DType::Bf16, DType::F64] {
            let a = random_poison(dt, &mut rng);
            let b = random_poison(dt, &mut rng);
            assert_eq!(a.len(), dt.size());
            assert!(decode(&a, dt)[0].is_nan(), "{dt}");
            assert_ne!(a, encode(&[f64::NAN], dt), "{dt}: not the canonical NaN");
            let mut out = a.repeat(2);
            out[dt.size()..].copy_from_slice(&b);
            let c = check_with_poison(&out, dt, &[1.0, 1.0], Tolerance { atol: 1e-3, rtol: 0.0 }, &a);
            assert!(c.unwritten >= 1, "{dt}");
        }
    }
    #[test]
    fn tolerance_is_atol_plus_rtol() {
        let r = vec![100.0, 0.0];
        let out = encode(&[100.5, 0.0005], DType::F64);
        assert!(check(&out, DType::F64, &r, Tolerance { atol: 1e-3, rtol: 1e-2 }).passed());
        assert!(!check(&out, DType::F64, &r, Tolerance { atol: 1e-3, rtol: 1e-3 }).passed());
    }
}

/// A per-run change of an input's values: `x' = center + (x - center) * scale`, computed in
/// f64 and rounded once to the input's dtype. Windows of one pool repeat values from run to
/// run (a kernel could reuse what it computed for them); a fresh scale per run makes every
/// value new while keeping it in its distribution's range (`center` is a normal's mean or a
/// uniform's low end, `scale` below 1). Integer inputs are never changed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fresh {
    pub center: f64,
    pub scale: f64,
}

impl Fresh {
    pub const NONE: Fresh = Fresh { center: 0.0, scale: 1.0 };

    /// A fresh change for an input drawn from `init` in `dtype`: a scale in [0.75, 1).
    pub fn draw(init: &crate::task::Init, dtype: DType, rng: &mut Rng) -> Fresh {
        if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::Bf16) {
            return Fresh::NONE;
        }
        let center = match *init {
            crate::task::Init::Normal { mean, .. } => mean,
            crate::task::Init::Uniform { lo, .. } => lo,
        };
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        Fresh {
            center,
            scale: 0.75 + 0.25 * u,
        }
    }

    pub fn is_none(&self) -> bool {
        self.scale == 1.0
    }

    /// `src` (encoded `dtype` elements) changed into `dst` (same length).
    pub fn apply(&self, src: &[u8], dst: &mut [u8], dtype: DType) {
        if self.is_none() {
            dst.copy_from_slice(src);
            return;
        }
        let (c, k) = (self.center, self.scale);
        let f = |x: f64| c + (x - c) * k;
        match dtype {
            DType::F32 => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                    let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64;
                    d.copy_from_slice(&(f(x) as f32).to_le_bytes());
                }
            }
            DType::F64 => {
                for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                    let x = f64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
                    d.copy_from_slice(&f(x).to_le_bytes());
                }
            }
            DType::F16 => {
                for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                    let x = half::f16::from_le_bytes([s[0], s[1]]).to_f64();
                    d.copy_from_slice(&half::f16::from_f64(f(x)).to_le_bytes());
                }
            }
            DType::Bf16 => {
                for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                    let x = half::bf16::from_le_bytes([s[0], s[1]]).to_f64();
                    d.copy_from_slice(&half::bf16::from_f64(f(x)).to_le_bytes());
                }
            }
            _ => dst.copy_from_slice(src),
        }
    }
}
