"""The request path's hooks: a request's ``kv_policy`` / ``kv_budget`` in (:mod:`.request_kv`),
its KV usage out (:mod:`.usage`). Registered by :func:`.plugin.register`; each passes its call
through unchanged without ``--kv-policy``.

In, in SGLang's front-end process (the tokenizer manager and the HTTP server):

- ``OpenAIServingBase.handle_request`` (AROUND): an OpenAI request's top-level ``kv_budget`` /
  ``kv_policy`` (what the client's ``extra_body`` adds; SGLang's request models drop unknown
  fields) go into its ``custom_params``, checked there: a bad one is a 400 answer whose message
  lists what the server accepts, before anything is queued;
- ``TokenizerManager._create_tokenized_object`` (AROUND): the same for native sampling
  parameters (``/generate``, ``Engine.generate``), where SGLang builds ``SamplingParams``; a
  ``ValueError`` there is SGLang's 400 (HTTP) or the caller's exception (Engine);
- ``Engine.generate`` / ``async_generate`` (AROUND): ``kv_budget=`` and ``kv_policy=``
  keywords, into every request's sampling parameters.

Out: the radix cache puts a finished request's usage in SGLang's per-token
``customized_info`` (its last token's entry, :meth:`~.radix.TieredRadixCache._report`);

- ``TokenizerManager.generate_request`` (AROUND): each output's ``meta_info["kv_usage"]`` is
  that one report (SGLang's accumulated per-token list has it last), absent before it exists;
- ``OpenAIServingChat._build_chat_response`` and ``OpenAIServingCompletion.
  _build_completion_response`` (AROUND): the response's ``usage.kv`` is the report (a list of
  them for ``n > 1``);
- ``OpenAIServingChat._generate_chat_stream`` and ``OpenAIServingCompletion.
  _generate_completion_stream`` (AROUND): a streamed response's usage chunk (``stream_options:
  {"include_usage": true}``) gets the same ``usage.kv``: the stream notes the reports that
  ``generate_request`` passes it (keyed by the stream's own request object, for its lifetime).
"""

from __future__ import annotations

import json

from . import config
from .request_kv import KEYS, RequestError, into_custom, resolve
from .usage import KEY

DECOUPLED_REFUSAL = (
    "kv_budget / kv_policy per request are not served by --kv-policy {name}: its routed "
    "requests repack their K/V into Zone A pages sized by the launch's budget; launch with a "
    "window policy (e.g. qevict) to set them per request"
)


def check(custom: dict | None) -> None:
    """Raise :class:`RequestError` for a ``kv_policy`` / ``kv_budget`` in ``custom`` (a
    request's ``custom_params``) that this launch cannot serve; nothing without tiering."""
    cfg = config.current()
    if cfg is None or not custom or not any(k in custom for k in KEYS):
        return
    if not cfg.policy.coupled:
        raise RequestError(DECOUPLED_REFUSAL.format(name=cfg.policy.name))
    resolve(custom, cfg)


async def openai_handle_request(original, self, request, raw_request=None):
    if config.current() is None or not hasattr(request, "custom_params"):
        return await original(self, request, raw_request)
    extra = await _body(raw_request)
    moved = into_custom({"custom_params": request.custom_params}, extra)
    if moved is not None:
        request = request.model_copy(update={"custom_params": moved["custom_params"]})
    try:
        check(request.custom_params)
    except RequestError as err:
        return self.create_error_response(str(err), param=_param(err))
    return await original(self, request, raw_request)


async def _body(raw_request) -> dict:
    """The request's JSON fields (FastAPI read and cached the body before the handler ran)."""
    if raw_request is None:
        return {}
    try:
        body = await raw_request.json()
    except Exception:  # no JSON body (it was validated as one): nothing to move
        return {}
    return body if isinstance(body, dict) else {}


def _param(err: RequestError) -> str:
    return next((k for k in KEYS if str(err).startswith(k)), KEYS[0])


def create_tokenized_object(original, self, obj, *args, **kwargs):
    if config.current() is not None and isinstance(getattr(obj, "sampling_params", None), dict):
        moved = into_custom(obj.sampling_params)
        if moved is not None:
            obj.sampling_params = moved
        check(obj.sampling_params.get("custom_params"))
    return original(self, obj, *args, **kwargs)


def engine_generate(original, self, *args, kv_budget=None, kv_policy=None, **kwargs):
    """``Engine.generate(..., kv_budget=, kv_policy=)`` (and ``async_generate``)."""
    extra = {"kv_budget": kv_budget, "kv_policy": kv_policy}
    if kv_budget is not None or kv_policy is not None:
        sp = kwargs.get("sampling_params")
        if isinstance(sp, list):
            kwargs["sampling_params"] = [into_custom(p, extra) for p in sp]
        else:
            kwargs["sampling_params"] = into_custom(sp, extra)
    return original(self, *args, **kwargs)


def unwrap(out):
    """An output dict with ``meta_info["kv_usage"]`` as the one report it carries (SGLang's
    ``customized_info`` gives a per-token list with it last); a list of outputs each."""
    if isinstance(out, list):
        return [unwrap(o) for o in out]
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not meta or not isinstance(meta.get(KEY), list):
        return out
    found = [r for r in meta[KEY] if r is not None]
    meta = {k: v for k, v in meta.items() if k != KEY}
    if found:
        meta[KEY] = found[-1]
    return {**out, "meta_info": meta}


# a streamed OpenAI response's reports so far, by choice index, keyed by ``id()`` of the
# request object its stream hands to ``generate_request``; only while that stream runs
_STREAMS: dict[int, dict[int, dict]] = {}


async def generate_request(original, self, obj, request=None):
    seen = _STREAMS.get(id(obj))
    async for out in original(self, obj, request):
        out = unwrap(out)
        if seen is not None:
            for o in out if isinstance(out, list) else [out]:
                report = o.get("meta_info", {}).get(KEY) if isinstance(o, dict) else None
                if isinstance(report, dict):
                    seen[o.get("index", 0)] = report
        yield out


async def stream_response(original, self, adapted_request, *args, **kwargs):
    """A streamed chat or completion response, its usage chunk with ``usage.kv``."""
    if config.current() is None:
        async for chunk in original(self, adapted_request, *args, **kwargs):
            yield chunk
        return
    seen = _STREAMS.setdefault(id(adapted_request), {})
    try:
        async for chunk in original(self, adapted_request, *args, **kwargs):
            yield with_kv(chunk, seen) if seen else chunk
    finally:
        _STREAMS.pop(id(adapted_request), None)


def with_kv(chunk: str, reports: dict[int, dict]) -> str:
    """``chunk`` (one server-sent event) with ``usage.kv`` if it is the usage chunk: usage
    and no choices, as SGLang sends it last."""
    if not chunk.startswith("data: {") or '"usage":{' not in chunk:
        return chunk
    data = json.loads(chunk[len("data: ") :])
    if data.get("choices") or not isinstance(data.get("usage"), dict):
        return chunk
    ordered = [reports[i] for i in sorted(reports)]
    data["usage"]["kv"] = ordered[0] if len(ordered) == 1 else ordered
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def build_response(original, self, request, ret, *args, **kwargs):
    """SGLang's OpenAI response, with ``usage.kv`` where the outputs carry KV usage."""
    response = original(self, request, ret, *args, **kwargs)
    reports = [r.get("meta_info", {}).get(KEY) for r in ret if isinstance(r, dict)]
    reports = [r for r in reports if isinstance(r, dict)]
    if not reports or not hasattr(response, "model_dump"):
        return response
    from fastapi.responses import ORJSONResponse

    data = response.model_dump(mode="json")
    data["usage"]["kv"] = reports[0] if len(reports) == 1 else reports
    return ORJSONResponse(content=data)


_SERVING = "sglang.srt.entrypoints.openai"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_ENGINE = "sglang.srt.entrypoints.engine.Engine"
HOOKS = (  # (target, hook): all AROUND
    (f"{_SERVING}.serving_base.OpenAIServingBase.handle_request", openai_handle_request),
    (f"{_SERVING}.serving_chat.OpenAIServingChat._build_chat_response", build_response),
    (f"{_SERVING}.serving_completions.OpenAIServingCompletion._build_completion_response",
     build_response),
    (f"{_SERVING}.serving_chat.OpenAIServingChat._generate_chat_stream", stream_response),
    (f"{_SERVING}.serving_completions.OpenAIServingCompletion._generate_completion_stream",
     stream_response),
    (f"{_TM}._create_tokenized_object", create_tokenized_object),
    (f"{_TM}.generate_request", generate_request),
    (f"{_ENGINE}.generate", engine_generate),
    (f"{_ENGINE}.async_generate", engine_generate),
)  # fmt: skip
