"""The one exception a policy file can raise, with the position and context a user can act on."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A place in a policy file: 1-based line and column, and the file's text for context."""

    file: str
    line: int
    col: int
    text: str = ""

    def shifted(self, offset: int) -> Span:
        """The span ``offset`` characters further along the same line (for spots inside a value)."""
        return Span(self.file, self.line, self.col + offset, self.text)


class PolicyError(Exception):
    """A policy file is invalid. ``str(err)`` reads::

    policies/bad.yaml:7:22: unknown signal 'atn'
        score: cumulative(atn, decay=0.99)
                          ^
      expected: a signal or score name (attn, colmass, ...)
      did you mean 'attn'?
    """

    def __init__(
        self, message: str, span: Span | None = None, *, expected: str = "", suggestion: str = ""
    ) -> None:
        self.message, self.span = message, span
        self.expected, self.suggestion = expected, suggestion
        super().__init__(self._render())

    def _render(self) -> str:
        if self.span is None:
            head = self.message
        else:
            head = f"{self.span.file}:{self.span.line}:{self.span.col}: {self.message}"
        lines = [head]
        if self.span is not None and self.span.text:
            source = self.span.text.splitlines()
            if 0 < self.span.line <= len(source):
                src = source[self.span.line - 1].rstrip()
                src = "".join(c if c.isprintable() or c == "\t" else "?" for c in src)
                lines += [f"    {src}", "    " + " " * (self.span.col - 1) + "^"]
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.suggestion:
            lines.append(f"  {self.suggestion}")
        return "\n".join(lines)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'attn'?"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def one_of(choices: Iterable[str]) -> str:
    """``"one of a, b, c"``: the valid names, sorted, for an ``expected:`` line."""
    return "one of " + ", ".join(sorted(set(choices)))
