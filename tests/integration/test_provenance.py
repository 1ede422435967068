"""Provenance: pinned models and data, safe loading, provenance.json.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_provenance.py)."""


import json
import shutil
from pathlib import Path

import pytest
from helpers.provenance import recipe_digest

from yeto.data.models import resolve_model
from yeto.data.provenance import ProvenanceError, build_record, write_provenance

YETO = Path(__file__).resolve().parents[2] / "yeto"  # the package's source


COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def model_dir(tmp_path, tiny_llama):
    d = tmp_path / "model"
    shutil.copytree(tiny_llama, d)
    return d


def test_local_model_is_pinned_by_content_digest(model_dir):
    src = resolve_model(str(model_dir))
    assert src.kind == "local" and src.commit is None and src.weights == ["model.safetensors"]
    assert src.digest == recipe_digest(model_dir)
    cfg = model_dir / "generation_config.json"
    cfg.write_text(cfg.read_text() + " ")
    assert resolve_model(str(model_dir)).digest != src.digest
    with pytest.raises(ProvenanceError, match="applies to hub ids"):
        resolve_model(str(model_dir), revision="main")


def test_pickled_weights_are_refused(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ProvenanceError, match=r"only pickled weights \(pytorch_model.bin\).*"
                                              r"safetensors only"):
        resolve_model(str(model_dir))
    # a tokenizer-only use (yeto data) loads no weights, so it is fine
    assert resolve_model(str(model_dir), need_weights=False).weights == []


def _with_remote_code(model_dir, model_type):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(model_type=model_type,
               auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "modeling_x.py").write_text("raise SystemExit('remote code ran')\n")


def test_remote_code_needs_the_flag(model_dir):
    _with_remote_code(model_dir, "mystery")
    with pytest.raises(ProvenanceError, match="needs code shipped in the model repo.*"
                                              "--trust-remote-code"):
        resolve_model(str(model_dir))
    src = resolve_model(str(model_dir), trust_remote_code=True)
    assert src.trust_remote_code and src.record()["trust_remote_code"] is True


def test_auto_map_on_a_builtin_architecture_is_loaded_without_remote_code(model_dir):
    _with_remote_code(model_dir, "llama")
    from yeto.torch.model import load_base

    model, _ = load_base(str(model_dir))  # modeling_x.py would exit if it ran
    assert type(model).__name__ == "LlamaForCausalLM"


def test_hub_model_resolves_to_a_commit_offline(tmp_path, monkeypatch, tiny_llama):
    cache = tmp_path / "hub"
    root = cache / "models--acme--tiny"
    shutil.copytree(tiny_llama, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve_model("acme/tiny")
    assert (src.kind, src.commit, src.revision) == ("hub", COMMIT, "main")
    assert resolve_model("acme/tiny", revision=COMMIT).path == root / "snapshots" / COMMIT
    with pytest.raises(ProvenanceError, match="could not be resolved"):
        resolve_model("acme/tiny", revision="v9")
    from yeto.torch.model import load_base

    model, tok = load_base(src)
    assert model.config.vocab_size == len(tok)


def test_record_redacts_secrets_and_is_written_atomically(tmp_path, model_dir):
    rec = build_record(resolve_model(str(model_dir)), {"id": "d.jsonl", "digest": "sha256:x"},
                       {"token": "s3cret", "tls_key": None, "output": tmp_path, "lr": 1e-3},
                       backend="torch")
    path = write_provenance(tmp_path / "out", rec)
    text = path.read_text()
    assert "s3cret" not in text and [p.name for p in (tmp_path / "out").iterdir()] == [
        "provenance.json"]
    back = json.loads(text)
    assert back["config"]["token"] == "<redacted>" and back["config"]["tls_key"] is None
    assert back["config"]["output"] == str(tmp_path)
    assert back["yeto"]["code_digest"] == recipe_digest(YETO, (".py", ".proto"))
    assert back["yeto"]["version"] and back["environment"]["torch"]
    assert back["model"]["digest"] == recipe_digest(model_dir)


def _island(args):
    from yeto.torch.learner import main

    return main([*args, "--no-progress", "--threads", "1", "--log-level", "WARNING"])


def test_torch_island_writes_provenance_everywhere(tmp_path, model_dir):
    from yeto.testing.tasks import make_task

    train, held_out = make_task(tmp_path / "task", n_train=40, n_eval=8)
    out = tmp_path / "run"
    assert _island(["--model", str(model_dir), "--data", str(train), "--eval-data",
                    str(held_out), "--max-steps", "2", "--seq-len", "32", "--batch-size", "2",
                    "--lora-r", "2", "--output", str(out), "--token", "s3cret"]) == 0
    for folder in (out, out / "adapter"):
        rec = json.loads((folder / "provenance.json").read_text())
        assert rec["model"]["digest"] == recipe_digest(model_dir)
        assert rec["data"]["kind"] == "local"
        assert rec["data"]["digest"] == recipe_digest(train.parent, only={train.name})
        assert rec["data"]["formats"] == {str(train): "messages"}
        assert rec["eval_data"]["files"] == ["eval.jsonl"]
        assert rec["config"]["packing"] == "document" and rec["config"]["max_steps"] == 2
        assert rec["config"]["token"] == "<redacted>" and rec["backend"] == "torch"
        assert rec["yeto"]["code_digest"] == recipe_digest(YETO, (".py", ".proto"))


def test_an_island_run_in_process_leaves_the_host_s_signals_alone(tmp_path, model_dir):
    """An island that ended used to set SIGINT and SIGTERM to be ignored in its process:
    run in-process (a test, a notebook, the library API) it left the host deaf to both,
    and every subprocess the host started afterwards too."""
    import signal

    from yeto.testing.tasks import make_task

    train, _ = make_task(tmp_path / "task", n_train=16, n_eval=4)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert _island(["--model", str(model_dir), "--data", str(train), "--max-steps", "1",
                    "--seq-len", "32", "--batch-size", "2", "--lora-r", "2",
                    "--output", str(tmp_path / "run")]) == 0
    assert {s: signal.getsignal(s) for s in before} == before


def test_torch_island_refuses_pickles_and_remote_code(tmp_path, model_dir, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    _with_remote_code(model_dir, "mystery")
    assert _island(["--model", str(model_dir), "--data", str(data)]) == 2
    assert "--trust-remote-code" in caplog.text
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    caplog.clear()
    assert _island(["--model", str(model_dir), "--data", str(data)]) == 2
    assert "only pickled weights" in caplog.text
