"""Row formats: detect, validate and normalise one training row, then encode it.

One format per file (detected from its first row; a row of another format is an
error that names the file and line). Extra keys are ignored. Accepted formats:

    text               {"text": str}
                       loss on every token, plus an appended EOS
    messages (OpenAI)  {"messages": [{"role", "content"}, ...], "tools"?: [...]}
                       rendered with the chat template; loss on assistant turns
    sharegpt           {"conversations": [{"from", "value"}, ...], "system"?, "tools"?}
                       from: human/user, gpt/assistant, system, function_call,
                       observation/tool; then as messages
    alpaca             {"instruction", "input"?, "output", "system"?, "history"?}
                       with a chat template: system, history turns, user
                       (instruction + input), assistant (output); loss on the
                       output only (history is context). Without a chat template:
                       the Stanford Alpaca prompt, loss on the output + EOS.
                       A pre-rendered "text" column beside them is ignored.
    prompt_completion  {"prompt": str, "completion": str}
                       loss on the completion tokens + EOS; or TRL's conversational
                       form, prompt and completion both lists of messages: loss on
                       the completion's assistant turns

Assistant-only loss for chat rows (messages, sharegpt, alpaca, conversational
prompt/completion) comes from the chat template:

* **generation markers**: where the template wraps assistant output in
  ``{% generation %} ... {% endgeneration %}``, transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the mask;
  exactly what the template author marked is trained (usually the reply and its
  end-of-turn token).
* **prefix render** (fallback, for the many templates without markers): the chat
  is rendered prefix by prefix; an assistant turn's span runs from the end of the
  render before it (with the generation prompt, so the "assistant" header is
  excluded) to the end of the render that includes it, minus trailing whitespace,
  so the end-of-turn token is in and the newline after it is out. Templates that
  rewrite earlier turns (e.g. strip reasoning from old turns) are refused: their
  turns cannot be located this way.

Backend-neutral: nothing here imports torch or mlx.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("yeto.data")

FORMATS = {
    "text": '{"text": ...}',
    "messages": '{"messages": [{"role": ..., "content": ...}, ...], "tools"?: [...]} (OpenAI)',
    "sharegpt": '{"conversations": [{"from": ..., "value": ...}, ...]} (ShareGPT)',
    "alpaca": '{"instruction": ..., "input"?: ..., "output": ...} (Alpaca)',
    "prompt_completion": '{"prompt": ..., "completion": ...}',
}
ACCEPTED_SCHEMAS = "; ".join(FORMATS.values())

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
    "function_response": "tool",
}  # fmt: skip

ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task{}. "
    "Write a response that appropriately completes the request."
)
_ALPACA_WITH_INPUT = ", paired with an input that provides further context"

LOSS_METHODS = ("all tokens", "completion only", "generation markers", "prefix render")

Encoded = tuple[list[int], list[float]]


class DataError(ValueError):
    """Training data that cannot be used, with a message saying where and why."""


# ---------------------------------------------------------------- examples


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Completion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Chat:
    """A conversation; assistant turns at index >= ``train_from`` carry loss."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    train_from: int = 0


@dataclass(frozen=True)
class Alpaca:
    instruction: str
    input: str
    output: str
    system: str | None = None
    history: tuple[tuple[str, str], ...] = ()

    def as_chat(self) -> Chat:
        msgs: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system}] if self.system else [])
        for q, a in self.history:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        user = self.instruction + (f"\n\n{self.input}" if self.input else "")
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": self.output}]
        return Chat(tuple(msgs), None, train_from=len(msgs) - 1)

    def as_completion(self) -> Completion:
        """The Stanford Alpaca prompt (``system`` replaces its preamble)."""
        head = self.system or ALPACA_PREAMBLE.format(_ALPACA_WITH_INPUT if self.input else "")
        parts = [head]
        for q, a in self.history:
            parts.append(f"### Instruction:\n{q}\n\n### Response:\n{a}")
        parts.append(f"### Instruction:\n{self.instruction}")
        if self.input:
            parts.append(f"### Input:\n{self.input}")
        parts.append("### Response:\n")
        return Completion("\n\n".join(parts), self.output)


Example = Text | Completion | Chat | Alpaca


# ---------------------------------------------------------------- detection


def _seen(row: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in row.items()) + "}"


def detect_format(row: Any, where: str = "row") -> str:
    """The format name of one row (a key of FORMATS), or DataError."""
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected a JSON object, got {type(row).__name__}; accepted: "
            f"{ACCEPTED_SCHEMAS}"
        )
    found = []
    if "messages" in row:
        found.append("messages")
    if "conversations" in row:
        found.append("sharegpt")
    if "instruction" in row and "output" in row:
        found.append("alpaca")
    if "prompt" in row and "completion" in row:
        found.append("prompt_completion")
    if "text" in row and found != ["alpaca"]:  # alpaca sets often carry a rendered copy
        found.append("text")
    if not found:
        hint = ""
        if "chosen" in row or "rejected" in row:
            hint = " (preference/DPO pairs are not supported; train on the chosen replies)"
        elif "instruction" in row:
            hint = ' (an Alpaca row needs "output")'
        elif "prompt" in row or "completion" in row:
            hint = ' (a prompt/completion row needs both "prompt" and "completion")'
        raise DataError(
            f"{where}: unknown row schema with keys {sorted(row)}, seen {_seen(row):.200}"
            f"{hint}; accepted: {ACCEPTED_SCHEMAS}"
        )
    if len(found) > 1:
        raise DataError(
            f"{where}: ambiguous row, it matches several formats ({', '.join(found)}) with keys "
            f"{sorted(row)}; keep only one of them per row"
        )
    return found[0]


# ---------------------------------------------------------------- normalisation


def _str(row: dict[str, Any], key: str, where: str, optional: bool = False) -> str:
    v = row.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise DataError(f'{where}: "{key}" must be a string, got {type(v).__name__}')
    return v


_PARTS = 'a string or a list of text parts ([{"type": "text", "text": ...}])'


def content_text(value: Any, where: str) -> str:
    """A message's content as one string: a string, or OpenAI text parts joined.
    DataError (one line, naming `where` and the part) for anything else."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise DataError(f"{where}: content must be {_PARTS}, got {value!r:.80}")
    for i, p in enumerate(value):
        if not (isinstance(p, dict) and p.get("type") == "text"):
            raise DataError(f"{where}: content[{i}] is not a text part; content must be "
                            f"{_PARTS}, got {p!r:.80}")
        if not isinstance(p.get("text"), str):
            raise DataError(f"{where}: content[{i}].text must be a string, got "
                            f"{p.get('text')!r:.80}")
    return "".join(p["text"] for p in value)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise DataError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise DataError(f"{where}: each tool call must be an object, got {call!r:.80}")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            # OpenAI sends arguments as a JSON string; chat templates expect a dict.
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                call["function"] = {**fn, "arguments": args}
        out.append(call)
    return out


def _openai_message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise DataError(f'{where} must be {{"role": str, "content": str}}, got {m!r:.80}')
    if "role" not in m and "from" in m:  # ShareGPT-style turns inside "messages"
        return _sharegpt_message(m, where)
    if not isinstance(m.get("role"), str):
        raise DataError(f'{where} must be {{"role": str, "content": str}}, got {m!r:.80}')
    msg = {k: v for k, v in m.items() if v is not None}
    if m.get("tool_calls"):
        msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if m.get("content") is not None:
            msg["content"] = content_text(m["content"], where)
    else:
        msg.pop("tool_calls", None)
        msg["content"] = content_text(m.get("content"), where)
    return msg


def _sharegpt_message(m: Any, where: str) -> dict[str, Any]:
    if isinstance(m, dict) and "role" in m and "from" not in m:
        return _openai_message(m, where)
    if not (isinstance(m, dict) and isinstance(m.get("from"), str)):
        raise DataError(f'{where} must be {{"from": str, "value": str}}, got {m!r:.80}')
    role = SHAREGPT_ROLES.get(m["from"].lower())
    if role is None:
        raise DataError(
            f'{where}: unknown "from" {m["from"]!r}; accepted: {", ".join(SHAREGPT_ROLES)}'
        )
    value = content_text(m.get("value"), where)
    if m["from"].lower() == "function_call":
        try:
            call = json.loads(value)
        except json.JSONDecodeError:
            call = None
        if isinstance(call, dict) and "name" in call:
            return {"role": "assistant", "tool_calls": _tool_calls(
                [{"type": "function", "function": call}], where)}
    return {"role": role, "content": value}


def _tools(value: Any, where: str) -> tuple[dict[str, Any], ...] | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):  # LLaMA-Factory keeps tools as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f'{where}: "tools" is a string but not JSON ({e.msg})') from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f'{where}: "tools" must be a list of tool schemas (objects)')
    return tuple(value)


def _turns(value: Any, key: str, where: str, parse: Callable[[Any, str], dict[str, Any]]
           ) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be a non-empty list of {{role, content}}')
    return tuple(parse(m, f"{where}: {key}[{i}]") for i, m in enumerate(value))


def to_example(row: dict[str, Any], fmt: str, where: str = "row") -> Example:
    """Validate a row of format ``fmt`` and turn it into an Example."""
    if fmt == "text":
        return Text(_str(row, "text", where))
    if fmt == "prompt_completion":
        p, c = row["prompt"], row["completion"]
        if isinstance(p, list) and isinstance(c, list):
            prompt = _turns(p, "prompt", where, _openai_message)
            completion = _turns(c, "completion", where, _openai_message)
            return Chat(prompt + completion, _tools(row.get("tools"), where), len(prompt))
        return Completion(_str(row, "prompt", where), _str(row, "completion", where))
    if fmt == "messages":
        msgs = _turns(row["messages"], "messages", where, _openai_message)
        return Chat(msgs, _tools(row.get("tools"), where))
    if fmt == "sharegpt":
        msgs = _turns(row["conversations"], "conversations", where, _sharegpt_message)
        system = row.get("system")
        if system:
            if not isinstance(system, str):
                raise DataError(f'{where}: "system" must be a string')
            if msgs[0]["role"] != "system":
                msgs = ({"role": "system", "content": system}, *msgs)
        return Chat(msgs, _tools(row.get("tools"), where))
    if fmt == "alpaca":
        history = row.get("history") or []
        if not isinstance(history, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 and all(isinstance(x, str) for x in h)
            for h in history
        ):
            raise DataError(f'{where}: "history" must be a list of [instruction, response] pairs')
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise DataError(f'{where}: "system" must be a string')
        return Alpaca(
            _str(row, "instruction", where), _str(row, "input", where, optional=True),
            _str(row, "output", where), system or None, tuple(tuple(h) for h in history))
    raise DataError(f"{where}: unknown format {fmt!r}")  # pragma: no cover


def parse_row(row: Any, where: str = "row") -> tuple[str, Example]:
    fmt = detect_format(row, where)
    return fmt, to_example(row, fmt, where)


def row_schema(row: Any, where: str = "row") -> str:
    """The format name of a row after full validation (DataError if invalid)."""
    return parse_row(row, where)[0]


# ---------------------------------------------------------------- encoding


def _eos_id(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token before encoding")
    return int(eos)


def _weights_from_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[float]:
    # A token counts when its character span overlaps a weighted span; zero-width
    # tokens (special tokens added by the tokenizer) never do. Overlapping spans are
    # merged first; then only the last span starting before a token's end can hold it
    # (a binary search per token: linear in the tokens, however many turns).
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    starts = [lo for lo, _ in merged]
    weights = []
    for s, e in offsets:
        i = bisect.bisect_left(starts, e) - 1
        weights.append(1.0 if i >= 0 and s < merged[i][1] else 0.0)
    return weights


_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template(tokenizer: Any, tools: Any = None) -> str:
    """The template string a chat would be rendered with, or DataError."""
    template: str | None = None
    if getattr(tokenizer, "chat_template", None):
        try:
            template = tokenizer.get_chat_template(None, list(tools) if tools else None)
        except (ValueError, AttributeError):
            template = None
    if not template:
        raise DataError(
            "chat rows (messages, conversations, conversational prompt/completion) need a "
            "tokenizer with a chat template, and this one has none; use a chat model's "
            "tokenizer, set tokenizer.chat_template, or write prompt/completion rows instead"
        )
    return template


def has_generation_markers(template: str) -> bool:
    return bool(_GENERATION.search(template))


@functools.lru_cache(maxsize=16)
def _warn_tools_ignored(template_hash: int) -> None:
    logger.warning(
        'rows carry "tools" but the chat template never reads `tools`, so the model will not '
        "see them; use the model's tool-calling template"
    )


def _render(tokenizer: Any, messages: Iterable[dict[str, Any]], tools: Any, gen: bool = False
            ) -> str:
    text: str = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False,
        add_generation_prompt=gen)
    return text


def _prefix_len(ex: Chat, tokenizer: Any, full: str, upto: int) -> int:
    """Length of the render of ``messages[:upto]``, checked to be a prefix of ``full``."""
    if upto == 0:
        return 0
    for gen in (True, False):
        before = _render(tokenizer, ex.messages[:upto], ex.tools, gen)
        if full.startswith(before):
            return len(before)
    raise DataError(_NOT_PREFIX.format(k=upto))


_NOT_PREFIX = (
    "the chat template does not render conversations prefix by prefix (the render up to "
    "message {k} is not a prefix of the full render), so assistant turns cannot be located; "
    "templates that rewrite earlier turns (e.g. stripping reasoning) do this. Use "
    "prompt/completion rows instead, or a chat template without that rewriting (or one with "
    "{{% generation %}} markers)"
)


#: the most messages a chat may have when its template cannot be rendered turn by turn,
#: so that locating its assistant turns takes a render of every prefix (quadratic)
PREFIX_RENDER_MAX_MESSAGES = 512


def assistant_spans(ex: Chat, tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The prefix-render fallback: the rendered chat and the character span of each
    trained assistant turn (see the module docstring). Each turn's part of the render
    comes from a short window of the chat (`_turn_pieces`), so the cost is linear in
    the turns; a template whose turns do not render alike in a window is rendered
    prefix by prefix instead, for chats of up to `PREFIX_RENDER_MAX_MESSAGES`."""
    full = _render(tokenizer, ex.messages, ex.tools)
    pieces = _turn_pieces(ex, tokenizer, full)
    if pieces is None:
        return full, _prefix_spans(ex, tokenizer, full)
    spans, at = [], 0
    for k, (piece, gen) in enumerate(pieces):
        if ex.messages[k]["role"] == "assistant" and k >= ex.train_from:
            start = at + len(gen) if gen and full.startswith(gen, at) else at
            end = at + len(piece.rstrip())
            if end > start:
                spans.append((start, end))
        at += len(piece)
    return full, spans


def _turn_pieces(ex: Chat, tokenizer: Any, full: str) -> list[tuple[str, str]] | None:
    """(what message k adds to the render, the generation prompt the render before it
    ends with: "" when none or not needed) for every message k, each from a window of
    the chat: a leading system message, then the one or two messages before k (the
    same parity of position as in the chat, for templates that check that roles
    alternate) and k. None when the pieces do not add up to `full`: a template whose
    turns depend on more of the chat than that."""
    msgs, tools = list(ex.messages), ex.tools
    head = 1 if msgs[0]["role"] == "system" else 0
    pieces = []
    for k, m in enumerate(msgs):
        if k <= head:  # the chat's own prefix
            context = msgs[:k]
        else:
            s = (k - 1) - (k - 1 - head) % 2
            context = [*msgs[:head], *msgs[s:k]]
        before = _render(tokenizer, context, tools) if context else ""
        after = _render(tokenizer, [*context, m], tools)
        if not after.startswith(before):
            return None
        gen = ""
        if context and m["role"] == "assistant" and k >= ex.train_from:
            opened = _render(tokenizer, context, tools, gen=True)
            gen = opened[len(before):] if opened.startswith(before) else ""
        pieces.append((after[len(before):], gen))
    return pieces if "".join(p for p, _ in pieces) == full else None


def _prefix_spans(ex: Chat, tokenizer: Any, full: str) -> list[tuple[int, int]]:
    """The assistant spans from a render of every prefix of the chat (a render per
    turn, each as long as the chat so far: for short chats only)."""
    if len(ex.messages) > PREFIX_RENDER_MAX_MESSAGES:
        raise DataError(
            f"this chat has {len(ex.messages)} messages and its chat template does not render "
            "turns alike in a short window of the chat, so locating the assistant turns takes "
            f"a render of every prefix; that is done for up to {PREFIX_RENDER_MAX_MESSAGES} "
            "messages: split the conversation, or use a template with {% generation %} markers")
    spans = []
    for k, m in enumerate(ex.messages):
        if m["role"] != "assistant" or k < ex.train_from:
            continue
        start = None
        for gen in (True, False):  # some templates render no generation prompt
            before = _render(tokenizer, ex.messages[:k], ex.tools, gen) if k else ""
            if full.startswith(before):
                start = len(before)
                break
        upto = _render(tokenizer, ex.messages[: k + 1], ex.tools)
        if start is None or not full.startswith(upto):
            raise DataError(_NOT_PREFIX.format(k=k))
        end = len(upto.rstrip())
        if end > start:
            spans.append((start, end))
    return spans


def _encode_chat(ex: Chat, tokenizer: Any) -> tuple[list[int], list[float], str]:
    template = chat_template(tokenizer, ex.tools)
    if ex.tools and "tools" not in template:
        _warn_tools_ignored(hash(template))
    if has_generation_markers(template):
        out = tokenizer.apply_chat_template(
            list(ex.messages), tools=list(ex.tools) if ex.tools else None, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True})
        ids = [int(i) for i in out["input_ids"]]
        weights = [float(x) for x in out["assistant_masks"]]
        if ex.train_from:
            full = _render(tokenizer, ex.messages, ex.tools)
            cut = _prefix_len(ex, tokenizer, full, ex.train_from)
            weights = [w if s >= cut else 0.0 for w, (s, _) in zip(weights, out["offset_mapping"])]
        return ids, weights, "generation markers"
    text, spans = assistant_spans(ex, tokenizer)
    # The template already holds any BOS / special tokens it wants.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    weights = _weights_from_spans(enc["offset_mapping"], spans)
    return list(enc["input_ids"]), weights, "prefix render"


def encode_example(ex: Example, tokenizer: Any) -> tuple[list[int], list[float], str]:
    """Token ids, per-token loss weights (1.0 = the token is a loss target) and the
    loss-mask method (one of LOSS_METHODS) of one example."""
    if isinstance(ex, Alpaca):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        ex = ex.as_chat() if has_template else ex.as_completion()
    if isinstance(ex, Chat):
        return _encode_chat(ex, tokenizer)
    eos = _eos_id(tokenizer)
    if isinstance(ex, Text):
        ids = tokenizer(ex.text, add_special_tokens=True, verbose=False)["input_ids"]
        ids = list(ids) if ids and ids[-1] == eos else [*ids, eos]
        return ids, [1.0] * len(ids), "all tokens"
    # Completion: tokenize as one string so the boundary tokenizes as at inference
    # (verbose=False: long rows are fine, they are packed, not fed whole).
    enc = tokenizer(ex.prompt + ex.completion, add_special_tokens=True,
                    return_offsets_mapping=True, verbose=False)
    ids = list(enc["input_ids"])
    weights = _weights_from_spans(enc["offset_mapping"], [(len(ex.prompt), 1 << 62)])
    if not ids or ids[-1] != eos:
        ids.append(eos)
        weights.append(1.0)
    return ids, weights, "completion only"


def encode_row(row: dict[str, Any], tokenizer: Any) -> Encoded:
    """Token ids and per-token loss weights (1.0 = counts in the loss) of one row."""
    fmt, ex = parse_row(row)
    ids, weights, _ = encode_example(ex, tokenizer)
    if not any(weights):
        logger.debug("row has no loss tokens (format %s, %d tokens)", fmt, len(ids))
    return ids, weights
