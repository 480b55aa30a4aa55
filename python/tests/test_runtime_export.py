"""runtime.py is pasted verbatim into exported modules: it must stand alone."""

import ast
import os
import sys

import ksearch_mlx.runtime as runtime

SOURCE = open(runtime.__file__).read()


def test_imports_only_the_standard_library_and_mlx_core():
    allowed = set(sys.stdlib_module_names) | {"mlx"}
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
