"""What mlx_lm/models/afmoe.py builds otherwise than the config says.

afmoe.py looks up the first layer of each kind in ``layer_types`` and builds one layer
per entry (``enumerate(layer_types)``). For a config with one kind of layer only,
`yeto.mlx.config` appends the other kind past the last layer (so that the lookup finds
one); `drop_appended_layer` drops the layer afmoe.py built from that entry.
"""

from __future__ import annotations

from typing import Any


def drop_appended_layer(model, args, config: dict[str, Any]) -> None:
    """The layer built from the entry appended past the last layer dropped before the
    weights load (it is never evaluated), so that the model has the config's layers,
    every one of the config's kind."""
    n = args.num_hidden_layers
    if len(getattr(args, "layer_types", None) or ()) != n + 1:
        return
    owner = next(m for _, m in model.named_modules()
                 if isinstance(m.get("layers") if isinstance(m, dict) else None, list)
                 and len(m["layers"]) == n + 1)
    owner.layers = owner["layers"][:n]
