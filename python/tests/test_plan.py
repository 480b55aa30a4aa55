import re

import pytest
from conftest import tiny_task

from ksearch_mlx.runtime import (
    CompiledCandidate,
    LaunchError,
    SourceError,
    constants_header,
    plan_launches,
    static_launches,
)

SOURCE = """__device__ inline float twice(float x) { return 2.0f * x; }
// @kernel stage
partial[0] = 0.0f;
// @kernel finish
y[0] = partial[0];
"""


def two_launches(**over):
    c = {
        "lang": "mlx_cuda",
        "source": SOURCE,
        "launches": [
            {
                "entry": "stage",
                "grid": ["D * 32", "batch", "1"],
                "block": ["THREADS", "1", "1"],
                "shared": "CHUNK * N * 4",
                "inputs": ["u", "A"],
                "outputs": ["partial"],
            },
            {
                "entry": "finish",
                "grid": ["ceil_div(batch * D, 128) * 128", "1", "1"],
                "block": ["128", "1", "1"],
                "shared": "0",
                "inputs": ["partial", "u"],
            },
        ],
        "scratch": [{"name": "partial", "bytes": "batch * D * N * 4"}],
        "defines": {"THREADS": 256, "CHUNK": 8},
        "options": {},
    }
    c.update(over)
    return c


AXES = {"batch": 2, "D": 64, "N": 16}


def test_plan_evaluates_sizes_templates_and_wiring():
    task = tiny_task()
    plans = plan_launches(two_launches(), task, "mlx-cuda", AXES)
    assert [p.entry for p in plans] == ["stage", "finish"]
    stage, finish = plans
    assert stage.grid == (64 * 32, 2, 1)
    assert stage.threadgroup == (256, 1, 1)
    assert stage.shared == 8 * 16 * 4
    # Axes in task order, then defines sorted.
    assert stage.template == (("batch", 2), ("D", 64), ("N", 16), ("CHUNK", 8), ("THREADS", 256))
    assert stage.inputs == ("u", "A") and stage.outputs == ("partial",)
    assert stage.output_shapes == ((2 * 64 * 16,),) and stage.output_dtypes == ("f32",)
    assert not stage.writes_task_output
    # Outputs default to every task output; u's dtype comes from the back-end override.
    assert finish.inputs == ("partial", "u")
    assert finish.outputs == ("y", "state")
    assert finish.output_shapes == ((2, 64), (2, 64, 16))
    assert finish.output_dtypes == ("f16", "f32")
    assert finish.writes_task_output
    assert finish.grid == (128, 1, 1)
    statics = static_launches(two_launches(), task, "mlx-cuda")
    assert statics[1].input_dtypes == ("f32", "bf16")


def test_header_has_constants_then_file_header():
    task = tiny_task()
    s = static_launches(two_launches(), task, "mlx-cuda")[0]
    assert s.header == (
        "constexpr float KS_EPS = 1e-05f;\n"
        "constexpr float KS_SCALE = 2.0f;\n"
        "__device__ inline float twice(float x) { return 2.0f * x; }\n"
    )
    assert s.body == "partial[0] = 0.0f;\n"
    assert constants_header({"eps": 1e-5}, "mlx-metal") == "constant float KS_EPS = 1e-05f;\n"


def test_kernel_names_are_unique_per_source_and_backend():
    task = tiny_task()
    a = static_launches(two_launches(), task, "mlx-cuda")
    b = static_launches(two_launches(source=SOURCE.replace("0.0f", "1.0f")), task, "mlx-cuda")
    c = static_launches(two_launches(), task, "mlx-metal")
    assert all(re.fullmatch(r"ks_(stage|finish)_[0-9a-f]{10}", s.name) for s in a)
    assert a[0].name == static_launches(two_launches(), task, "mlx-cuda")[0].name
    assert a[0].name != b[0].name and a[1].name == b[1].name
    assert a[0].name != c[0].name


def test_metal_takes_no_dynamic_shared_memory():
    plans = plan_launches(two_launches(), tiny_task(), "mlx-metal", AXES)
    assert plans[0].shared == 0


def test_single_body_file_serves_a_single_launch():
    c = two_launches(source="y[0] = 1;", launches=[{"entry": "k", "grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0"}], scratch=[])
    (s,) = static_launches(c, tiny_task(), "mlx-cuda")
    assert s.header.endswith("KS_SCALE = 2.0f;\n") and s.body == "y[0] = 1;"
    assert s.inputs == ("u", "A") and s.outputs == ("y", "state")


@pytest.mark.parametrize(
    "change, error, needle",
    [
        (lambda c: c["launches"][1].update(entry="other"), SourceError, "no `// @kernel other` section"),
        (lambda c: c.update(source="y[0] = 1;"), SourceError, "2 launches but no `// @kernel NAME` sections"),
        (lambda c: c["launches"][1].update(outputs=["y", "partial"]), LaunchError, "`partial` is written by two launches"),
        (lambda c: c["launches"][1].update(outputs=["y"]), LaunchError, "no launch writes output `state`"),
        (lambda c: c["launches"][0].update(inputs=["u", "partial"]), LaunchError, "reads `partial`"),
        (lambda c: c["launches"][0].update(outputs=["nowhere"]), LaunchError, "no task output and no scratch"),
        (lambda c: c.update(launches=[]), LaunchError, "no launches"),
    ],
)
def test_wiring_errors_are_clear(change, error, needle):
    c = two_launches()
    change(c)
    with pytest.raises(error, match=re.escape(needle)):
        plan_launches(c, tiny_task(), "mlx-cuda", AXES)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda c: c["scratch"][0].update(bytes="7"), "not a whole number of f32"),
        (lambda c: c["scratch"][0].update(bytes="0"), "scratch `partial`: 0 bytes"),
        (lambda c: c["launches"][0].update(block=["2048", "1", "1"]), "2048 threads"),
        (lambda c: c["launches"][0].update(grid=["D - 64", "1", "1"]), "size below 1"),
        (lambda c: c["launches"][0].update(shared="MISSING"), "unknown name `MISSING`"),
        (lambda c: c["defines"].update(D=3), "clashes with an axis"),
    ],
)
def test_size_errors_are_launch_errors(change, needle):
    c = two_launches()
    change(c)
    with pytest.raises(LaunchError, match=re.escape(needle)):
        plan_launches(c, tiny_task(), "mlx-cuda", AXES)


def test_missing_axis_is_a_launch_error():
    with pytest.raises(LaunchError, match="no value for axis `N`"):
        plan_launches(two_launches(), tiny_task(), "mlx-cuda", {"batch": 1, "D": 4})


def test_scratch_dtype_sets_element_count():
    c = two_launches()
    c["scratch"][0]["dtype"] = "f16"
    stage = plan_launches(c, tiny_task(), "mlx-cuda", AXES)[0]
    assert stage.output_dtypes == ("f16",) and stage.output_shapes == ((2 * 64 * 16 * 2,),)


def test_building_kernels_without_a_gpu_back_end_fails_clearly():
    import mlx.core as mx

    if hasattr(mx, "cuda") and mx.cuda.is_available():
        pytest.skip("this machine has MLX's CUDA back-end")
    with pytest.raises(RuntimeError, match="No CUDA back-end"):
        CompiledCandidate(two_launches(), tiny_task(), "mlx-cuda")
