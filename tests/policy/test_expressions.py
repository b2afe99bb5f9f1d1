"""The expression grammar: precedence, associativity, literals and source positions.

``to_text`` parenthesises every binary operation, so parsing and printing shows the tree shape.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_radix import PolicyError, compile_text
from tiered_radix.policy.errors import Span
from tiered_radix.policy.expr import BinOp, Call, Expr, Name, Num, UnaryOp, to_text
from tiered_radix.policy.transformer import parse


def expr(text: str, line: int = 1, col: int = 1) -> Expr:
    e = parse(text, "expr", Span("f.yaml", line, col, text))
    return Num(e) if isinstance(e, int | float) else e


@pytest.mark.parametrize(
    ("source", "tree"),
    [
        ("a + b * c", "(a + (b * c))"),
        ("a * b + c", "((a * b) + c)"),
        ("a - b - c", "((a - b) - c)"),  # left associative
        ("a / b / c", "((a / b) / c)"),
        ("a / b * c", "((a / b) * c)"),
        ("a - b + c", "((a - b) + c)"),
        ("a ^ b ^ c", "(a ^ (b ^ c))"),  # right associative
        ("a * b ^ c", "(a * (b ^ c))"),
        ("-a ^ 2", "(-(a ^ 2))"),  # power binds tighter than negation
        ("a ^ -b", "(a ^ (-b))"),
        ("a * -b", "(a * (-b))"),
        ("--a", "(-(-a))"),
        ("(a + b) * c", "((a + b) * c)"),
        ("a + b < c * d", "((a + b) < (c * d))"),
        ("a <= b", "(a <= b)"),
        ("a != b", "(a != b)"),
        ("a < b and c > d or e == f", "(((a < b) and (c > d)) or (e == f))"),
        ("a or b and c", "(a or (b and c))"),
        ("a and b and c", "((a and b) and c)"),
        ("a or b or c", "((a or b) or c)"),
        ("not a < b and c", "((not (a < b)) and c)"),  # not binds looser than comparison
        ("not not a", "(not (not a))"),
        ("f(a + b, k=c * d)", "f((a + b), k=(c * d))"),
        ("f()", "f()"),
        ("cumulative(attn, decay=0.99) * 2", "(cumulative(attn, decay=0.99) * 2)"),
        ("quantile(score, 50%)", "quantile(score, 0.5)"),
    ],
)
def test_precedence_and_associativity(source: str, tree: str) -> None:
    assert to_text(expr(source)) == tree


@pytest.mark.parametrize(
    "source",
    [
        "a < b < c",
        "a +",
        "* a",
        "f(a,)",
        "f(k=)",
        "a b",
        "(a",
        "not",
        "a == == b",
        "a and or b",
        "1.2.3",
        "a ^ ^ b",
    ],
)
def test_malformed_expressions_raise(source: str) -> None:
    with pytest.raises(PolicyError, match="syntax error"):
        expr(source)


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("50%", 0.5),
        ("100%", 1.0),
        ("2.5%", 0.025),
        ("0%", 0.0),
        ("7", 7),
        ("0.99", 0.99),
        ("3.0", 3.0),
    ],
)
def test_number_and_percent_literals(source: str, value: float) -> None:
    e = expr(source)
    assert isinstance(e, Num) and e.value == pytest.approx(value, abs=0, rel=1e-15)


def test_percent_inside_expressions() -> None:
    e = expr("score * 10% + 1")
    assert e == BinOp("+", BinOp("*", Name("score"), Num(0.1)), Num(1))


def test_call_arguments() -> None:
    e = expr("clip(x, 0, 1)")
    assert e == Call("clip", (Name("x"), Num(0), Num(1)))
    e = expr("pool_max(obs_attn, size=7)")
    assert e == Call("pool_max", (Name("obs_attn"),), (("size", Num(7)),))
    assert e.kwarg("size") == Num(7) and e.kwarg("missing") is None


def _cols(e: Expr) -> dict[str, int]:
    """The column of every name and call in ``e``."""
    out = {}
    for node in e.walk():
        if isinstance(node, Name):
            out[node.id] = node.span.col
        elif isinstance(node, Call):
            out[node.fn + "("] = node.span.col
    return out


def test_spans_point_at_columns() -> None:
    # columns:      1234567890123456789012345678901
    e = expr("alpha + max(beta, gamma) * delta")
    assert _cols(e) == {"alpha": 1, "max(": 9, "beta": 13, "gamma": 19, "delta": 28}
    assert e.span.col == 1  # a binary operation starts where its left operand starts
    assert e.right.span.col == 9


def test_spans_are_offset_by_the_value_position() -> None:
    e = expr("a * bee", line=7, col=12)
    assert (e.right.span.line, e.right.span.col) == (7, 16)  # 12 + len('a * ')
    assert e.right.span.file == "f.yaml"


def test_spans_in_a_compiled_file() -> None:
    text = (
        "budget: 10%\n"
        "units: token\n"
        "scores:\n"
        "  s: cumulative(attn, decay=0.99) + 2 * key_norm\n"
        '  t: "s + recency"\n'  # a quoted value: columns shift past the quote
        "tiers: {full: keep(bf16), evicted: evict}\n"
        "allocate: {method: rank, by: t}\n"
    )
    policy = compile_text(text, "spans.yaml")
    lines = text.splitlines()
    for name in ("s", "t"):
        for node in policy.score(name).walk():
            if isinstance(node, Name | Call):
                word = node.id if isinstance(node, Name) else node.fn
                line = lines[node.span.line - 1]
                assert line[node.span.col - 1 :].startswith(word), (word, node.span)
    assert policy.score("t").right.span.col == line_col(lines, "recency")


def line_col(lines: list[str], word: str) -> int:
    return next(line.index(word) + 1 for line in lines if word in line)


def test_unary_operators_keep_spans() -> None:
    e = expr("x + -y")
    assert isinstance(e.right, UnaryOp) and e.right.span.col == 5
    e = expr("a or not b")
    assert isinstance(e.right, UnaryOp) and e.right.span.col == 6


# ---- round trip: printing then parsing gives back the same tree ------------------------------

NAMES = st.sampled_from(["attn", "score", "x", "head_dim"])
NUMS = st.integers(0, 1000).map(Num) | st.integers(0, 400).map(lambda i: Num(i / 4))


def _arith(children):
    binop = st.tuples(st.sampled_from("+-*/^"), children, children).map(lambda t: BinOp(*t))
    call = st.tuples(st.sampled_from(["sqrt", "max", "f"]), st.lists(children, max_size=3))
    return (
        binop
        | children.map(lambda c: UnaryOp("-", c))
        | call.map(lambda t: Call(t[0], tuple(t[1])))
    )


ARITH = st.recursive(NAMES.map(Name) | NUMS, _arith, max_leaves=12)
COMPARE = st.tuples(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), ARITH, ARITH).map(
    lambda t: BinOp(*t)
)
LOGIC = st.recursive(
    COMPARE,
    lambda c: (
        st.tuples(st.sampled_from(["and", "or"]), c, c).map(lambda t: BinOp(*t))
        | c.map(lambda x: UnaryOp("not", x))
    ),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ARITH | LOGIC)
def test_to_text_round_trips(e: Expr) -> None:
    assert expr(to_text(e)) == e


@pytest.mark.parametrize("source", ["(-a) ^ b", "(not a) < b", "-(not a)", "(not a) + 1"])
def test_to_text_keeps_unary_operands_apart(source: str) -> None:
    e = expr(source)
    assert expr(to_text(e)) == e  # once: -(a ^ b), not (a < b), a syntax error, not (a + 1)
