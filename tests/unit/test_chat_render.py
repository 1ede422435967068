"""Chat rows at scale and content parts (issue 44, item 7): a chat's assistant turns
are located with a bounded number of renders per turn (a 4,000-turn chat encodes;
the per-prefix render is kept for templates that need it, on short chats only), the
turn-by-turn spans are exactly the per-prefix ones, and a content part whose text is
not a string is a one-line DataError that names the file, line and part.

Here: the checks that need no process, server or training."""

import json

import numpy as np
import pytest

from yeto.data import DataError, load_blocks, read_source
from yeto.data.formats import (
    PREFIX_RENDER_MAX_MESSAGES,
    _prefix_spans,
    _render,
    _turn_pieces,
    _weights_from_spans,
    assistant_spans,
    encode_example,
    parse_row,
)
from yeto.testing.tokenizer import stdlib_text, train_tokenizer

# Gemma's way: roles must alternate, a system message is folded into the first turn.
ALTERNATING = (
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set first = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- for m in loop_messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}"
    "{{- '<start>' + m['role'] + '\\n' + (first if loop.first else '') }}"
    "{{- m['content'] + '<end>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<start>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's way: a default system message when the chat has none.
DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nBe helpful.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Turns numbered through the whole chat: no short window renders a turn as the chat does.
NUMBERED = (
    "{%- for m in messages %}{{- '[' + loop.index|string + '] ' + m['role'] + ': ' "
    "+ m['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[' + (messages|length + 1)|string + '] assistant: ' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([stdlib_text(50_000)], vocab_size=512)


class Counting:
    """The real tokenizer, counting the messages its chat template renders."""

    def __init__(self, tok):
        self.tok, self.rendered = tok, 0

    def apply_chat_template(self, messages, **kw):
        self.rendered += len(messages)
        return self.tok.apply_chat_template(messages, **kw)

    def __call__(self, *a, **kw):
        return self.tok(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def chat(turns: int, system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for i in range(turns // 2):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return msgs


def with_template(tok, template):
    class Swap:
        def __enter__(self):
            self.saved, tok.chat_template = tok.chat_template, template

        def __exit__(self, *exc):
            tok.chat_template = self.saved

    return Swap()


def test_a_4000_turn_chat_encodes_with_a_bounded_number_of_renders_per_turn(tok):
    """The issue's case (4,000 turns took 26.6 s): every prefix was rendered, so the
    messages rendered grew with the square of the turns; now a few per turn."""
    for turns in (40, 4000):
        counting = Counting(tok)
        _, ex = parse_row({"messages": chat(turns)})
        ids, weights, method = encode_example(ex, counting)
        assert method == "prefix render"
        assert counting.rendered <= 8 * turns, (turns, counting.rendered)
        trained = tok.decode([i for i, w in zip(ids, weights) if w])
        assert trained == "".join(f"a{i}<|im_end|>" for i in range(turns // 2))


@pytest.mark.parametrize("template", [None, ALTERNATING, DEFAULT_SYSTEM])
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("train_from", [0, 3])
def test_turn_by_turn_spans_are_the_per_prefix_spans(tok, template, system, train_from):
    _, ex = parse_row({"messages": chat(12, system)})
    ex = type(ex)(ex.messages, ex.tools, train_from)
    with with_template(tok, template or tok.chat_template):
        full = _render(tok, ex.messages, ex.tools)
        assert _turn_pieces(ex, tok, full) is not None  # the linear path is taken
        got_full, spans = assistant_spans(ex, tok)
        assert got_full == full and spans == _prefix_spans(ex, tok, full) and spans


def test_a_template_that_needs_the_whole_chat_is_rendered_per_prefix_on_short_chats(tok):
    _, short = parse_row({"messages": chat(10)})
    _, long = parse_row({"messages": chat(PREFIX_RENDER_MAX_MESSAGES + 2)})
    with with_template(tok, NUMBERED):
        full = _render(tok, short.messages, None)
        assert _turn_pieces(short, tok, full) is None
        _, spans = assistant_spans(short, tok)
        assert [full[a:b] for a, b in spans] == [f"a{i}" for i in range(5)]
        with pytest.raises(DataError, match=f"up to {PREFIX_RENDER_MAX_MESSAGES} messages"):
            assistant_spans(long, tok)


def test_weights_from_spans_match_the_overlap_rule():
    """Binary search instead of every span for every token: the same weights."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        cuts = np.sort(rng.integers(0, 60, 2 * int(rng.integers(0, 6))))
        spans = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2])]
        spans += [(int(a), int(a) + int(rng.integers(0, 9))) for a in rng.integers(0, 60, 2)]
        offsets = [(int(s), int(s) + int(rng.integers(0, 4))) for s in np.sort(
            rng.integers(0, 64, 30))]
        want = [1.0 if any(s < hi and e > lo for lo, hi in spans) else 0.0 for s, e in offsets]
        assert _weights_from_spans(offsets, spans) == want, (offsets, spans)


@pytest.mark.parametrize("part, words", [
    ({"type": "text", "text": 5}, "content[1].text must be a string, got 5"),
    ({"type": "text"}, "content[1].text must be a string, got None"),
    ({"type": "image_url", "image_url": {"url": "x"}}, "content[1] is not a text part"),
    ("hello", "content[1] is not a text part"),
])
def test_a_content_part_without_string_text_is_a_one_line_data_error(tmp_path, part, words):
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]},
                        {"role": "assistant", "content": "ok"}]}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": chat(2)}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        read_source(p)
    msg = str(e.value)
    assert "d.jsonl line 2" in msg and "messages[0]" in msg and words in msg, msg
    assert "\n" not in msg
    with pytest.raises(DataError, match="content"):
        load_blocks(p, None, seq_len=16)
