import pytest

from ksearch_mlx.runtime import eval_expr, eval_expr_float

ENV = {"L": 4096, "CHUNK": 64, "causal": 1}


@pytest.mark.parametrize(
    "expr, want",
    [
        ("L / CHUNK", 64),
        ("ceil_div(L + 1, CHUNK)", 65),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-L % 3", -1),  # remainder keeps the dividend's sign, as in Rust
        ("-7 / 2", -3),  # truncates toward zero, not floor
        ("min(L, 100) + max(1, CHUNK)", 164),
        ("CHUNK <= 64 && L > 1", 1),
        ("!(CHUNK == 64) || 0", 0),
        ("!CHUNK == 0", 1),  # `!` binds tighter than `==`: (!CHUNK) == 0
        ("1 < 2 == 1", 1),  # `<` binds tighter than `==`
        ("3 > 2 > 1", 0),  # no chaining: (3 > 2) > 1 is 1 > 1
        ("L != 4096", 0),
        ("0.5 * L", 2048),
        ("1e3 * 2", 2000),
        ("ceil_div(7, 7)", 1),
    ],
)
def test_integer_semantics(expr, want):
    assert eval_expr(expr, ENV) == want


def test_float_semantics_for_flops():
    # 4 * D * (L*L - causal*L*(L-1)/2) with real division, as flops are evaluated.
    got = eval_expr_float("L * L - causal * L * (L - 1) / 2", ENV)
    assert got == 4096 * 4096 - 4096 * 4095 / 2
    assert eval_expr_float("5 * L / 2", ENV) == 10240.0
    assert eval_expr_float("7 / 2", {}) == 3.5


@pytest.mark.parametrize(
    "expr, needle",
    [
        ("L / X", "unknown name `X`"),
        ("L / (CHUNK - 64)", "division by zero"),
        ("L % 0", "division by zero"),
        ("L +", "unexpected end"),
        ("foo(1)", "unknown function `foo`"),
        ("min(1)", "takes 2 arguments"),
        ("", "empty expression"),
        ("1 2", "trailing input"),
        ("(1 + 2", "missing `)`"),
        ("L $ 2", "unexpected character `$`"),
        ("__import__('os')", "unexpected character"),
    ],
)
def test_errors_name_the_problem(expr, needle):
    with pytest.raises(ValueError) as e:
        eval_expr(expr, ENV)
    assert needle in str(e.value)
    assert expr in str(e.value) or expr == ""
