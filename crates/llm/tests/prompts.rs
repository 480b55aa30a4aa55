//! Prompt rendering (insta snapshots), bounds, template loading, schemas and reply types.

use ksearch_llm::prompts::*;
use ksearch_llm::*;
use serde_json::{Value, json};

fn task() -> TaskSummary {
    TaskSummary {
        name: "softmax".into(),
        description: "Row-wise softmax over the last axis.".into(),
        reference: "y[r, c] = exp(x[r, c] - max_c x[r, :]) / sum_c exp(x[r, c] - max_c x[r, :])".into(),
        interface: "extern \"C\" void softmax(const float* x, float* y, int rows, int cols); x and y are row-major.".into(),
        shapes: vec!["rows=4096 cols=1024".into(), "rows=64 cols=32768".into()],
        dtype: "f32".into(),
        tolerance: "atol 1e-5, rtol 1e-4".into(),
    }
}

fn target() -> TargetInfo {
    TargetInfo {
        name: "cpu".into(),
        lang: "cpp".into(),
        hardware: "x86-64, 2 cores, AVX2, ~20 GB/s DRAM bandwidth".into(),
        context:
            "- Use `#pragma omp simd` or explicit AVX2 intrinsics.\n- Keep one pass over the row where possible (online softmax)."
                .into(),
    }
}

fn node(id: i64, title: &str, status: &str, overall: f64) -> NodeView {
    NodeView {
        id,
        parent: if id == 0 { None } else { Some(0) },
        title: title.into(),
        description: format!("{title}: details."),
        pattern: Some(title.replace(' ', "_")),
        status: status.into(),
        overall,
        confidence: 0.5,
        bandwidth: Impact {
            rating: 7.0,
            note: "fewer passes".into(),
        },
        registers: Impact {
            rating: 8.0,
            note: String::new(),
        },
        hw_fit: Impact {
            rating: 6.0,
            note: "AVX2 width 8".into(),
        },
        difficulty: 2,
        prior: 0.6,
        speedup: None,
        time_us: None,
        failure: None,
    }
}

const SEED: &str = "#include <cmath>\nextern \"C\" void softmax(const float* x, float* y, int rows, int cols) {\n    for (int r = 0; r < rows; ++r) { /* three passes */ }\n}\n";

fn planner_ctx() -> PlannerContext {
    let mut solved = node(1, "online softmax", "solved", 8.0);
    solved.speedup = Some(1.8734);
    solved.time_us = Some(812.3456);
    let mut failed = node(2, "avx2 intrinsics", "failed", 6.0);
    failed.failure = Some("compile_error".into());
    PlannerContext {
        task: task(),
        target: target(),
        round: 3,
        max_rounds: Some(20),
        seed_source: Some(SEED.into()),
        active_path: vec![node(0, "seed", "solved", 5.0), solved.clone()],
        frontier: vec![node(3, "vectorized loads", "open", 7.5), node(4, "row blocking", "open", 6.5)],
        best: Some(BestView {
            node_id: 1,
            title: "online softmax".into(),
            speedup: 1.8734,
            time_us: Some(812.3456),
            source: Some(SEED.into()),
        }),
        last_evaluations: vec![
            EvalView {
                node_id: 1,
                title: "online softmax".into(),
                outcome: "correct".into(),
                speedup: Some(1.8734),
                time_us: Some(812.3456),
                details: "rows=4096 cols=1024: 812 us (seed 1522 us)".into(),
                log: String::new(),
            },
            EvalView {
                node_id: 2,
                title: "avx2 intrinsics".into(),
                outcome: "compile_error".into(),
                log: "k.cpp:7:5: error: '_mm256_exp_ps' was not declared in this scope".into(),
                ..Default::default()
            },
        ],
        notes: vec!["exp dominates once the row is in cache".into()],
    }
}

fn coder_ctx() -> CoderContext {
    CoderContext {
        task: task(),
        target: target(),
        action: node(3, "vectorized loads", "open", 7.5),
        parent_title: "online softmax".into(),
        parent_source: SEED.into(),
        attempt: 2,
        failed_source: Some("extern \"C\" void softmax(...) { _mm256_exp_ps(v); }".into()),
        last_failure: Some("k.cpp:3:40: error: '_mm256_exp_ps' was not declared in this scope".into()),
    }
}

fn show(msgs: &[Message]) -> String {
    msgs.iter()
        .map(|m| format!("##### {}\n{}\n", m.role.as_str(), m.content))
        .collect()
}

#[test]
fn snapshot_planner_init() {
    let ctx = PlannerContext {
        active_path: vec![],
        frontier: vec![],
        best: None,
        last_evaluations: vec![],
        round: 0,
        ..planner_ctx()
    };
    let msgs = Prompts::embedded().planner_init(&ctx).unwrap();
    assert_eq!(msgs.len(), 2);
    assert_eq!(msgs[0].role, Role::System);
    insta::assert_snapshot!("planner_init", show(&msgs));
}

#[test]
fn snapshot_planner_update() {
    let msgs = Prompts::embedded().planner_update(&planner_ctx()).unwrap();
    insta::assert_snapshot!("planner_update", show(&msgs));
}

#[test]
fn snapshot_coder() {
    let msgs = Prompts::embedded().coder(&coder_ctx()).unwrap();
    insta::assert_snapshot!("coder", show(&msgs));
}

#[test]
fn snapshot_coder_first_attempt() {
    let ctx = CoderContext {
        attempt: 1,
        failed_source: None,
        last_failure: None,
        ..coder_ctx()
    };
    let msgs = Prompts::embedded().coder(&ctx).unwrap();
    assert!(!msgs[1].content.contains("previous attempt"));
    insta::assert_snapshot!("coder_first_attempt", show(&msgs));
}

#[test]
fn snapshot_repair() {
    let p = Prompts::embedded();
    let code = p
        .repair(
            &ParseError::WrongLanguage {
                expected: "cuda".into(),
                found: "python".into(),
            },
            Some("cuda"),
        )
        .unwrap();
    let json = p
        .repair(
            &ParseError::TruncatedJson {
                tail: "\"overall\": 7".into(),
            },
            None,
        )
        .unwrap();
    insta::assert_snapshot!("repair", format!("{code}\n-----\n{json}"));
}

#[test]
fn sizes_are_bounded() {
    let huge_src = "x".repeat(100_000);
    let huge_log = "error line\n".repeat(10_000);
    let mut ctx = planner_ctx();
    ctx.frontier = (10..60).map(|i| node(i, &format!("action {i}"), "open", 5.0)).collect();
    ctx.active_path = (0..30).map(|i| node(i, &format!("step {i}"), "solved", 5.0)).collect();
    ctx.last_evaluations = (0..20)
        .map(|i| EvalView {
            node_id: i,
            title: format!("eval {i}"),
            log: huge_log.clone(),
            ..Default::default()
        })
        .collect();
    ctx.best.as_mut().unwrap().source = Some(huge_src.clone());
    ctx.target.context = "rule\n".repeat(50_000);
    let p = Prompts::embedded();
    let text = show(&p.planner_update(&ctx).unwrap());
    let l = Limits::default();
    assert!(text.len() < 60_000, "rendered {} chars", text.len());
    assert!(text.contains("characters omitted"));
    assert!(text.contains(&format!("({} more open nodes not shown)", 50 - l.max_frontier)));
    assert!(text.contains(&format!("({} nodes nearer the root not shown)", 30 - l.max_path)));
    assert!(text.contains(&format!("({} older evaluations not shown)", 20 - l.max_evals)));
    assert!(
        text.contains("eval 19") && !text.contains("### Node 0: eval 0"),
        "the most recent evaluations are kept"
    );
    assert!(
        text.contains("[29] step 29") && !text.contains("[0] step 0"),
        "the nodes nearest the leaf are kept"
    );

    let mut c = coder_ctx();
    c.parent_source = huge_src;
    c.last_failure = Some(huge_log);
    let text = show(&p.coder(&c).unwrap());
    assert!(text.len() < 40_000, "rendered {} chars", text.len());

    let tight = Prompts::load(None).unwrap().with_limits(Limits {
        max_source_chars: 100,
        ..Limits::default()
    });
    let t = show(&tight.coder(&c).unwrap());
    assert!(t.len() < show(&p.coder(&c).unwrap()).len());
}

#[test]
fn truncate_middle_keeps_head_and_tail() {
    let s: String = (0..1000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    let t = truncate_middle(&s, 90);
    assert!(t.starts_with(&s[..60]) && t.ends_with(&s[970..]));
    assert!(t.contains("[... 910 characters omitted ...]"));
    assert_eq!(truncate_middle("short", 90), "short");
}

#[test]
fn templates_load_from_a_dir_with_embedded_fallback() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(CODER),
        "System {{ target.lang }}\n=== USER ===\n{% if action.title %}\nDo {{ action.title }}.\n{% endif %}\n",
    )
    .unwrap();
    let p = Prompts::load(Some(dir.path())).unwrap();
    assert!(matches!(p.origin(CODER), Some(Origin::File(_))));
    assert_eq!(p.origin(PLANNER_INIT), Some(&Origin::Embedded));
    let m = p.coder(&coder_ctx()).unwrap();
    assert_eq!(m, vec![Message::system("System cpp"), Message::user("Do vectorized loads.")]);
    // The repo's prompts/ dir is what is embedded.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let repo = Prompts::discover(&root).unwrap();
    assert!(matches!(repo.origin(PLANNER_UPDATE), Some(Origin::File(_))));
    assert_eq!(
        repo.planner_update(&planner_ctx()).unwrap(),
        Prompts::embedded().planner_update(&planner_ctx()).unwrap()
    );
    // A broken template is a clear error.
    std::fs::write(dir.path().join(REPAIR), "{% if %}").unwrap();
    let e = Prompts::load(Some(dir.path())).unwrap_err();
    assert!(e.to_string().contains(REPAIR), "{e}");
}

#[test]
fn requests_carry_the_schemas() {
    let p = Prompts::embedded();
    let r = p.planner_init_request(&planner_ctx()).unwrap();
    assert_eq!(r.json_schema.as_ref().unwrap().0, "planner_init");
    let r = p.planner_update_request(&planner_ctx()).unwrap();
    assert_eq!(r.json_schema.as_ref().unwrap().1, *PLANNER_UPDATE_SCHEMA);
    let c = p.coder_request(&coder_ctx()).unwrap();
    assert!(c.json_schema.is_none());
    let fixed = p
        .repair_request(&c, "no code here", &ParseError::NoCodeBlock, Some("cpp"))
        .unwrap();
    assert_eq!(fixed.messages.len(), c.messages.len() + 2);
    assert_eq!(fixed.messages[fixed.messages.len() - 2], Message::assistant("no code here"));
    assert!(fixed.messages.last().unwrap().content.contains("in cpp"));
}

/// Strict structured output: every object lists all its properties as required and forbids others.
fn assert_strict(v: &Value, path: &str) {
    match v {
        Value::Object(o) => {
            if let Some(Value::Object(props)) = o.get("properties") {
                let req: Vec<&str> = o["required"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap())
                    .collect();
                for k in props.keys() {
                    assert!(req.contains(&k.as_str()), "{path}: `{k}` not required");
                }
                assert_eq!(o["additionalProperties"], json!(false), "{path}");
            }
            for (k, x) in o {
                assert_strict(x, &format!("{path}/{k}"));
            }
        }
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| assert_strict(x, &format!("{path}/{i}"))),
        _ => {}
    }
}

#[test]
fn schemas_are_strict_mode_compatible() {
    assert_strict(&PLANNER_INIT_SCHEMA, "init");
    assert_strict(&PLANNER_UPDATE_SCHEMA, "update");
}

/// The JSON example shown in a rendered template.
fn example_json(template_text: &str) -> Value {
    extract_json(template_text.split("## Reply format").nth(1).unwrap()).unwrap()
}

#[test]
fn the_template_examples_parse_into_the_reply_types() {
    let p = Prompts::embedded();
    let init = example_json(&p.planner_init(&planner_ctx()).unwrap()[1].content);
    let parsed = PlannerInit::from_value(&init).unwrap();
    assert_eq!(parsed.actions[0].title, "vectorized loads");
    assert_eq!(
        parsed.actions[0].bandwidth,
        Impact {
            rating: 8.0,
            note: "...".into()
        }
    );
    let upd = example_json(&p.planner_update(&planner_ctx()).unwrap()[1].content);
    let parsed = PlannerUpdate::from_value(&upd).unwrap();
    assert!(parsed.rejected.is_empty(), "{:?}", parsed.rejected);
    assert_eq!(parsed.ops.len(), 3);
    assert!(
        matches!(&parsed.ops[0], TreeOp::Update { node: 4, changes } if changes.overall == Some(8.5) && changes.registers.is_none())
    );
    assert!(matches!(&parsed.ops[1], TreeOp::Insert { parent: 4, .. }));
    assert!(matches!(&parsed.ops[2], TreeOp::Prune { node: 7, .. }));
}

#[test]
fn planner_init_is_parsed_tolerantly_and_clamped() {
    let reply = r#"Here is my analysis.
```json
{
  "classification": "memory-bound row reduction",
  "reference_rewrite": "one thread per row",
  "bottlenecks": "three passes over each row",
  "families": ["online softmax", "blocked rows"],
  "actions": [
    {"title": "online softmax", "description": "single pass", "pattern": "online_softmax", "overall": "8.5", "confidence": 1.7,
     "impacts": {"memory_bandwidth": {"rating": 9, "note": "one pass"}, "register_pressure": 6, "hardware_fit": {"rating": 12}},
     "difficulty": 9, "prior": -1},
    {"name": "vectorize", "description": "AVX2"},
  ]
}
```"#;
    let p = PlannerInit::parse(reply).unwrap();
    assert_eq!(p.bottlenecks, vec!["three passes over each row"]);
    let a = &p.actions[0];
    assert_eq!((a.overall, a.confidence, a.difficulty, a.prior), (8.5, 1.0, 5, 0.0));
    assert_eq!(
        a.bandwidth,
        Impact {
            rating: 9.0,
            note: "one pass".into()
        }
    );
    assert_eq!(a.registers.rating, 6.0);
    assert_eq!(a.hw_fit.rating, 10.0);
    let b = &p.actions[1];
    assert_eq!(
        (
            b.title.as_str(),
            b.overall,
            b.confidence,
            b.difficulty,
            b.prior,
            b.pattern.clone()
        ),
        ("vectorize", 5.0, 0.3, 2, 0.5, None)
    );
    assert!(matches!(
        PlannerInit::parse("{\"classification\": \"x\"}"),
        Err(ParseError::Schema { .. })
    ));
    assert!(matches!(
        PlannerInit::parse("{\"actions\": []}"),
        Err(ParseError::Schema { .. })
    ));
}

#[test]
fn planner_update_accepts_variants_and_reports_bad_ops() {
    let reply = r##"{"analysis": "online softmax confirmed the bandwidth hypothesis",
      "ops": [
        {"op": "update", "node": "#3", "overall": 9, "bandwidth": {"rating": 9, "note": "80% of peak"}, "reason": "measured"},
        {"op": "split", "node": 4, "actions": [{"title": "block 4 rows"}, {"title": "block 8 rows"}]},
        {"op": "split", "node": 5, "actions": [{"title": "only one"}]},
        {"op": "insert", "parent": 1, "title": "prefetch next row", "description": "software prefetch", "overall": 6},
        {"op": "prune", "node": "n7", "reason": "dominated"},
        {"op": "teleport", "node": 1}
      ]}"##;
    let u = PlannerUpdate::parse(reply).unwrap();
    assert_eq!(u.analysis, "online softmax confirmed the bandwidth hypothesis");
    assert_eq!(u.ops.len(), 4);
    assert!(
        matches!(&u.ops[0], TreeOp::Update { node: 3, changes } if changes.overall == Some(9.0) && changes.bandwidth.as_ref().unwrap().rating == 9.0)
    );
    assert!(matches!(&u.ops[1], TreeOp::Split { node: 4, into } if into.len() == 2));
    assert!(
        matches!(&u.ops[2], TreeOp::Insert { parent: 1, action } if action.title == "prefetch next row" && action.overall == 6.0)
    );
    assert!(matches!(&u.ops[3], TreeOp::Prune { node: 7, reason } if reason == "dominated"));
    assert_eq!(u.ops[3].target(), 7);
    assert_eq!(u.rejected.len(), 2);
    assert!(
        u.rejected[0].contains("at least 2") && u.rejected[1].contains("teleport"),
        "{:?}",
        u.rejected
    );
    // Serialisable for the run's log.
    let back: Vec<TreeOp> = serde_json::from_str(&serde_json::to_string(&u.ops).unwrap()).unwrap();
    assert_eq!(back, u.ops);
    assert!(matches!(
        PlannerUpdate::parse("{\"ops\": [{\"op\": \"nope\"}]}"),
        Err(ParseError::Schema { .. })
    ));
    assert!(matches!(
        PlannerUpdate::parse("{\"analysis\": \"x\", \"ops\": [{\"op\": \"prune\", \"node\": 2, "),
        Err(ParseError::TruncatedJson { .. })
    ));
}

#[test]
fn split_messages_without_marker_is_one_user_message() {
    assert_eq!(split_messages("  hello \n"), vec![Message::user("hello")]);
    assert_eq!(
        split_messages("sys\n=== USER ===\nu\n"),
        vec![Message::system("sys"), Message::user("u")]
    );
}

#[test]
fn trim_blocks_semantics() {
    assert_eq!(
        trim_blocks("a\n  {% if x %}\nb\n{% endif %}\nc\n"),
        "a\n{% if x %}b\n{% endif %}c\n"
    );
    assert_eq!(trim_blocks("{# note #}\nx {{ y }}\n"), "{# note #}x {{ y }}\n");
}

#[test]
fn a_planner_reply_puts_a_bounded_amount_into_the_tree() {
    // 40 actions, one with an 10 000-character title and a 100 000-character description.
    let mut actions: Vec<Value> = (0..40)
        .map(|i| json!({"title": format!("action {i}"), "description": "d", "overall": 5}))
        .collect();
    actions[0] = json!({"title": "t".repeat(10_000), "description": "x".repeat(100_000)});
    let init = PlannerInit::from_value(&json!({"classification": "memory-bound", "actions": actions})).unwrap();
    assert_eq!(init.actions.len(), 12, "at most 12 actions a reply");
    assert_eq!(init.actions[0].title.chars().count(), 160);
    assert_eq!(init.actions[0].description.chars().count(), 4000);
    assert_eq!(init.actions[11].title, "action 11");

    // 30 ops: the first 24 are taken, the rest named as rejected; a split into 20 keeps 12.
    let mut ops: Vec<Value> = (0..30)
        .map(|i| json!({"op": "insert", "parent": 1, "title": format!("op {i}")}))
        .collect();
    let children: Vec<Value> = (0..20).map(|i| json!({"title": format!("child {i}")})).collect();
    ops[1] = json!({"op": "split", "node": 2, "actions": children});
    let u = PlannerUpdate::from_value(&json!({"analysis": "a", "ops": ops})).unwrap();
    assert_eq!(u.ops.len(), 24, "at most 24 ops a reply");
    assert!(matches!(&u.ops[1], TreeOp::Split { node: 2, into } if into.len() == 12));
    assert!(matches!(&u.ops[23], TreeOp::Insert { action, .. } if action.title == "op 23"));
    assert_eq!(u.rejected.len(), 1, "{:?}", u.rejected);
    assert!(u.rejected[0].contains("24 to 29"), "{:?}", u.rejected);
}
