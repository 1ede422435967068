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
- `yeto.testing.variants`   other valid configs of an architecture than its preset (`draw`)
- `yeto.testing.servable`   a tiny model of any architecture that a rollout node can serve
- `yeto.testing.arch_sweep` every causal LM both transformers and mlx-lm implement, checked
                            for torch/MLX parity
- `yeto.testing.real`       a real pretrained checkpoint (SmolLM2-135M, GGUF) from the
                            package index, for the slow tests and the benchmarks
- `yeto.testing.reference_diloco`  DiLoCo as the paper writes it, in plain torch: the
                            independent reference the outer loop is checked against
- `yeto.testing.diloco_arms`  the arms of scripts/compare_diloco.py (DiLoCo against
                            data-parallel) as data: regimes, arms, each mode's plan
- `yeto.testing.diloco_report`  its tables and RESULT lines, from the arms' results
- `yeto.testing.synthetic`  a numpy island (no model, real sync) for fault tests and soaks
- `yeto.testing.chaos`      a real fleet under a seeded schedule of faults, then the checks
- `yeto.testing.netlab`     a network lab on one Linux machine: hosts as network namespaces
"""
