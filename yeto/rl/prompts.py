"""RL prompts from the training data formats (`yeto.data`): each row becomes the token
ids a rollout node continues, the prompt text, and the reference answer.

- chat rows (messages, conversations, alpaca, conversational prompt/completion):
  the chat up to its last assistant turn, rendered with the chat template and its
  generation prompt (tokenized without extra special tokens, as vLLM's chat API
  does); the reference is that last assistant turn (none if the chat ends on a
  user turn);
- prompt/completion rows: the prompt with the tokenizer's default special tokens
  (as vLLM's completions API does); the reference is the completion.

An "answer" or "reference" key in a row replaces the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from yeto.data import DataError
from yeto.data.formats import Alpaca, Chat, Completion


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str
    reference: str | None


def to_prompt(row: dict, example, tokenizer) -> Prompt:
    if isinstance(example, Alpaca):
        example = example.as_chat()
    if isinstance(example, Chat):
        msgs = list(example.messages)
        reference = None
        if msgs and msgs[-1]["role"] == "assistant":
            reference = msgs.pop()["content"]
        if not msgs:
            raise DataError("a chat row with nothing before its assistant turn has no prompt")
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif isinstance(example, Completion):
        text, reference = example.prompt, example.completion
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    else:
        raise DataError("RL prompts need chat or prompt/completion rows, not plain text rows")
    for key in ("answer", "reference"):
        if isinstance(row.get(key), str):
            reference = row[key]
    return Prompt(tuple(int(i) for i in ids), text, reference)


def load_prompts(source: str, tokenizer, shard: tuple[int, int] = (0, 1), *,
                 revision: str | None = None, split: str | None = None,
                 held_out: bool = False) -> tuple[list[Prompt], dict]:
    """The prompts of a data source (this island's shard: row i goes to island i mod n)
    and the source's provenance record."""
    from yeto.data import read_source

    rows = read_source(source, revision=revision, split=split, held_out=held_out)
    index, count = shard
    out = []
    for i in range(index, len(rows), count):
        try:
            out.append(to_prompt(rows.rows[i], rows.examples[i], tokenizer))
        except DataError as e:
            raise DataError(f"{rows.where[i]}: {e}") from None
    if not out:
        raise DataError(f"{source}: no prompts for shard {index}/{count}")
    return out, rows.source
