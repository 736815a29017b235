"""The engines' KV-event wire format: ZMQ frames and msgpack payloads, decoded and encoded.

One decoder reads every version docs/EVENTS.md lists: vLLM 0.9 to 0.33 and SGLang, the
positional-array events of vLLM up to 0.23 (and SGLang up to 0.5.22) and the tagged maps
(`{"type": "BlockStored", ...}`) after them, block hashes as ints (unsigned from vLLM, signed
from SGLang) or raw digests (bytes). An event decodes to a plain tuple, read by index:

    (kind, block_hashes, parent_block_hash, token_ids, block_size, medium, group_idx, spec_kind)

One encoder writes the same formats, for kvscope's own publisher (publisher.py) and for tests
that build streams with planted faults.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgpack

# An event's kind, the first item of its decoded tuple.
STORED, REMOVED, CLEARED = 0, 1, 2
KIND_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_KIND_OF_TAG = {name: i for i, name in enumerate(KIND_NAMES)}

# The indices of a decoded event.
KIND, HASHES, PARENT, TOKENS, BLOCK_SIZE, MEDIUM, GROUP, SPEC_KIND = range(8)

# A replay socket's end-of-replay marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Event = tuple[Any, ...]
Hash = int | bytes


class WireError(ValueError):
    """A frame or payload that is not a KV-event message of any known version."""


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


def _check_hashes(hashes: Any) -> list[Hash]:
    if type(hashes) is not list:
        raise WireError(f"block_hashes is {type(hashes).__name__}, not a list")
    for h in hashes:
        if type(h) is not int and type(h) is not bytes:
            raise WireError(f"a block hash of type {type(h).__name__}")
    return hashes


def _event_from_map(e: dict[Any, Any]) -> Event:
    kind = _KIND_OF_TAG.get(e.get("type"))  # type: ignore[arg-type]
    if kind is None:
        raise WireError(f"unknown event type {e.get('type')!r}")
    if kind == CLEARED:
        return (CLEARED, (), None, (), 0, None, None, None)
    hashes = _check_hashes(e.get("block_hashes"))
    group = e.get("group_idx")
    if kind == REMOVED:
        return (REMOVED, hashes, None, (), 0, e.get("medium"), group, None)
    return (
        STORED,
        hashes,
        e.get("parent_block_hash"),
        e.get("token_ids") or (),
        e.get("block_size") or 0,
        e.get("medium"),
        group,
        e.get("kv_cache_spec_kind"),
    )


def _event_from_array(e: list[Any]) -> Event:
    # vLLM up to 0.23 (array_like structs): BlockStored [tag, block_hashes, parent_block_hash,
    # token_ids, block_size, lora_id, medium (0.10.2), lora_name, extra_keys, group_idx,
    # kv_cache_spec_kind, kv_cache_spec_sliding_window]; BlockRemoved [tag, block_hashes,
    # medium, group_idx]; trailing fields at their default left out. SGLang's arrays agree up
    # to medium and carry other fields after it: only an int at vLLM's index is a group.
    kind = _KIND_OF_TAG.get(e[0]) if e and type(e[0]) is str else None
    if kind is None:
        raise WireError(f"unknown event tag {e[0] if e else None!r}")
    n = len(e)
    if kind == CLEARED:
        return (CLEARED, (), None, (), 0, None, None, None)
    if n < 2:
        raise WireError(f"{KIND_NAMES[kind]} of {n} fields")
    hashes = _check_hashes(e[1])
    if kind == REMOVED:
        group = e[3] if n > 3 and type(e[3]) is int else None
        return (REMOVED, hashes, None, (), 0, e[2] if n > 2 else None, group, None)
    if n < 5:
        raise WireError(f"BlockStored of {n} fields (5 at least)")
    group = e[9] if n > 9 and type(e[9]) is int else None
    spec = e[10] if n > 10 and type(e[10]) is str else None
    return (STORED, hashes, e[2], e[3] or (), e[4] or 0, e[6] if n > 6 else None, group, spec)


def decode_event(e: Any) -> Event:
    """One event of a batch, either encoding, as a decoded tuple."""
    if type(e) is dict:
        return _event_from_map(e)
    if type(e) is list:
        return _event_from_array(e)
    raise WireError(f"an event of type {type(e).__name__}")


def decode_payload(payload: bytes) -> tuple[float, int | None, list[Event]]:
    """(ts, data-parallel rank or None, events) of a batch's msgpack payload.

    The batch is positional in every version: [ts, events] (vLLM 0.9.0, SGLang), then
    [ts, events, data_parallel_rank] (the rank left out while it is None).
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several types for bytes that are not msgpack
        raise WireError(f"payload is not msgpack ({e})") from None
    if type(batch) is dict:  # a map-encoded batch (no known producer writes one)
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")]
    if type(batch) is not list or len(batch) < 2 or type(batch[1]) is not list:
        raise WireError("payload is not a batch [ts, events, rank?]")
    ts = batch[0]
    if type(ts) is not float and type(ts) is not int:
        raise WireError(f"batch timestamp of type {type(ts).__name__}")
    rank = batch[2] if len(batch) > 2 else None
    if rank is not None and type(rank) is not int:
        rank = None
    return float(ts), rank, [decode_event(e) for e in batch[1]]


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
