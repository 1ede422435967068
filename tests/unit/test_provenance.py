"""Provenance: pinned models and data, safe loading, provenance.json.

Here: the checks that need no process, server or training (the others:
tests/integration/test_provenance.py)."""


import shutil

import pytest
from helpers.provenance import recipe_digest

from yeto.data.models import resolve_model
from yeto.data.provenance import ProvenanceError, dir_digest


def test_content_digest_follows_the_recipe(tmp_path):
    """dir_digest pins exactly the content: paths, sizes and bytes, not where the
    folder is, and not hidden files."""
    root = tmp_path / "a"
    (root / "sub").mkdir(parents=True)
    (root / "x.json").write_text('{"a": 1}')
    (root / "sub" / "w.safetensors").write_bytes(bytes(range(256)) * 9)
    digest = dir_digest(root)
    assert digest == recipe_digest(root)
    shutil.copytree(root, tmp_path / "b")
    assert dir_digest(tmp_path / "b") == digest  # the location is not content
    (root / ".cache").mkdir()
    (root / ".cache" / "junk").write_text("x")
    assert dir_digest(root) == digest  # hidden paths are not content either
    (root / "x.json").write_text('{"a": 2}')  # same size, one byte differs
    assert dir_digest(root) not in (digest, dir_digest(tmp_path / "b"))
    assert dir_digest(root) == recipe_digest(root)
    (tmp_path / "b" / "x.json").rename(tmp_path / "b" / "y.json")  # same bytes, new name
    assert dir_digest(tmp_path / "b") != digest


def test_missing_model_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))


def test_the_recorded_command_never_holds_a_secret():
    """`--token=X` on an island was written into provenance.json as it was typed (issue 44)."""
    from yeto.data.provenance import build_record, redacted_command

    argv = ["yeto", "island", "--token=s3cret", "--tls-key", "key.pem", "--tok", "s3cret2",
            "--learner-id", "a", "--tokens-per-step", "5"]
    assert redacted_command(argv) == ["yeto", "island", "--token=<redacted>", "--tls-key",
                                      "<redacted>", "--tok", "<redacted>", "--learner-id", "a",
                                      "--tokens-per-step", "5"]
    import sys
    old = sys.argv
    sys.argv = ["island", "--token", "s3cret", "--max-steps", "3"]
    try:
        record = build_record(None, None, {"token": "s3cret", "max_steps": 3})
    finally:
        sys.argv = old
    assert "s3cret" not in str(record)


def test_a_gguf_model_that_is_not_one_gets_a_clear_error(tmp_path):
    """`--model FILE.gguf` is read by `yeto.gguf` (the real reader): a file that is not
    GGUF is named as such, and a hub revision flag is refused for it."""
    from yeto import gguf

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gguf.GGUFError, match="not a readable GGUF file"):
        resolve_model(str(bad))
    with pytest.raises(ProvenanceError, match="--model-revision"):
        resolve_model(str(bad), revision="main")
