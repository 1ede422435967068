"""Row formats, sources and refusals; the `yeto data` command."""

import json
import logging

import pytest

from yeto.cli.data import main as data_main
from yeto.data import DataError, load_blocks, read_source
from yeto.data.formats import encode_example, parse_row
from yeto.data.provenance import ProvenanceError
from yeto.testing.tasks import reverse_row
from yeto.testing.tokenizer import save_tokenizer, stdlib_text, train_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"

# ChatML with {% generation %} around assistant replies (and their end-of-turn).
GEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML that renders tools and tool calls.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{- '<call>' + c.function.name + ' ' + (c.function.arguments | tojson) + '</call>' }}"
    "{%- endfor %}{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    task = [m["content"] for m in reverse_row(["apple", "river", "stone"])["messages"]]
    return train_tokenizer([stdlib_text(50_000), *task * 20], vocab_size=512)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, tok):
    """A model dir holding only a tokenizer (enough for `yeto data`)."""
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, d)
    return d


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained(tok, row):
    _, ex = parse_row(row)
    ids, w, method = encode_example(ex, tok)
    return tok.decode([i for i, x in zip(ids, w) if x]), tok.decode(ids), method


def with_template(tok, template):
    class Swap:
        def __enter__(self):
            self.saved, tok.chat_template = tok.chat_template, template

        def __exit__(self, *exc):
            tok.chat_template = self.saved

    return Swap()


CHAT = [{"role": "user", "content": "reverse: apple river"},
        {"role": "assistant", "content": "river apple"}]


# ---------------------------------------------------------------- one test per format


def test_text(tok):
    loss, full, method = trained(tok, {"text": "def f(x): return x"})
    assert loss == full == "def f(x): return x<|eos|>" and method == "all tokens"


def test_openai_messages_with_content_parts(tok):
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "reverse: "},
                                                     {"type": "text", "text": "apple river"}]},
                        {"role": "assistant", "content": "river apple"}]}
    loss, full, method = trained(tok, row)
    assert loss == "river apple<|im_end|>" and method == "prefix render"
    assert "reverse: apple river" in full


def test_openai_messages_with_tools_and_tool_calls(tok):
    row = {
        "tools": [{"type": "function", "function": {"name": "rev", "parameters": {}}}],
        "messages": [
            {"role": "user", "content": "reverse apple river"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "rev",
                                                  "arguments": '{"words": "apple river"}'}}]},
            {"role": "tool", "content": "river apple"},
            {"role": "assistant", "content": "river apple"},
        ],
    }
    with with_template(tok, TOOL_TEMPLATE):
        loss, full, _ = trained(tok, row)
    assert full.startswith('<|im_start|>system\nTools: [{"type": "function"')
    # the JSON-string arguments reach the template as a dict
    assert loss == '<call>rev {"words": "apple river"}</call><|im_end|>river apple<|im_end|>'


def test_sharegpt(tok):
    turns = [{"from": "human", "value": "reverse: apple river"},
             {"from": "gpt", "value": "river apple"}]
    row = {"system": "be brief", "conversations": turns}
    loss, full, _ = trained(tok, row)
    assert loss == "river apple<|im_end|>"
    assert full.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")


def test_sharegpt_unknown_speaker(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(DataError, match=r"d\.jsonl line 1: conversations\[0\]: unknown \"from\""):
        read_source(p)


def test_alpaca_with_chat_template_trains_output_only(tok):
    row = {"instruction": "reverse", "input": "apple river", "output": "river apple",
           "history": [["say hi", "hello"]], "text": "pre-rendered copy, ignored"}
    loss, full, _ = trained(tok, row)
    assert loss == "river apple<|im_end|>"  # history replies are context
    assert "<|im_start|>user\nreverse\n\napple river<|im_end|>" in full
    assert "<|im_start|>assistant\nhello<|im_end|>" in full


def test_alpaca_without_chat_template_uses_the_alpaca_prompt(tok):
    with with_template(tok, None):
        loss, full, method = trained(tok, {"instruction": "reverse", "input": "apple river",
                                           "output": "river apple"})
    assert method == "completion only" and loss == "river apple<|eos|>"
    assert full.startswith("Below is an instruction that describes a task, paired with an input")
    assert "### Input:\napple river\n\n### Response:\nriver apple<|eos|>" in full


def test_prompt_completion_strings(tok):
    loss, full, method = trained(tok, {"prompt": "reverse: apple river\n",
                                       "completion": "river apple"})
    assert (loss, method) == ("river apple<|eos|>", "completion only")
    assert full == "reverse: apple river\nriver apple<|eos|>"


def test_prompt_completion_conversational_trains_completion_turns_only(tok):
    row = {"prompt": [*CHAT, {"role": "user", "content": "again: cloud stone"}],
           "completion": [{"role": "assistant", "content": "stone cloud"}]}
    assert trained(tok, row)[0] == "stone cloud<|im_end|>"  # not "river apple"
    with with_template(tok, GEN_TEMPLATE):
        loss, _, method = trained(tok, row)
    assert (loss, method) == ("stone cloud<|im_end|>", "generation markers")


# ---------------------------------------------------------------- loss masks


def test_generation_markers_are_used_where_the_template_has_them(tok):
    row = {"messages": [*CHAT, {"role": "user", "content": "again"},
                        {"role": "assistant", "content": "cloud stone"}]}
    _, ex = parse_row(row)
    ids_prefix, w_prefix, m1 = encode_example(ex, tok)
    with with_template(tok, GEN_TEMPLATE):
        ids_gen, w_gen, m2 = encode_example(ex, tok)
    assert (m1, m2) == ("prefix render", "generation markers")
    # Same render: the fallback reproduces exactly what the markers say.
    assert ids_gen == ids_prefix and w_gen == w_prefix
    # And the markers really are what decides: mark the reply without its <|im_end|>.
    narrow = GEN_TEMPLATE.replace("{{- message['content'] + '<|im_end|>' }}{% endgeneration %}",
                                  "{{- message['content'] }}{% endgeneration %}{{- '<|im_end|>' }}")
    with with_template(tok, narrow):
        assert trained(tok, row)[0] == "river applecloud stone"


def test_row_without_loss_tokens_is_skipped_with_a_warning(tmp_path, tok, caplog):
    rows = [{"messages": CHAT}] * 3 + [{"messages": [{"role": "user", "content": "hi"}]}]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="yeto.data"):
        b = load_blocks(p, tok, seq_len=16)
    assert "1 of 4 rows have no loss tokens" in caplog.text and "d.jsonl line 4" in caplog.text
    assert b.info["rows"] == 3 and b.info["rows_dropped"] == 1


def test_source_without_any_loss_token_is_an_error(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 2)
    with pytest.raises(DataError, match="no row has a loss token"):
        load_blocks(p, tok, seq_len=16)


# ---------------------------------------------------------------- refusals


def test_unknown_schema_says_file_line_seen_and_accepted(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"question": "?", "answer": 4}])
    with pytest.raises(DataError) as e:
        read_source(p)
    msg = str(e.value)
    assert "d.jsonl line 2" in msg and "'question': str" in msg and "'answer': int" in msg
    for accepted in ('"text"', '"messages"', '"conversations"', '"instruction"', '"prompt"'):
        assert accepted in msg


def test_mixed_schemas_in_one_file_are_refused(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, {"messages": CHAT}])
    with pytest.raises(DataError, match=r"d\.jsonl line 3: a messages row .* in a text file"):
        read_source(p)


@pytest.mark.parametrize("name, content", [("e.jsonl", "\n \n"), ("e.json", "[]"),
                                           ("e.json", "")])
def test_empty_file_is_refused(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match="no rows found; the file is empty"):
        read_source(tmp_path / name)


def test_empty_folder_and_missing_source(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no data files"):
        read_source(tmp_path / "empty")
    with pytest.raises(DataError, match="data not found"):
        read_source(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- sources

ROWS = [{"text": f"row {i}"} for i in range(4)]


def test_json_lines_in_a_json_file(tmp_path):
    p = tmp_path / "d.json"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert read_source(p).rows == ROWS


def test_parquet_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"prompt": "a", "completion": "b", "extra": None}, {"prompt": "c", "completion": "d",
                                                               "extra": 1}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    src = read_source(tmp_path / "d.parquet")
    assert src.formats == {str(tmp_path / "d.parquet"): "prompt_completion"}
    assert src.rows == [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d",
                                                             "extra": 1}]
    assert src.where[1].endswith("d.parquet row 2") and src.source["digest"].startswith("sha256:")


def test_folder_with_splits_and_formats_per_file(tmp_path):
    write_jsonl(tmp_path / "data" / "train-a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "data" / "train-b.jsonl", [{"messages": CHAT}])
    write_jsonl(tmp_path / "data" / "validation.jsonl", ROWS[2:])
    (tmp_path / "README.md").write_text("not data")
    train = read_source(tmp_path)
    assert train.source["split"] == "train" and len(train) == 3
    assert sorted(train.formats.values()) == ["messages", "text"]
    assert train.source["files"] == ["data/train-a.jsonl", "data/train-b.jsonl"]
    held_out = read_source(tmp_path, held_out=True)
    assert held_out.source["split"] == "validation" and held_out.rows == ROWS[2:]
    assert read_source(tmp_path, split="dev").rows == ROWS[2:]  # dev = validation
    with pytest.raises(DataError, match="no split 'test'; it has train, validation"):
        read_source(tmp_path, split="test")


def test_folder_without_split_names_reads_every_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "sub" / "b.jsonl", ROWS[1:])
    write_jsonl(tmp_path / ".hidden" / "c.jsonl", [{"bogus": 1}])
    assert read_source(tmp_path).rows == ROWS


def test_folder_splits_follow_datasets_patterns(tmp_path):
    """Split names are `datasets`' own: folder names (train/, test/), sharded file
    names with any split name, and its keywords (eval = test)."""
    write_jsonl(tmp_path / "dirs" / "train" / "a.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "dirs" / "test" / "b.jsonl", ROWS[3:])
    assert read_source(tmp_path / "dirs").rows == ROWS[:3]
    held_out = read_source(tmp_path / "dirs", held_out=True)
    assert held_out.source["split"] == "test" and held_out.source["files"] == ["test/b.jsonl"]
    assert read_source(tmp_path / "dirs", split="eval").rows == ROWS[3:]
    write_jsonl(tmp_path / "shards" / "data" / "train-00000-of-00001.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "shards" / "data" / "extra-00000-of-00001.jsonl", ROWS[1:])
    assert read_source(tmp_path / "shards").rows == ROWS[:1]
    assert read_source(tmp_path / "shards", split="extra").rows == ROWS[1:]
    with pytest.raises(DataError, match="no held-out .* split; it has extra, train"):
        read_source(tmp_path / "shards", held_out=True)


def test_folder_splits_are_the_ones_load_dataset_reads(tmp_path):
    """Each split holds the rows `datasets.load_dataset(folder)` puts in it (a file
    named after no split, here notes.jsonl, is in none)."""
    datasets = pytest.importorskip("datasets")
    rows = [{"text": f"row {i}"} for i in range(12)]
    layout = {"train-0.jsonl": rows[:2], "data/my_train.jsonl": rows[2:4],
              "valid.jsonl": rows[4:6], "data/dev_part.jsonl": rows[6:8],
              "notes.jsonl": rows[8:10], "testing_set.jsonl": rows[10:]}
    for rel, part in layout.items():
        write_jsonl(tmp_path / "d" / rel, part)
    want = datasets.load_dataset(str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"))
    assert sorted(want) == ["test", "train", "validation"]
    for split, ds in want.items():
        got = read_source(tmp_path / "d", split=split)
        assert sorted(r["text"] for r in got.rows) == sorted(ds["text"]), split
        assert got.source["split"] == split
        assert not any(r["text"] in ("row 8", "row 9") for r in got.rows)


def test_datasets_save_to_disk_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert read_source(tmp_path / "one").rows == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(
        str(tmp_path / "two"))
    assert read_source(tmp_path / "two").rows == ROWS[:3]
    held_out = read_source(tmp_path / "two", held_out=True)
    assert held_out.rows == ROWS[3:] and held_out.where == [f"{tmp_path / 'two'}[test] row 1"]


def fake_hub_dataset(cache, repo="acme/reverse", files=None, commit=COMMIT, refs=("main",)):
    """The layout huggingface_hub's cache uses: datasets--org--name/{refs,snapshots}."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    for ref in refs:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    for rel, rows in (files or {"data/train-00000-of-00001.jsonl": ROWS}).items():
        write_jsonl(root / "snapshots" / commit / rel, rows)
    return root


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be fetched
    return cache


def test_hub_dataset_resolves_revision_to_commit_offline(hub_cache):
    fake_hub_dataset(hub_cache, refs=("main", "v1"))
    fake_hub_dataset(hub_cache, files={"train.jsonl": ROWS[:1], "test.jsonl": ROWS[1:]},
                     commit=OTHER, refs=("v2",))
    src = read_source("acme/reverse")
    assert src.rows == ROWS
    assert src.source["kind"] == "hub" and src.source["commit"] == COMMIT
    assert src.source["revision"] == "main" and src.source["files"] == [
        "data/train-00000-of-00001.jsonl"]
    assert read_source("acme/reverse", revision="v1").source["commit"] == COMMIT
    v2 = read_source("acme/reverse", revision="v2")
    assert v2.source["commit"] == OTHER and v2.rows == ROWS[:1]
    assert read_source("acme/reverse", revision=OTHER, held_out=True).rows == ROWS[1:]
    assert "acme/reverse@fedcba9876/test.jsonl line 1" in read_source(
        "acme/reverse", revision="v2", split="test").where[0]


def test_hub_dataset_unknown_revision_or_repo(hub_cache):
    fake_hub_dataset(hub_cache)
    with pytest.raises(ProvenanceError, match=r"revision 'nope' could not be resolved .*offline"):
        read_source("acme/reverse", revision="nope")
    with pytest.raises(ProvenanceError, match="hf download acme/other --repo-type dataset"):
        read_source("acme/other")


def test_revision_on_a_local_path_is_refused(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="applies to hub dataset ids"):
        read_source(p, revision="main")


# ---------------------------------------------------------------- yeto data


def test_yeto_data_reports_and_marks_the_loss_mask(tmp_path, tok_dir, capsys):
    p = write_jsonl(tmp_path / "d.jsonl", [reverse_row(["apple", "river", "stone"])] * 6
                    + [{"messages": [{"role": "user", "content": "no reply"}]}])
    assert data_main([str(p), "--model", str(tok_dir), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "format:      messages" in out
    assert "[[<|im_start|>user\nreverse: apple river stone<|im_end|>\n<|im_start|>assistant\n]]" \
           "stone river apple<|im_end|>[[\n]]" in out
    last = out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert last.startswith("RESULT ") and fields["format"] == "messages" and fields["rows"] == "7"
    assert fields["skipped_rows"] == "1" and "d.jsonl line 7" in out
    assert int(fields["loss_tokens"]) > 0 and int(fields["tokens"]) > int(fields["loss_tokens"])


def test_yeto_data_fails_with_the_error(tmp_path, tok_dir, capsys):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"foo": 1}])
    assert data_main([str(p), "--model", str(tok_dir)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl line 2" in err and "'foo': int" in err and "accepted" in err
