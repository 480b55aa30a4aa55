"""Shared helpers: the package on the path, tasks loaded from the repository's task files."""

import os
import sys

import pytest

# As the worker does before MLX starts: f32 matrix products in f32, not TF32 (CUDA back-end).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def load_task(name: str) -> dict:
    """tasks/<name>/task.toml as a dict (the fields the worker reads have the same shape in
    the JSON that ksearch sends)."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "tasks", name, "task.toml"), "rb") as f:
        return tomllib.load(f)


def tiny_task() -> dict:
    """A two-output task in the shape ksearch serialises, small enough to reason about."""
    return {
        "name": "tiny",
        "reference": "mamba_step",
        "axes": ["batch", "D", "N"],
        "constants": {"eps": 1e-5, "scale": 2.0},
        "inputs": [
            {"name": "u", "shape": ["batch", "D"], "dtype": "f16", "init": {"dist": "normal", "mean": 0.0, "std": 1.0}},
            {"name": "A", "shape": ["D", "N"], "dtype": "f32", "init": {"dist": "uniform", "lo": -2.0, "hi": -1.0}},
        ],
        "outputs": [
            {"name": "y", "shape": ["batch", "D"], "dtype": "f16"},
            {"name": "state", "shape": ["batch", "D", "N"], "dtype": "f32"},
        ],
        "tolerance": {"f32": {"atol": 1e-5, "rtol": 1e-4}, "f16": {"atol": 1e-2, "rtol": 1e-2}},
        "backends": {"mlx-cuda": {"search": [{"batch": 1, "D": 64, "N": 16}], "dtypes": {"u": "bf16"}}},
    }


@pytest.fixture
def worker_cmd():
    return [sys.executable, "-m", "ksearch_mlx.worker"]


def task_candidate(task: dict, backend: str, kernel: str = "seed", defines: dict | None = None) -> dict:
    """A candidate as ksearch builds it from a task's knowledge-base kernel (default tunables)."""
    b = task["backends"][backend]
    spec = b["seed"] if kernel == "seed" else next(k for k in b.get("kernels", []) if k["name"] == kernel)
    with open(os.path.join(REPO, "tasks", task["name"], spec["file"])) as f:
        source = f.read()
    launches = spec.get("launches") or [{"entry": spec["entry"]}]
    launches = [
        {"grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0", **l} for l in launches
    ]
    tunables = {t["name"]: t.get("default", t["values"][0]) for t in spec.get("tunables", [])}
    tunables.update(defines or {})
    return {
        "lang": backend.replace("-", "_"),
        "source": source,
        "launches": launches,
        "scratch": spec.get("scratch", []),
        "defines": tunables,
        # As the task loader passes them on: a whole CUDA translation unit also names its file.
        "options": {**spec.get("options", {}), **({"file": spec["file"]} if spec.get("options", {}).get("form") == "cuda" else {})},
    }
