//! Compile checks of MLX CUDA-dialect bodies (`[backends.mlx-cuda]`) with NVRTC, no GPU and no
//! MLX needed: each body is wrapped the way `mx.fast.cuda_kernel` wraps it (inputs as
//! `const T*`, outputs as `T*`, template parameters as `constexpr int`, the header in front),
//! minus MLX's own device headers and cooperative groups (pip's CUDA headers lack the CCCL
//! parts they need), which shipped bodies must not rely on. A kernel that is a whole CUDA
//! translation unit (`options = { form = "cuda" }`) is compiled as it is, with `-DKS_AXIS=int`.

use std::collections::BTreeMap;

use ksearch_core::task::{Task, Workload};

use crate::cuda::{admitted_configs, candidate_arch, candidate_defines, nvrtc_compile, nvrtc_options, parse_ptxas};

/// The CUDA type MLX uses for a dtype name.
pub fn cuda_type(dtype: &str) -> &'static str {
    match dtype {
        "f16" => "__half",
        "bf16" => "__nv_bfloat16",
        "f64" => "double",
        "i32" => "int",
        _ => "float",
    }
}

pub use ksearch_core::mlx::LaunchIo as LaunchSig;

/// A standalone CUDA translation unit equivalent to what MLX builds for `body`.
pub fn wrap(
    header: &str,
    body: &str,
    sig: &LaunchSig,
    template: &BTreeMap<String, i64>,
    constants: &BTreeMap<String, f64>,
) -> String {
    let mut s = String::from(
        "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n\
         #define inf (__int_as_float(0x7f800000))\n\
         struct KsShape { int d[10]; __device__ int operator[](int i) const { return d[i]; } };\n\
         struct KsStrides { long long d[10]; __device__ long long operator[](int i) const { return d[i]; } };\n",
    );
    for (k, v) in constants {
        s.push_str(&format!("constexpr float KS_{} = {v:?}f;\n", k.to_uppercase()));
    }
    s.push_str(header);
    s.push_str("\nnamespace mlx { namespace core { namespace cu {\n");
    let mut params = Vec::new();
    for (n, d) in &sig.inputs {
        params.push(format!("const {}* {n}", cuda_type(d)));
        if body.contains(&format!("{n}_shape")) {
            params.push(format!("const __grid_constant__ KsShape {n}_shape"));
        }
        if body.contains(&format!("{n}_strides")) {
            params.push(format!("const __grid_constant__ KsStrides {n}_strides"));
        }
        if body.contains(&format!("{n}_ndim")) {
            params.push(format!("const __grid_constant__ int {n}_ndim"));
        }
    }
    for (n, d) in &sig.outputs {
        params.push(format!("{}* {n}", cuda_type(d)));
    }
    s.push_str(&format!(
        "extern \"C\" __global__ void ks_{}(\n    {}) {{\n",
        sig.entry,
        params.join(",\n    ")
    ));
    for (n, v) in template {
        s.push_str(&format!("  constexpr int {n} = {v};\n"));
    }
    s.push_str(body);
    s.push_str("\n}\n}}}\n");
    s
}

/// The flags a whole translation unit (`options = { form = "cuda" }`) is compiled with on top of
/// the CUDA back-end's: MLX passes integer scalars as 32-bit `int`, so the axes are `KS_AXIS`
/// = `int` (python/ksearch_mlx/runtime.py, `cuda_unit_options`).
pub fn unit_flags() -> Vec<String> {
    vec!["-DKS_MLX=1".to_string(), "-DKS_AXIS=int".to_string()]
}

/// The architecture a whole unit is checked for: the CUDA back-end's rule (`candidate_arch`:
/// the `a` suffix where the source needs it) for the compute capability `arch` names (`sm_90`).
fn unit_arch(arch: &str, k: &ksearch_core::KernelSpec) -> String {
    let digits = arch.trim_start_matches("sm_").trim_end_matches('a');
    let (Some(major), Ok(minor)) = (
        digits.get(..1).and_then(|d| d.parse::<i32>().ok()),
        digits.get(1..).unwrap_or("").parse::<i32>(),
    ) else {
        return arch.to_string();
    };
    let opts: BTreeMap<String, serde_json::Value> = k
        .options
        .iter()
        .filter_map(|(k, v)| serde_json::to_value(v).ok().map(|v| (k.clone(), v)))
        .collect();
    candidate_arch((major, minor), &k.source, &opts)
}

/// Compile-check every `[backends.mlx-cuda]` kernel of `tasks` for every admitted tunable
/// configuration (or a sample of `max_configs`) with the first search workload's axes, and the
/// default configuration with every other search workload. Returns (compiles, failures).
pub fn nvrtc_check(tasks: &[Task], arch: &str, max_configs: usize, report: &mut dyn FnMut(&str)) -> (usize, usize) {
    let (mut n, mut failed) = (0usize, 0usize);
    for task in tasks {
        let Some(b) = task.backend(ksearch_core::Backend::MlxCuda) else {
            continue;
        };
        for k in task.kernels(ksearch_core::Backend::MlxCuda) {
            let mut jobs: Vec<(BTreeMap<String, i64>, Workload)> = Vec::new();
            if let Some(w0) = b.search.first() {
                for c in admitted_configs(k, std::slice::from_ref(w0), max_configs) {
                    jobs.push((c, w0.clone()));
                }
            }
            for w in b.search.iter().skip(1) {
                let c = k.default_config();
                if k.admits(&c, w).unwrap_or(false) {
                    jobs.push((c, w.clone()));
                }
            }
            if jobs.is_empty() {
                n += 1;
                failed += 1;
                report(&format!("FAIL  {}/mlx-cuda/{}: no admitted configuration", task.name, k.name));
                continue;
            }
            if ksearch_core::mlx::Form::of_options(&k.options) == Ok(ksearch_core::mlx::Form::Cuda) {
                // A whole translation unit: compiled once per configuration (the axes are
                // run-time parameters), as the worker compiles it.
                let mut configs: Vec<BTreeMap<String, i64>> = Vec::new();
                // ... and the default's build for every held-out shape (other head sizes).
                let builds = b.heldout.iter().filter_map(|w| k.specialise(&k.default_config(), w));
                for c in jobs.into_iter().map(|(c, _)| c).chain(builds) {
                    if !configs.contains(&c) {
                        configs.push(c);
                    }
                }
                for c in configs {
                    n += 1;
                    let label = format!(
                        "{}/mlx-cuda/{} [{}]",
                        task.name,
                        k.name,
                        c.iter().map(|(a, v)| format!("{a}={v}")).collect::<Vec<_>>().join(",")
                    );
                    let arch = unit_arch(arch, k);
                    let opts = nvrtc_options(&arch, &candidate_defines(task, &c), &unit_flags());
                    let file = k.file.rsplit('/').next().unwrap_or(&k.file);
                    let compiled = nvrtc_compile(&k.source, file, &opts);
                    failed += usize::from(!report_compile(report, &label, &arch, compiled));
                }
                continue;
            }
            let sigs = ksearch_core::mlx::launch_io(task, ksearch_core::Backend::MlxCuda, k);
            for (c, w) in jobs {
                let mut template = w.clone();
                template.extend(c.iter().map(|(a, v)| (a.clone(), *v)));
                let label = format!(
                    "{}/mlx-cuda/{} [{}]",
                    task.name,
                    k.name,
                    template.iter().map(|(a, v)| format!("{a}={v}")).collect::<Vec<_>>().join(",")
                );
                for sig in &sigs {
                    n += 1;
                    let Some((header, body)) = ksearch_core::mlx::body_of(&k.source, &sig.entry) else {
                        failed += 1;
                        report(&format!("FAIL  {label}: no `// @kernel {}` section", sig.entry));
                        continue;
                    };
                    let src = wrap(&header, &body, sig, &template, &task.constants);
                    let opts = nvrtc_options(arch, &[], &[]);
                    let compiled = nvrtc_compile(&src, &format!("{}.cu", sig.entry), &opts);
                    failed += usize::from(!report_compile(report, &label, &sig.entry, compiled));
                }
            }
        }
    }
    (n, failed)
}

/// One line for a compile: `ok    LABEL WHAT (resources)`, or `FAIL  LABEL WHAT:` and the
/// first 30 lines of the log. True when it compiled.
fn report_compile(report: &mut dyn FnMut(&str), label: &str, what: &str, compiled: Result<(Vec<u8>, String), String>) -> bool {
    match compiled {
        Ok((_, log)) => {
            let r = parse_ptxas(&log);
            report(&format!(
                "ok    {label} {what} ({} regs, {} B smem, spills {}/{})",
                r.registers.unwrap_or(0),
                r.shared_bytes.unwrap_or(0),
                r.spill_stores.unwrap_or(0),
                r.spill_loads.unwrap_or(0)
            ));
            true
        }
        Err(e) => {
            let e: Vec<&str> = e.lines().take(30).collect();
            report(&format!("FAIL  {label} {what}:\n      {}", e.join("\n      ")));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn wrapping_follows_mlx() {
        let sig = LaunchSig {
            entry: "twice".into(),
            inputs: vec![("a".into(), "f16".into())],
            outputs: vec![("out".into(), "f32".into())],
        };
        let t: BTreeMap<String, i64> = [("N".to_string(), 8)].into();
        let c: BTreeMap<String, f64> = [("eps".to_string(), 1e-5)].into();
        let s = wrap(
            "",
            "int i = threadIdx.x; if (i < a_shape[0]) out[i] = 2.0f * __half2float(a[i]);",
            &sig,
            &t,
            &c,
        );
        assert!(s.contains("const __half* a,\n    const __grid_constant__ KsShape a_shape,\n    float* out)"));
        assert!(s.contains("constexpr int N = 8;"));
        assert!(s.contains("constexpr float KS_EPS = 1e-5f;"));
        assert!(!s.contains("a_strides"));
    }
}
