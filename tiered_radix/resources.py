"""Where the grammar and the shipped policies live, in a source checkout and in an installed wheel.

The wheel maps ``grammar/`` and ``policies/`` to ``tiered_radix/grammar`` and
``tiered_radix/policies`` (see pyproject.toml); a source checkout or an editable install keeps
them at the repository root.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tiered-radix data folder '{name}' is missing: reinstall the package")


def grammar_path() -> Path:
    return _data_dir("grammar") / "policy.lark"


def policies_dir() -> Path:
    return _data_dir("policies")
