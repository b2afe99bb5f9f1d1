"""Reading policy files: safe YAML with positions, ``extends`` and shipped-policy names.

Policy files are data. YAML is composed with the safe loader into nodes that keep their line and
column; tags other than YAML's plain types, anchors and aliases are refused; the only other files
read are the ones named by ``extends``.

Precedence of ``extends: base.yaml`` (explicit, single parent, chains allowed): the child's keys
win; mappings merge key by key, recursively; scalars and lists are replaced whole. The one key
never inherited is ``policy:`` (the name): a child without its own is named after its file stem.
There is no implicit cascade: a file inherits nothing it does not name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..resources import policies_dir
from .errors import PolicyError, Span, did_you_mean, one_of

_PLAIN_TAGS = {
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")
}


@dataclass(frozen=True)
class Scalar:
    text: str
    span: Span


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]
    span: Span


@dataclass(frozen=True)
class Map:
    """A YAML mapping; ``entries`` keeps the order and each key's own span."""

    entries: tuple[tuple[str, Span, Node], ...]
    span: Span

    def get(self, key: str) -> Node | None:
        return next((v for k, _, v in self.entries if k == key), None)

    def keys(self) -> list[str]:
        return [k for k, _, _ in self.entries]


Node = Scalar | Seq | Map


def shipped_names() -> list[str]:
    """Names of the policies shipped in ``policies/`` (``qevict``, ``rdkv``, ...)."""
    return sorted(p.stem for p in policies_dir().glob("*.yaml"))


def resolve(ref: str | Path, relative_to: Path | None = None) -> Path:
    """A policy path, or a shipped policy's name (``"qevict"``), to an existing file."""
    ref = str(ref)
    candidate = (
        relative_to.parent / ref if relative_to and not Path(ref).is_absolute() else Path(ref)
    )
    shipped = policies_dir() / (ref if ref.endswith(".yaml") else f"{ref}.yaml")
    try:
        if candidate.is_file():
            return candidate
        if "/" not in ref and shipped.is_file():
            return shipped
    except (OSError, ValueError):  # a name too long for the file system, or one with NUL
        pass
    names = shipped_names()
    raise PolicyError(
        f"no policy file '{ref}'",
        expected="a path to a .yaml file or " + one_of(names),
        suggestion=did_you_mean(Path(ref).stem, names),
    )


def load_tree(path: Path) -> Map:
    """Parse one file (no ``extends`` processing) into a positioned tree."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"cannot read policy file {path}: {e}") from None
    return tree_from_text(text, str(path))


def tree_from_text(text: str, name: str) -> Map:
    """Parse policy YAML ``text`` (reported as file ``name``) into a positioned tree."""
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise PolicyError(
                    "YAML anchors and aliases are not supported in policy files",
                    _mark(event.start_mark, name, text),
                    suggestion="write the value out, or use `extends:` to share parts",
                )
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise PolicyError(
            "the file nests too deeply",
            Span(name, 1, 1, text),
            suggestion="flatten the nested lists and mappings",
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context
        if e.context and e.problem and e.problem.startswith("but "):  # "expected X, but found Y"
            problem = f"{e.context}, {e.problem}"
        inside = re.fullmatch(r"while (?:parsing|scanning) an? (.+)", e.context or "")
        where = (
            f" (in the {inside[1]} that starts on line {e.context_mark.line + 1})"
            if (inside and e.context_mark and mark and e.context_mark.line != mark.line)
            else ""
        )
        raise PolicyError(
            f"invalid YAML: {problem}{where}",
            _mark(mark, name, text) if mark else Span(name, 1, 1, text),
        ) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        col = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        raise PolicyError(
            f"character U+{e.character:04X} is not allowed in a policy file",
            Span(name, line, col, text),
            suggestion="delete it; YAML accepts printable text only",
        ) from None
    if root is None:
        raise PolicyError(
            "empty policy file",
            Span(name, 1, 1, text),
            expected="a mapping with at least `budget:`, `units:` and `allocate:`",
        )
    try:
        tree = _convert(root, name, text)
    except RecursionError:
        raise PolicyError(
            "the file nests too deeply",
            Span(name, 1, 1, text),
            suggestion="flatten the nested lists and mappings",
        ) from None
    if not isinstance(tree, Map):
        raise PolicyError("a policy file must be a mapping of keys to values", tree.span)
    return tree


def load_with_extends(path: Path, _seen: tuple[Path, ...] = ()) -> Map:
    """The file's tree merged over its ``extends`` chain (child wins, mappings merge)."""
    if path.resolve() in _seen:
        chain = " -> ".join(p.name for p in (*_seen, path))
        raise PolicyError(f"`extends` cycle: {chain}")
    return extend(load_tree(path), path, (*_seen, path.resolve()))


def extend(tree: Map, path: Path, _seen: tuple[Path, ...] = ()) -> Map:
    """``tree`` (read from ``path``) merged over the file its ``extends`` names, if any."""
    parent = tree.get("extends")
    if parent is None:
        return tree
    if not isinstance(parent, Scalar):
        raise PolicyError(
            "`extends` takes one file name", parent.span, expected="extends: other.yaml"
        )
    try:
        parent_path = resolve(parent.text, relative_to=path)
    except PolicyError as e:
        raise PolicyError(
            e.message, parent.span, expected=e.expected, suggestion=e.suggestion
        ) from None
    if parent_path.resolve() in _seen:
        chain = " -> ".join(p.name for p in (*_seen, parent_path))
        raise PolicyError(
            f"`extends` cycle: {chain}",
            parent.span,
            suggestion="remove the `extends:` of one file in the chain",
        )
    base = load_with_extends(parent_path, _seen)
    unnamed = Map(tuple(e for e in base.entries if e[0] != "policy"), base.span)
    return _merge(unnamed, tree)


def _merge(base: Map, child: Map) -> Map:
    entries = {k: (s, v) for k, s, v in base.entries if k != "extends"}
    for key, span, value in child.entries:
        if key == "extends":
            continue
        old = entries.get(key)
        merged = (
            _merge(old[1], value)
            if old and isinstance(old[1], Map) and isinstance(value, Map)
            else value
        )
        entries[key] = (span, merged)
    return Map(tuple((k, s, v) for k, (s, v) in entries.items()), child.span)


def _mark(mark, name: str, text: str) -> Span:
    return Span(name, mark.line + 1, mark.column + 1, text)


def _convert(node: yaml.Node, name: str, text: str) -> Node:
    span = _mark(node.start_mark, name, text)
    if node.tag not in _PLAIN_TAGS:
        raise PolicyError(
            f"YAML tag '{node.tag}' is not allowed in a policy file",
            span,
            expected="plain values: strings, numbers, lists and mappings",
        )
    if isinstance(node, yaml.ScalarNode):
        quoted = node.style in ("'", '"')
        return Scalar(node.value, span.shifted(1) if quoted else span)
    if isinstance(node, yaml.SequenceNode):
        return Seq(tuple(_convert(n, name, text) for n in node.value), span)
    entries, seen = [], set()
    for key_node, value_node in node.value:
        key_span = _mark(key_node.start_mark, name, text)
        if not isinstance(key_node, yaml.ScalarNode):
            raise PolicyError("mapping keys must be plain names", key_span)
        if key_node.value in seen:
            raise PolicyError(
                f"duplicate key '{key_node.value}'",
                key_span,
                suggestion="each key may appear once in a mapping",
            )
        seen.add(key_node.value)
        entries.append((key_node.value, key_span, _convert(value_node, name, text)))
    return Map(tuple(entries), span)
