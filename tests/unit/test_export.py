"""`yeto export` / `yeto convert`: every output loads with the real loader
(peft.PeftModel.from_pretrained, mlx_lm.load(..., adapter_path=...)) and computes
peft's logits; what cannot be converted exactly is refused with the reason.

Here: the checks that need no process, server or training (the others:
tests/integration/test_export.py, tests/e2e/test_export.py)."""


from yeto.interop.adapters import MLX_CONFIG, MLX_WEIGHTS
from yeto.interop.export import main_convert, main_export


def test_clear_errors_for_wrong_inputs(tmp_path, capsys):
    assert main_export(["--state-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "neither final/ nor state.safetensors" in capsys.readouterr().err
    (tmp_path / "full" / "final").mkdir(parents=True)
    (tmp_path / "full" / "final" / "model.safetensors").write_bytes(b"")
    assert main_export(["--state-dir", str(tmp_path / "full"), "--out", str(tmp_path / "o")]) == 2
    assert "full model weights" in capsys.readouterr().err
    (tmp_path / "mlxonly").mkdir()
    (tmp_path / "mlxonly" / MLX_WEIGHTS).write_bytes(b"")
    (tmp_path / "mlxonly" / MLX_CONFIG).write_text("{}")
    assert main_convert([str(tmp_path / "mlxonly"), str(tmp_path / "o"), "--to", "mlx"]) == 2
    assert "already a mlx adapter" in capsys.readouterr().err
    assert main_convert([str(tmp_path / "mlxonly"), str(tmp_path / "o"), "--to", "peft"]) == 2
    assert "--base-model" in capsys.readouterr().err
