"""The MLX island: `python -m yeto.mlx.learner`. Its modules, one job each:

- `yeto.mlx.learner`: the island itself (model, loss, optimizer step, outputs);
- `yeto.mlx.grpo`: the GRPO objective on the MLX island (`python -m yeto.rl --backend mlx`);
- `yeto.mlx.lora`: a peft-shaped `LoRALinear`, LoRA attachment with the torch island's
  target selection, and the flat-vector view of the LoRA weights under peft names;
- `yeto.mlx.experts`: peft's LoRA on fused mixture-of-experts weights;
- `yeto.mlx.hf_paths`: mlx-lm's module paths as the Hugging Face paths they were
  loaded from (canonical LoRA names);
- `yeto.mlx.hf_renames`: transformers 5's load-time renames of checkpoint tensor names;
- `yeto.mlx.packing`: document-packed blocks, their mask handed in as an mlx-lm cache;
- `yeto.mlx.load`: a Hugging Face model dir loaded into an mlx-lm model that computes
  what transformers' model computes (the steps below, in order);
- `yeto.mlx.config`: ``config.json`` translated into what mlx-lm's ``ModelArgs`` read
  (the one call of a private mlx-lm name: `yeto.mlx.config.mlx_lm_classes`);
- `yeto.mlx.checkpoint`: the transformers-written weights translated into the layout
  mlx-lm's ``sanitize`` reads;
- `yeto.mlx.models`: per-model repairs of what an mlx-lm file builds otherwise than
  transformers, one module per file;
- `yeto.mlx.layer_kinds`: layers of each kind in the config's order where mlx-lm
  places kinds by a period;
- `yeto.mlx.heads`: attention heads as wide as the config's ``head_dim``;
- `yeto.mlx.activations`: the activation the config names, computed exactly;
- `yeto.mlx.rope`: RoPE as transformers computes it for the config's ``rope_type``;
- `yeto.mlx.rope_files`: the rotaries mlx-lm's files define for themselves, replaced;
- `yeto.mlx.structure`: the built model made to hold the checkpoint's biases and head;
- `yeto.mlx.rebind`: module classes whose ``__call__`` sees some globals replaced;
- `yeto.mlx.errors`: `UnsupportedConfig`, what the MLX island refuses before training.

Importing this package does not import mlx; the submodules do. Install with
``pip install 'yeto[mlx]'``.
"""

from __future__ import annotations

INSTALL_HINT = ("the MLX island needs mlx and mlx-lm: pip install 'yeto[mlx]' "
                "(Apple silicon, or Linux CPU with mlx[cpu])")


def mlx_available() -> bool:
    """True when mlx and mlx-lm import."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True
