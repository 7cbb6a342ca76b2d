from cleave.proto.cleave.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectRequest(_message.Message):
    __slots__ = ("layout", "client_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    client_id: str
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., client_id: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("layout_id", "block_num_bytes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    block_num_bytes: int
    def __init__(self, layout_id: _Optional[str] = ..., block_num_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout_id", "block_hashes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_blocks",)
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_hit_blocks: int
    def __init__(self, num_hit_blocks: _Optional[int] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("hash", "parent_hash", "layout_id", "payload")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    parent_hash: bytes
    layout_id: str
    payload: _common_pb2.Tensor
    def __init__(self, hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., layout_id: _Optional[str] = ..., payload: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_already_present")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_already_present: int
    def __init__(self, num_stored: _Optional[int] = ..., num_already_present: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("layout_id", "block_hashes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("hits", "misses", "bytes_stored", "bytes_served", "evictions", "num_blocks_ram", "num_blocks_disk", "num_lookups")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RAM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DISK_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    bytes_stored: int
    bytes_served: int
    evictions: int
    num_blocks_ram: int
    num_blocks_disk: int
    num_lookups: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., bytes_served: _Optional[int] = ..., evictions: _Optional[int] = ..., num_blocks_ram: _Optional[int] = ..., num_blocks_disk: _Optional[int] = ..., num_lookups: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("layout_id",)
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    def __init__(self, layout_id: _Optional[str] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("stored_hashes", "removed_hashes", "snapshot_done")
    STORED_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_HASHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    stored_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    snapshot_done: bool
    def __init__(self, stored_hashes: _Optional[_Iterable[bytes]] = ..., removed_hashes: _Optional[_Iterable[bytes]] = ..., snapshot_done: _Optional[bool] = ...) -> None: ...
