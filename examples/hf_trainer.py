"""A Hugging Face Trainer that joins a yeto DiLoCo run: one callback.

    python -m syncer --quorum 2 --state-dir runs/trainer/syncer
    python examples/hf_trainer.py --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --syncer 127.0.0.1:29400 --learner-id island-0 --shard 0/2 --output runs/trainer/island-0
    python examples/hf_trainer.py ... --learner-id island-1 --shard 1/2 \\
        --output runs/trainer/island-1

`DiLoCoCallback` joins the run when training begins, counts each step's loss
tokens from the labels (a forward hook), pushes every --sync-every optimizer
steps, and loads the run's final weights when training ends.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from yeto.interop.integrations import DiLoCoCallback

try:
    from torch_loop import load_examples  # the same data prep as examples/torch_loop.py
except ImportError:  # run from another dir
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch_loop import load_examples


def collate(rows, pad_id: int) -> dict:
    n = max(len(r["input_ids"]) for r in rows)
    return {
        "input_ids": torch.tensor([r["input_ids"] + [pad_id] * (n - len(r["input_ids"]))
                                   for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"]))
                                        for r in rows]),
        "labels": torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--syncer", default="127.0.0.1:29400")
    p.add_argument("--learner-id", default="island-0")
    p.add_argument("--shard", default="0/1", help="i/n: this island trains on rows i mod n")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output", type=Path, default=Path("runs/trainer/island-0"))
    args = p.parse_args(argv)
    shard, num_shards = (int(x) for x in args.shard.split("/"))

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj"]))
    train = load_examples(args.data, tok, shard, num_shards, 128)
    trainer = Trainer(
        model=model, train_dataset=train,
        data_collator=lambda rows: collate(rows, tok.pad_token_id),
        args=TrainingArguments(
            output_dir=str(args.output), max_steps=args.max_steps, learning_rate=args.lr,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum, lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            remove_unused_columns=False, disable_tqdm=True),
        callbacks=[DiLoCoCallback(syncer=args.syncer, learner_id=args.learner_id,  # yeto
                                  sync_every=args.sync_every)],
    )
    trainer.train()  # ends holding the run's final weights
    trainer.save_model(str(args.output / "adapter"))
    print(f"saved {args.output / 'adapter'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
