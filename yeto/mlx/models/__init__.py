"""Per-model repairs: what an mlx-lm model file builds or computes otherwise than
transformers' model of the same type, set right on the built model before the weights
load. One module per mlx-lm file repaired, named as that file:

- `yeto.mlx.models.afmoe`: the layer built from an appended layer-kind entry dropped;
- `yeto.mlx.models.exaone4`: (also exaone_moe) RoPE only in sliding-window layers when
  the config has a window;
- `yeto.mlx.models.gemma3`: (gemma3, gemma3_text) the embedding scale in the model's
  dtype, not rounded to bfloat16;
- `yeto.mlx.models.glm`: RoPE over the config's ``partial_rotary_factor`` of the head;
- `yeto.mlx.models.gpt_neox`: the MLP ``intermediate_size`` wide;
- `yeto.mlx.models.jamba`: the router's weights, a softmax over all experts;
- `yeto.mlx.models.llama4`: Llama 4's per-layer plan (RoPE, chunked attention) from
  the config;
- `yeto.mlx.models.minicpm3`: MiniCPM3's value width and its tied head's scaling;
- `yeto.mlx.models.mla`: the MLA latent norms' eps (longcat_flash, minicpm3,
  kimi_linear, glm4_moe_lite);
- `yeto.mlx.models.nanochat`: the norms with the config's ``rms_norm_eps``;
- `yeto.mlx.models.recurrent_gemma`: the block norms' eps and the RoPE base from the
  config.

`REPAIRS` lists, per model type, the repairs `yeto.mlx.load` runs on the built model
first, each ``repair(model, args, config)``; the Llama 4 plan and the MLA latent eps
run later in the build, after layers are built again (`yeto.mlx.layer_kinds`).
"""

from __future__ import annotations

from yeto.mlx.models import (
    afmoe,
    exaone4,
    gemma3,
    glm,
    gpt_neox,
    jamba,
    minicpm3,
    nanochat,
    recurrent_gemma,
)

#: model type -> the repairs of the built model, in order (before the weights load)
REPAIRS = {"glm": (glm.partial_rope,),
           "recurrent_gemma": (recurrent_gemma.block_norm_eps, recurrent_gemma.rope_base),
           "gpt_neox": (gpt_neox.mlp_width,),
           "gemma3": (gemma3.embedding_scale,), "gemma3_text": (gemma3.embedding_scale,),
           "nanochat": (nanochat.norm_eps,),
           "exaone4": (exaone4.rope_where_sliding,), "exaone_moe": (exaone4.rope_where_sliding,),
           "jamba": (jamba.router_weights,),
           "afmoe": (afmoe.drop_appended_layer,),
           "minicpm3": (minicpm3.fit_values, minicpm3.scale_tied_head)}


def repair(model, args, config: dict) -> None:
    """Run the `REPAIRS` of the config's model type on the built ``model``."""
    for fix in REPAIRS.get(config.get("model_type"), ()):
        fix(model, args, config)
