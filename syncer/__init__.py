"""The yeto syncer: the outer loop of a DiLoCo run (`python -m syncer --help`).

Read it top to bottom, in the order a push travels:

  __main__   the command: flags -> `Config`, serve until the run ends, stop on signals
  flags      the outer loop's flags, shared with `python -m yeto.sim`
  config     the run's settings (`Config`) and their defaults
  service    the gRPC edge: auth, framing, status codes; protobuf -> `messages`
  errors     `Reject`, the one way a call is refused, mapped to a gRPC status at the edge
  admission  which streaming calls it takes, and silent ones cancelled
  standby    a second syncer that holds every committed state and takes over the run
  run        the coordinator: the lock and the run's lifecycle; join, push, tick, status
  members    the ledger of islands: generations, who is live, declarations
  model      the layout, Θ, the outer momentum and step counts, the final files
  intake     what a push header must meet (encoding, size, round, claims): pure checks
  bounds     what one island can do: value, norm, claim and layout bounds
  rounds     each fragment's open round: its running sum, who pushed, when it is due
  staging    a push summed into its round as its bytes arrive, folded in at its last byte
  merge      the round's running sum and the chunked outer step
  strategy   merge rules (mean, uniform, RDA) and outer optimizers (Nesterov, ...)
  pacing     the open rounds and when they commit (quorum, grace, timeout)
  grace      the adaptive grace window (`--grace auto`)
  commit     `Committer`: merge -> step -> state on disk -> tape -> broadcast
  stepping   the outer step behind its broadcast: chunks stream as the step writes them
  persist    `Store`: the state dir, the state file (`state`: the formats) and final/
  broadcast  the next broadcast per fragment, its bytes, each island's stream
  direct     the direct port: broadcasts over plain TCP, sent from the weights' memory
  shards     a run served by several syncers, each the owner of some fragments
  tape       the event tape: one JSON line per merge or refused message
  dashboard  the live dashboard: one HTML page and a JSON API
  spawn      starting `python -m syncer` as a subprocess and learning its address

Needs numpy, grpcio, protobuf and safetensors only: no torch, transformers, peft or mlx.

One push: `service` checks the caller and hands the stream to `Run.push` once; the
run checks the header (`members`, `intake`), then, as the bytes arrive, stages them
into the round or makes way (`rounds`, `staging`), takes the push at its last byte
(`Rounds.take`), and a round that is due commits (`commit`: `Model.outer_step`, the
`Store`, the tape, the broadcast).

Memory, per parameter: Θ (4 B) and the open round's running sum (4 B); the outer
momentum (4 B) only when it is not 0; the islands' weights (4 B) only with a
compressed downlink, plus its encoded update (0.5625 B for q4), shared by all
islands. Each push in flight is written as it arrives to an unlinked temporary file
(validated on the way) and added to the sum from it chunk by chunk once whole; pushes
under `--spill-min-mib` are held in memory instead; at most `--max-inflight-pushes` at
once (clipping keeps a round's pushes, in their files, until it commits). Broadcasts
stream from the live weights (on the direct port the kernel copies from them: no
message is built); the state file streams from the arrays. What grows with
the number of islands is each connection's gRPC buffers, not a per-parameter cost.
A shard (`--shard I/S`) holds these for its own fragments only.
"""
