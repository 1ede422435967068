"""The OpenAI/vLLM request and response contract of a rollout node.

Requests are validated whole before anything is queued; a bad one raises
`ApiError` (an HTTP 4xx status and a message saying what to send instead) and the
node keeps serving. Conventions follow vLLM's:

- ``/v1/completions``: ``prompt`` is a string (tokenized with the model's
  tokenizer and its default special tokens), a list of token ids, or a list of
  either; ``max_tokens`` defaults to 16;
- ``/v1/chat/completions``: ``messages`` rendered with the model's chat template
  and the generation prompt, tokenized without extra special tokens;
  ``max_tokens`` defaults to the rest of the context;
- ``logprobs`` (completions: an int k >= 0; chat: true, with ``top_logprobs`` k):
  the log-probability of each sampled token under the model at temperature 1, and
  k alternatives; with ``return_tokens_as_token_ids`` tokens are written
  ``"token_id:<id>"``;
- every reply says ``yeto_version``: the version of the weights that sampled it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from yeto.data.formats import DataError, content_text
from yeto.io import finite_or_none
from yeto.rollout.generate import Output, SamplingParams

MAX_N = 256
MAX_LOGPROBS = 20


class ApiError(Exception):
    """A request the node refuses: HTTP `status`, OpenAI error `kind` and `message`."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


@dataclass
class Context:
    """What validation needs to know about the node."""

    model_name: str
    tokenizer: Any
    max_len: int
    vocab_size: int
    aliases: tuple[str, ...] = ()
    max_rows: int | None = None     # rows (prompts x n) one request may ask for (--max-batch)
    max_chars: int | None = None    # characters a prompt may hold (`max_prompt_chars`)


@dataclass
class Request:
    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    logprobs: int | None            # None: no logprobs; k: k alternatives
    as_token_ids: bool
    return_token_ids: bool


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def max_prompt_chars(tokenizer, max_len: int) -> int | None:
    """The most characters a prompt can hold and still fit in `max_len` tokens: no
    token stands for more characters than the tokenizer's longest vocabulary entry
    (byte-level entries hold a character per byte, and text has no more characters
    than bytes). Lets a request be refused before tokenizing it; None when the
    tokenizer lists no vocabulary."""
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return None
    return max_len * max(longest, 1)


def _check_chars(chars: int, ctx: Context, param: str) -> None:
    """Refuse a prompt of `chars` characters that cannot fit the context, untokenized."""
    if ctx.max_chars is not None and chars > ctx.max_chars:
        raise _bad(f"This model's maximum context length is {ctx.max_len} tokens, and no text "
                   f"over {ctx.max_chars} characters fits in it; this prompt holds {chars} "
                   "characters. Please reduce the length of the prompt", param)


def int_field(body: dict, key: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key} must be an integer, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(f"{key} must be {span}, got {v}", key)
    return v


def _finite(v) -> float | None:
    """`v` as a finite float; None for NaN, inf, ints beyond float, and non-numbers."""
    try:
        return finite_or_none(v)
    except OverflowError:
        return None


def _float(body: dict, key: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if _finite(v) is None:
        raise _bad(f"{key} must be a finite number, got {v!r}", key)
    if v < lo or v > hi or (lo_open and v == lo):
        side = "(" if lo_open else "["
        raise _bad(f"{key} must be in {side}{lo}, {hi}], got {v}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false, got {v!r}", key)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise _bad("stop must be a string or a list of strings", "stop")


def _stop_ids(body: dict, ctx: Context) -> tuple[int, ...]:
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_id(t, ctx) for t in ids):
        raise _bad(f"stop_token_ids must be a list of token ids in [0, {ctx.vocab_size})",
                   "stop_token_ids")
    return tuple(ids)


def _is_id(t, ctx: Context) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < ctx.vocab_size


def check_model(body: dict, ctx: Context) -> None:
    model = body.get("model")
    if model is not None and model != ctx.model_name and model not in ctx.aliases:
        raise ApiError(404, f"The model `{model}` does not exist; this node serves "
                       f"`{ctx.model_name}` (GET /v1/models)", "NotFoundError", "model")


def _n(body: dict, prompts: int, ctx: Context) -> int:
    """`n`, refused when `prompts` x `n` rows exceed what the node samples together."""
    n = int_field(body, "n", 1, lo=1, hi=MAX_N)
    if ctx.max_rows is not None and prompts * n > ctx.max_rows:
        raise _bad(f"this request asks for {prompts * n} rows ({prompts} prompts x n={n}); the "
                   f"node samples at most {ctx.max_rows} rows together (--max-batch "
                   f"{ctx.max_rows}): send fewer prompts or a smaller n per request, or start "
                   "the node with a larger --max-batch", "n")
    return n


def _common(body: dict, ctx: Context, prompts: list[list[int]], chat: bool,
            logprobs: int | None, n: int) -> Request:
    if body.get("stream"):
        raise _bad("stream is not supported by rollout nodes; send stream: false", "stream")
    for key in ("echo", "use_beam_search"):
        if body.get(key):
            raise _bad(f"{key} is not supported by rollout nodes", key)
    if int_field(body, "best_of", None, lo=1) not in (None, body.get("n", 1)):
        raise _bad("best_of is not supported by rollout nodes; use n", "best_of")
    longest = max(len(p) for p in prompts)
    default_max = ctx.max_len - longest if chat else 16
    max_tokens = int_field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                      else "max_tokens", default_max, lo=1)
    if longest + max_tokens > ctx.max_len:
        raise _bad(f"This model's maximum context length is {ctx.max_len} tokens. However, "
                   f"you requested {longest + max_tokens} tokens ({longest} in the prompt, "
                   f"{max_tokens} for the completion). Please reduce the length of the prompt "
                   "or max_tokens", "max_tokens")
    top_k = int_field(body, "top_k", 0, lo=-1)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=max(top_k, 0),
        seed=int_field(body, "seed", None), stop=_stop(body), stop_token_ids=_stop_ids(body, ctx),
        ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs)
    return Request(chat, prompts, params, n, logprobs,
                   _bool(body, "return_tokens_as_token_ids"), _bool(body, "return_token_ids"))


def parse_completion(body: dict, ctx: Context) -> Request:
    check_model(body, ctx)
    prompt = _prompt_list(body.get("prompt"))
    n = _n(body, len(prompt), ctx)  # before tokenizing: a refused request costs nothing
    logprobs = int_field(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return _common(body, ctx, _tokenized(prompt, ctx), False, logprobs, n)


def _prompt_list(prompt) -> list:
    """`prompt` (a string, a list of ids, or a list of either) as a list of prompts."""
    if prompt is None:
        raise _bad("prompt is required: a string, a list of token ids, or a list of those",
                   "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt must be a non-empty string, list of token ids, or list of those",
                   "prompt")
    return prompt


def _tokenized(prompt: list, ctx: Context) -> list[list[int]]:
    """Each prompt as token ids (strings with the tokenizer's default special tokens)."""
    for p in prompt:  # every prompt's size first: a refused request costs no tokenizing
        if isinstance(p, str):
            _check_chars(len(p), ctx, "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = list(ctx.tokenizer(p, add_special_tokens=True)["input_ids"])
        elif isinstance(p, list) and all(_is_id(t, ctx) for t in p):
            ids = list(p)
        else:
            raise _bad(f"prompt token ids must be integers in [0, {ctx.vocab_size})", "prompt")
        if not ids:
            raise _bad("prompt is empty", "prompt")
        out.append(ids)
    return out


def parse_chat(body: dict, ctx: Context) -> Request:
    check_model(body, ctx)
    n = _n(body, 1, ctx)
    ids = chat_prompt(body, ctx)
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = int_field(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif body.get("top_logprobs"):
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return _common(body, ctx, [ids], True, logprobs, n)


def chat_prompt(body: dict, ctx: Context) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages is required: a non-empty list of {role, content}", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a role", "messages")
        try:  # a string, or OpenAI content parts: text only
            content = content_text(m.get("content", ""), f"messages[{i}]")
        except DataError as e:
            raise _bad(str(e), "messages") from None
        clean.append({"role": m["role"], "content": content})
    _check_chars(sum(len(m["content"]) for m in clean), ctx, "messages")
    try:
        text = ctx.tokenizer.apply_chat_template(
            clean, tokenize=False, add_generation_prompt=_bool(body, "add_generation_prompt",
                                                               True))
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise _bad(f"the chat template cannot render these messages: {e}", "messages") from e
    _check_chars(len(text), ctx, "messages")
    ids = list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise _bad("the rendered chat is empty", "messages")
    return ids


# ---- responses -----------------------------------------------------------------
def _token(tid: int, ctx: Context, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else ctx.tokenizer.decode([tid])


def _completion_logprobs(o: Output, req: Request, ctx: Context) -> dict:
    tokens = [_token(t, ctx, req.as_token_ids) for t in o.token_ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    top = None
    if o.top is not None:
        top = [{_token(t, ctx, req.as_token_ids): lp for t, lp in alts} for alts in o.top]
    return {"tokens": tokens, "token_logprobs": o.logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _chat_logprobs(o: Output, req: Request, ctx: Context) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = _token(t, ctx, req.as_token_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for i, (t, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        alts = o.top[i] if o.top is not None else []
        content.append({**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alts]})
    return {"content": content}


def response(req: Request, outputs: list[Output], version: int, ctx: Context) -> dict:
    """The OpenAI/vLLM reply body; choice i*n + j is choice j of prompt i."""
    choices = []
    for i, o in enumerate(outputs):
        c: dict[str, Any] = {"index": i, "finish_reason": o.finish_reason,
                             "stop_reason": o.stop_reason}
        lp = None
        if req.logprobs is not None:
            lp = (_chat_logprobs if req.chat else _completion_logprobs)(o, req, ctx)
        if req.chat:
            c.update(message={"role": "assistant", "content": o.text}, logprobs=lp)
        else:
            c.update(text=o.text, logprobs=lp)
        if req.return_token_ids:
            c.update(token_ids=o.token_ids, prompt_token_ids=req.prompts[i // req.n])
        choices.append(c)
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": ctx.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "yeto_version": version}
