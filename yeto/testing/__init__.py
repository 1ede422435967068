"""What the demo and the tests build, offline: tiny models, a local tokenizer, tasks.

Nothing here is needed to train or to run a syncer; `yeto demo`, `yeto make-tiny-model`,
`yeto make-task`, the benchmarks and the tests use it to work without a network.

- `yeto.testing.tokenizer`  a byte-level BPE tokenizer with ChatML specials, trained here
- `yeto.testing.tasks`      the synthetic "reverse the words" chat task (`make_task`)
- `yeto.testing.tiny`       the tiny llama/qwen2/qwen3 model, briefly pretrained and cached
                            per machine (`make_tiny_model`)
- `yeto.testing.shapes`     random-weight models with a real small model's configuration
                            (`SHAPES`, `make_shaped_model`)
- `yeto.testing.archs`      tiny random models of any transformers architecture, for the
                            torch/MLX parity checks (`tiny_model`)
"""
