"""The torch island's loss: Σ w·CE over packed blocks (documents never attend to each
other), one optimizer step over micro-batches, and the held-out evaluation. The MLX
twin is `yeto.mlx.learner`; both follow the normalisation in `yeto.data.packing`."""

from __future__ import annotations

import numpy as np
import torch

from yeto.data import Blocks


def packed_inputs(model, tokens: torch.Tensor, positions: torch.Tensor | None) -> dict:
    """Forward kwargs for blocks whose documents must not attend to each other.

    ``positions`` (b, seq_len) restart at 0 at every document start (see yeto.data).
    Plain blocks (one causal sequence each, as with ``--packing naive``) get plain
    inputs. Otherwise the model gets per-document ``position_ids`` and, for eager and
    sdpa attention, an explicit 4D block-diagonal causal mask (bool for sdpa, additive
    float for eager), which transformers passes through as-is. Other attention
    implementations (flash_attention_*, flex_attention), and models with layers that
    see less than the block (a sliding window or an attention chunk shorter than it:
    `_layers_see_less_than`), get ``position_ids`` alone, from which transformers 5
    builds each layer kind's mask within the documents itself (windows and chunks
    counted from each document's start, as for the document alone). The KV cache is
    off either way: with a cache transformers ignores position-id packing.
    """
    kw: dict = {"input_ids": tokens[:, :-1]}
    if positions is None:
        return kw
    pos = positions.long()
    if bool((pos == torch.arange(pos.shape[1], device=pos.device)).all()):
        return kw
    kw.update(position_ids=pos, use_cache=False)
    config = getattr(model, "module", model).config  # DDP wraps the model in torchrun islands
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl in ("eager", "sdpa") and not _layers_see_less_than(config, pos.shape[1]):
        seg = torch.cumsum(pos == 0, dim=1)
        n = pos.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=pos.device).tril()
        allowed = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        if impl == "sdpa":
            kw["attention_mask"] = allowed
        else:
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
            kw["attention_mask"] = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return kw


def _layers_see_less_than(config, seq_len: int) -> bool:
    """Whether some layer attends within less than ``seq_len`` tokens: a sliding window
    or a chunk (Llama 4's ``chunked_attention`` layers, ``attention_chunk_size``)
    shorter than the block. A 4D mask is used as-is by every layer, so it would drop
    those (and per-layer mixes of them with full attention); such models get position
    ids. Image-text models keep these fields in their text config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if window and seq_len > window and getattr(text, "use_sliding_window", True):
        return True
    chunk = getattr(text, "attention_chunk_size", None)
    return bool(chunk) and seq_len > chunk


def weighted_ce_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
    """Σ w·CE, in float32 (the loss both islands compute; see yeto.data)."""
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           targets.reshape(-1).long(), reduction="none")
    return (ce * weights.reshape(-1)).sum()


def weighted_ce_sum(model, tokens: torch.Tensor, weights: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """Σ w·CE over the batch (normalised by the caller over the whole step); with
    ``positions``, packed documents do not attend to each other."""
    logits = model(**packed_inputs(model, tokens, positions)).logits
    return weighted_ce_from_logits(logits, tokens[:, 1:], weights)


def _positions(batch, device) -> torch.Tensor | None:
    pos = getattr(batch, "positions", None)  # a yeto.data.Batch; plain pairs have none
    return None if pos is None else torch.from_numpy(np.ascontiguousarray(pos)).to(device)


@torch.no_grad()
def evaluate(model, blocks: Blocks, batch_size: int, device) -> float:
    """Token-weighted mean CE over all held-out blocks."""
    was_training = model.training
    model.eval()
    total, weight = 0.0, 0.0
    for lo in range(0, len(blocks), batch_size):
        b = blocks[lo:lo + batch_size]
        t = torch.from_numpy(b.tokens).to(device)
        w = torch.from_numpy(b.weights).to(device)
        p = torch.from_numpy(np.ascontiguousarray(b.positions)).to(device)
        total += float(weighted_ce_sum(model, t, w, p))
        weight += float(w.sum())
    model.train(was_training)
    return total / max(weight, 1.0)


def train_step(model, opt, micro_batches, device) -> tuple[float, int]:
    """One optimizer step over grad-accum micro-batches (`yeto.data.Batch`, or plain
    (tokens, weights) pairs); returns (loss, loss tokens)."""
    total_w = float(sum(mb[1].sum() for mb in micro_batches))
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for mb in micro_batches:
        t = torch.from_numpy(mb[0]).to(device)
        w = torch.from_numpy(mb[1]).to(device)
        loss = weighted_ce_sum(model, t, w, _positions(mb, device)) / max(total_w, 1.0)
        loss.backward()
        loss_sum += float(loss.detach())
    opt.step()
    return loss_sum, int(sum(np.count_nonzero(mb[1]) for mb in micro_batches))
