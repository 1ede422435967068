"""Rollout nodes: `python -m yeto.rollout`, an OpenAI/vLLM-compatible completion
server for reinforcement learning, on torch or MLX.

RL needs two things a chat API does not return: the token ids the engine sampled
and the log-probability of each under the behaviour policy. A rollout node serves
both (``logprobs`` + ``return_tokens_as_token_ids``, as vLLM does) and says which
weights sampled them (``yeto_version``). With ``--syncer`` it joins a run as an
*observer*: it receives every committed Θ and never pushes.

- `generate`: the batched sampling loop, written once (numpy sampling, per-row
  seeds, stops, logprobs at temperature 1); a backend supplies prefill / merge /
  decode over its own KV cache;
- `engine`: what both engines share (`LoRAEngine`: the LoRA held, adapters loaded,
  stop tokens);
- `torch_engine`, `mlx_engine`: the two backends (peft-named LoRA on both), batched
  for attention-only and hybrid models (conv / state-space blocks beside attention:
  LFM2, Granite-4.0-H, Falcon-H1, Qwen3-Next, ...); `torch_cache`: transformers'
  caches of single prompts merged into a batch;
- `adapters`: a peft or mlx-lm adapter directory read as peft tensors;
- `scheduler`: one worker thread owns the engine; requests queued together run as
  one batch, and new weights are applied only between batches, so every request
  is served by exactly one weights version;
- `api`: request validation and OpenAI/vLLM response shapes;
- `server`: the HTTP server (standard library);
- `guard`: who may call a node (Host, Origin, Content-Type: no web page can) and
  where it may load adapters from (``--adapter-root``);
- `observer`: the syncer subscription.
- `cli`: `python -m yeto.rollout`: its flags, the engine it builds, serving.
"""
