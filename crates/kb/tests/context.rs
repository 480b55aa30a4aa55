//! Prompt context: snapshot tests for the three levels (committed snapshots, INSTA_UPDATE=no in CI).

use std::path::Path;

use ksearch_core::{Lang, Task};
use ksearch_kb::{ContextLevel, Kb, render_context};

fn kb() -> Kb {
    Kb::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kb")).unwrap()
}

const FLASH_CU: &str = r#"// small knowledge-base attention kernel for the context tests
extern "C" __global__ void flash(const float* q, const float* k, const float* v, float* o, long long L) {
  __shared__ float ks[64][65];
  float m = -INFINITY, l = 0.0f;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    float s = q[j] * k[j];
    float mn = fmaxf(m, s);
    l = l * exp2f(m - mn) + exp2f(s - mn);
    m = mn;
  }
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffff, l, off);
  o[threadIdx.x] = l + ks[0][0] + v[0];
}
"#;

/// A task with one CUDA knowledge-base kernel, written to a temporary directory so the test does
/// not depend on the repository's tasks.
fn task(dir: &Path) -> Task {
    std::fs::create_dir_all(dir.join("cuda")).unwrap();
    std::fs::write(
        dir.join("cuda/naive.cu"),
        "extern \"C\" __global__ void naive(float* o) { o[0] = 0.0f; }\n",
    )
    .unwrap();
    std::fs::write(dir.join("cuda/flash.cu"), FLASH_CU).unwrap();
    let toml = r#"
name = "attention"
reference = "attention"
axes = ["B", "H", "L", "D", "causal"]
[[inputs]]
name = "q"
shape = ["B", "H", "L", "D"]
dtype = "f32"
[[inputs]]
name = "k"
shape = ["B", "H", "L", "D"]
dtype = "f32"
[[inputs]]
name = "v"
shape = ["B", "H", "L", "D"]
dtype = "f32"
[[outputs]]
name = "o"
shape = ["B", "H", "L", "D"]
dtype = "f32"
[tolerance]
f32 = { atol = 1e-4, rtol = 1e-3 }
[backends.cuda]
search = [{ B = 1, H = 2, L = 128, D = 64, causal = 0 }]
[backends.cuda.seed]
file = "cuda/naive.cu"
entry = "naive"
[[backends.cuda.kernels]]
name = "flash"
file = "cuda/flash.cu"
entry = "flash"
pattern = "flash-attention-2"
description = "online softmax, exp2, warp shuffles"
"#;
    std::fs::write(dir.join("task.toml"), toml).unwrap();
    Task::load(&dir.join("task.toml")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn full_context_for_apple_has_the_rules_patterns_and_cuda_kernels() {
    let kb = kb();
    let tmp = tempfile::tempdir().unwrap();
    let t = task(&tmp.path().join("attention"));
    let m3 = kb.profile("m3-max").unwrap();
    let full = render_context(&kb, ContextLevel::Full, Lang::MlxMetal, m3, Some(&t));
    assert!(
        full.contains("apple.threadgroup-32k") && full.contains("32 KB (32768 B)"),
        "32 KB rule"
    );
    assert!(
        full.contains("simd_shuffle_xor") && full.contains("(`register-reduction`)"),
        "shuffle pattern"
    );
    assert!(full.contains("(`exp2-softmax`)") && full.contains("exp2"), "exp2 pattern");
    assert!(
        full.contains("### `tasks/attention/cuda/flash.cu` (flash, pattern `flash-attention-2`)"),
        "CUDA kb kernel"
    );
    assert!(full.contains("__shfl_xor_sync(0xffffffff, l, off)"), "kernel source");
    assert!(
        full.contains("| `__syncthreads` | `threadgroup_barrier(mem_flags::mem_threadgroup)` |"),
        "primitive map"
    );
    assert!(full.contains("MLX kernel-body conventions"));
    assert!(full.contains("400.0 GB/s"));
    insta::assert_snapshot!("full_m3_max_mlx_metal", full);
}

#[test]
fn none_context_is_empty_and_generic_has_only_figures() {
    let kb = kb();
    let tmp = tempfile::tempdir().unwrap();
    let t = task(&tmp.path().join("attention"));
    let m3 = kb.profile("m3-max").unwrap();
    let none = render_context(&kb, ContextLevel::None, Lang::MlxMetal, m3, Some(&t));
    assert!(
        !none.contains("32 KB") && !none.contains("simd_shuffle_xor") && !none.contains("exp2") && !none.contains("flash.cu")
    );
    insta::assert_snapshot!("none_m3_max_mlx_metal", none);
    let generic = render_context(&kb, ContextLevel::Generic, Lang::MlxMetal, m3, Some(&t));
    assert!(generic.contains("threadgroup memory per threadgroup: 32.0 KB") && generic.contains("400.0 GB/s"));
    assert!(!generic.contains("simd_shuffle_xor") && !generic.contains("flash.cu") && !generic.contains("apple.threadgroup-32k"));
    insta::assert_snapshot!("generic_m3_max_mlx_metal", generic);
}

#[test]
fn cuda_target_context() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    let generic = render_context(&kb, ContextLevel::Generic, Lang::Cuda, h100, None);
    assert!(generic.contains("up to 227.0 KB with the dynamic opt-in") && generic.contains("warp width 32"));
    insta::assert_snapshot!("generic_h100_cuda", generic);
    let full = render_context(&kb, ContextLevel::Full, Lang::Cuda, h100, None);
    assert!(full.contains("cuda.static-shared-48k") && !full.contains("apple.threadgroup-32k"));
    assert!(!full.contains("CUDA to Metal primitive map"));
}

#[test]
fn level_parses() {
    assert_eq!("none".parse::<ContextLevel>().unwrap(), ContextLevel::None);
    assert_eq!("generic".parse::<ContextLevel>().unwrap(), ContextLevel::Generic);
    assert_eq!("full".parse::<ContextLevel>().unwrap(), ContextLevel::Full);
    assert!("most".parse::<ContextLevel>().is_err());
}
