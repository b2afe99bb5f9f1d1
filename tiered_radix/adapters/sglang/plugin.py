"""The SGLang plugin: ``[project.entry-points."sglang.srt.plugins"] tiered_radix = ...:register``.

SGLang's ``load_plugins()`` runs :func:`register` in the launcher, in ``Engine.__init__`` and in
every scheduler process. It registers, through ``sglang.srt.plugins.hook_registry``:

- ``ServerArgs.add_cli_args`` (AFTER): the flags ``--kv-policy``, ``--kv-budget`` and
  ``--kv-policies`` (more policies a request may name, :mod:`.catalog`: a set whose pools
  differ stops the launch with each difference), and the ``--kv-*`` options of the backend
  (:class:`~.options.KVOptions`);
- ``ServerArgs.from_cli_args`` (AROUND): validates the policy (a :class:`PolicyError` prints
  ``file:line:col`` and exits with status 2, no traceback), selects ``--radix-cache-backend
  tiered``, ``--page-size W`` and ``--attention-backend tiered_triton`` (and turns prefill CUDA
  graphs off, and the overlap scheduler under ``--no-kv-overlap``), and exports the policy,
  budget and options to the processes SGLang spawns (:mod:`.config`);
- ``ServerArgs.__init__`` (AROUND): the same for ``sglang.Engine(..., kv_policy=...)`` (and
  ``kv_budget=``, ``kv_decode=``, ... for the options), where a bad policy raises
  :class:`PolicyError`;
- ``DefaultPoolConfigurator._compute_cell_size`` (AFTER) and
  ``KVCacheConfigurator._build_mha_kv_pool`` (AROUND): SGLang's cell size is
  :func:`~.sizing.cell_bytes` (the budget's rows and pages plus every slot's metadata), so the
  allocator gets the slots that fit, and the pool is a :class:`~.pool.TieredKVPool` (for
  every policy; a decoupled one, RDKV, repacks routed requests into its Zone A store,
  :mod:`.zones`);
- ``DecodeCudaGraphRunner.can_run_graph`` (AROUND): a decode batch over the backend's graph
  buffers (:mod:`.graph`) runs eagerly;
- ``DecodeCudaGraphRunner.execute`` (AROUND): the step's request ids to the tiered backend (its
  replay view has none), and after the replay its ``replay_done`` (the device time of replays,
  with ``--kv-device-times``) and SGLang's coarse write-after-read barrier (see
  :func:`graph_execute`);
- ``ScheduleBatch.check_decode_mem`` (AROUND): a decode step whose new windows find too few row
  blocks makes SGLang retract requests, as a full pool does;
- ``PrefillAdder.add_one_req`` and ``add_chunked_req`` (AROUND): a prefill batch admits only the
  windows its pool's row blocks hold: a request's chunk is cut to them, or it waits (NO_TOKEN);
  and a chunk ends only at a routing point of its request (:func:`aligned_chunk`: batch
  invariance);
- radix cache backend ``tiered`` (a :class:`~.radix.TieredRadixCache`) and attention backend
  ``tiered_triton`` (:class:`~.backend.TieredAttnBackend`), one for every policy;
- ``ForwardBatch.init_new`` (AFTER): the batch's request slots, host ints from SGLang's
  requests, to the tiered backend (:func:`forward_batch_made`: no device read in its metadata);
- ``Scheduler.get_internal_state`` (AFTER): the backend's stats (``TieredAttnBackend.stats``:
  bytes, tiers, transitions, host seconds per phase) under ``"tiered_radix"`` in SGLang's
  ``/server_info`` and ``Engine.get_server_info()`` (``internal_states[i]``), read when asked;
- the request path (:mod:`.serving`): a request's ``kv_policy`` / ``kv_budget`` from the OpenAI
  API, native sampling parameters and ``Engine.generate``, checked (400 with the accepted
  values), and its KV usage in the response (``meta_info["kv_usage"]``, OpenAI ``usage.kv``).

Without ``--kv-policy`` every hook passes its call through unchanged.
"""

from __future__ import annotations

import sys

from tiered_radix.policy import PolicyError

from . import config
from .options import KVOptions, add_flags

ATTENTION_BACKEND = "tiered_triton"
_SA = "sglang.srt.server_args.ServerArgs"
_registered = False
_in_cli = False  # set while from_cli_args builds ServerArgs (it passes no kv_policy kwarg)


class TieredBackendError(RuntimeError):
    """The tiered attention backend cannot run here."""


def add_cli_args(_result, parser) -> None:
    g = parser.add_argument_group("tiered-radix KV cache")
    g.add_argument(
        "--kv-policy",
        default=None,
        metavar="POLICY",
        help="tiered KV policy: a shipped name (qevict, rdkv, ...) or a YAML file",
    )
    g.add_argument(
        "--kv-budget",
        default=None,
        metavar="BUDGET",
        help="override the policy's budget: 10%%, 2 GiB or 4096 tokens",
    )
    g.add_argument(
        "--kv-policies",
        default=None,
        metavar="P1,P2|DIR",
        help="more policies a request may name (kv_policy): shipped names, YAML files or a "
        "folder of them; they must store windows as --kv-policy does",
    )
    add_flags(g)


def selections(cfg: config.KVConfig, given: dict) -> dict:
    """ServerArgs fields a tiered launch sets; ``given`` holds the user's values (None: unset).

    Raises:
        SystemExit-free ValueError: a user value that contradicts the policy.
    """
    from .reps import Layout

    layout = Layout.of(cfg.policy)
    want = {
        "radix_cache_backend": config.BACKEND,
        # the policy's window: 1 for token units; a decoupled policy's Zone A page (.zones)
        "page_size": layout.window,
        "attention_backend": ATTENTION_BACKEND,
    }
    for key, value in want.items():
        if given.get(key) not in (None, value):
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--kv-policy {cfg.policy_arg} needs {flag} {value}, got {given[key]}")
    if (given.get("tp_size") or 1) > 1:
        check_tensor_parallel(cfg, given)
    from .trizone import decodes

    # decode gathers in PyTorch (a layout the kernel cannot read, or --kv-decode gather): a
    # graph cannot hold it
    if not decodes(layout) or cfg.options.decode == "gather":
        want["disable_decode_cuda_graph"] = True
    return want | forced(cfg.options)


def check_tensor_parallel(cfg: config.KVConfig, given: dict) -> None:
    """``--tp N``: each rank's engine holds its KV heads and routes over all of them
    (:class:`~tiered_radix.engine.shard.HeadShard`, which gathers what a ``*_heads`` score
    reduces over), so attention must be tensor parallel over the same ranks.

    Raises:
        ValueError: ``--enable-dp-attention``.
    """
    if given.get("enable_dp_attention"):
        raise ValueError(f"--kv-policy {cfg.policy_arg} does not support --enable-dp-attention")


# The backend captures decode steps itself (:mod:`.graph`). An extend batch's index tables are
# built on the host at each step and its routing runs after the last layer, so SGLang's prefill
# graphs can hold only the layers between attention calls (its breakable graphs, which run each
# attention call eagerly): --kv-prefill-graphs, off by default (GPU run 22: faster at 1 x 4K,
# slower at 32 x 8K; docs/sglang.md). Decode graphs stay as the user has them. The overlap
# scheduler stays as the user has it unless --no-kv-overlap: decode is faster with it.
def forced(options: KVOptions) -> dict:
    """ServerArgs fields every tiered launch sets, whatever the user gave."""
    out = {} if options.prefill_graphs else {"disable_prefill_cuda_graph": True}
    if not options.overlap:
        out["disable_overlap_schedule"] = True
    return out


def from_cli_args(original, cls, args):
    global _in_cli
    policy = getattr(args, "kv_policy", None)
    if policy is None:
        given = [k for k in ("kv_budget", "kv_policies", *KVOptions.keys())
                 if getattr(args, k, None) is not None]  # fmt: skip
        if given:
            sys.exit(f"error: --{given[0].replace('_', '-')} needs --kv-policy")
        config.export(None)
    else:
        try:
            options = KVOptions.from_args(vars(args))
            cfg = config.resolve(policy, getattr(args, "kv_budget", None), options,
                                 getattr(args, "kv_policies", None))  # fmt: skip
            for key, value in selections(cfg, vars(args)).items():
                setattr(args, key, value)
        except PolicyError as err:
            print(config.describe_error(err), file=sys.stderr)
            raise SystemExit(2) from None
        except ValueError as err:  # PoolConfigError, OptionsError, CatalogError, contradictions
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        config.export(cfg)
    _in_cli = True
    try:
        return original(cls, args)
    finally:
        _in_cli = False


def server_args_init(original, self, *args, **kwargs):
    policy, budget = kwargs.pop("kv_policy", None), kwargs.pop("kv_budget", None)
    policies = kwargs.pop("kv_policies", None)
    options = KVOptions.from_args(kwargs, pop=True)  # OptionsError reaches the Engine's caller
    if policy is not None:
        # PolicyError and CatalogError reach the Engine's caller
        cfg = config.resolve(policy, budget, options, policies)
        kwargs.update(selections(cfg, kwargs))
        config.export(cfg)
    elif budget is not None or policies is not None or options != KVOptions():
        raise ValueError("kv_budget, kv_policies and the kv_* options need kv_policy")
    elif not _in_cli:
        config.export(None)
    return original(self, *args, **kwargs)


def cell_size(result, _self=None, kvc=None, num_layers=None, *_args, **_kwargs):
    """SGLang's bytes per token slot (``result``: one token's K and V over the rank's layers)
    for a tiered pool: :func:`~.sizing.cell_bytes`, the budget's rows and pages plus every
    slot's metadata, so ``N = available // cell`` slots fit in what SGLang set aside.

    Raises:
        PoolConfigError: the policy's metadata eats what its budget saves
            (:func:`~.sizing.check_metadata`).
    """
    cfg = config.current()
    if cfg is None:
        return None  # AFTER hook: None keeps SGLang's value
    from . import sizing

    L, H, d, itemsize = _shape(result, kvc, num_layers)
    sizing.check_metadata(cfg.policy, cfg.budget, L, H, d, itemsize)
    return max(1, sizing.cell_bytes(cfg.policy, cfg.budget, L, H, d, itemsize))


def attn_tp_size() -> int:
    """SGLang's attention tensor-parallel size (as its configurator reads it)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


def _shape(cell: int, kvc, num_layers) -> tuple[int, int, int, int]:
    """(layers, KV heads of this rank, head dim, bytes per element) behind SGLang's full
    ``cell`` (``2 * L * H * d * itemsize``), from its configurator's ``kvc``.

    Raises:
        PoolConfigError: the cell is not an MHA pool's of those shapes.
    """
    import torch

    from .reps import PoolConfigError

    itemsize = torch._utils._element_size(kvc.kv_cache_dtype)
    L = int(num_layers)
    H = kvc.model_config.get_num_kv_heads(attn_tp_size())
    d = cell // (2 * L * H * itemsize)
    if 2 * L * H * d * itemsize != cell:
        raise PoolConfigError(
            f"the tiered pool sizes MHA pools: SGLang's {cell} bytes a token are not K and V of "
            f"{L} layers x {H} KV heads at {itemsize} bytes an element"
        )
    return L, H, d, itemsize


def build_mha_kv_pool(original, self, *, max_total_num_tokens: int, mha_pool_class, **kw):
    cfg = config.current()
    if cfg is None:
        return original(
            self, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class, **kw
        )
    from functools import partial

    from .pool import TieredKVPool

    tiered = partial(TieredKVPool, policy=cfg.policy, budget=cfg.budget, options=cfg.options)
    return original(self, max_total_num_tokens=max_total_num_tokens, mha_pool_class=tiered, **kw)


def tree_cache_factory(ctx):
    from .radix import TieredRadixCache

    cfg = config.current()
    if cfg is None:
        raise ValueError("--radix-cache-backend tiered needs --kv-policy")
    return TieredRadixCache(ctx.params, policy=cfg.policy, kv=cfg)


def can_run_graph(original, self, forward_batch) -> bool:
    """SGLang's answer, and for the tiered backend whether the batch fits its graph buffers."""
    ok = original(self, forward_batch)
    fits = getattr(self.attn_backend, "graph_fits", None)
    if not ok or fits is None:
        return ok
    seqs = forward_batch.seq_lens_cpu
    return fits((seqs if seqs is not None else forward_batch.seq_lens).tolist())


def graph_execute(original, self, forward_batch, *args, **kwargs):
    """SGLang's decode graph replay, for the tiered backend with three additions:

    - before it, the batch's request ids (``note_replay``): the replay view its metadata gets
      has none, and reading them back from the padded ``req_pool_indices`` would be a host sync
      (under the overlap scheduler: a wait for the step still in flight);
    - after it, ``replay_done`` (the replay's device time with ``--kv-device-times``);
    - after it, no read-done event for the scheduler's write-after-read barrier. SGLang publishes
      one at the replay's input snapshot, so that its schedule stream waits only for that; the
      tiered backend's work outside a forward (the step's routing at :meth:`~.backend.
      TieredAttnBackend.flush`, closing views, freeing blocks) then runs on the schedule stream
      while the replay still reads the pool. Without the event the barrier waits for the whole
      forward: every stream's device work runs in the order the host issued it, while the host
      still runs ahead (prepares the next step, processes the last one's tokens)."""
    backend = self.attn_backend
    tiered = hasattr(backend, "replay_done")
    if tiered:
        backend.note_replay(getattr(forward_batch, "rids", None))
    out = original(self, forward_batch, *args, **kwargs)
    if tiered:
        backend.replay_done()
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.war_fastpath_read_done_event = None
    return out


def check_decode_mem(original, self, selected_indices=None) -> bool:
    """SGLang's answer (logical slots for the next decode step) and, over a tiered pool, whether
    its row blocks hold the step's new windows. When they do not, SGLang retracts requests (its
    answer to a full pool) instead of the forward raising ``PoolFullError`` or the device
    running out of memory."""
    ok = original(self, selected_indices=selected_indices)
    pool = self.token_to_kv_pool_allocator.get_kvcache()
    if not ok or not hasattr(pool, "holds_decode_tokens"):
        return ok
    return pool.holds_decode_tokens(self.new_tokens_required_next_decode(selected_indices))


_ADMITTED = "_tiered_windows"  # on a PrefillAdder: windows its batch opens so far


def _admitted(adder, req, pool, call):
    """``call()`` (an admission), then the windows ``req`` opens if it was admitted (its
    prefix is window-aligned) counted on the adder."""
    before = len(adder.can_run_list)
    out = call()
    if len(adder.can_run_list) > before and adder.can_run_list[-1] is req:
        n = -(-req.extend_range.length // pool.layout.window)
        setattr(adder, _ADMITTED, getattr(adder, _ADMITTED, 0) + n)
    return out


def add_one_req(original, self, req, *args, **kwargs):
    """SGLang's admission of a request into a prefill batch, over a tiered pool bounded also by
    its row blocks: every window of the batch is written at full precision before routing
    demotes it. When the request's chunk and the windows admitted before it do not fit the free
    rows (after evicting cached windows nobody holds), the chunk is cut to the windows that do
    (the rest is prefilled after routing frees rows), or, with no room or chunked prefill off,
    the request waits (NO_TOKEN, SGLang's answer to a full pool). A request that cannot wait
    (nothing admitted, nothing running to free rows) goes through: its forward raises
    :class:`~.pool.PoolFullError`, as it did before this hook. Within that, over any tiered
    pool, the chunk ends at a routing point (:func:`aligned_chunk`)."""
    pool = self.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(pool, "rows_for_windows"):
        return original(self, req, *args, **kwargs)
    call = lambda: aligned_chunk(original, self, req, *args, **kwargs)  # noqa: E731
    W, taken = pool.layout.window, getattr(self, _ADMITTED, 0)
    want = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
    if self.rem_chunk_tokens is not None:
        want = min(want, self.rem_chunk_tokens)
    with self._lock_node(req.last_node):  # evicting for rows must spare the matched prefix
        fits = pool.rows_for_windows(taken + -(-want // W))
        room = pool.windows_free() - taken
    if fits:
        return _admitted(self, req, pool, call)
    if room <= 0 or self.rem_chunk_tokens is None:
        rb = self.running_batch
        if not self.can_run_list and (rb is None or rb.is_empty()):
            return _admitted(self, req, pool, call)  # nothing will free rows: let it raise
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.NO_TOKEN
    return _cut_to_rows(self, req, pool, call, room)


def _cut_to_rows(adder, req, pool, call, room: int):
    """``call()`` (an admission) with the batch's chunk budget cut to the ``room`` windows the
    free rows hold; what the cut chunk used comes off the real budget afterwards."""
    chunk = adder.rem_chunk_tokens
    adder.rem_chunk_tokens = min(chunk, room * pool.layout.window)
    cut = adder.rem_chunk_tokens
    try:
        return _admitted(adder, req, pool, call)
    finally:
        adder.rem_chunk_tokens = chunk - (cut - adder.rem_chunk_tokens)


def route_stride() -> int | None:
    """The prefill routing stride: SGLang's ``--chunked-prefill-size`` in this scheduler
    process; ``None`` with chunked prefill off (or outside a scheduler)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        size = get_schedule().chunked_prefill_size
    except (ImportError, ValueError, AttributeError):
        return None
    return size if size is not None and size > 0 else None


def aligned_chunk(original, self, req, *args, **kwargs):
    """SGLang's admission (``original``: ``PrefillAdder.add_one_req``) of a chunk that ends at
    a *routing point* of the request: a multiple of the stride (:func:`route_stride`, rounded
    down to the page size) counted from the request's own token 0, or its prompt's end.

    A request routes after every chunk (``after_prefill``), so where its chunks end decides its
    tiers. SGLang cuts a chunk wherever the batch's shared token budget (``rem_chunk_tokens``)
    runs out, which depends on the other requests of the batch; cut here at routing points
    only, a request's chunks, its routings and so its tokens are the same alone and in any
    batch. The chunk is the rest of the prompt when that fits the budget and crosses no
    routing point; else the part up to the next routing point when that fits; else the request
    waits for the next batch (``OTHER``, as SGLang's own ``truncation_align_size`` does). The
    first request of a batch never waits: with a budget smaller than its next routing point
    (mixed chunks, rows a coupled pool lacks) it takes SGLang's cut, as before."""
    stride, limit = route_stride(), self.rem_chunk_tokens
    page = getattr(self, "page_size", 1)
    if stride is None or limit is None or stride < page:
        return original(self, req, *args, **kwargs)
    stride -= stride % page
    start = len(req.prefix_indices)
    rest = len(req.full_untruncated_fill_ids) - start
    to_point = stride - start % stride
    if rest <= to_point and -(-rest // page) * page <= limit:
        return original(self, req, *args, **kwargs)  # the prompt's end: SGLang takes it whole
    if rest > to_point and to_point <= limit:
        # SGLang cuts the chunk at the routing point and, as after any cut, the batch's budget
        # is spent: one chunked request per batch
        self.rem_chunk_tokens = to_point
        return original(self, req, *args, **kwargs)
    if not self.can_run_list:
        return original(self, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult.OTHER


def add_chunked_req(original, self, req):
    """SGLang's next chunk of the chunked request, cut to the windows the free rows hold
    (after evicting cached windows) where its chunk would not fit, as :func:`add_one_req` cuts
    a new request's; its windows counted for the requests :func:`add_one_req` admits after it.
    With no room at all while requests run, the request is *parked*: returned as SGLang's
    chunked request without a chunk (SGLang's own early return for hybrid SWA pools, which its
    scheduler leaves uncached), so this round decodes and finishing or retracted requests free
    rows for its next chunk. With no room and nothing running, a chunk of one window: the
    rows are the request's own prompt so far, which its routing frees first
    (:meth:`~.backend.TieredAttnBackend._route_for_rows`, a deferred routing run early)."""
    pool = self.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(pool, "rows_for_windows"):
        return original(self, req)
    call = lambda: original(self, req)  # noqa: E731
    W, taken, chunk = pool.layout.window, getattr(self, _ADMITTED, 0), self.rem_chunk_tokens
    want = min(len(req.full_untruncated_fill_ids) - len(req.prefix_indices), chunk)
    with self._lock_node(req.last_node):
        fits = pool.rows_for_windows(taken + -(-want // W))
        room = pool.windows_free() - taken
    if fits:
        return _admitted(self, req, pool, call)
    if room <= 0:
        rb = self.running_batch
        if rb is not None and not rb.is_empty():
            return req  # parked
        room = 1
    return _cut_to_rows(self, req, pool, call, room)


def attention_backend_factory(runner):
    from .backend import TieredAttnBackend

    tp = runner.server_args.tp_size
    if tp > 1 and runner.model_config.get_total_num_kv_heads() % tp:
        raise TieredBackendError(
            f"--tp {tp} does not split the model's {runner.model_config.get_total_num_kv_heads()} "
            "KV heads evenly: SGLang would replicate heads across ranks, and the tiered engine "
            "needs each rank to hold its own heads; use a --tp that divides the KV heads"
        )
    cfg = config.current()
    options = cfg.options if cfg is not None else KVOptions()
    if getattr(runner.server_args, "enable_deterministic_inference", False):
        options = options.batch_invariant()
    policies = cfg.served().policies if cfg is not None else None
    return TieredAttnBackend(runner, options, policies)


def forward_batch_made(result, *args, **kwargs):
    """``ForwardBatch.init_new(cls, batch, model_runner, ...)`` (AFTER): the slots
    (``req_pool_idx``) of ``batch``'s requests to a tiered backend
    (:meth:`~.backend.TieredAttnBackend.note_slots`), so its metadata does not read them back
    from the device. SGLang's forward batch is returned as it is; on every forward of every
    launch, so other backends cost one attribute lookup (no import)."""
    batch = kwargs.get("batch", args[1] if len(args) > 1 else None)
    runner = kwargs.get("model_runner", args[2] if len(args) > 2 else None)
    note = getattr(getattr(runner, "attn_backend", None), "note_slots", None)
    if note is not None and batch is not None and result is not None:
        note(result, [req.req_pool_idx for req in batch.reqs])
    return None


def internal_state(result, scheduler=None, *_args, **_kwargs):
    """``Scheduler.get_internal_state`` (AFTER): a tiered launch's backend stats under
    ``internal_state["tiered_radix"]`` (the state a ``/server_info`` reader gets; computed at
    the call, with the host syncs :meth:`~.backend.TieredAttnBackend.stats` makes, so nothing
    is written per routing as ``--kv-stats FILE`` does). None (SGLang's result as it is)
    without a tiered backend."""
    from .backend import TieredAttnBackend

    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    backend = getattr(runner, "attn_backend", None)
    if not isinstance(backend, TieredAttnBackend):
        return None
    result.internal_state["tiered_radix"] = backend.stats()
    return result


def register() -> None:
    """Entry point: register hooks and backends (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SA}.add_cli_args", add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SA}.from_cli_args", from_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SA}.__init__", server_args_init, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        cell_size,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
        build_mha_kv_pool,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
        ".can_run_graph",
        can_run_graph,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
        graph_execute,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        forward_batch_made,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", internal_state, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
        check_decode_mem,
        HookType.AROUND,
    )
    for name, hook in (("add_one_req", add_one_req), ("add_chunked_req", add_chunked_req)):
        HookRegistry.register(
            f"sglang.srt.managers.schedule_policy.PrefillAdder.{name}", hook, HookType.AROUND
        )
    from . import serving

    for target, hook in serving.HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
    if config.BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(config.BACKEND, tree_cache_factory)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    ATTENTION_BACKENDS[ATTENTION_BACKEND] = attention_backend_factory
    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])
    register_deterministic()


def register_deterministic() -> None:
    """SGLang's ``--enable-deterministic-inference`` accepts the tiered backend, radix cache
    kept: its extend kernel sums each query row by the request's own positions and the plugin
    cuts chunks at routing points, and under that flag the decode kernel's split count is
    fixed (:meth:`~.options.KVOptions.batch_invariant`), so with SGLang's batch-invariant
    GEMMs a request's tokens do not depend on its batch. (A prefix hit reads the prefix at the
    precision it was cached, as in every tiered launch.)"""
    from sglang.srt import server_args as sa

    if ATTENTION_BACKEND not in sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        sa.add_deterministic_attention_backend_choices([ATTENTION_BACKEND])
    if ATTENTION_BACKEND not in sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        sa.add_radix_supported_deterministic_attention_backend_choices([ATTENTION_BACKEND])
