import pytest

from ksearch_mlx.runtime import SourceError, split_sections


def test_file_without_sections_is_one_body():
    src = "uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"
    assert split_sections(src) == ("", {None: src})


def test_header_and_sections():
    src = (
        "__device__ inline float sq(float x) { return x * x; }\n"
        "// @kernel first\n"
        "a[0] = 1;\n"
        "//   @kernel   second_2  \n"
        "b[0] = 2;\n"
        "c[0] = 3;\n"
    )
    header, bodies = split_sections(src)
    assert header == "__device__ inline float sq(float x) { return x * x; }\n"
    assert bodies == {"first": "a[0] = 1;\n", "second_2": "b[0] = 2;\nc[0] = 3;\n"}


def test_malformed_markers_are_plain_text():
    # Same rule as crates/core/src/mlx.rs: a marker needs exactly one name.
    src = "// @kernel\n// @kernel two words\nx[0] = 1;\n"
    assert split_sections(src) == ("", {None: src})


def test_duplicate_sections_are_refused():
    with pytest.raises(SourceError, match="two `// @kernel a` sections"):
        split_sections("// @kernel a\nx;\n// @kernel b\ny;\n// @kernel a\nz;\n")
