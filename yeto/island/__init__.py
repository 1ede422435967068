"""The island, backend-neutral.

An island sees its trainable weights as one flat float32 vector in canonical order,
through the backend's `Weights` (`weights`: whole-vector get/set, range access when
the backend has it). The flat vector is cut into the syncer's P fragments
(P = 1 unless the syncer runs `--fragments P`); each fragment follows the same rules
on its own slice, kept by one part each:

- `island`: `Island`, the state machine that coordinates the parts below: start
  (join, adopt Θ), after each step (apply what arrived, push what is due), finish (a
  last push of every fragment, then the final Θ, f32, replaces the local weights
  exactly, so every island ends bit-identical to the syncer).
- `encoder`: the anchor (the exact Θ bytes last received, moved to the pushed
  weights by each push: the point up to which the syncer holds this island's work)
  and the uplink's error feedback. A push sends anchor − local, quantized with error
  feedback, so the pushes since Θ add up to Θ − local. The push leaves the training
  loop at once: the encode and the send run on a background thread while training
  goes on (when the transport sends in the background; `yeto.sim` on simulated time
  encodes inline). Before it the push is staged (x = residual + anchor − local into
  the residual's place, the anchor moved to local: one pass over the fragment), which
  must end before the weights next change, not before the next forward and backward:
- `staging`: where that happens. A loop that calls the guard `Island.before_update()`
  right before each change it makes to the weights (the torch and MLX learners do,
  installed by `Island.guard_updates`) has its pushes staged on the background thread
  too, while it computes the next gradient, and waits at the guard only for what is
  left; any other loop has them staged in the training thread. The bytes are those of
  an encode in the training thread either way, so islands with `blocking=True` stay
  bit-identical.
- `ledger`: loss tokens and optimizer steps since each fragment's last push, and the
  pushes in flight; a push the syncer does not hold (refused, or lost in a syncer
  restart) is carried forward into the next one.
- `applier`: broadcasts are applied only at step boundaries. Training overlaps the
  round trip, so the island keeps the steps it made since its push:
  local ← Θ + (local − anchor), anchor ← Θ. Every step is pushed exactly once; with
  `blocking=True` the island waits for Θ right after each push, so all islands hold
  bit-identical weights after every round.
- `schedule`: fragment f is pushed every H steps, offset by f·H/P (Streaming
  DiLoCo), or every T seconds with the same stagger; at most `pipeline` fragments
  are in flight at once.
- `weights`: passes over the weights (range access, or one flat copy per pass).

Memory, per trainable parameter, beyond the training loop itself:

- anchor: 4 B (f32, host memory; never on an accelerator). Moving it at the push
  means no copy of the weights at the push is kept, and carrying a refused push's
  decoded payload into the residual means no copy per push in flight.
- error-feedback residual: 4 B with a q4 or bf16 wire; none with f32 (exact), unless
  a refused f32 push is carried into one.
- the payload of the push in flight, kept until its round commits (the bytes the
  client streams, and what a refusal carries back): 0.5625 B (q4), 2 B (bf16),
  4 B (f32) per parameter of that fragment.
- the broadcast: streamed from the transport chunk by chunk into the model and the
  anchor when large (`ThetaStream`), else one fragment of f32 until applied. With a
  compressed downlink the client also keeps Θ (4 B) to add the syncer's updates to
  (`yeto.client.receiver.Downlink`).
- chunk-sized scratch: every pass (push, apply, start) reads and writes the weights
  `chunk` values at a time (4 MiB of f32 by default), straight from the backend's
  tensors when it has range access; a push's encode holds up to threads + 1 pieces
  (two chunks each: the weights read and anchor − local), threads ≤ ENCODE_THREADS
  (4): 40 MiB at most. A backend without range access (`get`/`set` only, e.g. the
  MLX LoRA view) costs one full flat copy per pass. Freed buffers go back to the OS
  after each pass (`yeto.memory.trim`).

Staging a push costs no memory beyond these: its values wait in the residual (4 B,
held anyway; with an f32 wire and no residual, in the payload, 4 B, held anyway),
and the encode turns them into the payload and the new residual in place. What it
costs is time: the staging pass reads anchor, residual and weights and writes anchor
and residual (20 B per parameter of memory traffic), where a copy of the weights
would move 8 but hold 4 B per parameter more; behind the guard that time overlaps the
loop's next gradient pass, and staging there holds no byte more either.

So a q4 island holds about 8.6 B per parameter, an f32-wire island 8 B.
"""

from yeto.island.encoder import default_threads
from yeto.island.island import Island
from yeto.island.weights import FlatWeights, Weights

__all__ = ["FlatWeights", "Island", "Weights", "default_threads"]
