"""Expression trees: what a score, a condition or a weight in a policy file compiles to.

The tier engine evaluates these over per-unit tensors (``tiered_radix.engine.scores``); every node
keeps the :class:`Span` it came from so the engine can report errors at the file's position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Span


@dataclass(frozen=True)
class Expr:
    span: Span | None = field(default=None, compare=False, repr=False, kw_only=True)

    def children(self) -> tuple[Expr, ...]:
        return ()

    def walk(self):
        """This node and all nodes below it, depth first."""
        yield self
        for child in self.children():
            yield from child.walk()


@dataclass(frozen=True)
class Num(Expr):
    value: float


@dataclass(frozen=True)
class Name(Expr):
    """A signal (``attn``), a named score (``score``) or a constant (``head_dim``)."""

    id: str


@dataclass(frozen=True)
class Call(Expr):
    fn: str
    args: tuple[Expr, ...] = ()
    kwargs: tuple[tuple[str, Expr], ...] = ()

    def children(self) -> tuple[Expr, ...]:
        return self.args + tuple(v for _, v in self.kwargs)

    def kwarg(self, key: str, default: Expr | None = None) -> Expr | None:
        return dict(self.kwargs).get(key, default)


@dataclass(frozen=True)
class BinOp(Expr):
    """Arithmetic (``+ - * / ^``), comparison (``< <= > >= == !=``) or logic (``and or``)."""

    op: str
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class UnaryOp(Expr):
    op: str  # "-" or "not"
    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)


ARITH_OPS = ("+", "-", "*", "/", "^")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("and", "or")


def is_condition(e: Expr) -> bool:
    """True when ``e`` yields a boolean mask (a comparison or a logical combination)."""
    if isinstance(e, BinOp):
        return e.op in COMPARE_OPS or e.op in LOGIC_OPS
    return isinstance(e, UnaryOp) and e.op == "not"


def to_text(e: Expr) -> str:
    """Source-like text of an expression, for ``explain`` and error messages."""
    if isinstance(e, Num):
        return f"{e.value:g}"
    if isinstance(e, Name):
        return e.id
    if isinstance(e, Call):
        parts = [to_text(a) for a in e.args] + [f"{k}={to_text(v)}" for k, v in e.kwargs]
        return f"{e.fn}({', '.join(parts)})"
    if isinstance(e, BinOp):
        return f"({to_text(e.left)} {e.op} {to_text(e.right)})"
    if isinstance(e, UnaryOp):
        return f"({e.op}{' ' if e.op == 'not' else ''}{to_text(e.operand)})"
    raise TypeError(f"not an expression: {e!r}")
