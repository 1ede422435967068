"""The torch island: `python -m yeto.learner` (`yeto.torch.learner`).

- `learner`: the island program and `TorchBackend`, the torch edge of `yeto.loop`;
- `model`: the Hugging Face causal LM loaded, peft LoRA attached, canonical names;
- `loss`: Σ w·CE over packed blocks, the optimizer step over micro-batches, evaluation;
- `weights`: the trainable tensors as one flat float32 vector (`yeto.island.Weights`);
- `snapshot`: a push's snapshot of a CUDA model's weights, taken without the loop waiting;
- `group`: an island as a torchrun group of data-parallel ranks (DDP);
- `fsdp`: an island whose ranks shard the model with FSDP2.
"""
