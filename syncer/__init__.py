"""The yeto syncer: the outer loop of a DiLoCo run (`python -m syncer --help`).

Read it top to bottom, in the order a push travels:

  __main__   the command: flags -> `Config`, serve until the run ends, stop on signals
  service    the gRPC edge: auth, framing, status codes; protobuf -> `messages`
  admission  which streaming calls it takes, and silent ones cancelled
  run        the coordinator: holds the lock, Θ, m and versions; join, push, tick, status
  members    the ledger of islands: generations, who is live, declarations
  intake     what a push must meet (header, claims, late pushes), then its sum
  bounds     what one island can do: value, norm, claim and layout bounds
  merge      the round's running sum and the chunked outer step
  strategy   merge rules (mean, uniform, RDA) and outer optimizers (Nesterov, ...)
  pacing     the open rounds and when they commit (quorum, grace, timeout)
  commit     merge -> step -> state on disk -> tape -> broadcast; a failed save waits
  persist    the run <-> the state file (`state`: the formats) and final/
  broadcast  the next broadcast per fragment, its bytes, each island's stream
  finish     the end of a run: final weights out, final/ written
  tape       the event tape: one JSON line per merge or refused message
  dashboard  the live dashboard: one HTML page and a JSON API
  spawn      starting `python -m syncer` as a subprocess and learning its address

Needs numpy, grpcio, protobuf and safetensors only: no torch, transformers, peft or mlx.

Memory, per parameter: Θ (4 B) and the open round's running sum (4 B); the outer
momentum (4 B) only when it is not 0; the islands' weights (4 B) only with a
compressed downlink, plus its encoded update (0.5625 B for q4), shared by all
islands. Each push in flight is written as it arrives to an unlinked temporary file
(validated on the way) and added to the sum from it chunk by chunk once whole; pushes
under `--spill-min-mib` are held in memory instead; at most `--max-inflight-pushes` at
once (clipping keeps a round's pushes, in their files, until it commits). Broadcasts
stream from the live weights; the state file streams from the arrays. What grows with
the number of islands is each connection's gRPC buffers, not a per-parameter cost.
"""
