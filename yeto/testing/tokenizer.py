"""A byte-level BPE tokenizer with ChatML special tokens, trained here in seconds.

Trained on Python standard library source (real text, no download) plus text of the
synthetic task, so the tiny models (`yeto.testing.tiny`) and the real-shape presets
(`yeto.testing.shapes`) have a real vocabulary and a chat template.
"""

from __future__ import annotations

import json
import logging
import random
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from yeto.testing.tasks import copy_row, random_words, reverse_row

logger = logging.getLogger(__name__)

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML, as used by Qwen; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def stdlib_text(max_chars: int = 400_000) -> str:
    """Python standard library source, read in a fixed order, up to ``max_chars``.

    Real text gives the tokenizer a real vocabulary and the base model something
    generic to pretrain on, without any download.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not parts:
        logger.warning("no stdlib source found under %s; using task text only", root)
    return "".join(parts)[:max_chars]


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens, in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets exact, which assistant-token masking relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def local_tokenizer(
    seed: int, vocab_size: int, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """The tokenizer the built models ship: trained on stdlib source and 2000 rows of
    the copy and reverse tasks (drawn with ``seed``)."""
    rng = random.Random(seed)
    rows = [(copy_row if rng.random() < 0.5 else reverse_row)(random_words(rng))
            for _ in range(2000)]
    task_text = [m["content"] + "\n" for r in rows for m in r["messages"]]
    return train_tokenizer([stdlib_text(), *task_text], vocab_size=vocab_size,
                           model_max_length=model_max_length)


def generation_config(tokenizer: PreTrainedTokenizerFast) -> Any:
    """The built models' generation config: stop at end-of-sequence or end-of-turn."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Save tokenizer.json + tokenizer_config.json, loadable by any transformers."""
    # Keep the chat template inside tokenizer_config.json (not chat_template.jinja),
    # the layout every loader version reads.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    # transformers 5 writes the class as "TokenizersBackend", unknown to 4.x (and so
    # to older mlx-lm installs); "PreTrainedTokenizerFast" loads the same in both.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
