"""``KVOptions``: how the tiered SGLang backend runs, one frozen object per launch.

The policy file says *what* the cache keeps; these options say how the adapter computes it
(which attention path, how CUDA graphs are sized, what it measures). They are built once from
the ``--kv-*`` flags (or the matching ``sglang.Engine(kv_...=...)`` keywords) by the plugin,
carried to SGLang's scheduler processes inside :class:`~.config.KVConfig` and handed explicitly
to the pool, the attention backend, the graph buffers and the profiler. Nothing reads them from
the environment.

=====================  ==========================  ===============================================
flag                   default                     what it selects
=====================  ==========================  ===============================================
``--kv-overlap``       on                          SGLang's overlap scheduler (decodes faster
                                                   than the serial order: docs/sglang.md); a
                                                   decode routing lands one step late.
                                                   ``--no-kv-overlap``: the serial order
``--kv-decode``        ``kernel``                  decode attention: the TriZone kernel, or
                                                   ``gather`` (PyTorch over gathered rows)
``--kv-extend``        ``kernel`` CUDA, ``exact`` CPU  extend attention: the TriZone extend kernel
                                                   over the pool in place, or the gather path with
                                                   a fused SDPA kernel or float32 score blocks
``--kv-gather``        ``all`` CUDA, ``live`` CPU  extend reads every window (no host sync) or
                                                   only those some head reads (two syncs a read)
``--kv-observe``       ``fold``                    replayed decode steps sum their attention on the
                                                   device (``fold``) or observe every step
``--kv-route-clock``   ``request``                 what ``every(N)`` counts: each request's own
                                                   decode steps, or the server's (``server``:
                                                   the running requests route together, one
                                                   routing every N steps, whatever their phases)
``--kv-prefill-graphs`` off                        SGLang's prefill CUDA graphs (its breakable
                                                   graphs: the layers between attention calls
                                                   captured, the tiered attention run eagerly
                                                   between them); off: every extend is eager
``--kv-graph-tokens``  every captured request at  tokens a captured decode batch holds
                       full context, within 1/8 of
                       the free device memory
``--kv-graph-splits``  per batch size              the decode kernel's splits per list, eager and
                                                   replayed (fixed: batch-invariant float order;
                                                   :data:`DETERMINISTIC_SPLITS` under SGLang's
                                                   ``--enable-deterministic-inference``)
``--kv-device-times``  off                         CUDA events time every graph replay
``--kv-profile``       off                         ``DIR:START:STEPS``: decode steps under
                                                   ``torch.profiler`` (:mod:`.profile`);
                                                   ``DIR:START:STEPS:extend``: extend batches
``--kv-stats``         off                         a JSON file rewritten after every routing
=====================  ==========================  ===============================================
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace

import torch

DECODE = ("kernel", "gather")
EXTEND = ("kernel", "sdpa", "exact")
GATHER = ("live", "all")
OBSERVE = ("fold", "step")
ROUTE_CLOCK = ("request", "server")
# The decode kernel's splits per list under SGLang's --enable-deterministic-inference (its
# batch-invariant GEMMs): the same for every batch size, so a request's attention sums its
# splits in one order alone and in any batch. By batch size (the default) a lone request gets
# ~128 splits and one of 8 ~17: its output differs in the last bits (GPU run 29).
DETERMINISTIC_SPLITS = 32


class OptionsError(ValueError):
    """A ``--kv-*`` value outside its choices."""


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class KVOptions:
    """The ``--kv-*`` flags of one launch (see the module docstring); ``None``: the device's
    default.

    Raises:
        OptionsError: a value outside its choices.
    """

    overlap: bool = True
    decode: str = "kernel"
    extend: str | None = None
    gather: str | None = None
    observe: str = "fold"
    route_clock: str = "request"
    prefill_graphs: bool = False
    graph_tokens: int | None = None
    graph_splits: int | None = None
    device_times: bool = False
    profile: str | None = None
    stats: str | None = None

    def __post_init__(self) -> None:
        for name, choices in (("decode", DECODE), ("extend", EXTEND), ("gather", GATHER),
                              ("observe", OBSERVE), ("route_clock", ROUTE_CLOCK)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise OptionsError(
                    f"--kv-{name} {value!r}: use {' or '.join(repr(c) for c in choices)}"
                )
        if any(n is not None and n < 1 for n in (self.graph_tokens, self.graph_splits)):
            raise OptionsError("--kv-graph-tokens and --kv-graph-splits must be positive")

    def extend_on(self, device) -> str:
        """Extend's attention on ``device``: ``kernel`` on CUDA, ``exact`` on CPU by default."""
        return self.extend or ("kernel" if _on_cuda(device) else "exact")

    def gather_on(self, device) -> str:
        """What extend reads on ``device``: ``all`` on CUDA, ``live`` on CPU by default."""
        return self.gather or ("all" if _on_cuda(device) else "live")

    def batch_invariant(self) -> KVOptions:
        """These options for a launch whose outputs must not depend on the batch (SGLang's
        ``--enable-deterministic-inference``): the decode kernel's split count fixed
        (``--kv-graph-splits`` if given, else :data:`DETERMINISTIC_SPLITS`)."""
        return replace(self, graph_splits=self.graph_splits or DETERMINISTIC_SPLITS)

    def to_dict(self) -> dict:
        """Plain values (JSON-serialisable), :meth:`from_dict`'s input."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> KVOptions:
        return cls(**values)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The ServerArgs attribute / Engine keyword of every option (``kv_decode``, ...)."""
        return tuple("kv_" + f.name for f in fields(cls))

    @classmethod
    def from_args(cls, args: dict, pop: bool = False) -> KVOptions:
        """The options among ServerArgs fields or Engine keywords ``args`` (``kv_decode``, ...;
        absent or ``None``: the default); ``pop`` removes them from ``args``."""
        given = {}
        for f in fields(cls):
            key = "kv_" + f.name
            value = args.pop(key, None) if pop else args.get(key)
            if value is not None:
                given[f.name] = value
        return cls(**given)


# (field, metavar or None for a switch, help) of every --kv-* option flag, in --help order
FLAGS = (
    ("overlap", None, "SGLang's overlap scheduler (default on; --no-kv-overlap: serial order)"),
    ("decode", "{kernel,gather}", "decode attention: TriZone kernel (default) or PyTorch"),
    ("extend", "{kernel,sdpa,exact}", "extend attention (default: kernel on CUDA, exact on CPU)"),
    ("gather", "{live,all}", "extend reads live windows or all (default: all on CUDA)"),
    ("observe", "{fold,step}", "graph steps' attention: summed on the device (fold) or per step"),
    (
        "route_clock",
        "{request,server}",
        "every(N) counts each request's decode steps (default) or the server's (all route at once)",
    ),
    ("prefill_graphs", None, "SGLang's prefill CUDA graphs around the tiered attention (off)"),
    ("graph_tokens", "N", "tokens a captured decode batch holds (default: sized by memory)"),
    ("graph_splits", "N", "decode kernel splits per list, every step (default: by batch)"),
    ("device_times", None, "time every decode graph replay with CUDA events (stats device_s)"),
    (
        "profile",
        "DIR:START:STEPS[:extend]",
        "profile decode steps (or extend batches) START..START+STEPS into DIR",
    ),
    ("stats", "FILE", "rewrite FILE with the backend's stats (JSON) after every routing"),
)


def add_flags(group) -> None:
    """The ``--kv-*`` option flags on an argparse group (``None`` defaults: unset). Switches
    that default to on also take ``--no-kv-NAME``."""
    kinds = {"graph_tokens": int, "graph_splits": int}
    choices = {"decode": DECODE, "extend": EXTEND, "gather": GATHER, "observe": OBSERVE,
               "route_clock": ROUTE_CLOCK}  # fmt: skip
    for name, metavar, help_ in FLAGS:
        flag = "--kv-" + name.replace("_", "-")
        if metavar is None and getattr(KVOptions, name):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_)  # fmt: skip
        elif metavar is None:
            group.add_argument(flag, action="store_true", default=None, help=help_)
        else:
            group.add_argument(flag, default=None, metavar=metavar, type=kinds.get(name, str),
                               choices=choices.get(name), help=help_)  # fmt: skip
