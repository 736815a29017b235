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
reads up to its last whole record; `StreamFile.truncated` says so. A record that does not fit
and is followed by whole records is corruption, not a cut: the reader skips to the next whole
record and `StreamFile.corrupt` names the bytes it skipped.
"""

from __future__ import annotations

import json
import mmap
import os
import re
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
# The most frames a record of the recorder holds (a published batch 3, a replay reply 2 or 3,
# a note 1), with room: a record header past it is no record's.
MAX_FRAMES = 16


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
        self.endpoints: list[str] = list(self.header.get("endpoints") or [])
        # The file ends inside a record whose start is whole (cut short: the recorder killed).
        self.truncated = False
        # (offset, bytes, records read before it) of each stretch that does not parse as
        # records: skipped up to the next whole record, or to the end of the file.
        self.corrupt: list[tuple[int, int, int]] = []
        # Bytes not read as records: the record cut short and every corrupt stretch.
        self.unread_bytes = 0
        # A record header as the recorder writes them, for finding the next whole record.
        eps = len(self.endpoints)
        ep = rb"[\x00-%s]" % re.escape(bytes([eps - 1])) if 0 < eps <= 256 else rb"."
        self._header_at = re.compile(rb"(?s)(?=.{8}[\x00-\x02]" + ep + rb"[\x01-\x10]\x00)")

    def records(self) -> Iterator[tuple[int, int, int, list[bytes]]]:
        """(recv_ns, source, endpoint, frames) of every whole record, in file order; a stretch
        that does not parse is skipped (`skip` says which)."""
        buf = self._buf
        end = len(buf)
        pos: int | None = self._first
        rec_size = _RECORD.size
        unpack_rec = _RECORD.unpack_from
        unpack_len = _LEN.unpack_from
        count = 0
        while pos is not None and pos < end:
            start = pos
            if pos + rec_size > end:
                pos = self.skip(start, count)
                continue
            recv_ns, source, endpoint, nframes = unpack_rec(buf, pos)
            pos += rec_size
            frames = []
            for _ in range(nframes):
                if pos + 4 > end:
                    break
                (n,) = unpack_len(buf, pos)
                pos += 4
                if pos + n > end:
                    break
                frames.append(buf[pos : pos + n])
                pos += n
            else:
                count += 1
                yield recv_ns, source, endpoint, frames
                continue
            pos = self.skip(start, count)

    def skip(self, pos: int, records_before: int) -> int | None:
        """Past a record at `pos` that runs past the end of the file: the offset of the next
        whole record when one follows (the bytes up to it are corrupt), else None (the file is
        cut short there, or its end is corrupt). `records_before`: the records read so far."""
        end = len(self._buf)
        for m in self._header_at.finditer(self._buf, pos + 1):
            q = m.start()
            if self._resumes_at(q):
                self.corrupt.append((pos, q - pos, records_before))
                self.unread_bytes += q - pos
                return q
        self.unread_bytes += end - pos
        if self._plausible(pos, cut=True) is not None:
            self.truncated = True
        else:
            self.corrupt.append((pos, end - pos, records_before))
        return None

    def _plausible(self, pos: int, cut: bool = False, strict: bool = False) -> int | None:
        """The end of the record at `pos` when its header is one the recorder writes and its
        frames fit in the file; with `cut`, the end of the file for a record whose start is
        whole up to it (cut short); with `strict`, only a record shaped as a batch (its seq
        frame 8 bytes) or a note (JSON). None otherwise."""
        buf = self._buf
        end = len(buf)
        if pos + _RECORD.size > end:
            return end if cut and (pos + 8 >= end or buf[pos + 8] <= NOTE) else None
        _, source, endpoint, nframes = _RECORD.unpack_from(buf, pos)
        eps = len(self.endpoints)
        if source > NOTE or not 0 < nframes <= MAX_FRAMES or 0 < eps <= endpoint:
            return None
        p = pos + _RECORD.size
        lens = []
        for _ in range(nframes):
            if p + 4 > end:
                return end if cut else None
            (n,) = _LEN.unpack_from(buf, p)
            if p + 4 + n > end:
                return end if cut else None
            lens.append((p + 4, n))
            p += 4 + n
        if strict:
            if source == NOTE:
                at, n = lens[0]
                if nframes != 1 or n < 2 or buf[at] != 0x7B or buf[at + n - 1] != 0x7D:
                    return None
            elif nframes not in (2, 3) or lens[-2][1] != 8:
                return None
        return p

    def _resumes_at(self, q: int) -> bool:
        """Whether whole records resume at `q`: one shaped as the recorder's, then the end of
        the file, or another record (whole, or cut short at the end)."""
        nxt = self._plausible(q, strict=True)
        if nxt is None:
            return False
        return nxt == len(self._buf) or self._plausible(nxt, cut=True) is not None

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
