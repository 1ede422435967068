import json
import logging

import numpy as np
import pytest

from yeto.data import (
    BatchSampler,
    Blocks,
    DataError,
    encode_row,
    load_blocks,
    load_rows,
    pack_blocks,
    shard_rows,
)
from yeto.testing.tasks import reverse_row
from yeto.testing.tokenizer import stdlib_text, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    task = [m["content"] for m in reverse_row(["apple", "river", "stone"])["messages"]]
    return train_tokenizer([stdlib_text(50_000), *task * 20], vocab_size=512)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: apple river"},
        {"role": "assistant", "content": "river apple"},
        {"role": "user", "content": "again: stone cloud"},
        {"role": "assistant", "content": "cloud stone"},
    ]
}


# ---------------------------------------------------------------- rows


def test_load_rows_accepts_each_schema(tmp_path):
    # One format per file (a mixed file is refused: tests/unit/test_formats.py).
    each = [{"text": "hello"}, CHAT, {"prompt": "2+2=", "completion": "4", "id": 7}]
    for i, row in enumerate(each):
        rows = [row, row]
        assert load_rows(write_jsonl(tmp_path / f"d{i}.jsonl", rows)) == rows
        (tmp_path / f"d{i}.json").write_text(json.dumps(rows))
        assert load_rows(tmp_path / f"d{i}.json") == rows


def test_blank_lines_are_skipped_but_counted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n{"foo": 1}\n')
    with pytest.raises(DataError, match="line 3"):
        load_rows(p)


def test_unknown_schema_names_file_line_keys_and_accepted(tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [{"text": "a"}, {"text": "b"}, {"foo": 1, "bar": 2}])
    with pytest.raises(DataError) as e:
        load_rows(p)
    msg = str(e.value)
    assert "data.jsonl line 3" in msg
    assert "['bar', 'foo']" in msg
    for accepted in ('{"text"', '{"messages"', '{"prompt"', '"completion"'):
        assert accepted in msg


@pytest.mark.parametrize(
    "row, match",
    [
        ({"text": 3}, '"text" must be a string'),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
        ({"prompt": "a", "completion": None}, '"completion" must be a string'),
        ({"text": "a", "prompt": "b", "completion": "c"}, "ambiguous"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_rows(tmp_path, row, match):
    with pytest.raises(DataError, match=match):
        load_rows(write_jsonl(tmp_path / "d.jsonl", [row]))


def test_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "oops\n')
    with pytest.raises(DataError, match=r"d\.jsonl line 2: invalid JSON"):
        load_rows(p)


def test_empty_and_missing_files(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(DataError, match="empty"):
        load_rows(p)
    with pytest.raises(DataError, match="not found: .*nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(tmp_path / "d.csv")


def test_shard_rows_i_mod_m():
    rows = [{"text": str(i)} for i in range(10)]
    shards = [shard_rows(rows, i, 3) for i in range(3)]
    for i, shard in enumerate(shards):
        assert [int(r["text"]) for r in shard] == [j for j in range(10) if j % 3 == i]
    assert sum(len(s) for s in shards) == 10
    with pytest.raises(DataError):
        shard_rows(rows, 3, 3)


# ---------------------------------------------------------------- encoding


def weighted_text(tok, ids, weights):
    return tok.decode([i for i, w in zip(ids, weights) if w])


def test_messages_weight_only_assistant_turns(tok):
    ids, w = encode_row(CHAT, tok)
    assert len(ids) == len(w)
    assert tok.decode(ids) == tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert weighted_text(tok, ids, w) == "river apple<|im_end|>cloud stone<|im_end|>"
    # Each assistant turn is one contiguous run of weighted tokens.
    runs = [tok.decode(ids[a:b]) for a, b in _runs(w)]
    assert runs == ["river apple<|im_end|>", "cloud stone<|im_end|>"]


def _runs(w):
    runs, start = [], None
    for i, x in enumerate([*w, 0.0]):
        if x and start is None:
            start = i
        elif not x and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_messages_without_assistant_has_no_loss_tokens(tok, caplog):
    row = {"messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.DEBUG, logger="yeto.data"):
        ids, w = encode_row(row, tok)
    assert ids and not any(w)
    assert "no loss tokens" in caplog.text


def test_template_that_is_not_prefix_stable_is_refused(tok):
    saved = tok.chat_template
    # Marks the last message differently, so a prefix render is not a prefix.
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    try:
        with pytest.raises(DataError, match="prefix"):
            encode_row(CHAT, tok)
    finally:
        tok.chat_template = saved


def test_messages_need_a_chat_template(tok):
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(DataError, match="chat template"):
            encode_row(CHAT, tok)
    finally:
        tok.chat_template = saved


def test_prompt_completion_weights_completion_and_eos(tok):
    ids, w = encode_row({"prompt": "reverse: apple river\n", "completion": "river apple"}, tok)
    assert ids[-1] == tok.eos_token_id
    assert weighted_text(tok, ids, w) == "river apple<|eos|>"
    assert tok.decode(ids) == "reverse: apple river\nriver apple<|eos|>"


def test_text_weights_everything_and_appends_eos(tok):
    ids, w = encode_row({"text": "def f(x):\n    return x"}, tok)
    assert ids[-1] == tok.eos_token_id
    assert all(w)
    assert tok.decode(ids) == "def f(x):\n    return x<|eos|>"


# ---------------------------------------------------------------- packing


def test_pack_blocks_shapes_and_alignment():
    ids = list(range(1, 104))  # 103 tokens
    encoded = [(part, [float(i % 2) for i in part]) for part in (ids[:40], ids[40:])]
    b = pack_blocks(encoded, seq_len=10)
    assert b.tokens.dtype == np.int32 and b.weights.dtype == np.float32
    assert b.tokens.shape == (10, 11) and b.weights.shape == (10, 10)  # (103 - 1) // 10
    assert b.seq_len == 10 and len(b) == 10
    # weights[:, t] is the weight of the target tokens[:, t + 1]
    np.testing.assert_array_equal(b.weights, b.tokens[:, 1:] % 2)
    # stride seq_len: a block starts where the previous one ended; targets never repeat
    np.testing.assert_array_equal(b.tokens[1:, 0], b.tokens[:-1, -1])
    assert b.tokens[0, 0] == 1 and b.tokens[-1, -1] == 101  # tail (102, 103) dropped
    assert b.loss_tokens == int(np.count_nonzero(b.tokens[:, 1:] % 2))


def test_pack_blocks_pads_tiny_data():
    b = pack_blocks([([5, 6, 7], [1.0, 1.0, 1.0])], seq_len=8, pad_id=0)
    assert b.tokens.shape == (1, 9)
    assert b.tokens[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0, 0]
    assert b.weights[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert b.loss_tokens == 2


def test_load_blocks_with_shard(tmp_path, tok):
    rows = [reverse_row(["apple", "river", "stone"][: 1 + i % 3]) for i in range(30)]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    full = load_blocks(p, tok, seq_len=16)
    half = load_blocks(p, tok, seq_len=16, shard=(1, 2))
    assert 0 < len(half) < len(full)
    assert full.tokens.shape[1] == 17 and half.loss_tokens > 0
    with pytest.raises(DataError, match="shard 35/40 is empty"):
        load_blocks(p, tok, seq_len=16, shard=(35, 40))


# ---------------------------------------------------------------- sampling


def _blocks(n, seq_len=4):
    tokens = np.arange(n * (seq_len + 1), dtype=np.int32).reshape(n, seq_len + 1)
    return Blocks(tokens=tokens, weights=np.ones((n, seq_len), np.float32))


def test_sampler_is_deterministic_by_seed():
    blocks = _blocks(10)
    a, b, c = (BatchSampler(blocks, 4, seed=s) for s in (1, 1, 2))
    batches_a = [next(a) for _ in range(12)]
    batches_b = [next(b) for _ in range(12)]
    batches_c = [next(c) for _ in range(12)]
    for (ta, wa), (tb, wb) in zip(batches_a, batches_b):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(wa, wb)
    assert any(not np.array_equal(x[0], y[0]) for x, y in zip(batches_a, batches_c))
    assert batches_a[0][0].shape == (4, 5) and batches_a[0][1].shape == (4, 4)


def test_sampler_covers_each_epoch_and_reshuffles():
    blocks = _blocks(8)
    s = BatchSampler(blocks, 4, seed=0)
    epochs = [np.concatenate([next(s)[0][:, 0] for _ in range(2)]) for _ in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == blocks.tokens[:, 0].tolist()
    assert any(not np.array_equal(epochs[0], e) for e in epochs[1:])


def test_sampler_with_fewer_blocks_than_batch():
    s = BatchSampler(_blocks(3), 8, seed=0)
    tokens, weights = next(s)
    assert tokens.shape == (8, 5) and weights.shape == (8, 4)
    assert iter(s) is s


# ---------------------------------------------------------------- positions and batches


def test_blocks_default_positions_are_plain_and_slicing_keeps_them():
    b = _blocks(5)
    np.testing.assert_array_equal(b.positions, np.tile(np.arange(4), (5, 1)))
    doc = pack_blocks([([1, 2, 3], [1.0] * 3), ([4, 5, 6, 7, 8], [1.0] * 5)], 4, packing="document")
    head = doc[:1]
    assert isinstance(head, Blocks) and len(head) == 1
    np.testing.assert_array_equal(head.positions, doc.positions[:1])


def test_sampler_batches_unpack_as_pairs_and_carry_positions():
    doc = pack_blocks([([1, 2, 3], [1.0] * 3), ([4, 5, 6, 7, 8], [1.0] * 5)], 4, packing="document")
    batch = next(BatchSampler(doc, 2, seed=0))
    tokens, weights = batch  # the pair every island unpacks
    assert tokens.shape == (2, 5) and weights.shape == (2, 4)
    assert batch.positions.shape == (2, 4) and batch.positions.dtype == np.int32
    assert batch.tokens is tokens and batch.weights is weights


@pytest.mark.parametrize("content, match", [
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"d\.jsonl: not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", r"d\.jsonl line 1: JSON nested too deeply"),
    (b'{"text": "' + b"x" * (9 << 20) + b'"}\n', r"d\.jsonl line 1: a row of 9,437,196"),
])
def test_hostile_data_files_are_one_clear_error(tmp_path, content, match):
    """A non-UTF-8 file, JSON nested 10^5 deep and a huge row were tracebacks or 21.8 GB
    of memory (issue 44); each is now a DataError naming the file and line."""
    p = tmp_path / "d.jsonl"
    p.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_rows(p)
