"""The recorded-stream file `kvscope events record` writes (docs/EVENTS.md, "Recorded streams").

A header, then one record per ZMQ message as it arrived, every frame kept byte for byte:

    magic  b"KVSEVTS1"
    u32    length of the JSON header that follows (little-endian)
    JSON   {"schema": 1, "endpoints": [...], "replay": [...], "topic": "...", "created_ns": N}
    record*:
      u64  receive time, ns since the epoch        (little-endian, as every field below)
      u8   source: 0 published (SUB), 1 replayed (from the replay socket), 2 recorder's note
      u8   endpoint: index into the header's "endpoints"
      u16  number of frames
      per frame: u32 length, then the frame's bytes

A note's one frame is JSON (`{"note": "replay", ...}`). A file cut short (the recorder killed)
reads up to its last whole record; `StreamFile.truncated` says so.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

from kvscope.errors import UsageError

MAGIC = b"KVSEVTS1"
SCHEMA = 1
PUBLISHED, REPLAYED, NOTE = 0, 1, 2

_RECORD = struct.Struct("<QBBH")
_LEN = struct.Struct("<I")


class StreamWriter:
    """Appends records to a recorded-stream file."""

    def __init__(self, path: str, header: dict[str, Any]):
        try:
            self._f: IO[bytes] = open(path, "wb")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
        head = json.dumps({"schema": SCHEMA, "created_ns": time.time_ns(), **header}).encode()
        self._f.write(MAGIC + _LEN.pack(len(head)) + head)
        self.path = path
        self.num_records = 0

    def write(self, recv_ns: int, source: int, endpoint: int, frames: Sequence[bytes]) -> None:
        """One message as it arrived."""
        parts = [_RECORD.pack(recv_ns, source, endpoint, len(frames))]
        for fr in frames:
            parts.append(_LEN.pack(len(fr)))
            parts.append(fr)
        self._f.write(b"".join(parts))
        self.num_records += 1

    def note(self, endpoint: int, note: dict[str, Any]) -> None:
        """A recorder's note (a replay's outcome) at this point of the stream."""
        self.write(time.time_ns(), NOTE, endpoint, [json.dumps(note).encode()])

    def flush(self) -> None:
        """Hand what was written to the OS."""
        self._f.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._f.close()


class StreamFile:
    """A recorded-stream file, read (mapped) whole: its header and its records in order."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < len(MAGIC) + 4:
                    raise UsageError(f"{path} is not a recorded event stream (too short)")
                self._buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        if self._buf[: len(MAGIC)] != MAGIC:
            raise UsageError(f"{path} is not a recorded event stream (no {MAGIC.decode()} magic)")
        (n,) = _LEN.unpack_from(self._buf, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            self.header: dict[str, Any] = json.loads(bytes(self._buf[start : start + n]))
        except ValueError:
            raise UsageError(f"{path}: the stream's header is not JSON") from None
        if self.header.get("schema") != SCHEMA:
            raise UsageError(
                f"{path}: recorded-stream schema {self.header.get('schema')!r}"
                f" (this kvscope reads {SCHEMA})"
            )
        self._first = start + n
        self.truncated = False
        self.endpoints: list[str] = list(self.header.get("endpoints") or [])

    def records(self) -> Iterator[tuple[int, int, int, list[bytes]]]:
        """(recv_ns, source, endpoint, frames) of every whole record, in file order."""
        buf = self._buf
        end = len(buf)
        pos = self._first
        rec_size = _RECORD.size
        unpack_rec = _RECORD.unpack_from
        unpack_len = _LEN.unpack_from
        while pos < end:
            if pos + rec_size > end:
                self.truncated = True
                return
            recv_ns, source, endpoint, nframes = unpack_rec(buf, pos)
            pos += rec_size
            frames = []
            for _ in range(nframes):
                if pos + 4 > end:
                    self.truncated = True
                    return
                (n,) = unpack_len(buf, pos)
                pos += 4
                if pos + n > end:
                    self.truncated = True
                    return
                frames.append(buf[pos : pos + n])
                pos += n
            yield recv_ns, source, endpoint, frames

    def mapping(self) -> tuple[Any, int]:
        """The mapped file and the offset of its first record (for a reader of its own)."""
        return self._buf, self._first

    def endpoint(self, i: int) -> str:
        """The endpoint a record came from, by its index."""
        return self.endpoints[i] if 0 <= i < len(self.endpoints) else f"endpoint {i}"

    def close(self) -> None:
        """Unmap the file."""
        self._buf.close()


def is_stream_file(path: str) -> bool:
    """Whether `path` is a readable recorded-stream file (by its magic)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False
