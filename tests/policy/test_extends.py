"""``extends``: the child's keys win, mappings merge recursively, lists and scalars are replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_radix import PolicyError, compile_text, load_policy
from tiered_radix.policy.expr import Name
from tiered_radix.policy.model import Evict, Granularity, Keep, Quantize

BASE = """\
policy: base
budget: 10%
units: window(size=32)
protect: {sinks: 4, recent: 64}
scores:
  score: cumulative(attn, decay=0.99)
  recent: recency
tiers:
  full: keep(bf16)
  int2: quantize(bits=2)
  evicted: evict
rules:
  - {when: recency < 16, then: promote}
  - {when: score < 0.01, then: evict}
allocate: {method: rank, by: score, shares: {full: 40%, int2: 60%}}
schedule: after_prefill, every(16)
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(tmp_path, "base.yaml", BASE)


def child(tmp_path: Path, text: str, name: str = "child.yaml") -> Path:
    return write(tmp_path, name, "extends: base.yaml\n" + text)


def test_child_scalars_win(tmp_path: Path, base: Path) -> None:
    p = load_policy(child(tmp_path, "policy: child\nbudget: 5%\nschedule: after_prefill\n"))
    assert p.name == "child" and p.budget.value == pytest.approx(0.05)
    assert p.schedule.every is None  # a scalar is replaced whole, triggers and all
    assert load_policy(base).budget.value == pytest.approx(0.10)  # the parent is untouched


def test_mappings_merge_key_by_key(tmp_path: Path, base: Path) -> None:
    p = load_policy(child(tmp_path, "protect: {recent: 128}\nallocate: {shares: {full: 30%}}\n"))
    assert (p.protect.sinks, p.protect.recent) == (4, 128)
    assert p.allocate.by == Name("score")  # allocate.method and .by come from the parent
    assert p.allocate.shares == pytest.approx((0.30, 0.60))  # shares merged one level deeper


def test_tiers_merge_in_the_parents_order(tmp_path: Path, base: Path) -> None:
    p = load_policy(child(tmp_path, "tiers: {int2: quantize(bits=4)}\n"))
    assert [t.name for t in p.tiers] == ["full", "int2", "evicted"]
    assert p.tiers[1].action == Quantize(bits=4)
    assert isinstance(p.tiers[0].action, Keep) and isinstance(p.tiers[2].action, Evict)


def test_a_new_tier_is_appended_after_the_parents(tmp_path: Path, base: Path) -> None:
    # New keys go last, here after the evicting tier, which the compiler refuses: to reorder
    # tiers a child must not extend a file that has them, or restate every tier in order.
    with pytest.raises(PolicyError, match="tier 'evicted' evicts but is not the last tier"):
        load_policy(child(tmp_path, "tiers: {int4: quantize(bits=4)}\n"))


def test_the_name_is_not_inherited(tmp_path: Path, base: Path) -> None:
    # `policy:` is the one key a child never inherits: without its own it is named after its
    # file, not after its parent (whose name is `base` here, and whose stem is also `base`).
    assert load_policy(base).name == "base"
    assert load_policy(child(tmp_path, "budget: 5%\n", name="fast.yaml")).name == "fast"
    assert load_policy(child(tmp_path, "policy: quick\n", name="fast.yaml")).name == "quick"
    write(tmp_path, "mid.yaml", "extends: base.yaml\npolicy: middle\n")
    leaf = load_policy(write(tmp_path, "leaf.yaml", "extends: mid.yaml\n"))
    assert leaf.name == "leaf"  # nor through a chain
    assert leaf.budget.value == pytest.approx(0.10)  # while every other key still is
    write(tmp_path, "named.yaml", BASE.replace("policy: base", "policy: parent"))
    assert load_policy(write(tmp_path, "kid.yaml", "extends: named.yaml\n")).name == "kid"
    assert load_policy(write(tmp_path, "kid.yaml", "extends: qevict\n")).name == "kid"


def test_lists_are_replaced(tmp_path: Path, base: Path) -> None:
    assert len(load_policy(base).rules) == 2
    p = load_policy(child(tmp_path, "rules:\n  - {when: recency < 4, then: keep}\n"))
    assert len(p.rules) == 1 and isinstance(p.rules[0].then, Keep)


def test_a_scalar_and_a_mapping_replace_each_other(tmp_path: Path, base: Path) -> None:
    write(
        tmp_path,
        "split.yaml",
        "extends: base.yaml\nunits: {k: window(size=16), v: window(size=16)}\n",
    )
    p = load_policy(write(tmp_path, "one.yaml", "extends: split.yaml\nunits: token\n"))
    assert p.k == p.v == Granularity("token")
    # ... and back: the child's mapping replaces the parent's scalar
    q = load_policy(write(tmp_path, "two.yaml", "extends: one.yaml\nunits: {k: token, v: token}\n"))
    assert q.k == q.v == Granularity("token")
    r = load_policy(
        write(tmp_path, "three.yaml", "extends: base.yaml\nunits: {k: token, v: token}\n")
    )
    assert r.k == Granularity("token")


def test_a_child_cannot_remove_a_key(tmp_path: Path, base: Path) -> None:
    # `null` is a value like any other, not a deletion: the parent's shares stay, and `null`
    # itself is then not a fraction.
    with pytest.raises(PolicyError, match="allocate.shares.full"):
        load_policy(child(tmp_path, "allocate: {shares: {full: null}}\n"))


def test_chain(tmp_path: Path, base: Path) -> None:
    write(tmp_path, "mid.yaml", "extends: base.yaml\nbudget: 20%\nprotect: {sinks: 8}\n")
    p = load_policy(write(tmp_path, "leaf.yaml", "extends: mid.yaml\nbudget: 15%\n"))
    assert p.budget.value == pytest.approx(0.15)  # leaf over mid
    assert p.protect.sinks == 8 and p.protect.recent == 64  # mid over base, base underneath
    assert p.k == Granularity("window", 32)


@pytest.mark.parametrize(
    "files",
    [
        {"a.yaml": "extends: a.yaml\nbudget: 5%\n"},
        {"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"},
        {
            "a.yaml": "extends: b.yaml\n",
            "b.yaml": "extends: c.yaml\n",
            "c.yaml": "extends: b.yaml\n",
        },
    ],
)
def test_cycles_are_refused(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    with pytest.raises(PolicyError, match="`extends` cycle"):
        load_policy(tmp_path / "a.yaml")


def test_relative_paths_are_relative_to_the_extending_file(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path, "shared/base.yaml", BASE)
    write(tmp_path, "shared/mid.yaml", "extends: base.yaml\nbudget: 7%\n")  # shared/base.yaml
    leaf = write(tmp_path, "team/leaf.yaml", "extends: ../shared/mid.yaml\nprotect: {sinks: 1}\n")
    monkeypatch.chdir(tmp_path / "team")
    write(tmp_path, "team/base.yaml", "this file must not be read: [")
    p = load_policy(leaf)
    assert p.budget.value == pytest.approx(0.07) and p.protect.sinks == 1
    assert p.protect.recent == 64


def test_shipped_names(tmp_path: Path) -> None:
    qevict = load_policy("qevict")
    for ref in ("qevict", "qevict.yaml"):
        p = load_policy(write(tmp_path, "mine.yaml", f"extends: {ref}\nbudget: 5%\n"))
        assert p.budget.value == pytest.approx(0.05)
        assert (p.tiers, p.allocate, p.ledger, p.k) == (
            qevict.tiers,
            qevict.allocate,
            qevict.ledger,
            qevict.k,
        )


def test_a_local_file_comes_before_a_shipped_one(tmp_path: Path) -> None:
    # A reference is first a path relative to the extending file; only a bare name with no such
    # file falls back to policies/. `qevict` (no suffix) names no local file here.
    write(tmp_path, "qevict.yaml", BASE.replace("10%", "3%"))
    local = load_policy(write(tmp_path, "mine.yaml", "extends: qevict.yaml\n"))
    assert local.budget.value == pytest.approx(0.03)
    shipped = load_policy(write(tmp_path, "mine.yaml", "extends: qevict\n"))
    assert shipped.budget.value == pytest.approx(0.10)
    assert shipped.tiers == load_policy("qevict").tiers


def test_compile_text_resolves_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path, "base.yaml", BASE)
    monkeypatch.chdir(tmp_path)
    p = compile_text("extends: base.yaml\nbudget: 1%\n", "inline.yaml")
    assert p.budget.value == pytest.approx(0.01) and p.source == "inline.yaml"
    assert p.name == "inline"  # named after its own name, not the parent's `policy: base`


def test_errors_point_into_the_file_that_has_them(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", BASE.replace("decay=0.99", "decy=0.99"))
    with pytest.raises(PolicyError) as info:
        load_policy(child(tmp_path, "budget: 5%\n"))
    assert Path(info.value.span.file).name == "base.yaml" and info.value.span.line == 6


def test_extends_takes_one_name(tmp_path: Path, base: Path) -> None:
    with pytest.raises(PolicyError, match="takes one file name"):
        load_policy(write(tmp_path, "two.yaml", "extends: [base.yaml, base.yaml]\n"))
