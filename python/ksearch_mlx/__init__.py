"""ksearch's MLX worker: candidates as MLX custom kernels (CUDA on Linux, Metal on macOS).

See docs/mlx.md in the ksearch repository. `runtime` runs a candidate's launches (and is
pasted verbatim into exported modules), `reference` and `baselines` hold the per-task MLX
reference and native implementations, `data` the inputs, checks and timing summaries, and
`worker` the JSON-lines protocol loop (`python -m ksearch_mlx.worker`).
"""

__version__ = "0.1.0"
