"""The yeto syncer: the outer loop of a DiLoCo run (`python -m syncer --help`).

Read it top to bottom, in the order a push travels:

  __main__   the command: flags -> `Config`, serve until the run ends, stop on signals
  service    server: the gRPC edge (framing, auth, status codes, broadcast streams)
  run        rounds: members, open rounds, commits, broadcasts, finish (one lock)
  merge      merge rules (token-weighted mean, uniform, RDA) and the outer Nesterov step
  state      state on disk (atomic, after every round) and the final/ folder
  tape       the event tape: one JSON line per merge or refused message
  dashboard  the live dashboard: one HTML page and a JSON API
  spawn      starting `python -m syncer` as a subprocess and learning its address

Needs numpy, grpcio, protobuf and safetensors only: no torch, transformers, peft or mlx.
"""
