"""The run file (`--config run.toml`, `yeto.runfile`): every program reads its sections,
flags win over the file, and a wrong key, type or section is refused naming the file,
the section and the key. The example files are read by every program they name."""

from pathlib import Path

import pytest

from syncer.__main__ import build_parser as syncer_parser
from syncer.__main__ import config_from_args
from syncer.__main__ import parse_args as syncer_args
from syncer.model import differing_setting
from yeto import runfile
from yeto.config import IslandConfig, island_parser, parse_island_args
from yeto.layout import TensorSpec
from yeto.torch.learner import build_parser as torch_parser

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _file(tmp_path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_each_program_takes_its_sections_and_flags_win(tmp_path):
    f = _file(tmp_path, '[run]\nmodel = "m"\ndata = "d.jsonl"\nquorum = 3\nsync_every = 7\n'
                        '[syncer]\nouter_lr = 0.5\nclip_factor = 4\n'
                        '[island]\nbatch_size = 2\nblocking_sync = true\nno_progress = true\n'
                        '[lora]\nr = 4\ntargets = "attention"\n[data]\nseq_len = 64\n')
    cfg = config_from_args(syncer_args(["--config", str(f)]))
    assert (cfg.quorum, cfg.outer_lr, cfg.clip_factor) == (3, 0.5, 4.0)
    again = config_from_args(syncer_args(["--config", str(f), "--quorum", "5"]))
    assert again.quorum == 5  # the flag wins
    isl = parse_island_args(torch_parser(), ["--config", str(f), "--seq-len", "32"])
    assert (isl.model, isl.sync_every, isl.batch_size, isl.lora_r, isl.lora_targets) == \
        ("m", 7, 2, 4, "attention")
    assert isl.blocking_sync is True and isl.progress is False and isl.seq_len == 32
    plain = parse_island_args(torch_parser(), ["--model", "m", "--data", "d.jsonl"])
    assert plain.batch_size == IslandConfig.batch_size  # no file: the dataclass's defaults


@pytest.mark.parametrize("text, says", [
    ("[island]\nbatch_sise = 2\n", "[island] batch_sise is not a setting of this program "
                                   "(did you mean 'batch_size'?)"),
    ("[run]\nmodle = 'm'\n", "[run] modle is not a setting of this program (did you mean "
                             "'model'?)"),
    ("[islands]\nbatch_size = 2\n", "[islands] is not a section of a run file"),
    ("[island]\nbatch_size = 'eight'\n", "[island] batch_size = 'eight': invalid literal"),
    ("[island]\nblocking_sync = 1\n", "[island] blocking_sync = 1: give true or false"),
    ("[island]\nwire = 'q8'\n", "[island] wire = 'q8': choose one of"),
    ("[island]\nbatch_size = true\n", "give a value for --batch-size, not true/false"),
    ("[island\n", "not valid TOML"),
    ("[island]\nprogress = false\n", "[island] progress is not a setting"),  # no_progress
])
def test_a_bad_run_file_is_refused_naming_file_section_and_key(tmp_path, capsys, text, says):
    f = _file(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        parse_island_args(torch_parser(), ["--config", str(f), "--model", "m", "--data", "d"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {f}" in err and says in err


def test_a_missing_run_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        syncer_args(["--config", str(tmp_path / "none.toml")])
    assert "cannot read it" in capsys.readouterr().err


def test_island_settings_in_shared_sections_do_not_trouble_the_syncer(tmp_path):
    """[run] model or [lora] r mean nothing to the syncer: it takes what it has."""
    f = _file(tmp_path, '[run]\nmodel = "m"\nquorum = 2\n[lora]\nr = 4\n[island]\nthreads = 1\n')
    values = runfile.values_for(syncer_parser(), runfile.load(f), "syncer",
                                programs={"island": island_parser})
    assert values == {"quorum": 2}


def test_a_key_another_program_takes_is_left_to_it():
    """The sim reads [syncer] but runs no server: `port` is the syncer's, so the sim
    skips it when told the syncer's parser, and refuses it when not."""
    from yeto.sim.__main__ import build_parser as sim_parser

    data = {"syncer": {"port": 29400, "quorum": 2}}
    both = {"island": island_parser, "syncer": syncer_parser}
    assert runfile.values_for(sim_parser(), data, "sim", programs=both) == {"quorum": 2}
    with pytest.raises(runfile.RunFileError, match=r"\[syncer\] port is not a setting"):
        runfile.values_for(sim_parser(), data, "sim", programs={"island": island_parser})


@pytest.mark.parametrize("name, roles", [
    ("lora.toml", ("syncer", "island", "launch", "sim")),
    ("full.toml", ("syncer", "island", "launch", "sim")),
    ("rl.toml", ("syncer", "rollout", "rl")),
])
def test_the_example_run_files_are_read_by_every_program_they_name(name, roles):
    from yeto.cli.launch import build_parser as launch_parser
    from yeto.rl.cli import build_parser as rl_parser
    from yeto.rollout.cli import build_parser as rollout_parser
    from yeto.sim.__main__ import build_parser as sim_parser

    parsers = {"syncer": syncer_parser, "island": torch_parser, "launch": launch_parser,
               "sim": sim_parser, "rl": rl_parser, "rollout": rollout_parser}
    shared = {"island": island_parser}  # what each program passes; the sim runs a syncer too
    programs = {role: shared for role in parsers} | {"sim": shared | {"syncer": syncer_parser}}
    data = runfile.load(EXAMPLES / name)
    for role in roles:
        values = runfile.values_for(parsers[role](), data, role, name, programs=programs[role])
        assert values, role
    island = parse_island_args(torch_parser(), ["--config", str(EXAMPLES / name)],
                               role="rl" if name == "rl.toml" else "island") \
        if name != "rl.toml" else None
    if name == "full.toml":
        assert island.tuning == "full"
    if name == "lora.toml":
        assert (island.lora_r, island.num_learners, island.syncer) == (8, 2, "127.0.0.1:29400")
        from yeto.mlx.learner import build_parser as mlx_parser  # the other backend, too

        mlx = parse_island_args(mlx_parser(), ["--config", str(EXAMPLES / name)])
        assert (mlx.lora_r, mlx.seq_len, mlx.batch_size) == (8, 128, 8)


def test_a_joining_island_hears_which_setting_differs():
    def lora(r, targets=("q_proj",)):
        return [TensorSpec(f"base_model.model.layers.0.{t}.lora_{ab}.weight",
                           (r, 16) if ab == "A" else (16, r), "float32")
                for t in targets for ab in "AB"]

    full = [TensorSpec("model.layers.0.q_proj.weight", (16, 16), "float32")]
    assert "LoRA rank differs" in differing_setting(lora(16), lora(8))
    assert "the run has 16, this island 8" in differing_setting(lora(16), lora(8))
    assert "LoRA targets differ" in differing_setting(lora(8), lora(8, ("q_proj", "v_proj")))
    assert "--tuning differs" in differing_setting(lora(8), full)
    assert "the model differs" in differing_setting(
        full, [TensorSpec("model.layers.0.q_proj.weight", (32, 32), "float32")])


def test_a_run_file_that_is_not_utf8_is_one_clear_error(tmp_path, capsys):
    """A non-UTF-8 run file ended the syncer in a UnicodeDecodeError traceback (issue 44)."""
    f = tmp_path / "run.toml"
    f.write_bytes(b"[syncer]\nquorum = 2\n# \xff\xfe\n")
    with pytest.raises(SystemExit) as e:
        syncer_args(["--config", str(f)])
    assert e.value.code == 2 and "not UTF-8 text" in capsys.readouterr().err
