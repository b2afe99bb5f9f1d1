"""The SGLang plugin: flags, validation with the policy language's errors, selections, no-op
without ``--kv-policy``, hand-over to spawned processes, backend registrations."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import require

require("sglang.srt.server_args")

from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

from tiered_radix.adapters.sglang import config, plugin, sizing  # noqa: E402
from tiered_radix.adapters.sglang.options import KVOptions, OptionsError  # noqa: E402
from tiered_radix.adapters.sglang.reps import PoolConfigError  # noqa: E402
from tiered_radix.policy import PolicyError, load_policy  # noqa: E402
from tiered_radix.policy.model import Budget  # noqa: E402

ARGV = ["--model-path", "dummy", "--attention-backend", "triton"]
BARE = ["--model-path", "dummy"]


def fields(args: ServerArgs) -> dict:
    return dataclasses.asdict(args)


@pytest.fixture(scope="module")
def baseline():
    """ServerArgs before the plugin's hooks exist; fields that vary run to run are dropped."""
    a, b = fields(prepare_server_args(ARGV)), fields(prepare_server_args(ARGV))
    stable = {k for k in a if a[k] == b[k]}
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    HookRegistry.apply_hooks()
    yield {k: a[k] for k in stable}
    config.export(None)


def test_without_kv_policy_nothing_changes(baseline):
    config.export(config.resolve("qevict"))  # a stale value must not switch tiering on
    after = fields(prepare_server_args(ARGV))
    assert {k: after[k] for k in baseline} == baseline
    assert config.current() is None
    assert plugin.cell_size(1000) is None
    seen = {}
    plugin.build_mha_kv_pool(
        lambda self, **kw: seen.update(kw), None, max_total_num_tokens=64, mha_pool_class=int
    )
    assert seen["mha_pool_class"] is int


def qwen_kvc(monkeypatch):
    """SGLang's KV cache configurator, as the cell-size hook reads it, for Qwen2.5-0.5B."""
    monkeypatch.setattr(plugin, "attn_tp_size", lambda: 1)
    model = SimpleNamespace(get_num_kv_heads=lambda tp: 2 // tp)
    return SimpleNamespace(kv_cache_dtype=torch.bfloat16, model_config=model)


def test_kv_policy_selects_the_tiered_cache_and_reaches_spawned_processes(baseline, monkeypatch):
    args = prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-budget", "20%"])
    assert (args.radix_cache_backend, args.page_size) == ("tiered", 32)
    assert args.attention_backend == plugin.ATTENTION_BACKEND
    child = subprocess.run(
        [sys.executable, "-c", "from tiered_radix.adapters.sglang import config as c\n"
         "k = c.current(); print(k.policy.name, k.budget.kind, k.budget.value)"],
        capture_output=True, text=True, env=dict(os.environ), check=True,
    )  # fmt: skip
    assert child.stdout.split() == ["qevict", "fraction", "0.2"]
    # 24 layers x 2 KV heads x d 64 in bf16 (Qwen2.5-0.5B): 12,288 bytes a full token; the
    # budget's 20% of it, plus every slot's metadata (tables, engine state)
    kvc, full = qwen_kvc(monkeypatch), 2 * 24 * 2 * 64 * 2
    cell = plugin.cell_size(full, None, kvc, 24)
    want = sizing.cell_bytes(load_policy("qevict"), Budget("fraction", 0.2), 24, 2, 64, 2)
    assert cell == want and 0.2 * full < cell < 0.5 * full


TOKEN_INT4 = """
policy: token-int4
budget: 30%
units: token
scores:
  recent: position
tiers:
  full: keep(bf16)
  int4: quantize(bits=4, group=32, axis=kivi)
  evicted: evict
allocate: {method: rank, by: recent, shares: {full: 50%, int4: 50%}}
schedule: after_prefill
"""


@pytest.mark.parametrize(
    ("policy", "decode_graphs"),
    [("qevict", True), ("full", True), ("h2o", True), ("streaming", True), (TOKEN_INT4, False)],
)
def test_decode_graphs_stay_on_where_the_decode_kernel_reads_the_pool(
    baseline, policy, decode_graphs, tmp_path
):
    """Windows the TriZone kernel pages (qevict's 32) and token units that hold rows only
    (full, h2o, streaming: each kept token a row the kernel lists by its slot) keep SGLang's
    decode CUDA graphs; token units with ledger pages of one token decode through PyTorch
    gathers, which a graph cannot hold. Prefill graphs are off unless
    ``--kv-prefill-graphs``; the overlap scheduler stays on (``--no-kv-overlap`` turns it
    off)."""
    if "\n" in policy:
        (tmp_path / "p.yaml").write_text(policy)
        policy = str(tmp_path / "p.yaml")
    args = prepare_server_args([*BARE, "--kv-policy", policy])
    assert args.disable_decode_cuda_graph is not decode_graphs
    assert args.disable_prefill_cuda_graph and not args.disable_overlap_schedule
    # --kv-decode gather (the PyTorch path, e.g. where a kernel fails to compile): no graphs
    args = prepare_server_args([*BARE, "--kv-policy", policy, "--kv-decode", "gather"])
    assert args.disable_decode_cuda_graph


def test_prefill_graphs_are_the_users_with_kv_prefill_graphs(baseline):
    """``--kv-prefill-graphs`` leaves SGLang's prefill CUDA graphs as the user has them (on by
    default: its breakable graphs), and reaches the backend's options."""
    args = prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-prefill-graphs"])
    assert not args.disable_prefill_cuda_graph
    assert config.current().options.prefill_graphs
    args = prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-prefill-graphs",
                                "--disable-prefill-cuda-graph"])  # fmt: skip
    assert args.disable_prefill_cuda_graph


def test_the_overlap_scheduler_is_on_unless_turned_off(baseline):
    """SGLang's overlap scheduler stays on by default (GPU run 17: faster decode at batch 1 and
    8); ``--no-kv-overlap`` (``kv_overlap=False``) turns it off, ``--kv-overlap`` says the
    default, and a user's own ``--disable-overlap-schedule`` still holds."""
    for flags, disabled, overlap in (([], False, True), (["--kv-overlap"], False, True),
                                     (["--no-kv-overlap"], True, False),
                                     (["--disable-overlap-schedule"], True, True)):  # fmt: skip
        args = prepare_server_args([*BARE, "--kv-policy", "qevict", *flags])
        assert args.disable_overlap_schedule is disabled, flags
        assert config.current().options.overlap is overlap, flags
    assert ServerArgs(model_path="dummy", kv_policy="qevict", kv_overlap=False
                      ).disable_overlap_schedule  # fmt: skip
    assert not ServerArgs(model_path="dummy", kv_policy="qevict").disable_overlap_schedule


def test_kv_flags_become_one_options_object_in_spawned_processes(baseline, tmp_path):
    """The ``--kv-*`` flags reach the scheduler processes as one :class:`KVOptions` (no other
    environment variable is read); a value outside its choices, or an option without
    ``--kv-policy``, stops the launch (status 2 / a ``ValueError`` from the Engine)."""
    stats = str(tmp_path / "s.json")
    prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-decode", "gather", "--kv-extend",
                         "exact", "--kv-graph-tokens", "4096", "--kv-stats", stats])  # fmt: skip
    want = KVOptions(decode="gather", extend="exact", graph_tokens=4096, stats=stats)
    assert config.current().options == want
    exported = {k for k in os.environ if k.startswith("TIERED_RADIX_")}
    assert exported - {"TIERED_RADIX_REQUIRE_SGLANG"} == {config.ENV}  # the harness's own
    child = subprocess.run(
        [sys.executable, "-c", "from tiered_radix.adapters.sglang import config as c\n"
         "print(c.current().options.to_dict())"],
        capture_output=True, text=True, env=dict(os.environ), check=True,
    )  # fmt: skip
    assert child.stdout.strip() == str(want.to_dict())
    ServerArgs(model_path="dummy", kv_policy="qevict", kv_observe="step")
    assert config.current().options == KVOptions(observe="step")
    with pytest.raises(SystemExit) as exc:
        prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-decode", "fast"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit, match="--kv-gather needs --kv-policy"):
        prepare_server_args([*BARE, "--kv-gather", "all"])
    with pytest.raises(OptionsError, match="'fold' or 'step'"):
        ServerArgs(model_path="dummy", kv_policy="qevict", kv_observe="every")
    with pytest.raises(ValueError, match="need kv_policy"):
        ServerArgs(model_path="dummy", kv_decode="gather")


def test_the_policy_is_compiled_once_per_process(baseline, monkeypatch):
    """``config.current()`` (called by every pool, cache and backend hook) loads the exported
    policy once, not at each call."""
    prepare_server_args([*BARE, "--kv-policy", "qevict"])
    calls = []
    real = config.load_policy
    monkeypatch.setattr(config, "load_policy", lambda arg: calls.append(arg) or real(arg))
    monkeypatch.setattr(config, "_current", None)  # as a freshly spawned process
    first = config.current()
    plugin.cell_size(2 * 24 * 2 * 64 * 2, None, qwen_kvc(monkeypatch), 24)  # calls current()
    assert config.current() is first
    assert calls == ["qevict"]


def test_a_decode_batch_over_the_graph_buffers_runs_eagerly():
    """The AROUND hook on the graph runner's ``can_run_graph``: SGLang's answer, narrowed by the
    tiered backend's ``graph_fits`` (other backends pass through)."""
    fb = SimpleNamespace(seq_lens_cpu=torch.tensor([100, 200]), seq_lens=None)
    tiered = SimpleNamespace(graph_fits=lambda seqs: sum(seqs) <= 250)
    for backend, sglang_says, want in [
        (tiered, True, False), (tiered, False, False), (SimpleNamespace(), True, True),
    ]:  # fmt: skip
        runner = SimpleNamespace(attn_backend=backend)
        assert plugin.can_run_graph(lambda _s, _fb, ok=sglang_says: ok, runner, fb) is want
    tiered.graph_fits = lambda seqs: sum(seqs) <= 300
    runner = SimpleNamespace(attn_backend=tiered)
    assert plugin.can_run_graph(lambda _s, _fb: True, runner, fb) is True


def test_a_graph_replay_carries_its_rids_ends_with_the_mark_and_a_whole_forward_barrier():
    """The AROUND hook on the graph runner's ``execute``: the batch's request ids reach the
    tiered backend before the replay (its metadata runs inside it), then SGLang's output, the
    backend's ``replay_done``, and no read-done event left for the scheduler's write-after-read
    barrier (it waits for the whole forward); other backends pass through untouched."""
    calls, noted = [], []
    tiered = SimpleNamespace(replay_done=lambda: calls.append("done"), note_replay=noted.append)

    def execute(self, fb, pp=None):
        calls.append(("replay", fb.rids, pp, len(noted)))  # ids noted before the replay
        self.model_runner.war_fastpath_read_done_event = "read-done"  # as SGLang's replay does
        return "logits"

    fb = SimpleNamespace(rids=["r1", "r2"])
    runner = SimpleNamespace(attn_backend=tiered, model_runner=SimpleNamespace())
    assert plugin.graph_execute(execute, runner, fb, pp="pp") == "logits"
    assert calls == [("replay", ["r1", "r2"], "pp", 1), "done"] and noted == [["r1", "r2"]]
    assert runner.model_runner.war_fastpath_read_done_event is None
    stock = SimpleNamespace(attn_backend=SimpleNamespace(), model_runner=SimpleNamespace())
    assert plugin.graph_execute(execute, stock, fb) == "logits"
    assert calls[-1] == ("replay", ["r1", "r2"], None, 1) and len(noted) == 1
    assert stock.model_runner.war_fastpath_read_done_event == "read-done"


def test_decode_retracts_when_the_row_blocks_cannot_hold_the_new_windows():
    """The AROUND hook on ``ScheduleBatch.check_decode_mem``: SGLang's logical answer, then the
    tiered pool's row blocks for the step's new windows (2 heads: 2 blocks a window a layer)."""
    from sglang_sim import Sim

    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    sim = Sim(blocks=PoolBlocks(11, 8))  # 11 row blocks a layer: 5 windows of 2 heads
    batch = SimpleNamespace(
        token_to_kv_pool_allocator=sim.alloc,
        new_tokens_required_next_decode=lambda idx: sim.W * (5 if idx is None else len(idx)),
    )
    yes = lambda _self, selected_indices=None: True  # noqa: E731
    assert plugin.check_decode_mem(yes, batch) is True  # 5 new windows: 10 of 11 blocks
    assert plugin.check_decode_mem(yes, batch, selected_indices=list(range(6))) is False
    assert plugin.check_decode_mem(lambda _s, selected_indices=None: False, batch) is False
    stock = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: object()),
        new_tokens_required_next_decode=lambda idx: 1 << 30,
    )
    assert plugin.check_decode_mem(yes, stock) is True  # another pool: SGLang's answer


class Adder:
    """What the admission hooks read of SGLang's ``PrefillAdder``, over the simulated pool."""

    def __init__(self, sim, chunk: int | None, running: bool = False) -> None:
        self.token_to_kv_pool_allocator, self.rem_chunk_tokens = sim.alloc, chunk
        self.can_run_list: list = []
        self.running_batch = SimpleNamespace(is_empty=lambda: not running)
        self.W, self.locked = sim.W, []

    @contextlib.contextmanager
    def _lock_node(self, node):
        self.locked.append(node)
        yield
        self.locked.remove(node)

    def admit(self, _self, req, *_args, **_kw):
        """SGLang's own admission: the whole extend, or a window-aligned chunk of what is left
        of ``rem_chunk_tokens`` (which it spends)."""
        n = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
        if self.rem_chunk_tokens is not None and n > self.rem_chunk_tokens:
            n = self.rem_chunk_tokens // self.W * self.W
            if n <= 0:
                return "OTHER"
        req.extend_range = SimpleNamespace(length=n)
        self.can_run_list.append(req)
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        return "CONTINUE"


def prompt(windows: int, W: int, cached: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        full_untruncated_fill_ids=[1] * (windows * W),
        prefix_indices=[0] * cached,
        last_node=f"node of {windows}",
    )


def test_prefill_admits_only_the_windows_the_row_blocks_hold():
    """The AROUND hooks on ``PrefillAdder.add_one_req``/``add_chunked_req``: 11 row blocks a
    layer hold 5 windows of 2 heads; a batch's windows are counted as they are admitted."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang_sim import Sim

    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    for name in ("add_one_req", "add_chunked_req"):  # the hooks' targets exist in SGLang
        assert "req" in inspect.signature(getattr(PrefillAdder, name)).parameters
    assert "last_node" in inspect.signature(PrefillAdder._lock_node).parameters
    sim = Sim(blocks=PoolBlocks(11, 8))
    W, a = sim.W, Adder(sim, chunk=100)
    rows_for_windows, seen = sim.pool.rows_for_windows, []

    def spy(n):  # eviction for rows happens with the request's matched prefix locked
        seen.append(list(a.locked))
        return rows_for_windows(n)

    sim.pool.rows_for_windows = spy
    one = lambda ad, req: plugin.add_one_req(ad.admit, ad, req, False, None)  # noqa: E731
    first = prompt(4, W)
    assert one(a, first) == "CONTINUE" and first.extend_range.length == 4 * W
    second = prompt(3, W, cached=W)  # 2 windows to prefill past its cached one: 1 fits
    assert one(a, second) == "CONTINUE" and second.extend_range.length == W
    assert a.rem_chunk_tokens == 100 - 5 * W  # the cut chunk spent only what it used
    assert one(a, prompt(1, W)) == AddReqResult.NO_TOKEN  # no room left: it waits
    assert seen == [["node of 4"], ["node of 3"], ["node of 1"]] and not a.locked
    whole = Adder(sim, chunk=None)  # chunked prefill off: no cut, the request waits ...
    whole.can_run_list.append("admitted before")
    assert one(whole, prompt(6, W)) == AddReqResult.NO_TOKEN
    alone = Adder(sim, chunk=None)  # ... unless nothing could ever free rows for it
    assert one(alone, prompt(6, W)) == "CONTINUE"
    chunked = Adder(sim, chunk=100)  # a chunked request's next chunk counts for the next
    plugin.add_chunked_req(chunked.admit, chunked, prompt(4, W))
    assert one(chunked, prompt(2, W)) == "CONTINUE"
    assert chunked.can_run_list[-1].extend_range.length == W
    stock = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: object())
    )
    assert plugin.add_one_req(lambda *_a, **_k: "stock", stock, prompt(9, W)) == "stock"


def test_bad_policy_exits_with_the_policy_error_not_a_traceback(baseline, tmp_path, capsys):
    text = open(load_policy("qevict").source).read().replace("cumulative(attn", "cumulative(atn")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(PolicyError) as want:
        load_policy(bad)
    with pytest.raises(SystemExit) as exit_:
        prepare_server_args([*BARE, "--kv-policy", str(bad)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert str(want.value) in err and f"{bad}:" in err and "did you mean 'attn'?" in err
    assert "Traceback" not in err


def test_bad_budget_and_contradicting_flags_exit_cleanly(baseline, capsys):
    with pytest.raises(SystemExit):
        prepare_server_args([*BARE, "--kv-policy", "qevict", "--kv-budget", "10 parsecs"])
    assert "--kv-budget:1:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_server_args([*BARE, "--kv-policy", "qevict", "--page-size", "16"])
    assert "needs --page-size 32, got 16" in capsys.readouterr().err


def test_engine_kwargs_validate_and_select(baseline, tmp_path):
    args = ServerArgs(model_path="dummy", kv_policy="qevict")
    assert args.radix_cache_backend == "tiered" and config.current().policy.name == "qevict"
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget: 10%\nunits: window(size=32)\nalocate: {}\n")
    with pytest.raises(PolicyError, match="bad.yaml:3:1"):
        ServerArgs(model_path="dummy", kv_policy=str(bad))
    ServerArgs(model_path="dummy")
    assert config.current() is None  # a later Engine without kv_policy is untiered


def test_backends_are_registered(baseline):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    assert get_radix_cache_factory("tiered") is plugin.tree_cache_factory
    factory = ATTENTION_BACKENDS[plugin.ATTENTION_BACKEND]
    heads = SimpleNamespace(get_total_num_kv_heads=lambda: 2)
    runner = SimpleNamespace(
        server_args=SimpleNamespace(tp_size=4), model_config=heads, token_to_kv_pool=None
    )
    with pytest.raises(plugin.TieredBackendError, match="does not split the model's 2 KV heads"):
        factory(runner)  # SGLang would replicate heads: refused
    for tp in (1, 2):
        runner.server_args.tp_size = tp
        with pytest.raises(PoolConfigError, match="needs a TieredKVPool"):
            factory(runner)


def test_deterministic_inference_keeps_the_tiered_stack_and_fixes_the_decode_splits(
    baseline, monkeypatch
):
    """SGLang's ``--enable-deterministic-inference`` (its batch-invariant GEMMs) accepts the
    tiered backend with the radix cache, and the backend then gets options whose decode split
    count is fixed for every batch size (GPU run 29: 128 splits alone, 17 in a batch of 8)."""
    from sglang.srt.server_args import DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    from tiered_radix.adapters.sglang import backend
    from tiered_radix.adapters.sglang.options import DETERMINISTIC_SPLITS

    assert plugin.ATTENTION_BACKEND in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    args = ServerArgs(model_path="dummy", kv_policy="qevict", enable_deterministic_inference=True)
    assert args.attention_backend == plugin.ATTENTION_BACKEND
    assert not args.disable_radix_cache and args.radix_cache_backend == config.BACKEND
    got = []
    monkeypatch.setattr(backend, "TieredAttnBackend", lambda runner, o, p: got.append(o))
    heads = SimpleNamespace(get_total_num_kv_heads=lambda: 2)
    for deterministic, splits in ((False, None), (True, DETERMINISTIC_SPLITS)):
        sa = SimpleNamespace(tp_size=1, enable_deterministic_inference=deterministic)
        plugin.attention_backend_factory(SimpleNamespace(server_args=sa, model_config=heads))
        assert got[-1].graph_splits == splits
    config.export(config.resolve("qevict", None, KVOptions(graph_splits=4)))
    try:
        plugin.attention_backend_factory(SimpleNamespace(server_args=sa, model_config=heads))
    finally:
        config.export(None)
    assert got[-1].graph_splits == 4  # the user's --kv-graph-splits stays


HEADS_POLICY = """
policy: all-heads
budget: 20%
units: window(size=32)
scores:
  heat: mean_heads(cumulative(attn))
tiers: {full: keep(bf16), evicted: evict}
allocate: {method: rank, by: heat}
schedule: after_prefill
"""


def test_tensor_parallel_takes_head_reductions_refuses_dp_attention(baseline, tmp_path):
    """--tp N: scores that reduce over all KV heads launch (the ranks gather the heads, see
    tests/engine/test_shard.py); DP attention stops the launch."""
    ServerArgs(model_path="dummy", kv_policy="qevict", tp_size=2)
    heads = tmp_path / "heads.yaml"
    heads.write_text(HEADS_POLICY)
    assert ServerArgs(model_path="dummy", kv_policy=str(heads), tp_size=2).tp_size == 2
    with pytest.raises(ValueError, match="dp-attention"):
        ServerArgs(model_path="dummy", kv_policy="qevict", tp_size=2, enable_dp_attention=True)


def test_the_chunked_request_is_cut_to_the_free_rows_or_parked():
    """The chunked request's next chunk (SGLang always admits it): cut to the windows the free
    rows hold; with none free while requests run, parked (returned without a chunk, so the
    round decodes); with nothing running, one window (the rows are its own prompt so far, which
    the backend's routing for rows frees before that chunk's forward)."""
    from sglang_sim import Sim

    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    sim = Sim(blocks=PoolBlocks(11, 8))  # 5 windows of 2 heads a layer
    W = sim.W
    a = Adder(sim, chunk=100, running=True)
    req = prompt(7, W)
    assert plugin.add_chunked_req(a.admit, a, req) == "CONTINUE"
    assert req.extend_range.length == 5 * W and a.rem_chunk_tokens == 100 - 5 * W
    sim.start("x", list(range(1, 5 * W + 1)))  # the rows are taken now
    parked = Adder(sim, chunk=100, running=True)
    req = prompt(2, W)
    assert plugin.add_chunked_req(parked.admit, parked, req) is req and not parked.can_run_list
    alone = Adder(sim, chunk=100, running=False)
    req = prompt(2, W)
    assert plugin.add_chunked_req(alone.admit, alone, req) == "CONTINUE"
    assert req.extend_range.length == W


def test_server_info_carries_the_backend_stats(baseline):
    """``Scheduler.get_internal_state`` (what ``/server_info`` and ``Engine.get_server_info``
    read) gets the tiered backend's stats, read at the call; other backends' state is left
    as SGLang made it."""
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry
    from test_backend import Harness

    target = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
    assert callable(Scheduler.get_internal_state)
    assert any(h is plugin.internal_state for _, h, _ in HookRegistry._hooks[target])
    h = Harness()
    req = h.start("a", list(range(1, 41)))
    h.step([req], [req.origin_input_ids], extend=True)

    def scheduler(backend):
        return SimpleNamespace(tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(attn_backend=backend)))  # fmt: skip

    out = plugin.internal_state(GetInternalStateReqOutput(internal_state={"x": 1}),
                                scheduler(h.backend))  # fmt: skip
    st = out.internal_state["tiered_radix"]
    assert out.internal_state["x"] == 1
    assert st["requests"] == 1 and st["pool_bytes_used"] == h.sim.pool.bytes_used() > 0
    assert st["host_s"]["extend_batches"] == 1
    assert plugin.internal_state(GetInternalStateReqOutput(internal_state={}),
                                 scheduler(object())) is None  # fmt: skip


class _DeviceOnly:
    """``req_pool_indices`` that must not be read back (a host sync on CUDA)."""

    def tolist(self):
        raise AssertionError("read back from the device")


def test_extend_metadata_takes_the_slots_sglang_noted_not_a_device_read(baseline):
    """``ForwardBatch.init_new``'s hook hands the batch's request slots (host ints from SGLang's
    requests) to the backend, whose metadata then reads no ``req_pool_indices`` back, also from
    the copy of the batch SGLang's runner makes (``load_batch``); a batch of other requests
    falls back to the read."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.plugins.hook_registry import HookRegistry
    from test_backend import Harness, Mode

    target = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
    assert callable(ForwardBatch.init_new)
    assert any(h is plugin.forward_batch_made for _, h, _ in HookRegistry._hooks[target])
    h = Harness(blocks=sizing.PoolBlocks(256, 256))
    reqs = [h.start("a", list(range(1, 41))), h.start("b", list(range(3, 30)))]
    new = [r.origin_input_ids for r in reqs]
    locs, pre = h._locs(reqs, new)

    def batch():
        return SimpleNamespace(
            forward_mode=Mode(True), seq_lens_cpu=torch.tensor([len(r.tokens) for r in reqs]),
            req_pool_indices=_DeviceOnly(), extend_prefix_lens_cpu=pre,
            extend_seq_lens_cpu=[len(t) for t in new], rids=[r.rid for r in reqs],
            out_cache_loc=torch.cat(locs),
        )  # fmt: skip

    runner = SimpleNamespace(attn_backend=h.backend)
    seen = batch()
    others = [SimpleNamespace(rid="x", req_pool_idx=5), SimpleNamespace(rid="y", req_pool_idx=6)]
    plugin.forward_batch_made(SimpleNamespace(rids=["x", "y"]), ForwardBatch,
                              SimpleNamespace(reqs=others), runner)  # fmt: skip
    with pytest.raises(AssertionError, match="read back"):
        h.backend.init_forward_metadata(seen)  # noted for other requests: read back
    assert plugin.forward_batch_made(seen, ForwardBatch, SimpleNamespace(reqs=reqs), runner) is None
    h.backend.init_forward_metadata(batch())  # the runner's copy of the batch
    assert h.backend.pool_of == {r.rid: r.req_pool_idx for r in reqs}
    assert set(h.backend.sessions) == {"a", "b"}
    plugin.forward_batch_made(seen, ForwardBatch, SimpleNamespace(reqs=reqs), object())  # no-op
