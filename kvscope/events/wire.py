"""The engines' KV-event wire format: ZMQ frames and msgpack payloads, decoded and encoded.

One decoder reads every version docs/EVENTS.md lists: vLLM 0.9 to 0.33 and SGLang, the
positional-array events of vLLM up to 0.23 (and SGLang up to 0.5.22) and the tagged maps
(`{"type": "BlockStored", ...}`) after them, block hashes as ints (unsigned from vLLM, signed
from SGLang) or raw digests (bytes). Decoding is msgspec's, into the structs below.

One encoder writes the same formats, for kvscope's own publisher (publisher.py) and for tests
that build streams with planted faults.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
import msgspec

# An event's kind (its class's KIND).
STORED, REMOVED, CLEARED = 0, 1, 2
KIND_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")

# A replay socket's end-of-replay marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = int | bytes
_NO_TOKENS = msgspec.Raw(b"\x90")


class WireError(ValueError):
    """A frame or payload that is not a KV-event message of any known version."""


# The events, decoded by msgspec. Both encodings give the attributes the checker reads:
# block_hashes, parent_block_hash, token_ids (the msgpack bytes of the list, decoded only where
# a check compares tokens: tokens()), block_size, medium, group_idx, kv_cache_spec_kind. Fields
# a version does not send take their default; fields this reader does not name are skipped.
# medium and group_idx key the checker's caches: text and an int (or none) in every version;
# anything else makes the batch malformed. kvscope/csrc/kvevents.c reads the same types.


class _Event(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = -1


class MapStored(_Event, tag="BlockStored", tag_field="type", gc=False):
    """BlockStored as a tagged map (vLLM >= 0.24, SGLang >= 0.5.23)."""

    KIND: ClassVar[int] = STORED
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: Any = None


class MapRemoved(_Event, tag="BlockRemoved", tag_field="type", gc=False):
    """BlockRemoved as a tagged map."""

    KIND: ClassVar[int] = REMOVED
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class MapCleared(_Event, tag="AllBlocksCleared", tag_field="type", gc=False):
    """AllBlocksCleared as a tagged map."""

    KIND: ClassVar[int] = CLEARED


class ArrayStored(_Event, tag="BlockStored", array_like=True, gc=False):
    """BlockStored as a positional array (vLLM <= 0.23; SGLang <= 0.5.22 agrees up to medium).

    [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium (0.10.2),
    lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]; trailing defaults left out.
    """

    KIND: ClassVar[int] = STORED
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: Any = None
    medium: str | None = None
    lora_name: Any = None
    extra_keys: msgspec.Raw = _NO_TOKENS
    group_idx: int | None = None
    kv_cache_spec_kind: Any = None


class ArrayRemoved(_Event, tag="BlockRemoved", array_like=True, gc=False):
    """BlockRemoved as a positional array: [tag, block_hashes, medium, group_idx]."""

    KIND: ClassVar[int] = REMOVED
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class ArrayCleared(_Event, tag="AllBlocksCleared", array_like=True, gc=False):
    """AllBlocksCleared as a positional array: [tag]."""

    KIND: ClassVar[int] = CLEARED


MapEvent = MapStored | MapRemoved | MapCleared
ArrayEvent = ArrayStored | ArrayRemoved | ArrayCleared
Event = Any  # one of the six classes above


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: Any = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: Any = None


_BATCH_DECODERS: list[Any] = [
    msgspec.msgpack.Decoder(_MapBatch),
    msgspec.msgpack.Decoder(_ArrayBatch),
]
_MAP_EVENT = msgspec.msgpack.Decoder(MapEvent)
_ARRAY_EVENT = msgspec.msgpack.Decoder(ArrayEvent)


def decode_seq(seq: bytes) -> int:
    """A sequence frame: 8 bytes, big-endian, unsigned (vLLM, SGLang)."""
    if len(seq) != 8:
        raise WireError(f"sequence frame of {len(seq)} bytes (8 expected)")
    return int.from_bytes(seq, "big")


def split_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a published message or a replay reply of either shape.

    Published: [topic, seq, payload]. Replay replies after the ROUTER's empty delimiter:
    [seq, payload] up to vLLM 0.25 (and older SGLang), [topic, seq, payload] from 0.26.
    """
    if len(frames) == 3:
        return bytes(frames[0]), decode_seq(frames[1]), frames[2]
    if len(frames) == 2:
        return b"", decode_seq(frames[0]), frames[1]
    raise WireError(f"message of {len(frames)} frames (3 expected: topic, seq, payload)")


def _decode_mixed(payload: bytes) -> tuple[float, Any, list[Event]]:
    # The slow path: a batch neither decoder takes whole (events of both encodings, a batch as
    # a map), one event at a time; or the error that says what is wrong with it.
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bytes that are not msgpack
        raise WireError(f"payload is not msgpack ({e})") from None
    if type(batch) is dict:
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")]
    if type(batch) is not list or len(batch) < 2 or type(batch[1]) is not list:
        raise WireError("payload is not a batch [ts, events, rank?]")
    ts = batch[0]
    if type(ts) is not float and type(ts) is not int:
        raise WireError(f"batch timestamp of type {type(ts).__name__}")
    events = []
    for item in batch[1]:
        dec: Any = _MAP_EVENT if type(item) is dict else _ARRAY_EVENT
        try:
            events.append(dec.decode(msgpack.packb(item, use_bin_type=True)))
        except msgspec.ValidationError as err:
            raise WireError(f"an event that is no KV event ({err})") from None
    return float(ts), batch[2] if len(batch) > 2 else None, events


def decode_payload(payload: bytes) -> tuple[float, int | None, list[Event]]:
    """(ts, data-parallel rank or None, events) of a batch's msgpack payload.

    The batch is positional in every version: [ts, events] (vLLM 0.9.0, older SGLang), then
    [ts, events, data_parallel_rank] (the rank left out while it is None).
    """
    for i, dec in enumerate(_BATCH_DECODERS):
        try:
            b = dec.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        if i:  # the other encoding first next time: a stream keeps to one
            _BATCH_DECODERS.reverse()
        rank = b.data_parallel_rank
        return b.ts, rank if type(rank) is int else None, b.events
    ts, rank, events = _decode_mixed(payload)
    return ts, rank if type(rank) is int else None, events


def num_tokens(raw: msgspec.Raw | bytes) -> int:
    """The length of an encoded token_ids list from its msgpack header; -1 if not a list."""
    m = memoryview(raw)
    if not m:
        return 0
    b = m[0]
    if 0x90 <= b <= 0x9F:
        return b - 0x90
    if b == 0xDC:
        return int.from_bytes(m[1:3], "big")
    if b == 0xDD:
        return int.from_bytes(m[1:5], "big")
    return 0 if b == 0xC0 else -1


def tokens(raw: msgspec.Raw | bytes) -> list[int]:
    """An encoded token_ids list, decoded."""
    out = msgspec.msgpack.decode(raw)
    return out if type(out) is list else []


def as_tuple(ev: Event) -> tuple[Any, ...]:
    """An event as (kind, hashes, parent, token_ids, block_size, medium, group, spec kind)."""
    if ev.KIND == CLEARED:
        return (CLEARED, [], None, [], 0, None, None, None)
    if ev.KIND == REMOVED:
        return (REMOVED, ev.block_hashes, None, [], 0, ev.medium, ev.group_idx, None)
    return (
        STORED,
        ev.block_hashes,
        ev.parent_block_hash,
        tokens(ev.token_ids),
        ev.block_size,
        ev.medium,
        ev.group_idx,
        ev.kv_cache_spec_kind,
    )


def peek_batch(payload: bytes) -> tuple[int, int | None]:
    """(number of events, data-parallel rank or None) of a batch, without decoding its events.

    (0, None) for a payload that is not a batch: the checker says what is wrong with it.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    try:
        n = unpacker.read_array_header()
        unpacker.skip()
        num_events = unpacker.read_array_header()
        for _ in range(num_events):
            unpacker.skip()
        rank = unpacker.unpack() if n > 2 else None
    except Exception:  # msgpack raises several types for bytes that are not a batch
        return 0, None
    return num_events, rank if type(rank) is int else None


def hash_text(h: Any) -> str:
    """A block hash for a person and for JSON: decimal for an int, hex for a digest."""
    if type(h) is bytes:
        return h.hex()
    return str(h)


# --- encoding --------------------------------------------------------------------------------

# vLLM's current BlockStored fields without a default (always on the wire), in order.
_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


class Encoder:
    """Batches in one producer's format: maps (vLLM >= 0.24) or arrays (vLLM <= 0.23).

    Args:
        maps: tagged maps (True) or positional arrays (False).
        with_rank: append the data-parallel rank to the batch (vLLM >= 0.9.2).
        with_medium: put `medium` on the events (vLLM >= 0.10.2).
    """

    def __init__(self, maps: bool = True, with_rank: bool = True, with_medium: bool = True):
        self.maps = maps
        self.with_rank = with_rank
        self.with_medium = with_medium
        self._packer = msgpack.Packer(use_bin_type=True)

    def stored(
        self,
        hashes: list[Hash],
        parent: Hash | None,
        token_ids: list[int],
        block_size: int,
        medium: str | None = "GPU",
        group: int | None = None,
    ) -> Any:
        """A BlockStored event as the wire holds it."""
        if self.maps:
            e: dict[str, Any] = {"type": "BlockStored"}
            e.update(zip(_STORED_REQUIRED, (hashes, parent, token_ids, block_size, None)))
            if self.with_medium:
                e["medium"] = medium
                e["lora_name"] = None
            if group is not None:
                e["group_idx"] = group
            return e
        a: list[Any] = ["BlockStored", hashes, parent, token_ids, block_size, None]
        if self.with_medium:
            a.append(medium)
        if group is not None:
            a += [None, None, group]
        return a

    def removed(self, hashes: list[Hash], medium: str | None = "GPU", group: int | None = None):
        """A BlockRemoved event as the wire holds it."""
        if self.maps:
            e: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
            if self.with_medium:
                e["medium"] = medium
            if group is not None:
                e["group_idx"] = group
            return e
        a: list[Any] = ["BlockRemoved", hashes]
        if self.with_medium:
            a.append(medium)
        if group is not None:
            a.append(group)
        return a

    def cleared(self) -> Any:
        """An AllBlocksCleared event."""
        return {"type": "AllBlocksCleared"} if self.maps else ["AllBlocksCleared"]

    def payload(self, events: list[Any], rank: int | None = 0, ts: float | None = None) -> bytes:
        """A batch's msgpack payload."""
        batch: list[Any] = [time.time() if ts is None else ts, events]
        if self.with_rank and rank is not None:
            batch.append(rank)
        return self._packer.pack(batch)

    def message(self, seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
        """The three frames of a published batch."""
        return [topic, seq.to_bytes(8, "big"), payload]
