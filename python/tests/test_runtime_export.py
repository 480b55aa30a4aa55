"""runtime.py is pasted verbatim into exported modules: it must stand alone."""

import ast
import os
import sys

import ksearch_mlx.runtime as runtime

SOURCE = open(runtime.__file__).read()


def test_imports_only_the_standard_library_and_mlx_core():
    # ksearch_nvrtc only where its text is not pasted before this one (the worker), itself
    # standard library only.
    allowed = set(sys.stdlib_module_names) | {"mlx", "ksearch_nvrtc"}
    nvrtc = open(os.path.join(os.path.dirname(os.path.dirname(runtime.__file__)), "ksearch_nvrtc.py")).read()
    for node in ast.walk(ast.parse(nvrtc)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert all(n.split(".")[0] in sys.stdlib_module_names for n in names), names
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            assert node.module.split(".")[0] in allowed and node.module != "__future__", node.module
        elif isinstance(node, ast.Import):
            for a in node.names:
                assert a.name.split(".")[0] in allowed, a.name
                if a.name.startswith("mlx"):
                    assert a.name == "mlx.core"


def test_runs_when_pasted_after_other_code():
    text = '"""An exported module."""\nKERNEL_SOURCE = "y[0] = 1;"\n' + SOURCE + "\nRESULT = eval_expr('ceil_div(L, 3)', {'L': 10})\n"
    ns: dict = {"__name__": "exported"}
    exec(compile(text, "exported.py", "exec"), ns)
    assert ns["RESULT"] == 4
    assert ns["split_sections"]("// @kernel a\nx;\n") == ("", {"a": "x;\n"})


def test_nvrtc_helpers_pasted_before_it_are_the_ones_it_uses():
    nvrtc = open(os.path.join(os.path.dirname(os.path.dirname(runtime.__file__)), "ksearch_nvrtc.py")).read()
    ns: dict = {"__name__": "exported"}
    exec(compile(nvrtc + "\n" + SOURCE, "exported.py", "exec"), ns)
    assert ns["nvrtc_build"].__code__.co_filename == "exported.py"
    assert ns["build_cuda_unit"].__globals__ is ns
