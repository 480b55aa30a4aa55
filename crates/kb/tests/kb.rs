//! Knowledge-base data and API tests: profiles, detection, primitive map, rules, patterns,
//! checks, Metal syntax checking, roofline.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ksearch_core::Lang;
use ksearch_kb::*;

fn kb_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kb")
}

fn kb() -> Kb {
    Kb::load(&kb_dir()).unwrap_or_else(|e| panic!("{e}"))
}

fn have_cxx() -> bool {
    let ok = find_cxx().is_some();
    if !ok {
        eprintln!("warning: no C++ compiler, Metal syntax checks skipped");
    }
    ok
}

// ---------- profiles ----------

#[test]
fn required_profiles_exist() {
    let kb = kb();
    for n in [
        "h100",
        "h200",
        "a100",
        "l4",
        "m1",
        "m1-pro",
        "m1-max",
        "m1-ultra",
        "m2",
        "m2-pro",
        "m2-max",
        "m2-ultra",
        "m3",
        "m3-pro",
        "m3-max",
        "m3-ultra",
        "m4",
        "m4-pro",
        "m4-max",
        "cpu",
        "generic-cuda",
        "generic-apple",
    ] {
        assert!(kb.profile(n).is_some(), "profile {n} missing");
    }
}

#[test]
fn every_profile_figure_has_a_source() {
    let kb = kb();
    for p in &kb.profiles {
        assert!(
            p.missing_sources().is_empty(),
            "{}: figures without a source: {:?}",
            p.name,
            p.missing_sources()
        );
        for (k, _) in p.figures() {
            assert!(
                p.sources[&k].len() > 10,
                "{}: source of {k} is too short to name anything",
                p.name
            );
        }
    }
}

#[test]
fn a_profile_without_a_source_fails_to_load_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(kb_dir().join("profiles/l4.toml")).unwrap();
    let cut: String = src
        .lines()
        .filter(|l| !l.starts_with("l2_mb = \""))
        .collect::<Vec<_>>()
        .join("\n");
    let p = dir.path().join("l4.toml");
    std::fs::write(&p, cut).unwrap();
    let e = Profile::load(&p).unwrap_err().to_string();
    assert!(e.contains("l4.toml:") && e.contains("l2_mb"), "{e}");
}

#[test]
fn key_figures() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    assert_eq!(h100.mem_bandwidth_gbs, 3350.0);
    assert_eq!(h100.shared_per_block_kb, 48.0);
    assert_eq!(h100.shared_optin_kb, Some(227.0));
    assert_eq!(h100.max_threads_per_block, 1024);
    assert_eq!(h100.simd_width, 32);
    assert_eq!(kb.profile("h200").unwrap().mem_bandwidth_gbs, 4800.0);
    let m3 = kb.profile("m3-max").unwrap();
    assert_eq!(m3.mem_bandwidth_gbs, 400.0);
    assert_eq!(m3.shared_per_block_kb, 32.0);
    assert_eq!(m3.shared_optin_kb, None);
    assert_eq!(m3.simd_width, 32);
    for p in kb.profiles.iter().filter(|p| p.vendor == "apple") {
        assert_eq!(p.shared_per_block_kb, 32.0, "{}", p.name);
        assert_eq!(p.max_threads_per_block, 1024, "{}", p.name);
    }
}

#[test]
fn detection() {
    let kb = kb();
    let d = |b: Backend, n: &str| {
        let (p, w) = kb.detect(b, n);
        (p.name.clone(), w)
    };
    assert_eq!(d(Backend::Cuda, "NVIDIA H200"), ("h200".into(), None));
    assert_eq!(d(Backend::Cuda, "NVIDIA H100 80GB HBM3"), ("h100".into(), None));
    assert_eq!(d(Backend::Cuda, "NVIDIA A100-SXM4-80GB"), ("a100".into(), None));
    assert_eq!(d(Backend::Cuda, "NVIDIA L4"), ("l4".into(), None));
    assert_eq!(d(Backend::MlxMetal, "Apple M3 Max"), ("m3-max".into(), None));
    assert_eq!(d(Backend::MlxMetal, "Apple M1 Max"), ("m1-max".into(), None));
    assert_eq!(d(Backend::MlxMetal, "Apple M1"), ("m1".into(), None));
    assert_eq!(d(Backend::MlxMetal, "Apple M2 Pro"), ("m2-pro".into(), None));
    assert_eq!(d(Backend::MlxMetal, "m4-max"), ("m4-max".into(), None));
    assert_eq!(d(Backend::Cpu, "AMD EPYC 9654"), ("cpu".into(), None));
    // A name that says its vendor wins over the back-end's.
    assert_eq!(d(Backend::Cpu, "NVIDIA H100 80GB HBM3"), ("h100".into(), None));
    assert_eq!(d(Backend::MlxCuda, "NVIDIA H200"), ("h200".into(), None));
    assert_eq!(d(Backend::Cuda, "Apple M3 Max"), ("m3-max".into(), None));
    // L40S must not match the L4 profile
    let (p, w) = kb.detect(Backend::Cuda, "NVIDIA L40S");
    assert_eq!(p.name, "generic-cuda");
    assert!(w.unwrap().contains("NVIDIA L40S"));
    let (p, w) = kb.detect(Backend::MlxMetal, "Apple M9 Hyper");
    assert_eq!(p.name, "generic-apple");
    assert!(w.is_some());
}

// ---------- primitive map ----------

#[test]
fn map_examples_from_the_brief() {
    let kb = kb();
    let m = |q: &str, to: Dialect| kb.map(q, to).first().map(|p| (p.metal.clone(), p.cuda[0].clone()));
    assert_eq!(m("__shfl_xor_sync", Dialect::Metal).unwrap().0, "simd_shuffle_xor");
    assert_eq!(m("__shfl_down_sync", Dialect::Metal).unwrap().0, "simd_shuffle_down");
    assert_eq!(
        m("__syncthreads()", Dialect::Metal).unwrap().0,
        "threadgroup_barrier(mem_flags::mem_threadgroup)"
    );
    assert_eq!(m("threadIdx", Dialect::Metal).unwrap().0, "thread_position_in_threadgroup");
    assert_eq!(m("blockIdx", Dialect::Metal).unwrap().0, "threadgroup_position_in_grid");
    assert_eq!(m("blockDim", Dialect::Metal).unwrap().0, "threads_per_threadgroup");
    assert_eq!(m("__shared__", Dialect::Metal).unwrap().0, "threadgroup");
    assert_eq!(m("__expf", Dialect::Metal).unwrap().0, "fast::exp");
    assert_eq!(m("exp2f", Dialect::Metal).unwrap().0, "exp2");
    assert_eq!(m("wmma::mma_sync", Dialect::Metal).unwrap().0, "simdgroup_matrix");
    assert_eq!(m("cp.async", Dialect::Metal).unwrap().0, "none");
    assert_eq!(
        m("__launch_bounds__", Dialect::Metal).unwrap().0,
        "[[max_total_threads_per_threadgroup(N)]]"
    );
    assert_eq!(m("atomicAdd", Dialect::Metal).unwrap().0, "atomic_fetch_add_explicit");
    assert_eq!(m("__nv_bfloat16", Dialect::Metal).unwrap().0, "bfloat");
    // A float reduction answers the shuffle-ladder helper, not the integer-only intrinsic.
    assert_eq!(m("simd_sum", Dialect::Cuda).unwrap().1, "warp_reduce_sum");
    assert_eq!(m("__reduce_add_sync", Dialect::Metal).unwrap().0, "simd_sum");
    assert_eq!(m("threadgroup_barrier", Dialect::Cuda).unwrap().1, "__syncthreads");
    assert_eq!(m("simd_shuffle_xor", Dialect::Cuda).unwrap().1, "__shfl_xor_sync");
    assert!(kb.map("no_such_thing_at_all", Dialect::Metal).is_empty());
}

#[test]
fn every_mapping_round_trips() {
    let kb = kb();
    for p in &kb.primitives {
        for c in &p.cuda {
            assert!(
                kb.map(c, Dialect::Metal).iter().any(|q| q.id == p.id),
                "CUDA spelling `{c}` does not find primitive {}",
                p.id
            );
        }
        if p.metal != "none" {
            assert!(
                kb.map(&p.metal, Dialect::Cuda).iter().any(|q| q.id == p.id),
                "Metal `{}` does not find {}",
                p.metal,
                p.id
            );
        }
    }
}

const EXAMPLE_PRELUDE: &str = "#include <metal_stdlib>
using namespace metal;
[[kernel]] void example(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
    device const half* hin [[buffer(2)]], device atomic_int* counter [[buffer(3)]], device atomic_float* acc [[buffer(4)]],
    uint3 gid [[thread_position_in_grid]], uint3 tid [[thread_position_in_threadgroup]],
    uint3 tgid [[threadgroup_position_in_grid]], uint3 tpg [[threads_per_threadgroup]],
    uint3 ntg [[threadgroups_per_grid]], uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]], uint simd_size [[threads_per_simdgroup]]) {
  threadgroup float tile[256];
  float v = in[gid.x];
";

fn example_source(p: &Primitive) -> String {
    if p.example_scope == "file" {
        p.metal_example.clone()
    } else {
        format!("{EXAMPLE_PRELUDE}{}\n  (void)tile;\n}}\n", p.metal_example)
    }
}

#[test]
fn every_metal_example_passes_the_rules() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    for p in &kb.primitives {
        let v = check(&kb, &example_source(p), SourceLang::Metal, m3, &CheckOptions::default());
        assert!(!rejected(&v), "{}: {:?}", p.id, v);
    }
}

#[test]
fn every_metal_example_compiles_with_the_shim() {
    if !have_cxx() {
        return;
    }
    let kb = kb();
    // one translation unit per scope to keep the test quick: all body examples in one kernel each
    for p in &kb.primitives {
        if let Err(e) = metal_syntax_check(&example_source(p), None) {
            panic!("primitive {}: {e}", p.id);
        }
    }
}

#[test]
fn cuda_spellings_in_cuda_examples_are_flagged_in_metal() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    let dialect = kb.rule("metal.cuda-identifier").unwrap();
    for p in kb
        .primitives
        .iter()
        .filter(|p| p.cuda[0].starts_with("__") && p.kind != "attribute")
    {
        let v = check(&kb, &p.cuda_example, SourceLang::MlxMetal, m3, &CheckOptions::default());
        assert!(
            v.iter().any(|x| x.rule == dialect.id),
            "{}: `{}` not flagged",
            p.id,
            p.cuda_example
        );
    }
}

// ---------- rules ----------

#[test]
fn every_rule_fires_on_its_bad_example_and_not_on_its_good_one() {
    let kb = kb();
    for r in &kb.rules {
        let ex = &r.example;
        let lang = ex.lang;
        let profile = kb.profile(&ex.profile).unwrap();
        let mut opts = CheckOptions {
            forbid: ex.forbid.clone(),
            dynamic_shared_bytes: ex.dynamic_shared,
            ..Default::default()
        };
        let bad = check(&kb, &ex.bad, lang, profile, &opts);
        assert!(
            bad.iter().any(|v| v.rule == r.id),
            "rule {}: bad example not flagged: {bad:?}",
            r.id
        );
        opts.dynamic_shared_bytes = None;
        let good = check(&kb, &ex.good, lang, profile, &opts);
        assert!(
            !good.iter().any(|v| v.rule == r.id),
            "rule {}: good example flagged: {good:?}",
            r.id
        );
    }
}

#[test]
fn rejection_message_cites_rule_bytes_profile_and_line() {
    let kb = kb();
    let src = std::fs::read_to_string(kb_dir().join("examples/reject/threadgroup-40k.metal")).unwrap();
    let v = check(
        &kb,
        &src,
        SourceLang::Metal,
        kb.profile("m3-max").unwrap(),
        &CheckOptions::default(),
    );
    let msg: Vec<String> = v.iter().map(|v| v.to_string()).collect();
    assert_eq!(
        msg,
        vec!["rule apple.threadgroup-32k: threadgroup memory 40960 B exceeds 32768 B on m3-max (line 13)"]
    );
    assert!(rejected(&v));
    // the same kernel fits a CUDA-sized budget: the rule is Apple's
    assert_eq!(threadgroup_bytes(&src, SourceLang::Metal, &BTreeMap::new()), 40960);
}

#[test]
fn threadgroup_bytes_use_defines_constants_and_dynamic_memory() {
    let kb = kb();
    let m1 = kb.profile("m1-max").unwrap();
    let src = "constant constexpr int ROWS = 16;\nthreadgroup half a[ROWS][BLOCK];\nthreadgroup float4 b[8], c[8];\n";
    let mut d = BTreeMap::new();
    d.insert("BLOCK".to_string(), 512);
    assert_eq!(threadgroup_bytes(src, SourceLang::MlxMetal, &d), 16 * 512 * 2 + 2 * 8 * 16);
    let opts = CheckOptions {
        defines: d.clone(),
        ..Default::default()
    };
    assert!(check(&kb, src, SourceLang::Metal, m1, &opts).is_empty());
    d.insert("BLOCK".to_string(), 1024);
    let opts = CheckOptions {
        defines: d,
        ..Default::default()
    };
    assert!(
        check(&kb, src, SourceLang::Metal, m1, &opts)
            .iter()
            .any(|v| v.rule == "apple.threadgroup-32k")
    );
    // dynamic threadgroup bytes count too
    let v = check_source(&kb, "threadgroup float a[1024];", Lang::MlxMetal, m1, &[], Some(30000));
    assert!(v.iter().any(|v| v.rule == "apple.threadgroup-32k"), "{v:?}");
    // comments do not count
    assert!(
        check(
            &kb,
            "// threadgroup float a[100000];\n",
            SourceLang::Metal,
            m1,
            &CheckOptions::default()
        )
        .is_empty()
    );
}

#[test]
fn cuda_shared_limits() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    let a100 = kb.profile("a100").unwrap();
    // 64 KB static: over 48 KB without opt-in
    let src = "#define N 128\n__global__ void k(float* o) {\n  __shared__ float s[N][N];\n  o[0] = s[0][0];\n}\n";
    let v = check_source(&kb, src, Lang::Cuda, h100, &[], None);
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].rule, "cuda.static-shared-48k");
    assert_eq!(v[0].line, Some(3));
    // 200 KB dynamic: fine on Hopper (227 KB), too much on A100 (163 KB)
    let dynsrc = "__global__ void k(float* o) { extern __shared__ float d[]; o[0] = d[0]; }";
    assert!(check_source(&kb, dynsrc, Lang::Cuda, h100, &[], Some(200 * 1024)).is_empty());
    let v = check_source(&kb, dynsrc, Lang::Cuda, a100, &[], Some(200 * 1024));
    assert_eq!(v[0].rule, "cuda.shared-optin-limit");
    assert!(v[0].message.contains("166912 B"), "{}", v[0].message);
    // above 227 KB on Hopper
    assert_eq!(
        check_source(&kb, dynsrc, Lang::Cuda, h100, &[], Some(228 * 1024))[0].rule,
        "cuda.shared-optin-limit"
    );
    // __align__ and multiple declarators
    let src = "__global__ void k() { __shared__ __align__(16) float a[6144], b[6145]; }";
    assert_eq!(
        check_source(&kb, src, Lang::Cuda, h100, &[], None)[0].rule,
        "cuda.static-shared-48k"
    );
}

#[test]
fn thread_limits() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    let src = "[[kernel, max_total_threads_per_threadgroup(2048)]] void k(device float* o [[buffer(0)]]) { o[0] = 0; }";
    let v = check(&kb, src, SourceLang::Metal, m3, &CheckOptions::default());
    assert!(v.iter().any(|v| v.rule == "threads.max-per-block"), "{v:?}");
    let v = check_launch(&kb, kb.profile("h100").unwrap(), SourceLang::Cuda, [32, 64, 1], 0);
    assert_eq!(v[0].rule, "threads.max-per-block");
    assert!(check_launch(&kb, kb.profile("h100").unwrap(), SourceLang::Cuda, [32, 32, 1], 0).is_empty());
}

#[test]
fn dialect_cuda_in_metal() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    let body = "uint i = thread_position_in_grid.x;\nif (i >= n) return;\nfloat v = inp[i];\nv = __shfl_down_sync(0xffffffff, v, 1);\n__syncthreads();\nout[threadIdx.x] = __expf(v);\n";
    let v = check_source(&kb, body, Lang::MlxMetal, m3, &[], None);
    let msgs: Vec<String> = v.iter().map(|v| v.to_string()).collect();
    assert!(
        msgs.iter()
            .any(|m| m.contains("`__shfl_down_sync` is CUDA, not Metal; use `simd_shuffle_down`") && m.ends_with("(line 4)")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("`__syncthreads` is CUDA") && m.contains("threadgroup_barrier(mem_flags::mem_threadgroup)"))
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("`threadIdx`") && m.contains("thread_position_in_threadgroup"))
    );
    assert!(msgs.iter().any(|m| m.contains("`__expf`") && m.contains("fast::exp")));
    assert!(rejected(&v));
}

#[test]
fn dialect_metal_in_cuda() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    let src = "__global__ void k(float* y) {\n  __shared__ float s[32];\n  float v = simd_sum(y[0]);\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n  y[0] = v + simd_shuffle_xor(v, 1);\n}\n";
    let v = check_source(&kb, src, Lang::Cuda, h100, &[], None);
    let msgs: Vec<String> = v.iter().map(|v| v.to_string()).collect();
    assert!(
        msgs.iter()
            .any(|m| m.contains("`simd_sum` is Metal, not CUDA") && m.contains("(line 3)")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("`threadgroup_barrier` is Metal") && m.contains("__syncthreads"))
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("`simd_shuffle_xor`") && m.contains("__shfl_xor_sync"))
    );
    // `__shared__` and identifiers that merely contain Metal words are fine
    assert!(!msgs.iter().any(|m| m.contains("`threadgroup`")), "{msgs:?}");
}

#[test]
fn forbidden_calls() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    let forbid = vec!["cublasSgemm".to_string(), "mx.fast.scaled_dot_product_attention".to_string()];
    let src = "__global__ void k(float* y) { printf(\"%f\", y[0]); }\nvoid h() { cublasSgemm(0); FILE* f = fopen(\"x\", \"w\"); system(\"ls\"); }\n";
    let v = check_source(&kb, src, Lang::Cuda, h100, &forbid, None);
    let ids: Vec<(&str, Option<usize>)> = v.iter().map(|v| (v.rule.as_str(), v.line)).collect();
    assert!(ids.contains(&("forbidden.host-io", Some(1))), "{ids:?}");
    assert!(ids.contains(&("task.forbid", Some(2))), "{ids:?}");
    assert_eq!(v.iter().filter(|v| v.rule == "forbidden.host-io").count(), 3);
    // a word in a comment or a string, or a longer identifier, is not a call
    let ok = "// printf(\"x\")\n__global__ void k(float* y) { const char* s = \"system(\"; int my_printf_count = 0; y[0] = my_printf_count; }\n";
    assert!(check_source(&kb, ok, Lang::Cuda, h100, &forbid, None).is_empty());
    // CPU sources too
    let cpu = kb.profile("cpu").unwrap();
    let v = check_source(
        &kb,
        "#include <iostream>\nvoid f() { std::cout << 1; }\n",
        Lang::Cpp,
        cpu,
        &[],
        None,
    );
    assert_eq!(v[0].rule, "forbidden.host-io");
}

#[test]
fn mlx_body_with_a_signature_is_rejected() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    let src =
        "kernel void f(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n  if (i < 4) out[i] = 0;\n}\n";
    let v = check_source(&kb, src, Lang::MlxMetal, m3, &[], None);
    assert!(v.iter().any(|v| v.rule == "mlx.no-signature" && v.line == Some(1)), "{v:?}");
    // a whole Metal file may have one
    assert!(check(&kb, src, SourceLang::Metal, m3, &CheckOptions::default()).is_empty());
    // CUDA bodies for mx.fast.cuda_kernel too
    let v = check_source(
        &kb,
        "__global__ void f(float* o) { if (threadIdx.x < 4) o[0] = 0; }",
        Lang::MlxCuda,
        kb.profile("h100").unwrap(),
        &[],
        None,
    );
    assert!(v.iter().any(|v| v.rule == "mlx.no-signature"));
}

#[test]
fn mlx_body_without_bounds_check_is_warned() {
    let kb = kb();
    let m3 = kb.profile("m3-max").unwrap();
    let v = check_source(
        &kb,
        "uint i = thread_position_in_grid.x;\nout[i] = inp[i];\n",
        Lang::MlxMetal,
        m3,
        &[],
        None,
    );
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].rule, "mlx.bounds-check");
    assert_eq!(v[0].severity, Severity::Warning);
    assert!(!rejected(&v));
    for guarded in [
        "uint i = thread_position_in_grid.x;\nif (i >= n) return;\nout[i] = inp[i];\n",
        "for (uint i = thread_position_in_grid.x; i < n; i += 1024) out[i] = inp[i];\n",
        "uint i = min(thread_position_in_grid.x, n - 1);\nout[i] = inp[i];\n",
    ] {
        assert!(
            check_source(&kb, guarded, Lang::MlxMetal, m3, &[], None).is_empty(),
            "{guarded}"
        );
    }
}

#[test]
fn metal_double_is_rejected() {
    let kb = kb();
    let v = check_source(&kb, "double x = 1.0;", Lang::MlxMetal, kb.profile("m2").unwrap(), &[], None);
    assert!(v.iter().any(|v| v.rule == "metal.no-double"));
}

// ---------- Metal syntax check ----------

#[test]
fn metal_examples_compile_with_the_shim() {
    if !have_cxx() {
        return;
    }
    let ok = std::fs::read_to_string(kb_dir().join("examples/softmax_rows.metal")).unwrap();
    metal_syntax_check(&ok, None).unwrap();
    let tg = std::fs::read_to_string(kb_dir().join("examples/reject/threadgroup-40k.metal")).unwrap();
    metal_syntax_check(&tg, None).unwrap(); // valid syntax, rejected by the rules only
}

#[test]
fn metal_syntax_errors_are_reported_with_lines() {
    if !have_cxx() {
        return;
    }
    let bad = "#include <metal_stdlib>\nusing namespace metal;\n[[kernel]] void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n  o[i] = undefined_thing + 1.0f;\n}\n";
    let e = metal_syntax_check(bad, None).unwrap_err();
    assert!(e.contains("source.metal:4") && e.contains("undefined_thing"), "{e}");
    // CUDA spellings do not type-check either
    let cuda = "#include <metal_stdlib>\nusing namespace metal;\n[[kernel]] void k(device float* o [[buffer(0)]]) {\n  __syncthreads();\n}\n";
    assert!(metal_syntax_check(cuda, None).is_err());
    // simdgroup_load type mismatch (half data into a float matrix)
    let mm = "#include <metal_stdlib>\nusing namespace metal;\n[[kernel]] void k(device const half* h [[buffer(0)]]) {\n  simdgroup_float8x8 a;\n  simdgroup_load(a, h, 8);\n}\n";
    assert!(metal_syntax_check(mm, None).is_err());
}

#[test]
fn mlx_bodies_are_wrapped_with_their_signature() {
    if !have_cxx() {
        return;
    }
    let sig = BodySig {
        inputs: vec![("inp".into(), "f32".into()), ("w".into(), "f16".into())],
        outputs: vec![("out".into(), "f32".into())],
        template_params: vec![("BLOCK".into(), 256)],
        ..Default::default()
    };
    let body = "threadgroup float part[BLOCK / 32];\nuint i = thread_position_in_grid.x;\nif (i >= inp_shape[0]) return;\nfloat v = inp[i] * float(w[i]);\nv = simd_sum(v);\nif (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = v;\nthreadgroup_barrier(mem_flags::mem_threadgroup);\nout[i] = part[0] + 1.0h;\n";
    metal_syntax_check(body, Some(&sig)).unwrap();
    let e = metal_syntax_check("uint i = thread_position_in_grid.x;\nout[i] = missing[i];\n", Some(&sig)).unwrap_err();
    assert!(e.contains("body.metal:2"), "{e}");
    let ex = std::fs::read_to_string(kb_dir().join("examples/scale_body.metal")).unwrap();
    let sig = BodySig::from_comments(&ex).unwrap();
    assert_eq!(sig.inputs, vec![("inp".to_string(), "f32".to_string())]);
    metal_syntax_check(&ex, Some(&sig)).unwrap();
}

// ---------- patterns ----------

#[test]
fn required_patterns_exist_with_sane_priors() {
    let kb = kb();
    for n in [
        "flash-attention-2",
        "chunked-scan",
        "register-reduction",
        "vectorised-loads",
        "fused-epilogue",
        "split-kv",
        "fused-moe-routing",
        "online-softmax",
        "exp2-softmax",
        "tiling",
        "multithreading",
        "unroll",
        "tensor-cores",
    ] {
        let p = kb.pattern(n).unwrap_or_else(|| panic!("pattern {n} missing"));
        assert!((0.0..=1.0).contains(&p.prior) && (1..=5).contains(&p.difficulty), "{n}");
        assert!(
            !p.when.is_empty() && !p.cuda.is_empty() && !p.metal.is_empty() && !p.body.is_empty(),
            "{n}"
        );
        // A pattern no shipped kernel expresses yet says so with an empty list.
        assert!(
            !p.kernel_refs.is_empty() || n == "fused-moe-routing",
            "{n} has no kernel reference"
        );
    }
    assert_eq!(kb.pattern("simd-shuffle").unwrap().name, "register-reduction");
    assert_eq!(kb.pattern("occupancy").unwrap().name, "multithreading");
    assert_eq!(kb.pattern("tensor-cores").unwrap().hw_fit_for("apple"), 5.0);
}

#[test]
fn every_file_the_knowledge_base_names_exists() {
    let kb = kb();
    let root = kb.repo_root();
    assert!(root.join("tasks").is_dir(), "no tasks folder beside {}", root.display());
    let mut problems: Vec<String> = kb
        .missing_kernel_refs()
        .into_iter()
        .map(|(p, r)| format!("pattern {p}: kernel_refs names {r}, which does not exist"))
        .collect();
    for p in &kb.patterns {
        for r in &p.kernel_refs {
            if !r.starts_with("tasks/") {
                problems.push(format!("pattern {}: {r} is not a task kernel path", p.name));
            }
        }
    }
    // Any repository path written anywhere in kb/ (patterns, maps, rules, profiles, README).
    let re =
        regex::Regex::new(r"\b((?:tasks|kb|crates|docs|python|scripts|bench|prompts|examples)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")
            .unwrap();
    let mut checked = 0;
    let mut stack = vec![kb_dir()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let path = e.path();
            if path.is_dir() {
                // The Metal shim is a copy of Apple's headers, not the knowledge base's text.
                if !path.ends_with("metal-shim") {
                    stack.push(path);
                }
                continue;
            }
            if !matches!(path.extension().and_then(|x| x.to_str()), Some("md" | "toml" | "j2")) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for c in re.captures_iter(&text) {
                let r = &c[1];
                // Only names of files (with an extension), as written from the repository root
                // or from kb/.
                if !r.rsplit('/').next().unwrap_or("").contains('.') {
                    continue;
                }
                checked += 1;
                if !root.join(r).exists() && !kb_dir().join(r).exists() {
                    problems.push(format!("{} names {r}, which does not exist", path.display()));
                }
            }
        }
    }
    assert!(
        checked >= 20,
        "only {checked} file names found: is the scan looking in the right place?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn task_pattern_tags_resolve() {
    let kb = kb();
    let tasks = kb.repo_root().join("tasks");
    let rd = std::fs::read_dir(&tasks).unwrap_or_else(|e| panic!("{}: {e}", tasks.display()));
    // Kernels and tunables are tagged inline (`{ name = "VEC", …, pattern = "vectorised-loads" }`)
    // or on a line of their own.
    let re = regex::Regex::new(r#"\bpattern\s*=\s*"([^"]+)""#).unwrap();
    let (mut files, mut tags, mut unknown) = (0, 0, Vec::new());
    for e in rd.filter_map(|e| e.ok()) {
        let Ok(text) = std::fs::read_to_string(e.path().join("task.toml")) else {
            continue;
        };
        files += 1;
        for c in re.captures_iter(&text) {
            tags += 1;
            if kb.pattern(&c[1]).is_none() {
                unknown.push(format!(
                    "{} tags pattern `{}`, which kb/patterns lacks",
                    e.path().display(),
                    &c[1]
                ));
            }
        }
    }
    assert!(files >= 5, "only {files} task files read from {}", tasks.display());
    assert!(tags >= 50, "only {tags} pattern tags found: is the pattern still matched?");
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
}

/// A tag the knowledge base lacks is caught (the check above can fail).
#[test]
fn an_unknown_pattern_tag_does_not_resolve() {
    let kb = kb();
    assert!(kb.pattern("no-such-pattern").is_none());
    assert!(kb.pattern("occupancy").is_some(), "an alias resolves");
}

// ---------- CUDA <-> Metal type domains ----------

#[test]
fn every_mapping_states_its_type_domain_and_floats_never_map_to_integer_intrinsics() {
    let kb = kb();
    for p in &kb.primitives {
        assert!(!p.types.trim().is_empty(), "{} states no type domain", p.id);
        for s in p.cuda_types.keys() {
            assert!(p.cuda.contains(s), "{}: {s} is no spelling of it", p.id);
        }
        if p.takes_float() {
            let d = p.cuda_domain(&p.cuda[0]);
            assert!(
                d.contains("float") || d.contains("half"),
                "{}: a float mapping answers {} ({d})",
                p.id,
                p.cuda[0]
            );
        }
    }
    for (metal, int_only) in [("simd_sum", "__reduce_add_sync"), ("simd_max", "__reduce_max_sync")] {
        let hits = kb.map(metal, Dialect::Cuda);
        let p = hits.first().unwrap_or_else(|| panic!("{metal} has no mapping"));
        assert_ne!(p.cuda[0], int_only, "{metal} answers an integer-only intrinsic");
        assert!(p.takes_float(), "{metal} reduces floats");
        assert!(p.cuda_domain(int_only).contains("integers"), "{}", p.cuda_domain(int_only));
    }
    // The loader refuses a float mapping whose first CUDA spelling takes integers only.
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("kb");
    for sub in ["", "profiles", "patterns", "templates"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
        for e in std::fs::read_dir(kb_dir().join(sub)).unwrap().filter_map(|e| e.ok()) {
            if e.path().is_file() {
                std::fs::copy(e.path(), d.join(sub).join(e.file_name())).unwrap();
            }
        }
    }
    Kb::load(&d).expect("the copy loads");
    let prim = d.join("primitives.toml");
    let text = std::fs::read_to_string(&prim).unwrap();
    let broken = text.replace(
        r#"cuda = ["warp_reduce_sum", "cub::WarpReduce", "__reduce_add_sync"]"#,
        r#"cuda = ["__reduce_add_sync", "cub::WarpReduce", "warp_reduce_sum"]"#,
    );
    assert_ne!(broken, text, "the warp-sum entry changed");
    std::fs::write(&prim, broken).unwrap();
    let e = match Kb::load(&d) {
        Ok(_) => panic!("a float mapping to an integer intrinsic must not load"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("warp-sum") && e.contains("__reduce_add_sync"), "{e}");
}

// ---------- roofline ----------

#[test]
fn roofline_floor() {
    let kb = kb();
    let h100 = kb.profile("h100").unwrap();
    // 3.35 GB at 3350 GB/s = 1 ms
    assert!((floor_us(h100, 3.35e9, 0.0, "f32", 0.0, None) - 1000.0).abs() < 1e-6);
    // compute-bound: 66.9 TFLOP of f32 = 1 s
    assert!((floor_us(h100, 0.0, 66.9e12, "f32", 0.0, None) - 1e6).abs() < 1e-3);
    // tensor-core dtype is faster
    assert!(floor_us(h100, 0.0, 1e12, "f16_tensor", 0.0, None) < floor_us(h100, 0.0, 1e12, "f32", 0.0, None));
    // transcendental floor
    let t = floor_us(h100, 0.0, 0.0, "f32", h100.exp_per_s.unwrap(), None);
    assert!((t - 1e6).abs() < 1e-3);
    // measured bandwidth replaces the datasheet one
    assert!((floor_us(h100, 1e9, 0.0, "f32", 0.0, Some(1000.0)) - 1000.0).abs() < 1e-6);
    // M3 Max: 400 GB/s
    let m3 = kb.profile("m3-max").unwrap();
    assert!((floor_us(m3, 4e8, 0.0, "f32", 0.0, None) - 1000.0).abs() < 1e-6);
    // unknown dtype: the highest peak (lowest floor)
    assert!(floor_us(h100, 0.0, 1e12, "int4", 0.0, None) <= floor_us(h100, 0.0, 1e12, "fp8_tensor", 0.0, None));
}

#[test]
fn load_errors_carry_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.path().is_file() {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    };
    let k = dir.path().join("kb");
    copy(&kb_dir(), &k);
    for d in ["profiles", "patterns", "templates"] {
        copy(&kb_dir().join(d), &k.join(d));
    }
    Kb::load(&k).unwrap();
    let rules = std::fs::read_to_string(k.join("rules.toml")).unwrap();
    std::fs::write(
        k.join("rules.toml"),
        rules.replacen("kind = \"tokens\"\nseverity", "kind = \"tokenz\"\nseverity", 1),
    )
    .unwrap();
    let e = Kb::load(&k).unwrap_err().to_string();
    assert!(e.contains("rules.toml:") && e.contains("unknown kind `tokenz`"), "{e}");
    std::fs::write(k.join("rules.toml"), "[[rule]]\nid = 3\n").unwrap();
    let e = Kb::load(&k).unwrap_err().to_string();
    assert!(e.contains("rules.toml:2:"), "{e}");
    // A back-end or language name the code does not know is one line naming the file and line.
    std::fs::write(k.join("rules.toml"), &rules).unwrap();
    Kb::load(&k).unwrap();
    std::fs::write(
        k.join("rules.toml"),
        rules.replacen("langs = [\"metal\", \"mlx-metal\"]", "langs = [\"metal\", \"hip\"]", 1),
    )
    .unwrap();
    let e = Kb::load(&k).unwrap_err().to_string();
    assert!(
        e.contains("rules.toml:") && e.contains("unknown language `hip`") && e.contains("mlx-cuda") && !e.contains('\n'),
        "{e}"
    );
    std::fs::write(k.join("rules.toml"), &rules).unwrap();
    let h200 = std::fs::read_to_string(k.join("profiles/h200.toml")).unwrap();
    let line = h200.lines().position(|l| l.starts_with("backends = ")).unwrap() + 1;
    std::fs::write(
        k.join("profiles/h200.toml"),
        h200.replacen("backends = [\"cuda\", \"mlx-cuda\"]", "backends = [\"cuda\", \"rocm\"]", 1),
    )
    .unwrap();
    let e = Kb::load(&k).unwrap_err().to_string();
    assert!(
        e.contains(&format!("h200.toml:{line}:")) && e.contains("`rocm`") && e.contains("mlx-metal") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn profiles_name_the_back_ends_they_serve() {
    let kb = kb();
    assert_eq!(kb.profile("h200").unwrap().backends, [Backend::Cuda, Backend::MlxCuda]);
    assert_eq!(kb.profile("cpu").unwrap().backends, [Backend::Cpu]);
    for p in &kb.profiles {
        for b in &p.backends {
            // Every profile a back-end lists is one detection can choose for it.
            let vendor = match b.vendor() {
                Vendor::Host => "generic",
                Vendor::Nvidia => "nvidia",
                Vendor::Apple => "apple",
            };
            assert_eq!(p.vendor, vendor, "{}: serves {b}", p.name);
        }
    }
}

#[test]
fn nothing_translates_to_cpp() {
    let kb = kb();
    assert!(!kb.map("__syncthreads", Dialect::Metal).is_empty());
    assert!(kb.map("__syncthreads", Dialect::Cpp).is_empty());
    assert!(kb.map("warp-sum", Dialect::Cpp).is_empty());
    let p = &kb.map("__syncthreads", Dialect::Metal)[0];
    assert_eq!(p.spelling(Dialect::Cuda), Some("__syncthreads"));
    assert_eq!(p.spelling(Dialect::Cpp), None);
    assert_eq!(SourceLang::from(Backend::MlxCuda), SourceLang::MlxCuda);
    assert_eq!(SourceLang::MlxCuda.dialect(), Dialect::Cuda);
    assert_eq!(SourceLang::Cpp.dialect(), Dialect::Cpp);
}
