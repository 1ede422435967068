"""mlx-lm's own LoRA trainer joining a yeto DiLoCo run (next to torch islands).

    python -m syncer --quorum 2 --state-dir runs/mlx/syncer
    python examples/mlx_lm_trainer.py --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --syncer 127.0.0.1:29400 --learner-id island-1 --shard 1/2 --output runs/mlx/island-1

`MLXDiLoCo` hands `mlx_lm.tuner.trainer.train` a wrapped `iterate_batches` (the
step boundary: the trainer asks for batch i+1 after step i) and a
`TrainingCallback` (the reported losses). mlx-lm's LoRA factors are synced under
peft's names (transposed), so with the same model, targets, rank and scale
(here: q_proj and v_proj on every block, r=8, scale 2 = alpha 16 / r 8, as in
examples/torch_loop.py) torch islands can join the same run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.optimizers as optim
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import TrainingArgs, train
from mlx_lm.tuner.utils import linear_to_lora_layers

from yeto.interop.integrations import MLXDiLoCo


def load_examples(path: str, tok, shard: int, num_shards: int, max_len: int) -> list:
    """Chat rows -> (tokens, prompt length): mlx-lm masks the loss before the offset."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i % num_shards != shard:
                continue
            messages = json.loads(line)["messages"]
            prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True)
            ids = tok.apply_chat_template(messages)[:max_len]
            out.append((ids, len(prompt)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--syncer", default="127.0.0.1:29400")
    p.add_argument("--learner-id", default="island-1")
    p.add_argument("--shard", default="0/1", help="i/n: this island trains on rows i mod n")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output", type=Path, default=Path("runs/mlx/island-1"))
    args = p.parse_args(argv)
    shard, num_shards = (int(x) for x in args.shard.split("/"))

    model, tok = mlx_lm.load(args.model)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {
        "rank": 8, "scale": 2.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    train_set = load_examples(args.data, tok, shard, num_shards, 128)
    args.output.mkdir(parents=True, exist_ok=True)
    targs = TrainingArgs(batch_size=args.batch_size, iters=args.max_steps, steps_per_report=5,
                         steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=128,
                         adapter_file=str(args.output / "adapters.safetensors"))

    diloco = MLXDiLoCo(model, syncer=args.syncer, learner_id=args.learner_id,  # yeto
                       sync_every=args.sync_every, base_model=args.model, output_dir=args.output)
    train(model, optim.AdamW(learning_rate=args.lr), train_set, args=targs,
          **diloco.trainer_kwargs(targs))  # yeto: the step hook and loss reports
    diloco.finish()  # yeto: last push; the model now holds the run's final weights
    # what mlx-lm saves (adapters.safetensors + adapter_config.json) loads with
    # mlx_lm.load(model, adapter_path=...)
    import mlx.core as mx

    mx.save_safetensors(str(args.output / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))
    (args.output / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": len(model.layers), "model": args.model,
        "lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0,
                            "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
