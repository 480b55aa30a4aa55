//! NVRTC compile checks: need only libnvrtc.so.13 (no GPU); skipped without it, unless
//! `KSEARCH_REQUIRE_NVRTC=1` (scripts/test.sh, which installs it), where they fail.

use ksearch_eval::cuda::{REFERENCE_SOURCE, compile_check, compiled_entries, nvrtc_available, nvrtc_compile, nvrtc_options};

fn nvrtc() -> bool {
    if !nvrtc_available() {
        if std::env::var("KSEARCH_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("KSEARCH_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH: scripts/nvrtc-env.sh)");
        }
        eprintln!("skipped: no NVRTC (libnvrtc.so.13)");
        return false;
    }
    true
}

#[test]
fn device_references_compile_for_sm90_with_a_resource_report() {
    if !nvrtc() {
        return;
    }
    let r = compile_check(REFERENCE_SOURCE, &[], "sm_90").expect("references compile");
    assert!(r.registers.unwrap_or(0) > 0, "no register count in {:?}", r);
    let (_, log) = nvrtc_compile(REFERENCE_SOURCE, "reference.cu", &nvrtc_options("sm_90", &[], &[])).unwrap();
    let entries = compiled_entries(&log);
    for e in [
        "ksref_softmax",
        "ksref_rmsnorm",
        "ksref_attention",
        "ksref_mamba_scan",
        "ksref_mamba_step",
    ] {
        assert!(entries.iter().any(|x| x == e), "{e} missing from {entries:?}");
    }
}

#[test]
fn defines_reach_the_kernel_and_errors_carry_the_log() {
    if !nvrtc() {
        return;
    }
    let src = "#include <cuda_fp16.h>\n\
               extern \"C\" __global__ void k(const __half* x, __half* y, long long n) {\n\
                 __shared__ float s[TILE];\n\
                 long long i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 s[threadIdx.x % TILE] = __half2float(x[i % n]) * (float)KS_EPS;\n\
                 __syncthreads();\n\
                 if (i < n) y[i] = __float2half(s[(threadIdx.x + 1) % TILE]);\n\
               }\n";
    let d = vec![
        ("TILE".to_string(), "256".to_string()),
        ("KS_EPS".to_string(), "1e-5".to_string()),
    ];
    let r = compile_check(src, &d, "sm_90").expect("compiles");
    assert_eq!(r.shared_bytes, Some(1024), "{r:?}");
    let e = compile_check(src, &d[1..], "sm_90").expect_err("TILE undefined");
    assert!(e.contains("TILE"), "log should name the problem: {e}");
}

/// What `ksearch nvrtc-check` does, over the repository's tasks (run with `--ignored`; the CI
/// runs the CLI command instead).
#[test]
#[ignore]
fn shipped_kernels_compile() {
    if !nvrtc() {
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks");
    let tasks = ksearch_core::task::load_all(&dir).expect("tasks load");
    let (n, failed) = ksearch_eval::cuda::nvrtc_check(&tasks, "sm_90", 40, &mut |l| println!("{l}"));
    println!("{n} compiles, {failed} failed");
    assert_eq!(failed, 0);
}
