from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA: _ClassVar[PushKind]
    SEED: _ClassVar[PushKind]
DELTA: PushKind
SEED: PushKind

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "layout", "fingerprint", "backend", "weights_file", "export_files", "observer", "tokens_per_step", "regime", "sync_every", "init_sha256", "known_term", "term_proof")
    class ExportFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FILE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FILES_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    REGIME_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    INIT_SHA256_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TERM_FIELD_NUMBER: _ClassVar[int]
    TERM_PROOF_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    layout: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    fingerprint: str
    backend: str
    weights_file: str
    export_files: _containers.ScalarMap[str, str]
    observer: bool
    tokens_per_step: int
    regime: str
    sync_every: int
    init_sha256: bytes
    known_term: int
    term_proof: bytes
    def __init__(self, learner_id: _Optional[str] = ..., layout: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., weights_file: _Optional[str] = ..., export_files: _Optional[_Mapping[str, str]] = ..., observer: _Optional[bool] = ..., tokens_per_step: _Optional[int] = ..., regime: _Optional[str] = ..., sync_every: _Optional[int] = ..., init_sha256: _Optional[bytes] = ..., known_term: _Optional[int] = ..., term_proof: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("run_id", "generation", "num_fragments", "send_seed", "quorum", "joined", "version", "finished", "last_seq", "downlink", "shard", "shards", "fragment_owner", "term", "term_proof", "direct_port")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEND_SEED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_OWNER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TERM_PROOF_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PORT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    generation: int
    num_fragments: int
    send_seed: bool
    quorum: int
    joined: int
    version: int
    finished: bool
    last_seq: int
    downlink: str
    shard: int
    shards: int
    fragment_owner: _containers.RepeatedScalarFieldContainer[int]
    term: int
    term_proof: bytes
    direct_port: int
    def __init__(self, run_id: _Optional[str] = ..., generation: _Optional[int] = ..., num_fragments: _Optional[int] = ..., send_seed: _Optional[bool] = ..., quorum: _Optional[int] = ..., joined: _Optional[int] = ..., version: _Optional[int] = ..., finished: _Optional[bool] = ..., last_seq: _Optional[int] = ..., downlink: _Optional[str] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., fragment_owner: _Optional[_Iterable[int]] = ..., term: _Optional[int] = ..., term_proof: _Optional[bytes] = ..., direct_port: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "generation", "round", "fragment", "base_version", "loss_tokens", "steps", "encoding", "numel", "payload_bytes", "kind", "seq", "train_loss", "eval_loss")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    generation: int
    round: int
    fragment: int
    base_version: int
    loss_tokens: int
    steps: int
    encoding: str
    numel: int
    payload_bytes: int
    kind: PushKind
    seq: int
    train_loss: float
    eval_loss: float
    def __init__(self, learner_id: _Optional[str] = ..., generation: _Optional[int] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., encoding: _Optional[str] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., seq: _Optional[int] = ..., train_loss: _Optional[float] = ..., eval_loss: _Optional[float] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "status", "round", "staleness")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    status: str
    round: int
    staleness: int
    def __init__(self, accepted: _Optional[bool] = ..., status: _Optional[str] = ..., round: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("learner_id", "generation", "after_version", "have_any")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_ANY_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    generation: int
    after_version: int
    have_any: bool
    def __init__(self, learner_id: _Optional[str] = ..., generation: _Optional[int] = ..., after_version: _Optional[int] = ..., have_any: _Optional[bool] = ...) -> None: ...

class BroadcastHeader(_message.Message):
    __slots__ = ("version", "round", "fragment", "encoding", "numel", "payload_bytes", "final", "delta", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    round: int
    fragment: int
    encoding: str
    numel: int
    payload_bytes: int
    final: bool
    delta: bool
    base_version: int
    def __init__(self, version: _Optional[int] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., encoding: _Optional[str] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., final: _Optional[bool] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ...) -> None: ...

class BroadcastChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BroadcastHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BroadcastHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DirectHello(_message.Message):
    __slots__ = ("learner_id", "generation", "authorization", "run_id", "keepalive_s")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    generation: int
    authorization: str
    run_id: str
    keepalive_s: float
    def __init__(self, learner_id: _Optional[str] = ..., generation: _Optional[int] = ..., authorization: _Optional[str] = ..., run_id: _Optional[str] = ..., keepalive_s: _Optional[float] = ...) -> None: ...

class DirectError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "generation", "step")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    generation: int
    step: int
    def __init__(self, learner_id: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version", "round", "finished")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    version: int
    round: int
    finished: bool
    def __init__(self, version: _Optional[int] = ..., round: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IslandStatus(_message.Message):
    __slots__ = ("learner_id", "state", "last_contact_s", "pushes", "loss_tokens", "generation", "backend")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTACT_S_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    state: str
    last_contact_s: float
    pushes: int
    loss_tokens: int
    generation: int
    backend: str
    def __init__(self, learner_id: _Optional[str] = ..., state: _Optional[str] = ..., last_contact_s: _Optional[float] = ..., pushes: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., generation: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "round", "version", "quorum", "islands", "bytes_in", "bytes_out", "finished", "last_merge_s", "problem", "shard", "shards")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LAST_MERGE_S_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    version: int
    quorum: int
    islands: _containers.RepeatedCompositeFieldContainer[IslandStatus]
    bytes_in: int
    bytes_out: int
    finished: bool
    last_merge_s: float
    problem: str
    shard: int
    shards: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., version: _Optional[int] = ..., quorum: _Optional[int] = ..., islands: _Optional[_Iterable[_Union[IslandStatus, _Mapping]]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., finished: _Optional[bool] = ..., last_merge_s: _Optional[float] = ..., problem: _Optional[str] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("learner_id", "generation")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    generation: int
    def __init__(self, learner_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("run_finished",)
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    run_finished: bool
    def __init__(self, run_finished: _Optional[bool] = ...) -> None: ...

class RegisterStandbyRequest(_message.Message):
    __slots__ = ("address", "version")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    address: str
    version: int
    def __init__(self, address: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class RegisterStandbyReply(_message.Message):
    __slots__ = ("run_id", "version", "finished")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    finished: bool
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class ReplicateChunk(_message.Message):
    __slots__ = ("version", "size", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    size: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
