"""``KVOptions``: the ``--kv-*`` flags as one frozen object (no SGLang needed)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tiered_radix.adapters.sglang.options import KVOptions, OptionsError, add_flags


def test_device_defaults_and_explicit_choices():
    o = KVOptions()
    assert (o.extend_on("cpu"), o.gather_on("cpu")) == ("exact", "live")
    assert (o.extend_on("cuda:0"), o.gather_on("cuda")) == ("kernel", "all")
    o = KVOptions(extend="sdpa", gather="all")
    assert (o.extend_on("cpu"), o.gather_on("cpu")) == ("sdpa", "all")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.decode = "gather"


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"decode": "fast"}, "'kernel' or 'gather'"), ({"observe": "every"}, "'fold' or 'step'"),
     ({"graph_tokens": 0}, "positive"), ({"graph_splits": -1}, "positive"),
     ({"route_clock": "global"}, "'request' or 'server'")],
)  # fmt: skip
def test_values_outside_their_choices_are_refused(kw, match):
    with pytest.raises(OptionsError, match=match):
        KVOptions(**kw)


def test_flags_and_keywords_build_the_same_options():
    p = argparse.ArgumentParser()
    add_flags(p.add_argument_group("kv"))
    args = p.parse_args(["--kv-decode", "gather", "--kv-overlap", "--kv-graph-tokens", "4096",
                         "--kv-profile", "/tmp/p:1:2", "--kv-route-clock", "server"])  # fmt: skip
    want = KVOptions(decode="gather", overlap=True, graph_tokens=4096, profile="/tmp/p:1:2",
                     route_clock="server")  # fmt: skip
    assert KVOptions.from_args(vars(args)) == want
    kwargs = {"kv_decode": "gather", "kv_overlap": True, "kv_graph_tokens": 4096,
              "kv_profile": "/tmp/p:1:2", "kv_route_clock": "server",
              "model_path": "m"}  # fmt: skip
    assert KVOptions.from_args(kwargs, pop=True) == want and kwargs == {"model_path": "m"}
    assert KVOptions.from_dict(want.to_dict()) == want
    assert KVOptions.from_args(vars(p.parse_args([]))) == KVOptions()  # unset: the defaults
    assert KVOptions().overlap and not KVOptions.from_args(
        vars(p.parse_args(["--no-kv-overlap"]))).overlap  # fmt: skip
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-extend", "flash"])


def test_batch_invariant_options_fix_the_decode_splits():
    """Under SGLang's ``--enable-deterministic-inference`` the decode kernel's split count is
    the same for every batch size: ``--kv-graph-splits`` if given, else the default."""
    from tiered_radix.adapters.sglang.options import DETERMINISTIC_SPLITS

    assert KVOptions().graph_splits is None
    assert KVOptions().batch_invariant() == KVOptions(graph_splits=DETERMINISTIC_SPLITS)
    assert KVOptions(graph_splits=8, decode="gather").batch_invariant() == KVOptions(
        graph_splits=8, decode="gather"
    )
