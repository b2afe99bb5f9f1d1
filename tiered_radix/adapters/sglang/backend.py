"""``TieredAttnBackend`` (``--attention-backend tiered_triton``): attention over a
:class:`~.pool.TieredKVPool`, the scores the policy reads, and routing at the policy's schedule.

Per forward batch (:meth:`TieredAttnBackend.init_forward_metadata`, out of the layers):

- a request the backend has not seen *opens a view* (:meth:`~.radix.TieredRadixCache.open_view`:
  it borrows its matched prefix at the states the tree holds) and gets a :class:`Session`: a
  :class:`~tiered_radix.engine.store.TierStore` built with ``reader=`` (tiers, scores and byte
  counts only; its rows are the pool's) whose tiers start at the borrowed states;
- every request's view grows to its new length (:meth:`~.radix.TieredRadixCache.sync_view`).

Per layer (:meth:`forward_extend`, :meth:`forward_decode`): the new K/V go to the pool; each
request attends over what its view reads (``read``: full rows, ``dequantize(ledger copy)`` rows,
evicted rows masked) with :func:`~tiered_radix.adapters.transformers.attention.attend`, which
also returns the signals (``attn``; on extend ``colmass``/``obs_attn``/``qnorm`` when the policy
reads them), fed to the request's store. After the last layer, requests whose schedule is due
route: the store plans, and :meth:`~.radix.TieredRadixCache.route` moves the pool's blocks.

Extend routes after every chunk when the policy says ``after_prefill`` (as the transformers
adapter does); decode steps count per request, or per server forward under ``--kv-route-clock
server`` (then ``every(N)`` falls due for every running request at once: one routing every N
steps instead of one for each phase the requests' start times left). Extend runs the TriZone
extend kernel on CUDA (:func:`~.trizone.extend_layer`: one launch a layer for the batch, the
pool read in place, the policy's signals from the same launch, or a second one for
``colmass``, observed after the last layer); without it (the CPU, or ``--kv-extend
sdpa``/``exact``) it gathers rows per request and layer and attends with
``scaled_dot_product_attention`` under a kept/causal mask (float32 score blocks on CPU, or with
``--kv-extend exact``); decode runs the TriZone kernel over the pool's pages and rows in place
(:mod:`.trizone`) where it can read the pool, else PyTorch.

CUDA graphs (decode): SGLang calls :meth:`init_forward_metadata_out_graph` before capturing a
batch size and before every replay. It builds the step's lists on the host side as the eager
path does and copies them into :class:`~.graph.GraphDecode`'s fixed buffers (SGLang's replay
batch has no request ids: the plugin's ``execute`` hook hands over the forward batch's, and
each request's ``req_pool_idx`` is recorded at its extend; without the hook, the ids come from
the padded ``req_pool_indices``, a host sync);
the recorded forward only writes rows and launches the kernels. What follows the last layer
(observing the side output, routing) cannot be recorded: it runs at :meth:`flush`, before the
next forward's metadata or a request's view closes, so routing sees the same state as eager
routing after the step. Where the policy's scores allow it (``TierStore.attn_decay``) the side
output is not observed per step: the graph's buffer sums the steps (with the score's decay)
and :meth:`fold_pending` hands them to the engines at once, before routing or a list rebuild.
Batches over the buffers' capacity run eagerly.

The overlap scheduler (on unless ``--no-kv-overlap`` or SGLang's ``--disable-overlap-schedule``):
SGLang prepares and launches step t+1 before it processes step t's tokens, so a request that
finished at step t runs one more step (its token is dropped) and its view closes (``before_close``
-> :meth:`flush`) after step t+1 was launched. Other requests' steps, scores and routings are as in
the serial order (each store is its own). A decode step's routing (``late_landing``'s ``landing``)
lands one step late, when the next decode step is processed, and at no other time: not at a
close's flush, an extend or the next metadata, whose timing depends on the batch, so every
request's routings land at the same steps alone and in any batch. The parts of requests whose view
closes before they land (finished, aborted, retracted, flushed) are dropped: their windows stay at
the states their close left, so a request's routings after its last token never land, in any
batch. A close's flush only drops: a replayed step's work (observing, landing, planning) waits
for the next forward, so every request that ended at one step has closed before it runs
(SGLang closes them one by one, and the first close's flush landed the others' routings planned
after their last token: GPU run 34). It plans no routing for the closed requests either: it
would be dropped, and it would hold up their last token (a deferred first routing of a long
prompt runs long: bench/routing_notes.md). On the device every piece of
work runs in the order the host issued it: SGLang's forward stream waits for its schedule stream
before each forward, and the plugin's :func:`~.plugin.graph_execute` makes the schedule stream wait
for the whole replay.

Tensor parallelism (``--tp N``): each rank's pool holds its ``H / N`` KV heads and each request's
store is built with that rank's :class:`~tiered_radix.engine.shard.HeadShard` over SGLang's TP
group, so every rank plans over all ``H`` heads (one all-gather per routing step) and applies the
slice of its own heads: ranks decide the same tiers as one engine over all heads.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from tiered_radix.engine.attention import attend, attend_sdpa
from tiered_radix.engine.scores import ScoreEvaluator
from tiered_radix.engine.shard import HeadShard
from tiered_radix.engine.signals import PREFILL_SIGNALS, Signals, at_positions, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.kernels import decode

from . import graph, trizone, zone_decode
from .options import KVOptions
from .pool import TieredKVPool
from .profile import StepTimer
from .reps import S_A, S_Q, S_R, PoolConfigError
from .stats import BackendStats, log

CHUNK_ELEMS = {"cuda": 1 << 27, "cpu": 1 << 22}  # float32 scores per attention block


def tp_shard(runner, heads_local: int) -> HeadShard | None:
    """This rank's KV heads under ``--tp N`` (``runner.tp_group``, SGLang's GroupCoordinator:
    collectives on its device group); ``None`` without tensor parallelism."""
    group = getattr(runner, "tp_group", None)
    if group is None or group.world_size == 1:
        return None
    return HeadShard(
        group.rank_in_group, group.world_size, heads_local * group.world_size, group.device_group
    )


class RouteDigest:
    """Under ``--tp``: this rank's heads, and a digest of every routing so far (request,
    reason, the whole model's bytes held after it, budget, over-budget flag). It is equal on
    every rank when the ranks routed the same requests at the same steps over the same all-head
    totals. Routings are recorded by reference and hashed at :meth:`record` (``stats()``): no
    host sync when routing."""

    def __init__(self, shard: HeadShard) -> None:
        self.shard, self.digest, self.routes, self.pending = shard, hashlib.sha256(), 0, []

    def add(self, rid: str, why: str, store: TierStore) -> None:
        self.pending.append((rid, why, store.events.steps[-1]))

    def record(self) -> dict:
        for rid, why, ev in self.pending:
            rec = f"{rid}|{why}|{ev.bytes_used}|{ev.budget}|{int(ev.over_budget)}\n"
            self.digest.update(rec.encode())
        self.routes += len(self.pending)
        self.pending.clear()
        sh = self.shard
        return {
            "rank": sh.rank, "world": sh.world, "heads": [sh.start, sh.start + sh.heads_local],
            "routes": self.routes, "digest": self.digest.hexdigest(),
        }  # fmt: skip


@dataclass
class Session:
    """One request's tier engine: its store, and its step counters."""

    store: TierStore
    prefills: int = 0
    decode_steps: int = 0


@dataclass
class _Req:
    """One request of the current batch: rows ``[start, start + tq)`` of q, ``seq`` tokens."""

    rid: str
    session: Session
    start: int
    tq: int
    seq: int


def extend_attention(device, options: KVOptions):
    """The gather path's extend attention, ``--kv-extend``: ``attend_sdpa`` (``sdpa``: a fused
    kernel in the model's dtype, far faster than the float32 path: bench/extend_notes.md) or
    ``attend`` (``exact``, the default on CPU: float32, the engine's reference numbers). Under
    ``kernel`` (the default on CUDA) it serves batches the extend kernel cannot: ``sdpa`` on
    CUDA, ``exact`` on CPU."""
    mode = options.extend_on(device)
    if mode == "kernel":
        mode = "sdpa" if torch.device(device).type == "cuda" else "exact"
    return attend_sdpa if mode == "sdpa" else attend


def batch_rows(fb) -> tuple[list[int], list[int], list[int]] | None:
    """A forward batch's requests as rows: each one's length after the step, the tokens it held
    before (``prefix``) and its new ones; ``None`` for an idle batch.

    Raises:
        NotImplementedError: a forward mode other than extend and decode (target verify
            included), or a batch without request ids.
    """
    mode = fb.forward_mode
    if mode.is_idle():
        return None
    if not (mode.is_extend() or mode.is_decode()) or mode.is_target_verify():
        raise NotImplementedError(f"tiered_triton: forward mode {mode} is not supported")
    if fb.rids is None:
        raise NotImplementedError("tiered_triton: a forward batch without request ids")
    seqs = fb.seq_lens_cpu.tolist()
    if mode.is_extend():
        return seqs, list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
    return seqs, [s - 1 for s in seqs], [1] * len(seqs)


def window_starts(prefix: list[int], new: list[int], window: int) -> list[int]:
    """Indices among a batch's new tokens (request after request, ``new[i]`` tokens after
    ``prefix[i]``) of those at the first position of a window."""
    out, at = [], 0
    for pre, n in zip(prefix, new, strict=True):
        first = -(-pre // window) * window
        out.extend(range(at + first - pre, at + n, window))
        at += n
    return out


def due_routings(
    batch: list[_Req], extend: bool, clock: int | None = None
) -> list[tuple[_Req, str]]:
    """After a forward of ``batch``: count each request's prefill or decode step, and return
    those whose schedule (their own policy's) is due now, with the reason the engine records.
    ``clock``: the server's decode step (``--kv-route-clock server``), which ``every(N)`` then
    counts instead of each request's own step, so the running requests fall due together."""
    due = []
    for r in batch:
        s = r.session
        if extend:
            s.prefills += 1
            if s.store.policy.schedule.after_prefill:
                due.append((r, f"after prefill {s.prefills}"))
        else:
            step, s.decode_steps = s.decode_steps, s.decode_steps + 1
            if s.store.schedule_due(step if clock is None else clock):
                due.append((r, f"decode step {step}"))
    return due


def common_decay(policies) -> float | None:
    """The decay at which every policy's decode attention folds (``TierStore.attn_decay``), or
    None (each step observed) where one cannot fold or two differ."""
    decays = {ScoreEvaluator(p, 1, 1).attn_decay() for p in policies}
    return decays.pop() if len(decays) == 1 else None


class TieredAttnBackend(AttentionBackend):
    """``options``: the launch's ``--kv-*`` flags (defaults when omitted). Extend attention
    runs through the TriZone extend kernel (:func:`~.trizone.extend_layer`: the pool read in
    place, one launch a layer for the whole batch) where ``--kv-extend`` is ``kernel`` (the
    default on CUDA) and it can read the pool; ``sdpa``/``exact`` name the gather path's
    attention (the path before the kernel; on CPU ``exact`` is the reference).

    ``policies``: every policy a request may run with (the launch's :class:`~.catalog.Catalog`;
    default: the pool's): the signals computed are those any of them reads, and each request's
    engine runs its own policy and budget (:meth:`~.radix.TieredRadixCache.request_kv`).

    Raises:
        PoolConfigError: the model runner's pool is not a :class:`TieredKVPool`.
    """

    def __init__(self, runner, options: KVOptions | None = None, policies=None) -> None:
        super().__init__()
        self.options = options = options or KVOptions()
        pool = runner.token_to_kv_pool
        if not isinstance(pool, TieredKVPool):
            raise PoolConfigError(f"tiered_triton needs a TieredKVPool, got {type(pool).__name__}")
        self.pool, self.policy, self.budget = pool, pool.policy, pool.budget
        self.policies = tuple(policies or (self.policy,))
        self.layers = pool.layer_num
        self.last_layer = pool.start_layer + pool.layer_num - 1
        reads = set().union(*(policy_reads(p) for p in self.policies))
        self.prefill_needs = frozenset(reads & set(PREFILL_SIGNALS))
        # the extend kernel computes only what the policy reads (attn of the last query too)
        self.extend_needs = self.prefill_needs | frozenset(reads & {"attn"})
        # decode attention mass (the kernel's side output): only for policies that read it
        self.decode_attn = "attn" in reads
        # replayed steps sum the side output on the device and fold it in before routing, where
        # the policy's scores allow it (TierStore.attn_decay); else every step is observed
        fold = options.observe == "fold"
        self.fold_decay = common_decay(self.policies) if fold else None
        self.sessions: dict[str, Session] = {}
        self.batch: list[_Req] = []
        self.extend = False
        self.capturing = False  # the extend batch is a prefill graph's capture (_metadata)
        self.out_loc: torch.Tensor | None = None  # the eager batch's slots (_metadata)
        self.counters = BackendStats(path=options.stats)
        self.kernel = self._use_kernel()
        self.extend_attend = extend_attention(pool.device, options)
        self.extend_kernel = self._use_extend_kernel()
        self.extend_kernel_batches = 0  # extend forwards the kernel served
        self.ebatch: trizone.ExtendBatch | None = None
        self.kernel_error: str | None = None
        self.dbatch: trizone.DecodeBatch | None = None
        model = getattr(runner, "model_config", None)
        self.context_len = getattr(model, "context_len", None) or pool.size
        self.graph: graph.GraphDecode | None = None  # init_cuda_graph_state's buffers
        self._warned_graph_tokens = False  # a batch too long for the graphs was logged
        self.graph_bs: int | None = None  # the captured batch size this step runs at, if any
        self.pending = False  # a captured step's observe/route waits for flush()
        self.landing: tuple | None = None  # a routing planned, moving at the next flush()
        self.closed: set[str] = set()  # requests closed since the replayed step's work waits
        # a decode routing lands one step late only where SGLang's overlap scheduler runs: not
        # under --no-kv-overlap, a user's --disable-overlap-schedule or a runner without
        # server args (a serial stand-in)
        args = getattr(runner, "server_args", None)
        self.late_landing = options.overlap and not getattr(args, "disable_overlap_schedule", True)
        self.decode_clock = 0  # decode forwards so far (--kv-route-clock server's step)
        self._tiers_of: dict[str, torch.Tensor] = {}  # holder state -> engine tier, per device
        self.rid_of: dict[int, str] = {}  # req_pool_idx -> rid (replays carry no rids)
        self.pool_of: dict[str, int] = {}  # rid -> req_pool_idx, for the same
        self.replay_rids: list[str] | None = None  # the next replay's, from the plugin's hook
        self.noted: tuple | None = None  # (rids, slots) of the next forward: note_slots
        self.graph_last: tuple | None = None  # the last replay's (bs, pools, seqs, remaps)
        self.relist = False  # blocks moved since the last replay's lists: rebuild them
        self.mass_rows: list[_Req] = []  # whose engines the graphs' side output rows are for
        timing = options.device_times and torch.device(pool.device).type == "cuda"
        self.timer = StepTimer(timing, options.profile)  # host/device times, see stats()
        self._timed = self.timer.phase
        self.shard, self.tp = tp_shard(runner, pool.head_num), None
        if self.shard is not None:
            self.counters.rank, self.tp = self.shard.rank, RouteDigest(self.shard)

    def _kernels_run(self) -> bool:
        """Whether the TriZone kernels can serve this pool: its layout is one they read, and
        Triton runs here (a GPU, or the interpreter on CPU)."""
        runs = self.pool.device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
        return runs and trizone.supported(self.pool)

    def _use_kernel(self) -> bool:
        """Decode with the TriZone kernel (``--kv-decode kernel``) where it can serve."""
        return self.options.decode == "kernel" and self._kernels_run()

    def _use_extend_kernel(self) -> bool:
        """Extend through the TriZone extend kernel (``--kv-extend kernel``, the default on CUDA)
        where it can serve."""
        return self.options.extend_on(self.pool.device) == "kernel" and self._kernels_run()

    # -- per batch -------------------------------------------------------------------------
    @property
    def tree(self):
        tree = self.pool.tree
        if tree is None:
            raise PoolConfigError("tiered_triton needs --radix-cache-backend tiered")
        tree.connect(self.flush, self._after_reset)
        return tree

    def _after_reset(self) -> None:
        """SGLang's ``flush_cache`` emptied the tree: the stats file is rewritten (a reader
        that flushes gets the host seconds of forwards that did not route)."""
        self.counters.publish(self.stats, True)

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            self.timer.decode_step()
        elif fb.forward_mode.is_extend():
            self.timer.extend_batch()
        # the rows of the windows this forward opens, which SGLang's checks counted free, stay
        # free of the moves a landing or a rows-short routing makes before they open
        with self.pool.rows_held(self._opens(fb)):
            self.flush()
            self.fold_pending()  # an eager forward may open windows, route or change the batch
            self.graph_last = None  # an eager forward may open windows or route: lists rebuild
            extend = fb.forward_mode.is_extend()
            with self._timed("metadata_extend" if extend else "metadata"):
                self._metadata(fb)
        if self.batch:
            self.timer.count("extend_batches" if self.extend else "decode_steps")

    def _opens(self, fb) -> int:
        """How many windows the eager forward ``fb`` opens (its tokens at a window's first
        position; host ints): 0 for a batch without request ids (a graph capture's) or one
        :meth:`_metadata` refuses."""
        if fb.rids is None or fb.forward_mode.is_idle():
            return 0
        try:
            _, prefix, new = batch_rows(fb)
        except NotImplementedError:
            return 0  # _metadata raises it, after the flush as before
        return len(window_starts(prefix, new, self.pool.layout.window))

    def _metadata(self, fb) -> None:
        self.batch, self.dbatch, self.graph_bs, self.ebatch = [], None, None, None
        # SGLang's prefill graph runner captures (and warms up) on a dummy batch: no request ids
        self.capturing = fb.forward_mode.is_extend() and fb.rids is None
        if self.capturing:
            self.extend = True
            return
        # the slots the batch writes: a prefill graph's replay hands the layers a copy of them
        # (its static buffer), the rows prepared below are for these
        self.out_loc = fb.out_cache_loc
        rows = batch_rows(fb)
        if rows is None:
            return
        self.extend = fb.forward_mode.is_extend()
        seqs, prefix, new = rows
        # a batch's new windows are where its tokens begin one: known on the host, no sync
        starts = window_starts(prefix, new, self.pool.layout.window)
        self._make_rows(list(fb.rids), len(starts))
        self._admit(list(fb.rids), self._slots(fb), seqs, prefix, new)
        self.pool.end_step()
        # open new windows, find rows in every layer
        self.pool.prepare_write(fb.out_cache_loc, starts=starts)

    def note_replay(self, rids: list[str] | None) -> None:
        """The request ids of the decode graph replay about to run, as the plugin's hook on the
        graph runner's ``execute`` reads them from SGLang's forward batch (the replay view the
        metadata gets has none); None: read them back from its padded ``req_pool_indices``."""
        self.replay_rids = None if rids is None else list(rids)

    def note_slots(self, fb, slots: list[int]) -> None:
        """The request slots (``req_pool_idx``, host ints) of the forward batch ``fb`` about to
        run, as the plugin's hook on ``ForwardBatch.init_new`` reads them from SGLang's requests:
        its metadata then need not read ``fb.req_pool_indices`` back from the device, a host
        sync that under the overlap scheduler waits for the forward in flight
        (bench/extend_notes.md measured what it cost). Matched by
        request ids: SGLang's runner hands the metadata a copy of ``fb`` (its ``load_batch``), and
        a running request keeps its slot."""
        self.noted = (list(fb.rids or ()), list(slots))

    def _slots(self, fb) -> list[int]:
        """The slots of ``fb``'s requests: noted for the same requests (:meth:`note_slots`),
        else read from the device."""
        noted, self.noted = self.noted, None
        if noted is not None and noted[0] == list(fb.rids) and len(noted[1]) == len(noted[0]):
            return noted[1]
        return fb.req_pool_indices.tolist()

    def _admit(self, rids, pools, seqs, prefix, new) -> None:
        """The batch's requests: views opened (new requests) and grown to their lengths, their
        engines told of the new tokens; sessions of finished requests dropped."""
        tree = self.tree
        start = 0
        for rid, idx, seq, pre, tq in zip(rids, pools, seqs, prefix, new, strict=True):
            self.rid_of[idx], self.pool_of[rid] = rid, idx
            req = SimpleNamespace(rid=rid, req_pool_idx=idx)
            if rid not in tree.views:  # a new request, or one retracted and scheduled again
                if not self.extend:
                    raise AssertionError(f"decode of request {rid} without a view")
                self.sessions[rid] = self._open(tree, req, pre, seq)
            tree.sync_view(req, seq)
            sess = self.sessions[rid]
            grown = seq - sess.store.n_tokens(0)
            sess.store.append_tokens(None, grown)
            self.batch.append(_Req(rid, sess, start, tq, seq))
            start += tq
        for rid in [r for r in self.sessions if r not in tree.views]:
            del self.sessions[rid]  # finished or aborted: the tree closed its view
            self.pool_of.pop(rid, None)

    # -- CUDA graphs (decode) --------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The fixed buffers of every batch size SGLang captures (up to ``max_bs``).

        Raises:
            PoolConfigError: decode cannot run the TriZone kernel here (the gather path is not
                capturable).
        """
        if not self.kernel:
            raise PoolConfigError(
                "tiered_triton decodes under CUDA graphs through the TriZone kernel, which cannot "
                f"read this pool (window {self.pool.layout.window}, head dim {self.pool.head_dim}"
                f", --kv-decode {self.options.decode}): relaunch with "
                "--disable-cuda-graph"
            )
        tokens = self.options.graph_tokens
        if tokens is None:  # sized by the batches and the memory free now (graph.auto_tokens)
            pool, dev = self.pool, torch.device(self.pool.device)
            L, H, W = pool.layer_num, pool.head_num, pool.layout.window
            per = graph.token_bytes(L, H, pool.head_dim, W, max_bs, graph.lists_pages(pool))
            n_max = graph.unit_count(pool, self.context_len)
            mass = graph.mass_bytes(L, H, max_bs, n_max) if self.decode_attn else 0
            free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
            if self.shard is not None:  # one capacity on every rank: they replay alike
                free = int(self.shard.least(torch.tensor([free], device=dev))[0])
            tokens = graph.auto_tokens(max_bs, self.context_len, W, per, free, mass)
        tokens = graph.capacity(self.context_len, tokens)
        self.graph = graph.GraphDecode(self.pool, max_bs, tokens, self.context_len,
                                       self.decode_attn, self.fold_decay,
                                       splits=self.options.graph_splits)  # fmt: skip
        nbytes = self.graph.nbytes()
        log.info("tiered-radix: decode CUDA graphs up to batch %d, %d tokens, %.1f MiB of "
                 "buffers", max_bs, tokens, nbytes / (1 << 20))  # fmt: skip

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_fits(self, seq_lens: list[int]) -> bool:
        """Whether a decode batch of these lengths can replay a captured graph. A batch within
        the captured sizes whose tokens exceed the buffers' runs eagerly: counted
        (``host_s["graph_too_long"]`` in :meth:`stats`), and the first one logged with the
        ``--kv-graph-tokens`` it needs."""
        if self.graph is None:
            return False
        if self.graph.fits(seq_lens):
            return True
        if len(seq_lens) <= self.graph.max_bs:
            self.timer.count("graph_too_long")
            if not self._warned_graph_tokens:
                self._warned_graph_tokens = True
                need = sum(seq_lens) + self.pool.layout.window * len(seq_lens)
                log.warning(
                    "tiered-radix: a decode batch of %d requests, %d tokens, runs without CUDA "
                    "graphs: the graphs' buffers hold %d tokens (--kv-graph-tokens %d or more "
                    "would fit it)", len(seq_lens), sum(seq_lens), self.graph.tokens, need,
                )  # fmt: skip
        return False

    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:
        """Before capturing batch size ``fb.batch_size`` (every request padding) and before
        each replay (the first ``bs - num_padding`` requests are real): the step's views, engines,
        write rows and index lists, into the graph's buffers. The rows of the windows the step
        opens are held from moves until they open (as in :meth:`init_forward_metadata`)."""
        if in_capture:
            return self._graph_metadata(fb, in_capture)
        self.timer.decode_step()
        raw = fb.batch_size - (getattr(fb, "num_padding", 0) or 0)
        prev = [s - 1 for s in fb.seq_lens_cpu[:raw].tolist()]  # before each new token
        opens = window_starts(prev, [1] * raw, self.pool.layout.window)
        with self.pool.rows_held(len(opens)):
            self._graph_metadata(fb, in_capture)

    def _graph_metadata(self, fb, in_capture: bool) -> None:
        """:meth:`init_forward_metadata_out_graph`'s work: the last step's routing, then this
        step's views, rows and lists."""
        self.flush()
        bs, g, H = fb.batch_size, self.graph, self.pool.head_num
        if in_capture:
            self._graph_step(bs, same=False)
            self.graph_last, self.mass_rows = None, []
            g.clear(bs)
            self.pool.graph_write(fb.out_cache_loc[:0], g.dest[:, : bs * H])
            return
        with self._timed("metadata"):
            raw = bs - (getattr(fb, "num_padding", 0) or 0)
            rids, self.replay_rids = self.replay_rids, None
            if rids is not None:  # no host sync: under overlap, step t-1 may still run
                rids = list(rids[:raw])
                pools = [self.pool_of[r] for r in rids]
            else:  # a replay not launched through the plugin's hook
                pools = fb.req_pool_indices[:raw].tolist()
                rids = [self.rid_of[p] for p in pools]
            seqs = fb.seq_lens_cpu[:raw].tolist()
            prev = [s - 1 for s in seqs]  # each request's length before its new token
            W = self.pool.layout.window
            # an insert that replaced a request's windows by the tree's freed its duplicates'
            # rows (SGLang's insert after a prefill runs after the next step's metadata)
            remaps = [self.tree.views[r].remaps if r in self.tree.views else -1 for r in rids]
            # the same requests, a token more each, none of whose windows were replaced
            same = self.graph_last == (bs, pools, prev, remaps)
            # and neither a routing's moves nor a new window since: the lists stand
            steady = same and not self.relist and all(p % W for p in prev)
            self._graph_step(bs, same)
            starts = [] if steady else window_starts(prev, [1] * raw, W)
            self._make_rows(rids, len(starts))
            self._admit(rids, pools, seqs, prev, [1] * raw)
            if not steady:  # the real requests' tokens: which begin a window is known here
                self.pool.graph_write(fb.out_cache_loc[:raw], g.dest[:, : bs * H], starts)
        with self._timed("decode_lists"):
            if steady:  # the lists hold the new rows already: their ends move on
                g.advance(raw)
                self.pool.graph_rows(g.dest[:, : bs * H])
                self.timer.count("steady_steps")
            else:
                views = [self.tree.views[r.rid] for r in self.batch]
                if self.pool.zones is not None:  # decoupled: Zone A pages and window rows
                    rids = [r.rid for r in self.batch]
                    ls = zone_decode.lists(self.pool, rids, views, seqs, g.n_max, ahead=True)
                else:
                    # a few layers at a time: bounded temporaries at any batch
                    ls = trizone.candidate_chunks(self.pool, views, seqs, g.n_max, ahead=True)
                g.load(bs, ls, carry=same)
                self.relist = False
        self.graph_last, self.mass_rows = (bs, pools, seqs, remaps), self.batch
        self.pending = True
        self.timer.count("decode_steps")
        self.timer.count("graph_steps")
        self.timer.replay_starts()  # SGLang launches the replay after this

    def _graph_step(self, bs: int, same: bool) -> None:
        """A step of captured batch size ``bs`` begins (no requests yet). Unless the batch stays
        the ``same`` (every unit keeps its place in the side output, which sums on), the summed
        side output goes to the engines first."""
        if not same:
            self.fold_pending()
        self.batch, self.extend, self.graph_bs, self.ebatch = [], False, bs, None
        self.dbatch = self.graph.batches.get(bs)  # made by the capture's first layer (q heads)
        self.pool.end_step()

    def replay_done(self) -> None:
        """After SGLang launched a decode graph (its runner's ``execute``): with
        ``--kv-device-times``, the end mark of the replay's device time."""
        self.timer.replay_launched()

    def flush(self, closing: list[str] = ()) -> None:
        """A replayed decode step's work after its last layer, which a graph cannot record:
        the side output to each request's engine, and routing where due. Runs before the next
        forward's metadata, so routing happens before anything reads its result, as in eager
        mode, and before requests' views close (:attr:`~.radix.TieredRadixCache.before_close`,
        with their ids as ``closing``). Under the overlap scheduler a close only drops the
        closing requests' parts of the pending routing, and the step's work waits for the next
        forward, after SGLang has closed every request that ended at the step it processes
        (they close one by one): run at the first close, it would land the routings of those
        closing after it, planned after their last token (GPU run 34: two requests ending at
        one step, the second routed once more than alone)."""
        if closing:  # routings of theirs still to land would be read by nobody
            self._drop(lambda r: r.rid in closing)
            if self.late_landing:
                self.closed.update(closing)
                return
        self._replayed_work()
        self.closed.clear()

    def _replayed_work(self) -> None:
        """:meth:`flush`'s work of the replayed step, if one is pending."""
        if not self.pending:
            return
        self.pending = False
        self.counters.kernel_steps += 1
        self.timer.replay_done()  # its device time is read at stats(), no wait
        folds = self.graph.decay is not None
        if self.dbatch is not None and self.dbatch.mass is not None and not folds:
            with self._timed("observe"):
                self._observe_decode()
        with self._timed("route"):
            if self._route_due():  # blocks moved: the next step rebuilds its lists
                self.relist = True

    def fold_pending(self, only: list[_Req] | None = None) -> None:
        """The side output summed over replayed steps (:class:`~.graph.GraphDecode` with a
        decay) into each request's engine, in one fold: before the batch changes (other
        requests, or an eager forward) every request's, before a routing ``only`` the routed
        requests' (the others' rows keep summing: a request clock routes one or two of a
        large batch at a step). Counted as ``folds``."""
        g = self.graph
        db = g.pending() if g is not None else None
        if db is None:
            return
        reqs = self.mass_rows  # the replayed batch (this step's is not admitted yet)
        picked = None if only is None else {id(r) for r in only}
        rows = None if picked is None else [b for b, r in enumerate(reqs) if id(r) in picked]
        todo = [b for b in (range(len(reqs)) if rows is None else rows) if g.row_steps[b]]
        if not todo:
            return
        self.timer.count("folds")
        with self._timed("observe"):
            W = self._unit_tokens()  # the side output is per window (per token: decoupled)
            L, bs, HN = db.mass.shape
            mass = db.mass.view(L, bs, HN // db.n_max, db.n_max)
            for b in todo:
                r = reqs[b]
                r.session.store.fold_attn(mass[:, b, :, : -(-r.seq // W)], g.row_steps[b], W)
            g.folded(rows)

    def _open(self, tree, req, prefix_len: int, n_tokens: int) -> Session:
        """Borrow the matched prefix; the store's tiers start at the borrowed states. The
        store runs the request's own policy and budget (its ``kv_policy`` / ``kv_budget``),
        its tier maps made for the ``n_tokens`` the request holds after this batch."""
        view = tree.open_view(req, prefix_len)
        kv = tree.request_kv(req.rid)
        store = TierStore(
            kv.policy, n_layers=self.layers, n_heads=self.pool.head_num,
            head_dim=self.pool.head_dim, dtype=self.pool.dtype, device=self.pool.device,
            budget_override=kv.budget, reader=lambda li: self._read(req.rid, li),
            shard=self.shard, max_tokens=n_tokens, history=1,  # moves are counted in stats
        )  # fmt: skip
        n = view.windows.numel()
        if n:
            store.append_tokens(None, prefix_len)
        if n and self.pool.zones is None:  # decoupled windows are full rows: nothing to seed
            lay, states = self.pool.layout, view.state.long()  # [L, H, n]
            copied = (states == S_Q) | ((states == S_R) & lay.write_once)
            store.seed_states(self._state_tiers(store.device)[states], copied)
            self.counters.borrowed((states == S_Q).sum())
        return Session(store)

    def _read(self, rid: str, li: int):
        t = self.sessions[rid].store.n_tokens(li)
        if self.pool.zones is not None:  # decoupled: its Zone A pages, and rows
            windows = self.tree.views[rid].windows
            return self.pool.read_request(rid, li + self.pool.start_layer, windows, t)
        k, v, kept = self.tree.read(rid, li + self.pool.start_layer)
        return k[:, :t], v[:, :t], kept[:, :t]

    # -- per layer -------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True, **_kw):
        return self._forward(q, k, v, layer, fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True, **_kw):
        return self._forward(q, k, v, layer, fb, save_kv_cache)

    def _forward(self, q, k, v, layer, fb, save_kv_cache: bool):
        if getattr(layer, "logit_cap", 0) or (getattr(layer, "sliding_window_size", -1) or -1) > 0:
            raise NotImplementedError("tiered_triton: logit caps and sliding windows unsupported")
        if self.capturing and fb.forward_mode.is_extend():
            # a prefill graph's capture records the layers around this call, which its replays
            # make again with the batch's own metadata (eager, as any other extend): nothing
            # is written or routed for the capture's dummy tokens
            return q.new_zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if save_kv_cache and k is not None:
            loc = fb.out_cache_loc if self.graph_bs is not None else self.out_loc
            with self._timed("write_extend" if self.extend else "write"):
                self.pool.set_kv_buffer(layer, loc, k, v)
        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.reshape(-1, hq, layer.qk_head_dim)
        li = layer.layer_id - self.pool.start_layer
        if self.graph_bs is not None:  # a captured decode step: what the graph records
            out = self._decode_kernel(q3, layer, li)
            return out.reshape(-1, hq * dv)
        if self.kernel and not self.extend:
            try:
                with self._timed("decode_kernel"):
                    out = self._decode_kernel(q3, layer, li)
            except Exception as err:  # e.g. a Triton compile error on this GPU: keep serving
                if li != 0 or self.counters.kernel_steps:
                    raise  # a later layer or step: outputs of this step are already mixed
                log.exception("tiered-radix: decode kernel failed; using the PyTorch path")
                self.kernel, self.kernel_error = False, repr(err)[:500]
                out = self._gather(q3, layer, li, dv)
            else:
                self.counters.kernel_steps += li == 0
        elif self.extend and self.extend_kernel and self._rows_only():
            try:
                with self._timed("extend_attend"):
                    out = self._extend_kernel(q3, layer, li)
            except Exception as err:  # e.g. a Triton compile error on this GPU: keep serving
                if li != 0 or self.extend_kernel_batches:
                    raise
                log.exception("tiered-radix: extend kernel failed; using the PyTorch path")
                self.extend_kernel, self.kernel_error, self.ebatch = False, repr(err)[:500], None
                out = self._gather(q3, layer, li, dv)
        else:
            with self._timed("extend_attend" if self.extend else "decode_gather"):
                out = self._gather(q3, layer, li, dv)
        if layer.layer_id == self.last_layer:
            if self.ebatch is not None:
                with self._timed("observe_extend"):
                    self._observe_extend()
            if self.dbatch is not None and self.kernel and self.dbatch.mass is not None:
                with self._timed("observe"):
                    self._observe_decode()
            with self._timed("route_extend" if self.extend else "route"):
                self._route_due()
        return out.reshape(-1, hq * dv)

    def _gather(self, q3, layer, li: int, dv: int):
        """Attention over each request's rows as read from the pool (PyTorch: extend through
        :func:`extend_attention`'s choice, decode without the kernel in float32). Windows that
        every head evicted are not read (``read_live``): a long prompt at a 10% budget reads a
        fraction of its rows; the signals go back to their tokens' positions."""
        out = q3.new_empty(q3.shape[0], q3.shape[1], dv)
        need = self.prefill_needs if self.extend else frozenset()
        fn = self.extend_attend if self.extend else attend
        elems = CHUNK_ELEMS.get(q3.device.type, 1 << 22)
        for r in self.batch:
            t = r.session.store.n_tokens(li)
            if self.pool.zones is not None:
                kk, vv, kept = self._read(r.rid, li)
                pos = torch.arange(t, device=kk.device)
            else:
                kk, vv, kept, pos = self.tree.read_live(r.rid, li + self.pool.start_layer, t)
            qi = q3[r.start : r.start + r.tq].transpose(0, 1)
            o, signals = fn(qi, kk, vv, kept, float(layer.scaling), need=need, chunk_elems=elems)
            out[r.start : r.start + r.tq] = o.transpose(0, 1).to(out.dtype)
            r.session.store.observe(li, at_positions(signals, pos, t))
        return out

    def _extend_kernel(self, q3, layer, li: int):
        """The batch's new tokens: the TriZone extend kernel over the pool in place (lists of
        every layer built at the first layer), the signals the policy reads kept for
        :meth:`_observe_extend`."""
        if self.ebatch is None:
            views = [self.tree.views[r.rid] for r in self.batch]
            with self._timed("extend_lists"):
                self.ebatch = trizone.build_extend(
                    self.pool, views, [r.tq for r in self.batch], [r.seq for r in self.batch],
                    q3.shape[1] // self.pool.head_num, self.extend_needs,
                )  # fmt: skip
        q = q3.to(self.pool.dtype).contiguous()
        out = trizone.extend_layer(self.pool, self.ebatch, li, q, float(layer.scaling))
        return out.to(q3.dtype)

    def _observe_extend(self) -> None:
        """After the last layer: every layer's extend signals to each request's engine, all
        layers at once (:meth:`~tiered_radix.engine.store.TierStore.observe_layers`: one op a
        ``cumulative`` score a request; the latest signals are kept as views of the batch's)."""
        eb = self.ebatch
        self.extend_kernel_batches += 1
        signals, qnorm = eb.signals(), eb.qnorm()  # every layer's and request's at once
        for b, r in enumerate(self.batch):
            store = r.session.store
            t = store.n_tokens(0)
            sig = {n: x[:, b, :, :t] for n, x in signals.items()}
            qn = None if qnorm is None else qnorm[:, b]
            store.observe_layers(Signals(qnorm=qn, **sig))

    def _decode_kernel(self, q3, layer, li: int):
        """One decode token per request: the TriZone kernel over the pool's pages and rows,
        with the per-window attention mass as the ``attn`` signal."""
        if self.dbatch is None and self.graph_bs is not None:
            self.dbatch = self.graph.batch(self.graph_bs, q3.shape[1])
        if self.dbatch is None:
            views = [self.tree.views[r.rid] for r in self.batch]
            seqs = [r.seq for r in self.batch]
            with self._timed("decode_lists"):
                if self.pool.zones is not None:  # decoupled: Zone A pages and window rows
                    self.dbatch = zone_decode.build(
                        self.pool, [r.rid for r in self.batch], views, seqs, q3.shape[1],
                        side_output=self.decode_attn, splits=self.options.graph_splits,
                    )  # fmt: skip
                else:
                    self.dbatch = trizone.build(
                        self.pool, views, seqs, q3.shape[1], side_output=self.decode_attn,
                        splits=self.options.graph_splits,
                    )  # fmt: skip
        db = self.dbatch
        out = decode.run(
            q3.to(self.pool.dtype).contiguous(), db.layouts[li], db.plan,
            mass=None if db.mass is None else db.mass[li],
            sm_scale=float(layer.scaling),
        )  # fmt: skip
        return out.to(q3.dtype)

    def _observe_decode(self) -> None:
        """After the last layer: every layer's per-window mass to each request's engine (those
        whose view is still open: a replayed step's work runs after the requests that ended at
        it closed)."""
        attn = trizone.window_attn(self.dbatch, self._unit_tokens())
        for b, r in enumerate(self.batch):
            if not self._ended(r):
                r.session.store.observe_attn(attn[:, b, :, : r.seq])

    # -- routing ---------------------------------------------------------------------------
    def _route_due(self) -> bool:
        """Route the batch's requests whose schedule is due; whether blocks moved now. Under
        SGLang's overlap scheduler a decode step's routing is planned and its masks computed
        now, and it lands (units and blocks move) when the next decode step is processed here
        (a replay's at :meth:`flush`, an eager step's at its last layer), so the host does not
        wait for the device: the next step still reads the old tiers (one step late), and
        every request's routings land at the same steps in any batch, whatever closes or
        prefills in between; requests that closed since their step ran are not planned (their
        part would not land: :meth:`_ended`).
        An extend batch lands the pending routing only where its requests are in it (mixed
        chunks: a store takes no routing while one of its own is pending)."""
        landed = False
        if not self.extend or self._pending_for(self.batch):
            landed = self._land()
        alloc = self.tree.token_to_kv_pool_allocator  # tokens held: running and tree-cached
        self.counters.forward_done(self.pool, alloc.size - alloc.available_size())
        clock = None
        if not self.extend and self.options.route_clock == "server":
            clock, self.decode_clock = self.decode_clock, self.decode_clock + 1
        due = due_routings(self.batch, self.extend, clock)
        if not self.extend:
            self.counters.request_decode_steps += len(self.batch)
        if self.late_landing:  # the ended (closed since the step ran) would not land
            due = [(r, why) for r, why in due if not self._ended(r)]
        if due:  # their scores up to date (replayed steps summed their attention)
            self.fold_pending([r for r, _ in due])
        # planned together (one pass over their stacked layers), then one pool move for all
        stores = [r.session.store for r, _ in due]
        pending = TierStore.begin_routes(stores, [why for _, why in due], prefill=self.extend)
        if due and self.late_landing and not self.extend:
            self.landing = (due, pending)
            return landed
        return self._moved(due, pending) or landed

    def _make_rows(self, rids: list[str], windows: int) -> None:
        """Before a forward of requests ``rids`` opens ``windows`` new windows: rows for them,
        by :meth:`_route_for_rows` where the free rows and the radix cache's do not hold them
        (in a decoupled pool a routing repacks, and the windows its pages cover give their rows
        when :meth:`~.pool.TieredKVPool.open_windows` next reclaims)."""
        if windows and not self.pool.rows_for_windows(windows):
            self._route_for_rows(rids)

    def _route_for_rows(self, rids: list[str]) -> None:
        """The batch's new windows do not fit the free row blocks, even after the radix cache
        gave back what no running request holds: the batch's requests, and every request whose
        routing waits (``after_prefill(defer=true)``: every token so far at full precision;
        e.g. a chunked prompt SGLang holds back this round), route now, before this batch's
        tokens join them, so the windows their routing demotes or evicts free rows. A prompt
        longer than the rows hold is prefilled in routed pieces instead of a forward failing
        (``PoolFullError``), and its routing after the last chunk still waits for the question,
        as the policy says; a decoding request's windows that left the protected recent tokens
        since its last routing go to their tier. Only under this pressure, so a request's tiers
        then depend on what else the pool holds (as SGLang's retractions do). Counted as
        ``rows_routings``."""
        waiting = [rid for rid, sess in self.sessions.items() if sess.store.deferred]
        due = []
        for rid in dict.fromkeys([*rids, *waiting]):  # in order, once each
            sess = self.sessions.get(rid)
            if sess is None or rid not in self.tree.views:
                continue  # new to this batch, or closed: nothing of it is held
            due.append((_Req(rid, sess, 0, 0, sess.store.n_tokens(0)), "rows short"))
        if not due:
            return
        if self._pending_for([r for r, _ in due]):  # a store takes no routing while its own is
            self._land()  # pending: under this pressure it lands now, a step early
        self.fold_pending()
        with self._timed("route_rows"):
            stores = [r.session.store for r, _ in due]
            self._moved(due, TierStore.begin_routes(stores, [why for _, why in due]))
        self.counters.rows_routings += len(due)

    def _land(self) -> bool:
        """A routing left pending by :meth:`_route_due` moves now; whether one did. Requests
        that ended since it was planned (finished, aborted, retracted, flushed: their view
        closed) drop out of it; the others' parts land."""
        self._drop(self._ended)
        if self.landing is None:
            return False
        (due, pending), self.landing = self.landing, None
        with self._timed("route"):
            return self._moved([d for d in due if d is not None], pending)

    def _drop(self, ended) -> None:
        """The parts of the pending routing whose request ``ended(_Req)`` are dropped: its
        windows stay at the states they hold (counted as ``dropped_routings``). A request's
        last routings are dropped so, in any batch: planned after its last token or the step
        after it (the overlap scheduler runs one more), they would land after it ended."""
        if self.landing is None:
            return
        due, pending = self.landing
        for i, d in enumerate(due):
            if d is not None and ended(d[0]):
                pending.drop(i)
                due[i] = None
                self.counters.dropped_routings += 1
        if all(d is None for d in due):
            self.landing = None

    def _pending_for(self, batch: list[_Req]) -> bool:
        """Whether a request of ``batch`` has a part in the pending routing."""
        if self.landing is None:
            return False
        rids = {r.rid for r in batch}
        return any(d is not None and d[0].rid in rids for d in self.landing[0])

    def _ended(self, r: _Req) -> bool:
        """Whether request ``r`` closed since its step ran (its view, or a close's flush)."""
        return r.rid in self.closed or not self._live(r)

    def _live(self, r: _Req) -> bool:
        """Whether request ``r``'s view is still open, with the session ``r`` was planned in."""
        return r.rid in self.tree.views and self.sessions.get(r.rid) is r.session

    def _moved(self, due, pending) -> bool:
        """The engines' moves of ``pending`` (their routings, for ``due``), then the pool's: a
        coupled pool moves windows; in a decoupled one each request that routed repacks."""
        steps = [r.session.store.step for r, _ in due]
        moves = pending.land()
        if self.pool.zones is not None:
            for (r, _), step in zip(due, steps, strict=True):
                if r.session.store.step != step:
                    self._repack(r)
        else:
            routed = [(r.rid, m) for (r, _), m in zip(due, moves, strict=True)]
            settled = self.tree.route_many(routed)
            if settled:  # the pool may have been short of blocks
                self._settle(settled)
        if self.tp is not None:
            for r, why in due:
                self.tp.add(r.rid, why, r.session.store)
        self.counters.routed(moves, self.pool.device, [r.session.store for r, _ in due])
        self.counters.deferred_routings += sum(r.session.store.deferred for r, _ in due)
        # the stats file after a routing that planned: a deferred one (a prefill chunk under
        # after_prefill(defer=true)) moved nothing, and its snapshot's host sync would wait for
        # the chunk's forward
        self.counters.publish(self.stats, any(not r.session.store.deferred for r, _ in due))
        return bool(due)

    def _unit_tokens(self) -> int:
        """Tokens of a side-output unit: a window, a token for a decoupled pool."""
        return 1 if self.pool.zones is not None else self.pool.layout.window

    def _rows_only(self) -> bool:
        """Whether every request of the extend batch has new tokens and reads window rows only
        (the extend kernel's input; a routed decoupled request reads Zone A pages too)."""
        zones = self.pool.zones
        return all(r.tq and (zones is None or not zones.holds(r.rid)) for r in self.batch)

    def _repack(self, r: _Req) -> None:
        """A decoupled request's routing, as the pool stores it: V widths per token and K
        widths per channel from its engine's tiers, every layer repacked into Zone A pages."""
        store = r.session.store
        bits = torch.tensor(store.tier_bits(), device=store.device)
        decided = []
        for li in range(self.layers):
            k_tier, in_set = store.channel_tiers(li)
            decided.append((bits[store.tiers(li)], bits[k_tier], in_set))
        windows = self.tree.views[r.rid].windows
        covered = self.pool.repack(r.rid, windows, store.n_tokens(0), decided)
        if covered is not None:  # the windows its pages cover: their rows may go
            self.tree.page_out(r.rid, covered)

    def _settle(self, settled: list) -> None:
        """Units whose move the pool degraded (:class:`~.radix.Settled`, one per routed
        request) take the engine tier of the state they reached in their request's store, so
        its bytes and its next plan follow the pool (all requests' units in one pass)."""
        lay = self.pool.layout
        state = torch.cat([s.state for s in settled]).long()
        tier = self._state_tiers(state.device)[state]
        copy = (state == S_Q) | ((state == S_R) & lay.write_once) | (state == S_A)  # archived
        sizes = [s.state.numel() for s in settled]
        units = [
            (s.ly, s.h, s.u, t, c, s.off)
            for s, t, c in zip(settled, tier.split(sizes), copy.split(sizes), strict=True)
        ]
        TierStore.settle_many([self.sessions[s.rid].store for s in settled], units)

    def _state_tiers(self, device) -> torch.Tensor:
        """int64 ``[states]``: the engine tier of each holder state, made once per device."""
        key = str(device)
        if self._tiers_of.get(key) is None:
            tiers = self.pool.layout.state_tiers()
            self._tiers_of[key] = torch.tensor(tiers, dtype=torch.long, device=device)
        return self._tiers_of[key]

    def stats(self) -> dict:
        """:meth:`~.stats.BackendStats.snapshot` (bytes, blocks, transitions, the peak) and
        ``host_s``: host seconds spent issuing each phase since startup, decode steps'
        (``metadata``, ``write``, ``decode_kernel`` (including ``decode_lists``, the step's index
        lists), ``decode_gather``, ``observe``, ``route``) apart from extend batches'
        (``metadata_extend``, ``write_extend``, ``extend_attend``, ``route_extend``), and the
        ``decode_steps``/``extend_batches`` counts they divide by (and ``graph_too_long``: decode
        batches too long for the graphs' buffers, run eagerly). On the GPU a phase's time is
        what it costs the host to launch it (plus any host sync in it): where their sum per step
        nears the step time, the step is launch-bound. With ``--kv-device-times``,
        ``device_s``: the device seconds of graph replays (``replay``, CUDA events around
        SGLang's replay of the forward) and their count (``replays``). On CUDA, ``cuda_bytes``:
        the process's allocator (``allocated_peak``, ``reserved``, ``reserved_peak``; the pool,
        graphs and activations together, for the server's memory beside the pool's)."""
        decode = "kernel" if self.kernel else "gather"
        out = self.counters.snapshot(self.pool, len(self.sessions), decode, self.kernel_error)
        out["extend"] = "kernel" if self.extend_kernel else "gather"
        out |= self.timer.report()
        if self.tp is not None:
            out["tp"] = self.tp.record()
        dev = torch.device(self.pool.device)
        if dev.type == "cuda":  # the whole process's, pool included: what a server costs
            out["cuda_bytes"] = {"allocated_peak": torch.cuda.max_memory_allocated(dev),
                                 "reserved": torch.cuda.memory_reserved(dev),
                                 "reserved_peak": torch.cuda.max_memory_reserved(dev)}  # fmt: skip
        return out
