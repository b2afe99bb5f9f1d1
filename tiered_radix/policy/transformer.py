"""The compiler proper: one lark ``Transformer`` from parse trees to frozen dataclasses.

One method per grammar rule (``grammar/policy.lark``). :func:`parse` picks the start rule, turns
lark's syntax errors into :class:`PolicyError` at the file's position, and returns the value.
"""

from __future__ import annotations

from functools import cache

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, VisitError

from ..resources import grammar_path
from .errors import PolicyError, Span, did_you_mean
from .expr import BinOp, Call, Name, Num, UnaryOp
from .model import Budget, Demote, Evict, Granularity, Keep, Promote, Quantize, Schedule, Spread

_MAX_DIGITS = 30
STARTS = ("expr", "budget", "granularity", "action", "schedule", "spread", "bitset")
_BYTE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "DECIMAL": "a number",
    "COMPARE": "a comparison",
    "BYTE_UNIT": "a byte unit (B, KiB, MiB, GiB, ...)",
    "DTYPE": "bf16 or fp16",
    "AXIS": "kivi, token or channel",
    "BOOL": "true or false",
    "$END": "the end of the value",
}


@cache
def _parser() -> Lark:
    return Lark.open(
        str(grammar_path()),
        parser="lalr",
        start=list(STARTS),
        propagate_positions=True,
        maybe_placeholders=True,
    )


def parse(text: str, start: str, span: Span):
    """Parse ``text`` (a YAML value found at ``span``) from grammar rule ``start``."""
    try:
        tree = _parser().parse(text, start=start)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, span) from None
    try:
        return PolicyTransformer(span).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, PolicyError):
            raise e.orig_exc from None
        raise


def _at(base: Span, line: int | None, column: int | None) -> Span:
    if not line or not column:
        return base
    if line == 1:
        return base.shifted(column - 1)
    return Span(base.file, base.line + line - 1, column, base.text)


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[terminal]
    try:
        return f"'{_parser().get_terminal(terminal).pattern.value}'"
    except KeyError:
        return terminal


def _syntax_error(e: UnexpectedInput, text: str, base: Span) -> PolicyError:
    expected = getattr(e, "accepts", None) or getattr(e, "expected", None) or set()
    if isinstance(e, UnexpectedCharacters):
        expected = e.allowed or expected
    words = sorted({_describe(t) for t in expected})
    if isinstance(e, UnexpectedEOF) or getattr(getattr(e, "token", None), "type", "") == "$END":
        where, found = _at(base, 1, len(text) + 1), "the value ends too early"
    else:
        where = _at(base, e.line, e.column)
        found = (
            f"unexpected '{text[e.pos_in_stream]}'"
            if isinstance(e, UnexpectedCharacters)
            else f"unexpected '{e.token}'"
        )
    word = (
        text[e.pos_in_stream :].split("(")[0].split(",")[0].strip()
        if e.pos_in_stream is not None
        else ""
    )
    keywords = [w.strip("'") for w in words if w.startswith("'") and w[1:-1].isidentifier()]
    return PolicyError(
        f"syntax error in '{text}': {found}",
        where,
        expected=" or ".join(words[:12]),
        suggestion=did_you_mean(word, keywords),
    )


class PolicyTransformer(Transformer):
    """Parse tree -> values; ``base`` is where the parsed text sits in the policy file."""

    def __init__(self, base: Span) -> None:
        super().__init__()
        self.base = base

    def _span(self, meta) -> Span:
        return _at(self.base, getattr(meta, "line", None), getattr(meta, "column", None))

    def _error(self, meta, message: str, expected: str = "") -> PolicyError:
        return PolicyError(message, self._span(meta), expected=expected)

    # -- literals ------------------------------------------------------------------------
    def INT(self, token: Token) -> Token:  # lark calls a terminal's method by its name
        if len(token) > _MAX_DIGITS:  # int() refuses more than 4300 digits; nothing needs 31
            raise PolicyError(
                f"number {token[:12]}... is too long",
                _at(self.base, token.line, token.column),
                expected=f"at most {_MAX_DIGITS} digits",
            )
        return token

    DECIMAL = INT

    def number(self, c):
        return float(c[0]) if c[0].type == "DECIMAL" else int(c[0])

    # -- budget --------------------------------------------------------------------------
    @v_args(meta=True)
    def budget_fraction(self, meta, c):
        if not 0 < c[0] <= 100:
            raise self._error(meta, f"budget {c[0]}% is out of range", "a percentage in (0, 100]")
        return Budget("fraction", c[0] / 100)

    def budget_bytes(self, c):
        return Budget("bytes", c[0] * _BYTE_UNITS[str(c[1])])

    def budget_tokens(self, c):
        return Budget("tokens", int(c[0]))

    # -- granularity ---------------------------------------------------------------------
    @v_args(meta=True)
    def window(self, meta, c):
        if int(c[0]) < 1:
            raise self._error(meta, "a window needs at least one token", "window(size=N), N >= 1")
        return Granularity("window", int(c[0]))

    def token(self, _):
        return Granularity("token")

    def channel(self, _):
        return Granularity("channel")

    # -- actions -------------------------------------------------------------------------
    def keep(self, c):
        return Keep(str(c[0]) if c[0] else "bf16")

    @v_args(meta=True)
    def quantize(self, meta, c):
        args = dict(c)
        if len(args) != len(c):
            raise self._error(meta, "an argument of quantize() is given twice")
        if "bits" not in args:
            raise self._error(meta, "quantize() needs bits", "quantize(bits=2|4|8, group=N)")
        if args["bits"] not in (2, 4, 8):
            raise self._error(
                meta,
                f"quantize(bits={args['bits']}) is not supported",
                "bits=2, 4 or 8 (use keep for 16 bits, evict for 0)",
            )
        if args.get("group", 32) < 1:
            raise self._error(meta, "quantize(group=...) must be at least 1")
        if args.get("symmetric"):
            raise self._error(
                meta,
                "symmetric codes are not implemented by the tier engine",
                "symmetric=false (asymmetric codes: a scale and a zero point)",
            )
        return Quantize(**args)

    def q_bits(self, c):
        return ("bits", int(c[0]))

    def q_group(self, c):
        return ("group", int(c[0]))

    def q_axis(self, c):
        return ("axis", str(c[0]))

    def q_symmetric(self, c):
        return ("symmetric", str(c[0]) == "true")

    def evict(self, c):
        return Evict(str(c[0]) if c and c[0] is not None else None)

    def promote(self, _):
        return Promote()

    def demote(self, _):
        return Demote()

    # -- schedule ------------------------------------------------------------------------
    @v_args(meta=True)
    def schedule(self, meta, c):
        fields = dict(c)
        if len(fields) != len(c):
            raise self._error(meta, "a schedule trigger is listed twice")
        prefill = fields.get("after_prefill")
        return Schedule(
            after_prefill=prefill is not None,
            prefill_defers=bool(prefill),
            every=fields.get("every"),
            on_pressure=fields.get("on_pressure"),
        )

    def after_prefill(self, c):
        """``after_prefill`` -> False (route after each prefill chunk);
        ``after_prefill(defer=true)`` -> True (route at the next decode step instead)."""
        return ("after_prefill", c[0] is not None and str(c[0]) == "true")

    @v_args(meta=True)
    def every(self, meta, c):
        if int(c[0]) < 1:
            raise self._error(meta, "every(N) needs N >= 1 decode steps")
        return ("every", int(c[0]))

    @v_args(meta=True)
    def on_pressure(self, meta, c):
        level = 100 if c[0] is None else c[0]
        if not 0 < level <= 100:
            raise self._error(meta, "on_pressure(P%) needs 0 < P <= 100")
        return ("on_pressure", level / 100)

    # -- spread --------------------------------------------------------------------------
    def uniform(self, _):
        return Spread("uniform")

    @v_args(meta=True)
    def pyramid(self, meta, c):
        if c[0] <= 0:
            raise self._error(meta, "pyramid(ratio=...) must be positive")
        return Spread("pyramid", ratio=float(c[0]))

    def proportional(self, c):
        return Spread("proportional", by=Num(c[0]) if isinstance(c[0], int | float) else c[0])

    def bitset(self, c):
        return tuple(int(t) for t in c)

    # -- expressions ---------------------------------------------------------------------
    @v_args(meta=True)
    def name(self, meta, c):
        return Name(str(c[0]), span=self._span(meta))

    @v_args(meta=True)
    def percent(self, meta, c):
        return Num(c[0] / 100, span=self._span(meta))

    @v_args(meta=True)
    def call(self, meta, c):
        fn, args = str(c[0]), c[1] or []
        positional = tuple(a for a in args if not isinstance(a, tuple))
        keywords = tuple(a for a in args if isinstance(a, tuple))
        return Call(fn, positional, keywords, span=self._span(meta))

    def arguments(self, c):
        return list(c)

    def positional(self, c):
        return c[0] if not isinstance(c[0], int | float) else Num(c[0])

    def keyword(self, c):
        value = c[1] if not isinstance(c[1], int | float) else Num(c[1])
        return (str(c[0]), value)

    def _bin(op):  # noqa: N805 - a method factory, evaluated in the class body
        @v_args(meta=True)
        def method(self, meta, c):
            left, right = (Num(x) if isinstance(x, int | float) else x for x in (c[0], c[-1]))
            return BinOp(op if op else str(c[1]), left, right, span=self._span(meta))

        return method

    add, sub, mul, div, pow_ = _bin("+"), _bin("-"), _bin("*"), _bin("/"), _bin("^")
    and_, or_, compare = _bin("and"), _bin("or"), _bin(None)

    @v_args(meta=True)
    def neg(self, meta, c):
        return UnaryOp(
            "-", Num(c[0]) if isinstance(c[0], int | float) else c[0], span=self._span(meta)
        )

    @v_args(meta=True)
    def not_(self, meta, c):
        return UnaryOp(
            "not", Num(c[0]) if isinstance(c[0], int | float) else c[0], span=self._span(meta)
        )

    def __default_token__(self, token: Token):
        return token
