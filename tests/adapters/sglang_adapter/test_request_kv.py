"""Per-request ``kv_budget`` / ``kv_policy`` (issue 22): parsing and its 400 messages, the launch's
policy set (``--kv-policies``), a request's engine running its own budget and policy over a
shared cached prefix (isolation: the same request alone and beside another reads and writes the
same), and the usage a finished request reports, read from the pool."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import POLICY, require

require("sglang.srt.mem_cache.radix_cache")

from test_backend import KERNEL_POLICY, Harness  # noqa: E402

from tiered_radix.adapters.sglang import config, serving  # noqa: E402
from tiered_radix.adapters.sglang.catalog import Catalog, CatalogError, load  # noqa: E402
from tiered_radix.adapters.sglang.config import KVConfig  # noqa: E402
from tiered_radix.adapters.sglang.request_kv import (  # noqa: E402
    RequestError,
    into_custom,
    resolve,
)
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402
from tiered_radix.adapters.sglang.usage import KEY  # noqa: E402
from tiered_radix.policy import compile_text, load_policy  # noqa: E402
from tiered_radix.policy.model import Budget  # noqa: E402

# the test-size qevict with another split of its budget: the same pool, another policy
OTHER = POLICY.replace("tiny-qevict", "tiny-split").replace(
    "full: 50%, int2: 50%", "full: 80%, int2: 20%"
)


def launch(policy_text: str = POLICY, *others: str, budget: str | None = None) -> KVConfig:
    """A launch's configuration over policies given as text (``--kv-policy`` first)."""
    base, rest = compile_text(policy_text), [compile_text(t) for t in others]
    cat = Catalog(base, tuple((p.name, p) for p in (base, *rest)))
    b = config.parse_budget(budget) if budget else base.budget
    return KVConfig(base.name, budget, base, b, policies_arg="x" if rest else None, catalog=cat)


# -- parsing -------------------------------------------------------------------------------
def test_budgets_parse_in_the_policy_files_syntax_and_absent_ones_are_the_launchs():
    cfg = launch(POLICY, OTHER)
    assert resolve({"kv_budget": "25%"}, cfg).budget == Budget("fraction", 0.25)
    assert resolve({"kv_budget": " 2 GiB "}, cfg).budget == Budget("bytes", 2 * 2**30)
    assert resolve({"kv_budget": "8192 tokens"}, cfg).budget == Budget("tokens", 8192)
    plain = resolve(None, cfg)
    assert (plain.policy.name, plain.budget, plain.asked) == ("tiny-qevict", cfg.budget, False)
    named = resolve({"kv_policy": "tiny-split"}, cfg)
    assert named.policy.name == "tiny-split" and named.budget == named.policy.budget
    # --kv-budget is every policy's default
    over = resolve({"kv_policy": "tiny-split"}, launch(POLICY, OTHER, budget="30%"))
    assert over.budget == Budget("fraction", 0.3)


@pytest.mark.parametrize(
    "params, says",
    [
        ({"kv_budget": "25 percent"}, ["kv_budget '25 percent'", "unexpected 'percent'",
                                       "'25%'", "'2 GiB'", "'8192 tokens'"]),
        ({"kv_budget": "150%"}, ["out of range", "'25%'"]),
        ({"kv_budget": 0.25}, ["must be a string", "'8192 tokens'"]),
        ({"kv_policy": "tiny-splt"}, ["'tiny-splt' is not loaded", "'tiny-qevict', 'tiny-split'",
                                      "did you mean 'tiny-split'", "--kv-policies"]),
        ({"kv_policy": 3}, ["3 is not loaded", "'tiny-qevict'"]),
    ],
)  # fmt: skip
def test_a_bad_value_names_what_the_server_accepts(params, says):
    with pytest.raises(RequestError) as err:
        resolve(params, launch(POLICY, OTHER))
    for text in says:
        assert text in str(err.value)
    assert isinstance(err.value, ValueError)  # SGLang answers a ValueError with 400


def test_top_level_fields_move_into_custom_params_and_explicit_ones_win():
    assert into_custom({"max_new_tokens": 4}) is None
    got = into_custom({"max_new_tokens": 4, "kv_budget": "25%"}, {"kv_policy": "qevict"})
    assert got == {"max_new_tokens": 4,
                   "custom_params": {"kv_budget": "25%", "kv_policy": "qevict"}}  # fmt: skip
    got = into_custom({"custom_params": {"kv_budget": "10%", "x": 1}}, {"kv_budget": "50%"})
    assert got["custom_params"] == {"kv_budget": "10%", "x": 1}


# -- the launch's policies -----------------------------------------------------------------
def test_policies_that_store_windows_alike_load_together_and_others_are_refused(tmp_path):
    qevict = load_policy("qevict")
    cat = load(qevict, "examples/qevict_full70.yaml, kivi")
    assert cat.names == ("qevict", "qevict-full70", "kivi")  # kivi never evicts: a prefix
    with pytest.raises(CatalogError, match="'rdkv'.*pool shared windows .* vs Zone A pages"):
        load(qevict, "rdkv")
    with pytest.raises(CatalogError, match="'full'.*window 32 vs 1"):
        load(qevict, "rdkv,full".split(",")[1])
    with pytest.raises(CatalogError, match="'h2o'.*tiers full/quantized/evicted vs full/evicted"):
        load(qevict, "h2o")
    archive = "examples/ablation/archive.yaml"  # the pool archives for every request, or none
    with pytest.raises(CatalogError, match="evicted windows dropped vs archived"):
        load(qevict, archive)
    assert load(load_policy(archive), "kivi").names == ("qevict-archive", "kivi")
    (tmp_path / "a.yaml").write_text(OTHER)
    (tmp_path / "b.yaml").write_text(OTHER.replace("80%, int2: 20%", "60%, int2: 40%"))
    with pytest.raises(CatalogError, match="two different policies are named 'tiny-split'"):
        load(compile_text(POLICY), str(tmp_path))  # a folder: every *.yaml in it


def test_launch_refuses_a_mixed_set_and_spawned_processes_get_the_set(capsys):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from tiered_radix.adapters.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    base = ["--model-path", "dummy", "--kv-policy", "qevict"]
    try:
        with pytest.raises(SystemExit) as out:
            prepare_server_args([*base, "--kv-policies", "rdkv,full"])
        assert out.value.code == 2
        assert "'rdkv' (rdkv) cannot share the pool of --kv-policy 'qevict'" in (
            capsys.readouterr().err
        )
        prepare_server_args([*base, "--kv-policies", "examples/qevict_full70.yaml"])
        assert config.current().served().names == ("qevict", "qevict-full70")
    finally:
        config.export(None)


def test_engine_keywords_load_the_set_or_raise():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    from tiered_radix.adapters.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    try:
        with pytest.raises(CatalogError, match="'full'.*window 32 vs 1"):
            ServerArgs(model_path="dummy", kv_policy="qevict", kv_policies="full")
        ServerArgs(model_path="dummy", kv_policy="qevict", kv_policies="kivi")
        assert config.current().served().names == ("qevict", "kivi")
        with pytest.raises(ValueError, match="need kv_policy"):
            ServerArgs(model_path="dummy", kv_policies="kivi")
    finally:
        config.export(None)


def test_decode_attention_folds_only_at_a_decay_every_loaded_policy_shares():
    from tiered_radix.adapters.sglang.backend import common_decay

    qevict, full70 = load_policy("qevict"), load_policy("examples/qevict_full70.yaml")
    position = compile_text(KERNEL_POLICY.replace("cumulative(attn, decay=0.99)", "position"))
    assert common_decay([qevict, full70]) == 0.99
    assert common_decay([qevict, position]) is None  # position reads no attn: observe each step
    h = Harness(kv=launch(POLICY, OTHER))
    assert h.backend.policies == tuple(p for _, p in h.sim.cache.kv.served().by_name)


# -- one request's engine, its isolation, its usage -----------------------------------------
SHARED = list(range(1, 41))  # 10 windows of 4 tokens


def serve(h: Harness, asks: dict[str, dict], steps: int = 5, seed: bool = True):
    """A request ``s`` prefills ``SHARED`` and finishes (the tree caches it, routed); then the
    requests of ``asks`` (rid -> custom_params) extend it with their own suffix in one batch
    and decode ``steps`` tokens together. Returns each one's per-step outputs."""
    if seed:
        s = h.start("s", SHARED)
        h.step([s], [SHARED], extend=True)
        h.finish(s)
    reqs = [h.start(rid, SHARED + suffix(rid), kv) for rid, kv in asks.items()]
    assert all(r.prefix_len == len(SHARED) for r in reqs)  # the cached prefix is matched
    outs = {r.rid: [] for r in reqs}

    def keep(step_out):
        for i, r in enumerate(reqs):
            rows = [o.reshape(-1, h.hq, h.sim.d) for o in step_out]
            start = sum(len(new[j]) for j in range(i))
            outs[r.rid].append([x[start : start + len(new[i])].clone() for x in rows])

    new = [r.origin_input_ids[len(SHARED) :] for r in reqs]
    keep(h.step(reqs, new, extend=True))
    for t in range(steps):
        new = [[70 + t + 5 * i] for i in range(len(reqs))]
        keep(h.step(reqs, new, extend=False))
    return reqs, outs


def suffix(rid: str) -> list[int]:
    return [50 + (ord(rid) % 7) + i for i in range(6)]


def test_two_budgets_over_one_cached_prefix_each_read_what_their_own_engine_decided():
    h = Harness(kv=launch(POLICY, OTHER))
    reqs, _ = serve(h, {"a": {"kv_budget": "25%"},
                        "b": {"kv_budget": "75%", "kv_policy": "tiny-split"}})  # fmt: skip
    a, b = (h.backend.sessions[r].store for r in "ab")
    assert (a.policy.name, a.budget) == ("tiny-qevict", Budget("fraction", 0.25))
    assert (b.policy.name, b.budget) == ("tiny-split", Budget("fraction", 0.75))
    cache = h.sim.cache
    sa, sb = cache.states_all("a")[:, :, :10], cache.states_all("b")[:, :, :10]
    assert not torch.equal(sa, sb)  # the shared windows, read in two ways
    held = {r: cache.usage(r, h.backend.sessions[r].store.n_tokens(0)) for r in "ab"}
    assert held["a"]["bytes_held"] < held["b"]["bytes_held"]
    assert held["a"]["evictions"] > 0 and held["b"]["promotions"] > 0  # b restored what s left
    # each engine's tiers are what its view reads: engine tier of every (layer, head, unit)
    tiers = torch.tensor(h.sim.pool.layout.state_tiers())
    for rid, store in (("a", a), ("b", b)):
        st = cache.states_all(rid).long()
        for li in range(h.sim.L):
            assert torch.equal(tiers[st[li]], store.tiers(li).cpu()), (rid, li)


@pytest.mark.parametrize("late", [False, True], ids=["serial", "late-landing"])
@pytest.mark.parametrize("other", [{"kv_budget": "75%"},
                                   {"kv_budget": "75%", "kv_policy": "tiny-split"}])  # fmt: skip
def test_a_request_alone_and_beside_another_at_another_budget_is_the_same(other, late,
                                                                          monkeypatch):  # fmt: skip
    """Isolation: ``a`` at 25% gives the same outputs, tiers and usage whether ``b`` (another
    budget, or another policy too: planned apart) runs beside it over the same cached prefix;
    in the serial order and, routing every 2 decode steps, with those routings landing a step
    late (SGLang's overlap scheduler, the default launch)."""
    texts = (every(POLICY), every(OTHER)) if late else (POLICY, OTHER)
    alone, beside = (Harness(kv=launch(*texts), overlap_schedule=late) for _ in range(2))
    late_landings = []  # routings that landed at a later flush than the step that planned them
    for h in (alone, beside):
        land = h.backend._land
        monkeypatch.setattr(h.backend, "_land", lambda b=h.backend, land=land: (
            late_landings.append(b.landing is not None), land())[1])  # fmt: skip
    _, out1 = serve(alone, {"a": {"kv_budget": "25%"}})
    _, out2 = serve(beside, {"a": {"kv_budget": "25%"}, "b": other})
    for s1, s2 in zip(out1["a"], out2["a"], strict=True):
        for x, y in zip(s1, s2, strict=True):
            assert torch.equal(x, y)
    n = alone.backend.sessions["a"].store.n_tokens(0)
    u1, u2 = alone.sim.cache.usage("a", n), beside.sim.cache.usage("a", n)
    assert u1 == u2
    assert torch.equal(alone.sim.cache.states_all("a"), beside.sim.cache.states_all("a"))
    assert any(late_landings) is late


def test_usage_is_the_pools_blocks_and_agrees_with_the_engine_after_routing():
    """One request alone holds every block in use: its report's bytes are the pool's; at a
    page the engine counts byte for byte (W 16, d 64), they are the engine's too, within the
    request's budget right after its routing; tokens per state and moves follow the pool."""
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64))
    before = {k: 0 for k in ("demote", "promote", "evict")}
    for budget in ("20%", "60%"):
        req = h.start("a" + budget, [3 + i % 11 for i in range(96)], {"kv_budget": budget})
        h.step([req], [req.origin_input_ids], extend=True)  # routed after prefill
        store = h.backend.sessions[req.rid].store
        got = h.sim.cache.usage(req.rid, 96)
        assert got["bytes_held"] == h.sim.pool.bytes_used() == store.bytes_used()
        assert got["bytes_held"] <= got["budget_bytes"] == store.budget_bytes()
        assert got["budget"] == budget and got["routed_steps"] == 1
        occupancy = store.occupancy()  # engine tiers: full, int2, evicted
        units = got["units_per_state"]
        assert (units["full"] + units["restored"], units["quantized"], units["evicted"]) == (
            occupancy["full"],
            occupancy["int2"],
            occupancy["evicted"],
        )
        assert sum(got["tokens_per_state"].values()) == 96
        stats = h.backend.stats()  # since startup: this request's are the difference
        assert (got["demotions"], got["promotions"], got["evictions"]) == tuple(
            stats[k] - before[k] for k in before
        )
        before = {k: stats[k] for k in before}
        assert sum(before.values())
        assert got["bf16_bytes"] == 96 * 2 * h.sim.L * h.sim.H * 64 * 2
        h.finish(req)
        h.sim.cache.reset()  # the next budget starts from an empty pool


def test_a_finished_request_reports_its_usage_in_the_response():
    h = Harness(kv=launch(POLICY, OTHER))
    reqs, _ = serve(h, {"a": {"kv_budget": "25%"}}, steps=3)
    a = reqs[0]
    # the harness writes KV for every token it decoded (SGLang's overlap loop, running a request
    # one step past its end, does so too, only by batch): the report covers the KV its output
    # needed, the prompt's and every output token's but the last
    n = len(a.tokens)
    expected = h.sim.cache.usage("a", n - 1)
    assert expected["tokens"] == n - 1 and expected != h.sim.cache.usage("a", n)
    h.finish(a)
    info = a.customized_info[KEY]
    assert len(info) == 3 and info[:2] == [None, None] and info[-1] == expected
    # what the tokenizer side accumulates per token, as meta_info shows it to a client
    out = serving.unwrap({"text": "x", "meta_info": {"id": "a", KEY: info}})
    assert out["meta_info"][KEY] == expected and expected["policy"] == "tiny-qevict"
    assert "a" not in h.sim.cache.asked and "a" not in h.sim.cache.views


# -- the request path's hooks ---------------------------------------------------------------
@pytest.fixture
def exported():
    config.export(config.resolve("qevict", None, None, "examples/qevict_full70.yaml"))
    yield
    config.export(None)


def test_native_sampling_params_are_moved_and_checked(exported):
    seen = []
    obj = SimpleNamespace(sampling_params={"max_new_tokens": 8, "kv_budget": "10%"})
    serving.create_tokenized_object(lambda self, o: seen.append(o.sampling_params), None, obj)
    assert seen == [{"max_new_tokens": 8, "custom_params": {"kv_budget": "10%"}}]
    bad = SimpleNamespace(sampling_params={"custom_params": {"kv_policy": "qevict-ful70"}})
    with pytest.raises(ValueError, match="did you mean 'qevict-full70'"):
        serving.create_tokenized_object(lambda self, o: None, None, bad)


def test_a_decoupled_launch_refuses_per_request_fields_and_an_untiered_one_ignores_them():
    try:
        config.export(config.resolve("rdkv"))
        with pytest.raises(RequestError, match="not served by --kv-policy rdkv.*Zone A pages"):
            serving.check({"kv_budget": "10%"})
        serving.check({"thinking_budget": 3})  # other custom params: not ours
        config.export(None)
        serving.check({"kv_budget": "nonsense"})  # no tiering: the plugin changes nothing
    finally:
        config.export(None)


def test_outputs_stream_out_with_the_one_report():
    report = {"policy": "qevict"}
    chunks = [{"meta_info": {KEY: [None]}}, {"meta_info": {KEY: [None, None, report]}}]

    async def original(self, obj, request=None):
        for c in chunks:
            yield c

    async def collect():
        return [o async for o in serving.generate_request(original, None, None)]

    first, last = asyncio.run(collect())
    assert KEY not in first["meta_info"] and last["meta_info"][KEY] == report
    assert chunks[1]["meta_info"][KEY][-1] is report  # SGLang's own list is left as it was


def test_engine_keywords_reach_every_prompts_sampling_params(exported):
    got = serving.engine_generate(lambda self, **kw: kw, None, prompt=["x", "y"],
                                  sampling_params=[{"n": 1}, {}], kv_budget="50%")  # fmt: skip
    assert [p["custom_params"] for p in got["sampling_params"]] == [{"kv_budget": "50%"}] * 2
    got = serving.engine_generate(lambda self, **kw: kw, None, prompt="x", kv_policy="qevict")
    assert got["sampling_params"] == {"custom_params": {"kv_policy": "qevict"}}


class _Raw:
    def __init__(self, body: dict) -> None:
        self.body = body

    async def json(self) -> dict:
        return self.body


def test_openai_extra_body_fields_reach_custom_params_or_answer_400(exported):
    protocol = require("sglang.srt.entrypoints.openai.protocol")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "kv_budget": "25%",
            "kv_policy": "qevict-full70"}  # fmt: skip
    request = protocol.ChatCompletionRequest(**body)  # SGLang's model drops the two fields
    assert request.custom_params is None
    served = SimpleNamespace(create_error_response=lambda msg, **kw: ("error", msg, kw))

    async def original(self, req, raw):
        return ("served", req.custom_params)

    run = lambda b: asyncio.run(  # noqa: E731
        serving.openai_handle_request(original, served, protocol.ChatCompletionRequest(**b),
                                      _Raw(b))
    )  # fmt: skip
    assert run(body) == ("served", {"kv_budget": "25%", "kv_policy": "qevict-full70"})
    kind, msg, kw = run(body | {"kv_budget": "lots"})
    assert kind == "error" and kw["param"] == "kv_budget" and "'8192 tokens'" in msg
    kind, msg, kw = run(body | {"kv_policy": "h2o"})
    assert kw["param"] == "kv_policy" and "'qevict', 'qevict-full70'" in msg


def test_openai_response_usage_carries_the_report():
    protocol = require("sglang.srt.entrypoints.openai.protocol")
    report = {"policy": "qevict", "bytes_held": 10}
    response = protocol.ChatCompletionResponse(
        id="x", model="m", choices=[], usage=protocol.UsageInfo(prompt_tokens=3)
    )
    ret = [{"text": "a", "meta_info": {KEY: report}}]
    out = serving.build_response(lambda self, req, ret: response, None, None, ret)
    import json

    data = json.loads(out.body)
    assert data["usage"]["kv"] == report and data["usage"]["prompt_tokens"] == 3
    plain = serving.build_response(lambda self, req, ret: response, None, None, [{"meta_info": {}}])
    assert plain is response  # nothing to add: SGLang's response as it was


def test_a_streamed_responses_usage_chunk_carries_the_report(exported):
    """SGLang's stream reads outputs through ``generate_request`` and sends its usage chunk
    last (``stream_options.include_usage``); the hooks put the report there, nowhere else."""
    protocol = require("sglang.srt.entrypoints.openai.protocol")
    report = {"policy": "qevict", "bytes_held": 10}
    outputs = [{"text": "a", "meta_info": {KEY: [None]}},
               {"text": "ab", "meta_info": {KEY: [None, report]}}]  # fmt: skip

    async def tokenizer_generate(self, obj, request=None):
        for o in outputs:
            yield o

    def chunk(**fields) -> str:
        body = protocol.ChatCompletionStreamResponse(id="x", model="m", **fields)
        return f"data: {body.model_dump_json()}\n\n"

    async def sglang_stream(self, adapted, request, raw):
        async for out in serving.generate_request(tokenizer_generate, None, adapted):
            delta = protocol.DeltaMessage(content=out["text"])
            yield chunk(choices=[protocol.ChatCompletionResponseStreamChoice(index=0, delta=delta)])
        yield chunk(choices=[], usage=protocol.UsageInfo(prompt_tokens=3, completion_tokens=2))
        yield "data: [DONE]\n\n"

    async def collect():
        gen = serving.stream_response(sglang_stream, None, SimpleNamespace(), None, None)
        return [c async for c in gen]

    import json

    *content, usage, done = asyncio.run(collect())
    assert done == "data: [DONE]\n\n" and all("kv" not in c for c in content)
    data = json.loads(usage[len("data: ") :])
    assert data["usage"]["kv"] == report and data["usage"]["prompt_tokens"] == 3
    assert not serving._STREAMS  # nothing kept after the stream
    config.export(None)  # no tiering: the stream passes through untouched
    untouched = asyncio.run(collect())
    assert "kv" not in json.loads(untouched[-2][len("data: ") :])["usage"]


def test_isolation_holds_through_the_decode_kernel_under_cuda_graphs(monkeypatch):
    """The GPU's decode path (the TriZone kernel, replayed graphs of batch 1 and 2, a fixed
    split count): ``a`` at 20% over a cached prefix gives bit-identical rows and the same tiers
    alone (batch 1) and beside ``b`` at 60% (batch 2), through routings every 3 steps."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tiered_radix.adapters.sglang.options import KVOptions

    other = KERNEL_POLICY.replace("kernel-qevict", "kernel-split").replace(
        "full: 50%, int2: 50%", "full: 80%, int2: 20%"
    )
    prompt = [3 + i % 11 for i in range(64)]  # 4 windows of 16

    def run(asks: dict[str, dict]) -> tuple[Harness, list]:
        h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=40, blocks=PoolBlocks(96, 96),
                    options=KVOptions(graph_splits=2), kv=launch(KERNEL_POLICY, other))  # fmt: skip
        h.backend.init_cuda_graph_state(2, 2)
        for bs in (2, 1):
            h.capture(bs)
        s = h.start("s", prompt)
        h.step([s], [prompt], extend=True)
        h.finish(s)
        reqs = [h.start(r, prompt + [40 + ord(r) % 5 + i for i in range(5)], kv)
                for r, kv in asks.items()]  # fmt: skip
        assert all(r.prefix_len == 64 for r in reqs)
        h.step(reqs, [r.origin_input_ids[64:] for r in reqs], extend=True)
        rows = []
        for t in range(7):
            out = h.replay(reqs, [[60 + t + 9 * i] for i in range(len(reqs))], len(reqs))
            rows.append([x[:1].clone() for x in out])  # a's row: the batch's first
        h.backend.flush()
        return h, rows

    alone, rows1 = run({"a": {"kv_budget": "20%"}})
    beside, rows2 = run({"a": {"kv_budget": "20%"},
                         "b": {"kv_budget": "60%", "kv_policy": "kernel-split"}})  # fmt: skip
    for s1, s2 in zip(rows1, rows2, strict=True):
        for x, y in zip(s1, s2, strict=True):
            assert torch.equal(x, y)
    sa, sb = (h.backend.sessions["a"].store for h in (alone, beside))
    assert sa.step > 0 and sa.step == sb.step  # as many routings applied
    for li in range(alone.sim.L):
        assert torch.equal(sa.tiers(li), sb.tiers(li))
    n = sa.n_tokens(0)
    held = alone.sim.cache.usage("a", n)
    assert held == beside.sim.cache.usage("a", n)
    b = beside.sim.cache.usage("b", beside.backend.sessions["b"].store.n_tokens(0))
    assert b["policy"] == "kernel-split" and b["bytes_held"] > held["bytes_held"]


# -- requests routed together ----------------------------------------------------------------
def every(text: str, n: int = 2) -> str:
    return text.replace("schedule: after_prefill", f"schedule: after_prefill, every({n})")


MIXED = {  # rid -> (custom_params, prompt tokens): other lengths, budgets and policies
    "a": ({"kv_budget": "25%"}, 37),
    "b": ({"kv_budget": "75%", "kv_policy": "tiny-split"}, 52),
    "c": ({}, 61),
    "d": ({"kv_budget": "40%", "kv_policy": "tiny-split"}, 90),
}


def run_mixed(rids: str, steps: int = 6) -> tuple[Harness, dict]:
    """Requests ``rids`` of :data:`MIXED` prefilled in one batch and decoded together, routing
    after the prompt and every 2 steps; each one's outputs per forward."""
    h = Harness(kv=launch(every(POLICY), every(OTHER)), pages=120, blocks=PoolBlocks(400, 400))
    prompts = {r: [(7 * i + 3 * ord(r)) % 90 + 5 for i in range(MIXED[r][1])] for r in rids}
    reqs = [h.start(r, prompts[r], MIXED[r][0]) for r in rids]
    outs: dict[str, list] = {r: [] for r in rids}
    new = [prompts[r] for r in rids]
    for t in range(steps + 1):
        rows = [o.reshape(-1, h.hq, h.sim.d) for o in h.step(reqs, new, extend=t == 0)]
        at = 0
        for r, n in zip(rids, map(len, new), strict=True):
            outs[r].append([x[at : at + n].clone() for x in rows])
            at += n
        new = [[60 + t + 3 * ord(r) % 20] for r in rids]  # each request's own tokens
    return h, outs


def test_mixed_requests_routed_together_decide_as_each_alone(monkeypatch):
    """Requests of other lengths, budgets and policies (``kv_policy``) route in one pass (their
    moves in one StackedMoves) and each one's outputs, tiers and usage are those it has served
    alone."""
    from tiered_radix.engine import stacked

    moved_together = []
    init = stacked.StackedMoves.__init__

    def spy(self, stacks, news):
        moved_together.append(len(stacks))
        init(self, stacks, news)

    monkeypatch.setattr(stacked.StackedMoves, "__init__", spy)
    h, outs = run_mixed("abcd")
    assert moved_together and max(moved_together) == 4  # every request in one move
    for rid in "abcd":
        one, alone = run_mixed(rid)
        for s1, s2 in zip(alone[rid], outs[rid], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(s1, s2, strict=True))
        assert torch.equal(one.sim.cache.states_all(rid), h.sim.cache.states_all(rid))
        s1, s2 = one.backend.sessions[rid].store, h.backend.sessions[rid].store
        assert all(torch.equal(s1.tiers(li), s2.tiers(li)) for li in range(h.sim.L))
        n = s1.n_tokens(0)
        assert one.sim.cache.usage(rid, n) == h.sim.cache.usage(rid, n)
        assert s1.events.steps[-1].bytes_used == s2.events.steps[-1].bytes_used
    moved = h.backend.stats()
    assert moved["demote"] + moved["evict"] > 0  # the routings move units
