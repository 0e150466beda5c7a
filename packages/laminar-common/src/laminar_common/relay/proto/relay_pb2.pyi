from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Origin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORIGIN_UNSPECIFIED: _ClassVar[Origin]
    ORIGIN_PUBLISHER: _ClassVar[Origin]
    ORIGIN_RELAY: _ClassVar[Origin]
ORIGIN_UNSPECIFIED: Origin
ORIGIN_PUBLISHER: Origin
ORIGIN_RELAY: Origin

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ChunkSpec(_message.Message):
    __slots__ = ("index", "offset", "nbytes", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    nbytes: int
    checksum: str
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "total_bytes", "chunk_bytes", "tensors", "chunks", "created_at", "trainer_step", "checksum_algo", "base_version", "full")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    chunk_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkSpec]
    created_at: float
    trainer_step: int
    checksum_algo: str
    base_version: int
    full: Manifest
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ChunkSpec, _Mapping]]] = ..., created_at: _Optional[float] = ..., trainer_step: _Optional[int] = ..., checksum_algo: _Optional[str] = ..., base_version: _Optional[int] = ..., full: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class BeginPublishRequest(_message.Message):
    __slots__ = ("manifest", "origin", "sender_id")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    origin: Origin
    sender_id: str
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., origin: _Optional[_Union[Origin, str]] = ..., sender_id: _Optional[str] = ...) -> None: ...

class BeginPublishReply(_message.Message):
    __slots__ = ("accepted", "reason", "session", "data_endpoint", "data_plane", "relay_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    session: bytes
    data_endpoint: str
    data_plane: str
    relay_id: str
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., session: _Optional[bytes] = ..., data_endpoint: _Optional[str] = ..., data_plane: _Optional[str] = ..., relay_id: _Optional[str] = ...) -> None: ...

class CommitPublishRequest(_message.Message):
    __slots__ = ("session", "chunks_sent", "checksums")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    session: bytes
    chunks_sent: int
    checksums: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[bytes] = ..., chunks_sent: _Optional[int] = ..., checksums: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitPublishReply(_message.Message):
    __slots__ = ("version", "relay_id", "visible")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    relay_id: str
    visible: bool
    def __init__(self, version: _Optional[int] = ..., relay_id: _Optional[str] = ..., visible: bool = ...) -> None: ...

class AbortPublishRequest(_message.Message):
    __slots__ = ("session", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: bytes
    reason: str
    def __init__(self, session: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortPublishReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("version", "reader_id", "wait_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    reader_id: str
    wait_s: float
    def __init__(self, version: _Optional[int] = ..., reader_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("manifest", "lease", "lease_s", "shm_path", "host", "relay_id")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    lease: str
    lease_s: float
    shm_path: str
    host: str
    relay_id: str
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., lease: _Optional[str] = ..., lease_s: _Optional[float] = ..., shm_path: _Optional[str] = ..., host: _Optional[str] = ..., relay_id: _Optional[str] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("lease", "first_chunk", "end_chunk")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_CHUNK_FIELD_NUMBER: _ClassVar[int]
    lease: str
    first_chunk: int
    end_chunk: int
    def __init__(self, lease: _Optional[str] = ..., first_chunk: _Optional[int] = ..., end_chunk: _Optional[int] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("index", "checksum", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    checksum: str
    data: bytes
    def __init__(self, index: _Optional[int] = ..., checksum: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: str
    def __init__(self, lease: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatestReply(_message.Message):
    __slots__ = ("version", "total_bytes", "trainer_step", "relay_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    trainer_step: int
    relay_id: str
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., trainer_step: _Optional[int] = ..., relay_id: _Optional[str] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("relay_id", "master", "master_id", "versions", "receiving", "upstream_id", "downstream_id", "chain", "used_bytes", "max_bytes", "readers", "protocol_version", "package_version", "data_endpoint", "forwarded_version", "rejected", "serving", "sealed_at", "begun_at", "first_chunk_at")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SealedAtEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class BegunAtEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class FirstChunkAtEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RECEIVING_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_VERSION_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SEALED_AT_FIELD_NUMBER: _ClassVar[int]
    BEGUN_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_AT_FIELD_NUMBER: _ClassVar[int]
    relay_id: str
    master: bool
    master_id: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    receiving: _containers.RepeatedScalarFieldContainer[int]
    upstream_id: str
    downstream_id: str
    chain: _containers.RepeatedScalarFieldContainer[str]
    used_bytes: int
    max_bytes: int
    readers: int
    protocol_version: int
    package_version: str
    data_endpoint: str
    forwarded_version: int
    rejected: _containers.ScalarMap[str, int]
    serving: bool
    sealed_at: _containers.ScalarMap[int, float]
    begun_at: _containers.ScalarMap[int, float]
    first_chunk_at: _containers.ScalarMap[int, float]
    def __init__(self, relay_id: _Optional[str] = ..., master: bool = ..., master_id: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., receiving: _Optional[_Iterable[int]] = ..., upstream_id: _Optional[str] = ..., downstream_id: _Optional[str] = ..., chain: _Optional[_Iterable[str]] = ..., used_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., readers: _Optional[int] = ..., protocol_version: _Optional[int] = ..., package_version: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., forwarded_version: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., serving: bool = ..., sealed_at: _Optional[_Mapping[int, float]] = ..., begun_at: _Optional[_Mapping[int, float]] = ..., first_chunk_at: _Optional[_Mapping[int, float]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
