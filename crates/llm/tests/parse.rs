//! Reply parsing: JSON, code blocks, language detection, repair prompts.

use ksearch_llm::parse::{compatible, fences, normalize_lang};
use ksearch_llm::*;
use serde_json::json;

#[test]
fn json_in_a_fence_with_prose() {
    let t = "Sure! Here is the plan:\n```json\n{\"a\": 1, \"b\": [1, 2]}\n```\nLet me know.";
    assert_eq!(extract_json(t).unwrap(), json!({"a": 1, "b": [1, 2]}));
}

#[test]
fn bare_json_with_leading_prose_and_brackets() {
    let t = "As noted in [1], the kernel {mostly} streams. {\"x\": {\"y\": \"}\"}} Thanks.";
    assert_eq!(extract_json(t).unwrap(), json!({"x": {"y": "}"}}));
}

#[test]
fn trailing_commas_comments_and_python_literals_are_repaired() {
    let t = "{\n  \"a\": [1, 2, 3,],\n  // a comment\n  \"ok\": True,\n  \"none\": None,\n}";
    assert_eq!(extract_json(t).unwrap(), json!({"a": [1, 2, 3], "ok": true, "none": null}));
}

#[test]
fn the_largest_value_wins() {
    let t = "Options [1] and [2]:\n{\"actions\": [{\"title\": \"t\"}]}";
    assert_eq!(extract_json(t).unwrap(), json!({"actions": [{"title": "t"}]}));
}

#[test]
fn truncated_json_is_detected() {
    for t in [
        "{\"actions\": [{\"title\": \"tile\", \"overall\": 7",
        "```json\n{\"a\": \"unterminated",
        "Plan: {\"a\": 1, \"b\": {",
    ] {
        assert!(matches!(extract_json(t), Err(ParseError::TruncatedJson { .. })), "{t}");
    }
}

#[test]
fn invalid_and_missing_json() {
    assert!(matches!(
        extract_json("{\"a\": 'single'}"),
        Err(ParseError::InvalidJson { .. })
    ));
    assert_eq!(extract_json("No JSON here, just {braces} in prose."), Err(ParseError::NoJson));
    assert_eq!(extract_json(""), Err(ParseError::NoJson));
}

#[test]
fn think_sections_are_ignored() {
    let t = "<think>maybe {\"wrong\": true, \"longer\": \"yes indeed\"}</think>\n{\"right\": 1}";
    assert_eq!(extract_json(t).unwrap(), json!({"right": 1}));
}

const CUDA: &str = r#"#include <cuda_fp16.h>
extern "C" __global__ void softmax(const float* __restrict__ x, float* y, int n) {
    __shared__ float buf[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = x[i];
    __syncthreads();
    y[i] = buf[threadIdx.x];
}"#;

const METAL: &str = r#"#include <metal_stdlib>
using namespace metal;
kernel void softmax(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                    uint tid [[thread_position_in_grid]]) {
    threadgroup float buf[256];
    float m = simd_max(x[tid]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = exp2(x[tid] - m);
}"#;

const MLX_METAL_BODY: &str = "uint elem = thread_position_in_grid.x;\nT v = inp[elem];\nout[elem] = metal::exp(v);\n";

const PYTHON: &str = r#"import numpy as np

def softmax(x):
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)
"#;

const CPP: &str = r#"#include <cmath>
#include <algorithm>
extern "C" void softmax(const float* x, float* y, int rows, int cols) {
    for (int r = 0; r < rows; ++r) {
        const float* row = x + r * cols;
        float m = *std::max_element(row, row + cols);
        float s = 0.f;
        for (int c = 0; c < cols; ++c) { y[r * cols + c] = std::exp(row[c] - m); s += y[r * cols + c]; }
        for (int c = 0; c < cols; ++c) y[r * cols + c] /= s;
    }
}"#;

const RUST: &str =
    "use std::f32;\npub fn softmax(x: &mut Vec<f32>) {\n    let mut m = f32::MIN;\n    for v in x.iter() { m = m.max(*v); }\n}\n";

#[test]
fn languages_are_detected() {
    assert_eq!(detect_lang(CUDA), Some("cuda"));
    assert_eq!(detect_lang(METAL), Some("metal"));
    assert_eq!(detect_lang(MLX_METAL_BODY), Some("metal"));
    assert_eq!(detect_lang(PYTHON), Some("python"));
    assert_eq!(detect_lang(CPP), Some("cpp"));
    assert_eq!(detect_lang(RUST), Some("rust"));
    assert_eq!(detect_lang("int add(int a, int b) { return a + b; }"), Some("c"));
    assert_eq!(detect_lang("just words"), None);
    // A comment mentioning CUDA does not make Metal code CUDA.
    assert_eq!(
        detect_lang(&format!("// ported from __global__ / __shared__ CUDA code\n{METAL}")),
        Some("metal")
    );
    // `__restrict__` alone is CPU C++.
    assert_eq!(detect_lang("void f(float* __restrict__ a) { a[0] = 1.f; }"), Some("c"));
}

#[test]
fn language_names_and_compatibility() {
    assert_eq!(normalize_lang("c++"), Some("cpp"));
    assert_eq!(normalize_lang("mlx_metal"), Some("metal"));
    assert_eq!(normalize_lang("CU"), Some("cuda"));
    assert!(compatible("cuda", "cpp") && compatible("metal", "c"));
    assert!(!compatible("cpp", "cuda") && !compatible("metal", "cuda") && !compatible("cuda", "python"));
}

#[test]
fn code_is_taken_from_the_fence() {
    let t = format!("Here is the kernel:\n\n```cuda\n{CUDA}\n```\n\nIt uses shared memory.");
    assert_eq!(extract_code(&t, Some("cuda")).unwrap(), format!("{CUDA}\n"));
    assert_eq!(extract_code(&t, None).unwrap(), format!("{CUDA}\n"));
}

#[test]
fn the_largest_block_or_a_nearly_as_large_last_one() {
    let small = "y[i] = x[i];";
    let t = format!("```cpp\n{CPP}\n```\nUsage:\n```cpp\n{small}\n```");
    assert_eq!(extract_code(&t, Some("cpp")).unwrap(), format!("{CPP}\n"));
    let revised = CPP.replace("0.f", "0.0f");
    let t = format!("First draft:\n```cpp\n{CPP}\n```\nFixed:\n```cpp\n{revised}\n```");
    assert_eq!(extract_code(&t, Some("cpp")).unwrap(), format!("{revised}\n"));
}

#[test]
fn blocks_tagged_with_the_asked_language_are_preferred() {
    let t = format!(
        "Compile with:\n```bash\nnvcc -O3 k.cu\n```\nReference in Python:\n```python\n{PYTHON}```\nKernel:\n```cu\n{CUDA}\n```"
    );
    assert_eq!(extract_code(&t, Some("cuda")).unwrap(), format!("{CUDA}\n"));
}

#[test]
fn wrong_languages_are_reported() {
    let t = format!("```python\n{PYTHON}```");
    assert_eq!(
        extract_code(&t, Some("cuda")),
        Err(ParseError::WrongLanguage {
            expected: "cuda".into(),
            found: "python".into()
        })
    );
    // Untagged Metal where CUDA was asked.
    let t = format!("```\n{METAL}\n```");
    assert!(matches!(extract_code(&t, Some("cuda")), Err(ParseError::WrongLanguage { found, .. }) if found == "metal"));
    // CUDA where an MLX Metal body was asked.
    let t = format!("```metal\n{CUDA}\n```");
    assert!(matches!(extract_code(&t, Some("mlx_metal")), Err(ParseError::WrongLanguage { found, .. }) if found == "cuda"));
    // A plain MLX Metal body is fine.
    let t = format!("```metal\n{MLX_METAL_BODY}```");
    assert_eq!(extract_code(&t, Some("mlx_metal")).unwrap(), MLX_METAL_BODY);
    let e = ParseError::WrongLanguage {
        expected: "cuda".into(),
        found: "python".into(),
    };
    assert!(repair_prompt(&e).contains("python code, but the target needs cuda"));
}

#[test]
fn missing_empty_and_truncated_code() {
    assert_eq!(
        extract_code("I suggest tiling the loop.", Some("cuda")),
        Err(ParseError::NoCodeBlock)
    );
    assert_eq!(extract_code("```cuda\n\n```", Some("cuda")), Err(ParseError::EmptyCode));
    let cut = &CUDA[..CUDA.len() / 2];
    assert_eq!(
        extract_code(&format!("```cuda\n{cut}"), Some("cuda")),
        Err(ParseError::TruncatedCode)
    );
    // A missing closing fence on complete code is tolerated.
    assert_eq!(
        extract_code(&format!("```cuda\n{CUDA}\n"), Some("cuda")).unwrap(),
        format!("{CUDA}\n")
    );
    // Only shell blocks: no source.
    assert_eq!(extract_code("```bash\nmake\n```", Some("cpp")), Err(ParseError::NoCodeBlock));
}

#[test]
fn bare_code_without_fences_is_accepted_when_it_is_only_code() {
    assert_eq!(extract_code(CPP, Some("cpp")).unwrap(), format!("{CPP}\n"));
    assert!(matches!(
        extract_code(PYTHON, Some("cpp")),
        Err(ParseError::WrongLanguage { .. })
    ));
}

#[test]
fn fences_with_tildes_and_long_markers() {
    let f = fences("~~~cpp\nint a;\n~~~\n````cuda\n```\ninner\n```\n````\n");
    assert_eq!(f.len(), 2);
    assert_eq!(f[1].lang(), "cuda");
    assert_eq!(f[1].body, "```\ninner\n```\n");
}

#[test]
fn every_parse_error_has_a_repair_prompt() {
    let errs = [
        ParseError::NoJson,
        ParseError::TruncatedJson { tail: "...".into() },
        ParseError::InvalidJson {
            message: "expected value".into(),
        },
        ParseError::Schema {
            message: "missing `actions`".into(),
        },
        ParseError::NoCodeBlock,
        ParseError::TruncatedCode,
        ParseError::EmptyCode,
        ParseError::WrongLanguage {
            expected: "metal".into(),
            found: "cuda".into(),
        },
    ];
    for e in &errs {
        let p = repair_prompt(e);
        assert!(p.starts_with("Your previous reply could not be used"), "{p}");
        assert!(p.contains(&e.guidance()), "{p}");
    }
}
