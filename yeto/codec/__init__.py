"""The wire codec: how flat float32 vectors travel between islands and the syncer.

- `yeto.codec.format`: the encodings (f32, bf16, q4: the byte-exact spec is written
  there, next to the encoders and decoders), piecewise encoding (`Encoder`) and
  validation. Its API is this package's: `codec.encode`, `codec.decode`,
  `codec.CodecError`, `codec.ENCODINGS`, ...
- `yeto.codec.feedback`: error feedback (`ErrorFeedback`), the quantization residual
  carried from each encode into the next.
- `yeto.codec.chunked`: the same work over vectors of any size a chunk at a time, on
  a few threads (`decode_add`, norms, `encode_diff`), and `ranges`.
- `yeto.codec.buffers`: where a payload waits: pooled buffers, spill files.
- `yeto.codec.receiver`: `PayloadReceiver`, the streaming receiver of both ends,
  validating a payload as its pieces arrive.
- `yeto.codec.kernels`: the syncer's hot loops (a q4 chunk added into a sum, the
  outer step) as compiled passes with numba, or a numpy twin with the same bits.
"""

from yeto.codec.feedback import ErrorFeedback
from yeto.codec.format import (
    CHUNK,
    ENCODINGS,
    Q4_BLOCK,
    CodecError,
    Encoder,
    Payload,
    Scratch,
    add_to,
    as_view,
    decode,
    decode_add,
    encode,
    encoded_size,
    q4_error_bound,
    spare_scratch,
    validate,
    validate_q4_scales,
)

__all__ = ["CHUNK", "ENCODINGS", "Q4_BLOCK", "CodecError", "Encoder", "ErrorFeedback",
           "Payload", "Scratch", "add_to", "as_view", "decode", "decode_add", "encode",
           "encoded_size", "q4_error_bound", "spare_scratch", "validate", "validate_q4_scales"]
