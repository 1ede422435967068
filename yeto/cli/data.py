"""`yeto data SOURCE --model M`: check a data source the way an island will read it.

Prints the detected format, rows, tokens, loss tokens, blocks and one rendered
sample with its loss-masked tokens marked, then a machine-readable last line:

    RESULT format=messages rows=2000 tokens=47978 loss_tokens=9989 blocks=374 skipped_rows=0

(tokens and loss tokens count the rows used; rows without loss tokens are skipped.)

Exits 2 with the error (file, line, what was seen, what is accepted) on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from yeto.data import PACKING, DataError, load_blocks, read_source
from yeto.data.formats import FORMATS, encode_example
from yeto.data.models import resolve_model
from yeto.data.provenance import ProvenanceError

MASK_OPEN, MASK_CLOSE = "[[", "]]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto data",
        description="Read a training data source with a model's tokenizer, exactly as an island "
                    "does, and report what it holds. Sources: a .jsonl/.json/.parquet file, a "
                    "folder of them, a datasets save_to_disk folder, or a hub dataset id (from "
                    "the local Hugging Face cache when HF_HUB_OFFLINE=1). Row formats: "
                    + "; ".join(f"{k} {v}" for k, v in FORMATS.items()),
        epilog="Example: yeto make-task runs/task && yeto make-tiny-model runs/tiny && "
               "yeto data runs/task/train.jsonl --model runs/tiny")
    p.add_argument("source", help="data file, folder, saved dataset or hub dataset id")
    p.add_argument("--model", required=True, help="model dir or hub id whose tokenizer is used")
    p.add_argument("--model-revision", default=None, help="branch, tag or commit of a hub model")
    p.add_argument("--data-revision", default=None, help="branch, tag or commit of a hub dataset")
    p.add_argument("--split", default=None, help="split of a folder / hub / saved dataset")
    p.add_argument("--held-out", action="store_true",
                   help="choose the split as for --eval-data (validation, else test)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow tokenizer code shipped in the model repo to run")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block (as the island)")
    p.add_argument("--packing", choices=PACKING, default="document", help="as the island")
    p.add_argument("--sample", type=int, default=1, help="which row to render (1 = first)")
    p.add_argument("--max-chars", type=int, default=3000, help="cut the rendered sample here")
    return p


def render_sample(tokenizer: Any, ids: Sequence[int], weights: Sequence[float]) -> str:
    """The row's text with every run of loss-masked tokens (weight 0) inside [[ ]]."""
    out, run, masked = [], [], None
    for i, w in zip([*ids, None], [*weights, None]):
        m = None if i is None else not w
        if run and m != masked:
            text = tokenizer.decode(run)
            out.append(f"{MASK_OPEN}{text}{MASK_CLOSE}" if masked else text)
            run = []
        if i is not None:
            run.append(int(i))
            masked = m
    return "".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from transformers import AutoTokenizer

    try:
        src = resolve_model(args.model, args.model_revision, args.trust_remote_code,
                            need_weights=False)
        tok = AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=args.trust_remote_code)
        rows = read_source(args.source, revision=args.data_revision, split=args.split,
                           held_out=args.held_out)
        blocks = load_blocks(rows, tok, args.seq_len, packing=args.packing)
        if not 1 <= args.sample <= len(rows):
            raise DataError(f"--sample {args.sample} is outside 1..{len(rows)}")
        k = args.sample - 1
        ids, weights, method = encode_example(rows.examples[k], tok)
        if args.packing == "document":
            weights = [0.0, *weights[1:]]
    except (DataError, ProvenanceError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    info = blocks.info
    source = info["source"]
    pin = source.get("commit") or source.get("digest")
    tokens, loss = info["tokens"], info["loss_tokens_in_rows"]
    print(f"source:      {source['id']} ({source['kind']}"
          + (f", split {source['split']}" if source.get("split") else "") + f", {pin})")
    for name, fmt in source["formats"].items():
        if len(source["formats"]) > 1:
            print(f"  {name}: {fmt}")
    print(f"format:      {info['format']}")
    print(f"rows:        {info['rows_read']}" + (
        f" ({info['rows_dropped']} without loss tokens skipped, e.g. {info['dropped'][0]})"
        if info["rows_dropped"] else ""))
    print(f"tokens:      {tokens}")
    print(f"loss tokens: {loss} ({100 * loss / max(tokens, 1):.1f}% of tokens) in rows; "
          f"{info['loss_tokens']} in blocks (the incomplete tail is dropped)")
    print(f"blocks:      {info['blocks']} x {args.seq_len} tokens, {args.packing} packing")
    print("loss mask:   " + ", ".join(f"{m} ({n} rows)" for m, n in info["loss_mask"].items()))
    text = render_sample(tok, ids, weights)
    if len(text) > args.max_chars:
        text = text[:args.max_chars] + f" ... ({len(text) - args.max_chars} more chars)"
    print(f"\nsample: {rows.where[k]}, {len(ids)} tokens, {int(sum(1 for w in weights if w))} "
          f"loss tokens ({method}); {MASK_OPEN}...{MASK_CLOSE} = loss-masked (context only), "
          "the rest is trained on:")
    print(text)
    print(f"\nRESULT format={info['format']} rows={info['rows_read']} tokens={tokens} "
          f"loss_tokens={loss} blocks={info['blocks']} skipped_rows={info['rows_dropped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
