"""A plain torch training loop that joins a yeto DiLoCo run: three added lines.

Start a syncer, then this script once per island (each trains on its shard):

    python -m syncer --quorum 2 --state-dir runs/loop/syncer
    python examples/torch_loop.py --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --syncer 127.0.0.1:29400 --learner-id island-0 --shard 0/2 --output runs/loop/island-0
    python examples/torch_loop.py ... --learner-id island-1 --shard 1/2 --output runs/loop/island-1

(`yeto demo` builds runs/demo/model and runs/demo/data once.) The lines marked
"yeto" are all DiLoCo needs; the rest is an ordinary peft fine-tuning loop.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from yeto.interop.integrations import DiLoCo


def load_examples(path: str, tok, shard: int, num_shards: int, max_len: int) -> list[dict]:
    """Chat rows -> input_ids, with labels only on the assistant's reply."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i % num_shards != shard:
                continue
            messages = json.loads(line)["messages"]
            prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)[:max_len]
            labels = [-100] * len(prompt) + ids[len(prompt):]
            out.append({"input_ids": ids, "labels": labels[:len(ids)]})
    return out


def batches(examples: list[dict], batch_size: int, pad_id: int, seed: int):
    rng = random.Random(seed)
    while True:
        rng.shuffle(examples)
        for lo in range(0, len(examples) - batch_size + 1, batch_size):
            rows = examples[lo:lo + batch_size]
            n = max(len(r["input_ids"]) for r in rows)
            pad = [n - len(r["input_ids"]) for r in rows]
            yield {
                "input_ids": torch.tensor([r["input_ids"] + [pad_id] * p
                                           for r, p in zip(rows, pad)]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p
                                                for r, p in zip(rows, pad)]),
                "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)]),
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
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output", type=Path, default=Path("runs/loop/island-0"))
    args = p.parse_args(argv)
    shard, num_shards = (int(x) for x in args.shard.split("/"))

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
    data = batches(load_examples(args.data, tok, shard, num_shards, 128), args.batch_size,
                   tok.pad_token_id, seed=shard)

    diloco = DiLoCo(model, syncer=args.syncer, learner_id=args.learner_id,  # yeto
                    sync_every=args.sync_every, output_dir=args.output, optimizer=opt)
    model.train()
    for step, batch in zip(range(args.max_steps), data):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if diloco.step(batch["labels"], loss=loss.item()):  # yeto: True = the run is over
            break
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} round {diloco.version}", flush=True)
    diloco.finish()  # yeto: last push; the model now holds the run's final weights
    model.save_pretrained(args.output / "adapter")
    print(f"saved {args.output / 'adapter'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
