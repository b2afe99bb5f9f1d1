"""Multi-turn greedy chat on a :class:`TieredCache`: each turn prefills only its new tokens.

The cache holds exactly the tokens fed so far: every prompt chunk and every generated token
except the stop token. A new turn's chunk is what the chat template adds after the previous
answer (the end-of-turn marker, the user message and the generation prompt), found by rendering
the conversation with a sentinel in place of that answer, so the previous answer's tokens are
never re-tokenized and the store (quantized windows and ledger included) is kept as it is. A
turn after the first begins by recalling what the policy archived (``evict(archive=...)``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tiered_radix.policy import Policy
from tiered_radix.policy.model import Budget

from .attention import tiered_attention_on
from .cache import TieredCache

_SENTINEL = "\u2063TIERED_RADIX_ANSWER\u2063"
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class Turn:
    """One answer and the cache after it. Bytes count full rows at 2 bytes per element."""

    text: str
    ids: tuple[int, ...]  # generated token ids (the stop token excluded)
    new_tokens: int  # generated tokens
    prefill_tokens: int  # tokens prefilled this turn
    reused_tokens: int  # tokens already cached when the turn began (prefix reuse)
    occupancy: dict[str, int]  # units per tier over layers and KV heads
    bytes_used: int  # what this turn attends to: rows and copies of units not evicted
    archived_bytes: int  # copies of evicted units kept for later turns (evict(archive=...))
    recalled: int  # units brought back from the archive as this turn began
    full_bytes: int  # the same tokens as full KV (bf16)
    budget_bytes: int
    over_budget: bool  # a routing step this turn could not meet the budget (forced content)
    seconds: float


def stop_ids(model, tokenizer) -> frozenset[int]:
    """The model's EOS ids, the tokenizer's, and a known end-of-turn token if it has one."""
    eos = model.generation_config.eos_token_id
    ids = set([eos] if isinstance(eos, int) else eos or ())
    if tokenizer is not None:
        ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return frozenset(ids - {None})


class ChatSession:
    """A greedy conversation with ``model`` whose KV cache is run by ``policy``.

    ``tokenizer`` renders turns with its chat template (plain text if it has none); it may be
    None for :meth:`ask_ids`. ``budget`` replaces the policy's. ``eos_ids`` defaults to
    :func:`stop_ids`. The model runs with the tiered attention only inside each call.
    ``prefill_chunk``: feed a turn's prompt in forwards of at most this many tokens, as a
    server's chunked prefill does (the store routes after each; default: one forward).
    """

    def __init__(
        self,
        model,
        tokenizer,
        policy: Policy | str,
        *,
        budget: Budget | str | None = None,
        max_new_tokens: int = 64,
        eos_ids: Sequence[int] | None = None,
        progress: bool = False,
        prefill_chunk: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if prefill_chunk is not None and prefill_chunk < 2:
            raise ValueError(f"prefill_chunk must be at least 2, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.cache = TieredCache(policy, model.config, budget=budget)
        self.eos = frozenset(eos_ids) if eos_ids is not None else stop_ids(model, tokenizer)
        self.messages: list[dict[str, str]] = []
        self.progress = progress

    def ask(self, user_text: str) -> Turn:
        """Send one user message; prefill only what the template adds; answer greedily."""
        turn = self.ask_ids(self._new_turn_ids(user_text))
        self.messages += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": turn.text},
        ]
        return turn

    def ask_ids(self, ids: Sequence[int]) -> Turn:
        """Prefill ``ids`` after what is cached, then decode up to ``max_new_tokens``."""
        start, reused, n_routes = time.perf_counter(), self.cache.n_tokens(), self._routes()
        recalled = self.cache.new_turn() if reused else 0
        device = self.model.device
        ids, n = list(ids), self.prefill_chunk or max(len(ids), 1)
        last = len(ids) % n or n
        last = min(n + 1, len(ids)) if last == 1 else last  # one token would be a decode step
        step = torch.tensor([ids[len(ids) - last :]], dtype=torch.long, device=device)
        out: list[int] = []
        bar = tqdm(total=self.max_new_tokens, desc="generating", disable=not self.progress,
                   leave=False, unit="tok")  # fmt: skip
        with bar, torch.no_grad(), tiered_attention_on(self.model):
            for i in range(0, len(ids) - step.shape[1], n):  # the chunks before the last
                chunk = torch.tensor([ids[i : i + n]], dtype=torch.long, device=device)
                self.model(input_ids=chunk, past_key_values=self.cache, use_cache=True,
                           logits_to_keep=1)  # fmt: skip
            for _ in range(self.max_new_tokens):
                logits = self.model(
                    input_ids=step, past_key_values=self.cache, use_cache=True, logits_to_keep=1
                ).logits
                token = int(logits[0, -1].argmax())
                if token in self.eos:
                    break
                out.append(token)
                bar.update(1)
                step = torch.tensor([[token]], dtype=torch.long, device=device)
            else:  # the last token is not fed yet: feed it so the cache holds the whole answer
                self.model(input_ids=step, past_key_values=self.cache, use_cache=True,
                           logits_to_keep=1)  # fmt: skip
            self.cache.finish_step()
        c = self.cache
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer else ""
        over = any(s.over_budget for s in c.store.events.steps[n_routes:])
        return Turn(
            text=text.strip(), ids=tuple(out), new_tokens=len(out), prefill_tokens=len(ids),
            reused_tokens=reused, occupancy=c.occupancy(), bytes_used=c.bytes_used(),
            archived_bytes=c.archived_bytes(), recalled=recalled, full_bytes=c.full_bytes(),
            budget_bytes=c.budget_bytes(), over_budget=over,
            seconds=time.perf_counter() - start,
        )  # fmt: skip

    def _routes(self) -> int:
        return 0 if self.cache.store is None else len(self.cache.store.events.steps)

    def _new_turn_ids(self, user_text: str) -> list[int]:
        tok, user = self.tokenizer, {"role": "user", "content": user_text}
        if not tok.chat_template:
            text = ("\n" if self.messages else "") + f"User: {user_text}\nAssistant:"
            return tok(text, add_special_tokens=not self.messages)["input_ids"]
        if not self.messages:
            return _ids(tok.apply_chat_template([user], add_generation_prompt=True))
        msgs = self.messages[:-1] + [{"role": "assistant", "content": _SENTINEL}, user]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert _SENTINEL in text, "the chat template dropped the previous answer"
        return tok(text.split(_SENTINEL, 1)[1], add_special_tokens=False)["input_ids"]


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def generate(
    model,
    tokenizer,
    prompt: str,
    policy: Policy | str,
    *,
    max_new_tokens: int = 64,
    budget: Budget | str | None = None,
    prefill_chunk: int | None = None,
) -> tuple[str, Turn]:
    """One prompt (chat template applied when the tokenizer has one), greedy; (text, stats)."""
    session = ChatSession(
        model, tokenizer, policy, budget=budget, max_new_tokens=max_new_tokens,
        prefill_chunk=prefill_chunk,
    )  # fmt: skip
    turn = session.ask(prompt)
    return turn.text, turn
