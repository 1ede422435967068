"""`yeto export` / `yeto convert`: every output loads with the real loader
(peft.PeftModel.from_pretrained, mlx_lm.load(..., adapter_path=...)) and computes
peft's logits; what cannot be converted exactly is refused with the reason.

Here: the checks that need real processes (the others: tests/unit/test_export.py,
tests/integration/test_export.py)."""


import numpy as np
import pytest
import torch
from helpers.syncer import running_syncer
from helpers.wait import wait_until
from safetensors.numpy import load_file

from yeto.interop.adapters import MLX_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS
from yeto.interop.export import main_export

IDS = np.random.default_rng(0).integers(3, 1000, (2, 24))


@pytest.fixture(scope="module")
def base(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 2
    with torch.no_grad():
        plain = model(input_ids=torch.from_numpy(IDS)).logits.numpy()
    return model, plain


def test_export_of_an_unfinished_frozen_a_run_rebuilds_lora_a(tmp_path, tiny_llama, base):
    """--lora-freeze-a: only lora_B travels, so the syncer's state holds no lora_A.
    `yeto export` of the unfinished run rebuilds every lora_A from the shared seed as
    the syncer's final/ does: the adapter loads with peft, its lora_A is
    `frozen_lora_a` bit for bit, and it equals the final/ adapter of the same Θ."""
    from peft import PeftModel

    from yeto import frozen
    from yeto.client import SyncerClient
    from yeto.interop.adapters import peft_adapter_config
    from yeto.layout import Layout
    from yeto.targets import peft_key

    model, plain = base
    seed = 11
    linears = {n: m for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}
    a_shapes = {peft_key(n, "lora_A"): (2, m.in_features) for n, m in linears.items()}
    b_layout = Layout.from_shapes({peft_key(n, "lora_B"): (m.out_features, 2)
                                   for n, m in linears.items()})
    theta = (np.random.default_rng(0).standard_normal(b_layout.numel) * 0.1).astype(np.float32)
    files = {PEFT_CONFIG: peft_adapter_config(str(tiny_llama), 2, 4.0, sorted(linears)),
             frozen.EXPORT_FILE: frozen.describe(seed, a_shapes)}
    state, mid = tmp_path / "state", tmp_path / "mid"
    with running_syncer(quorum=1, rounds=2, state_dir=state) as (run, address):
        c = SyncerClient(address, "island-0", b_layout, weights_file=PEFT_WEIGHTS,
                         export_files=files)
        c.start(theta)
        assert wait_until(lambda: run.started and c.connected.is_set(), timeout=30)
        zero = np.zeros(b_layout.numel, np.float32).tobytes()

        def commit_round(version: int) -> None:
            assert wait_until(lambda: c.push(
                zero, encoding="f32", base_version=version, loss_tokens=10, steps=1,
                seq=version).result(timeout=30).accepted, timeout=30)
            assert wait_until(lambda: run.version >= version + 1, timeout=30)

        commit_round(0)
        assert not (state / "final").exists()  # the run is in progress: export its state
        assert main_export(["--state-dir", str(state), "--out", str(mid)]) == 0
        assert main_export(["--state-dir", str(state), "--out", str(tmp_path / "mlx"),
                            "--format", "mlx"]) == 0
        commit_round(1)  # the last round: the syncer writes final/
        assert wait_until(lambda: run.finished, timeout=30)
        c.close()
    exported, final = load_file(mid / PEFT_WEIGHTS), load_file(state / "final" / PEFT_WEIGHTS)
    assert sorted(exported) == sorted([*a_shapes, *b_layout.offsets])  # lora_A is back
    assert exported.keys() == final.keys()
    assert all(exported[k].tobytes() == final[k].tobytes() for k in final)
    loaded = PeftModel.from_pretrained(__import__("copy").deepcopy(model), str(mid)).eval()
    got_a = {n.replace(".default", ""): p.detach().numpy()
             for n, p in loaded.named_parameters() if ".lora_A." in n}
    assert got_a.keys() == a_shapes.keys()
    for name, shape in a_shapes.items():
        assert got_a[name].tobytes() == frozen.frozen_lora_a(name, shape, seed).tobytes()
    with torch.no_grad():
        logits = loaded(input_ids=torch.from_numpy(IDS)).logits.numpy()
    assert np.abs(logits - plain).max() > 1e-3  # B·A, not a zero or a B-only adapter
    assert load_file(tmp_path / "mlx" / MLX_WEIGHTS).keys() == {
        f"{k[len('base_model.model.'):-len('.lora_A.weight')]}.lora_{w}"
        for k in a_shapes for w in "ab"}
