"""The tiny model's named sizes (yeto.testing.tiny.MODEL_SIZES): the parameters each has,
counted on the meta device (no weights, no tokenizer), and the cache key of the default
size, which must stay the key models were cached under before sizes existed."""

import pytest

from yeto.cli.make import main_make_tiny_model
from yeto.testing import tiny

# tiny.cache_key("llama", 0, True) before sizes existed (commit 7c3f952): the directory
# every machine's pretrained base is cached under
KEY_BEFORE_SIZES = "274b58b7fddfe1d6"


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_small_has_over_2m_parameters_and_the_same_vocabulary(arch):
    small, default = tiny.parameter_count("small", arch), tiny.parameter_count(arch=arch)
    assert small >= 2_000_000 > default
    assert default == tiny.parameter_count("tiny", arch)
    assert tiny.shape_of("small")["vocab_size"] == tiny.SIZES["vocab_size"]


def test_the_default_size_keeps_its_cache_key():
    assert tiny.DEFAULT_SIZE == "tiny" and tiny.MODEL_SIZES["tiny"] is tiny.SIZES
    assert tiny.cache_key("llama", 0, True) == tiny.cache_key("llama", 0, True, "tiny") \
        == KEY_BEFORE_SIZES
    keys = {tiny.cache_key("llama", 0, p, s) for p in (True, False) for s in tiny.MODEL_SIZES}
    assert len(keys) == 2 * len(tiny.MODEL_SIZES)  # each size and pretraining its own dir


def test_an_unknown_size_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model size 'huge'; choose one of tiny, "
                                         "small"):
        tiny.make_tiny_model(tmp_path / "m", size="huge", cache_dir=tmp_path)
    assert not (tmp_path / "tiny-models").exists()  # refused before building anything


def test_the_cli_refuses_size_with_shape(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main_make_tiny_model([str(tmp_path / "m"), "--shape", "smollm2-135m", "--size", "small"])
    assert "fixes the model's size; drop --size" in capsys.readouterr().err
