//! The roofline floor: no correct kernel can run faster than this.

use crate::Profile;

/// Lower bound on a kernel's time in microseconds: the largest of moving `bytes` at the memory
/// bandwidth (the measured one when given), doing `flops` at the peak rate of `flop_dtype`, and
/// evaluating `transcendentals` exponentials at the special-function rate. A measured time below
/// it is a bug or a cheat. Unknown dtypes use the device's highest peak (a lower, safe floor).
pub fn floor_us(
    profile: &Profile,
    bytes: f64,
    flops: f64,
    flop_dtype: &str,
    transcendentals: f64,
    measured_bw_gbs: Option<f64>,
) -> f64 {
    let bw = measured_bw_gbs.filter(|b| *b > 0.0).unwrap_or(profile.mem_bandwidth_gbs);
    let t_mem = if bw > 0.0 { bytes.max(0.0) / (bw * 1e9) } else { 0.0 };
    let t_flop = match profile.peak(flop_dtype) {
        Some(p) if p > 0.0 => flops.max(0.0) / (p * 1e12),
        _ => 0.0,
    };
    let t_exp = match profile.exp_per_s {
        Some(r) if r > 0.0 => transcendentals.max(0.0) / r,
        _ => 0.0,
    };
    t_mem.max(t_flop).max(t_exp) * 1e6
}
