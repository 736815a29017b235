"""Dump files: a consistent copy of a pool's segment (and optionally its KV data) that travels.

A dump is `DUMP_HEADER_DTYPE` (kvscope.allocator.layout), then the segment bytes, then the KV
data bytes when `DUMP_WITH_DATA` is set, so a dump and a live pool are read by the same
`SegmentView`. The dump header's `segment_header_prefix` holds the first 256 bytes of the segment
header as the dumper last saw it intact (zero when unknown): a dump of a pool whose header was
scribbled over can still be laid out and analyzed.

    from kvscope.allocator.dumpfile import write_dump
    from kvscope.allocator.dumpread import read_dump
    write_dump("demo", "demo.kvd", redact=True, reason="nightly")
    view, dump_header = read_dump("demo.kvd")

This module writes them (and holds what both sides share); dumpread.py reads them.
"""

from __future__ import annotations

import os
import stat
import sys

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.geometry import geometry_problem
from kvscope.allocator.layout import (
    DUMP_FAILED,
    DUMP_HEADER_DTYPE,
    DUMP_MAGIC,
    DUMP_REDACTED,
    DUMP_TORN,
    DUMP_VERSION,
    DUMP_WITH_DATA,
    FORMAT_VERSION,
    HEADER_DTYPE,
    POOL_MAGIC,
    Layout,
    SegmentView,
)
from kvscope.allocator.process import now_ns
from kvscope.allocator.segment import (
    check_name,
    check_size,
    data_path,
    open_existing,
    open_file,
    release,
    segment_path,
    view_of,
)
from kvscope.allocator.snapshot import snapshot

# Bytes of the segment header kept in the dump header's segment_header_prefix field.
SAVED_HEADER_BYTES = 256
DUMP_SUFFIX = ".kvd"
# `kvscope dump NAME -o -`: the dump goes to standard output.
STDOUT = "-"


def dump_name(pool: str, pid: int) -> str:
    """The file name `kvscope run` gives a dump: kvscope-<pool>-<pid>.kvd."""
    return f"kvscope-{pool}-{pid}{DUMP_SUFFIX}"


def layout_of_prefix(prefix: bytes) -> Layout | None:
    """The layout a saved header prefix describes, or None when it holds no usable pool header
    (every geometry field it covers is range-checked, as for a whole header)."""
    if len(prefix) < 8 or int.from_bytes(prefix[:8], "little") != POOL_MAGIC:
        return None
    buf = bytearray(HEADER_DTYPE.itemsize)
    buf[: len(prefix)] = prefix[: HEADER_DTYPE.itemsize]
    h = np.frombuffer(buf, HEADER_DTYPE, 1)[0]
    if int(h["version"]) != FORMAT_VERSION:
        return None
    if geometry_problem(h, known_bytes=min(len(prefix), HEADER_DTYPE.itemsize)) is not None:
        return None
    return Layout.from_header(h)


def write_dump(
    view_or_name: str | SegmentView | object,
    path: str | os.PathLike[str],
    *,
    with_data: bool = False,
    redact: bool = False,
    reason: str = "",
    pid: int | None = None,
    header_prefix: bytes | None = None,
    trust_owner: bool = False,
    failed: bool = False,
) -> str:
    """Write a consistent dump of a pool (by name, SegmentView or KVPool) to path, mode 0600;
    path "-" writes it to standard output.

    Args:
        pid: the process the dump is about (default: this one), recorded in the dump header.
        header_prefix: the segment header's first bytes as last seen intact (default: the
            segment's own header when it is intact).
        trust_owner: dump a pool that another user owns (by name).
        failed: the program the dump is about failed (an exception, a signal, a non-zero exit
            status: `reason` says which); its live requests ended with it.
    """
    if with_data and redact:
        raise PoolError(
            "--redact cannot be combined with --with-data: the KV values encode the prompt; dump one or the other"
        )
    target = os.fspath(path)
    check_target(target)
    mf = None
    name = getattr(view_or_name, "name", None)
    if isinstance(view_or_name, str):
        name = view_or_name
        mf = open_existing(segment_path(name), name, trust_owner)
        live = view_of(mf)
    elif isinstance(view_or_name, SegmentView):
        live = view_or_name
    else:
        live = view_or_name.view  # type: ignore[attr-defined]
    try:
        # A live mapping is copied under the seqlock; an already-copied view (a snapshot, a
        # dump read back: a memoryview of its private mapping) as it is.
        snap = snapshot(live) if not isinstance(live.buf, bytearray | bytes | memoryview) else live
        torn = bool(getattr(snap, "torn", False))
        owner = mf.uid if mf is not None else -1
        data = _read_data(snap, name, owner, trust_owner) if with_data else b""
    finally:
        if mf is not None:
            release(mf)
    seg = bytearray(snap.raw.tobytes()) if snap.buf is live.buf else snap.buf
    seg_view = SegmentView(seg, snap.layout)
    if redact:
        from kvscope.allocator.redact import redact_view

        redact_view(seg_view)
    if header_prefix is None:
        header_prefix = bytes(seg[:SAVED_HEADER_BYTES])
    dh = np.zeros(1, DUMP_HEADER_DTYPE)
    dh["magic"], dh["version"] = DUMP_MAGIC, DUMP_VERSION
    dh["flags"] = (
        (DUMP_WITH_DATA if with_data else 0)
        | (DUMP_REDACTED if redact else 0)
        | (DUMP_TORN if torn else 0)
        | (DUMP_FAILED if failed else 0)
    )
    dh["segment_size"], dh["data_size"] = len(seg), len(data)
    dh["created_ns"] = now_ns()
    dh["pid"] = os.getpid() if pid is None else pid
    dh["host"] = host_name().encode()[:64]
    dh["pool"] = bytes(snap.h["name"])
    dh["reason"] = reason.encode()[:128]
    if layout_of_prefix(header_prefix) is not None:
        dh["segment_header_prefix"][0, : len(header_prefix[:SAVED_HEADER_BYTES])] = np.frombuffer(
            header_prefix[:SAVED_HEADER_BYTES], np.uint8
        )
    parts = [dh.tobytes(), seg, data]
    if target == STDOUT:
        return _write_stdout(parts)
    return write_atomic(target, parts)


def _read_data(view: SegmentView, name: str | None, owner: int, trust_owner: bool) -> bytes:
    """The pool's KV data bytes (CPU: its shared file; CUDA: copied from the device)."""
    h = view.h
    device = bytes(h["device"]).decode(errors="replace")
    nbytes = int(h["data_bytes"])
    if device == "cpu":
        # The data file is found by the pool's name, never by a name the segment holds
        # unchecked: a header naming "../x" must not make the dump read another file.
        name = check_name(name or bytes(h["name"]).decode(errors="replace"))
        path = data_path(name)
        fd = open_file(
            path,
            name,
            trust_owner=trust_owner,
            missing=f"cannot read the KV data of pool {name!r}: {path} does not exist",
            owner=os.geteuid() if owner < 0 else owner,
        )
        try:
            check_size(fd, nbytes, path)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(nbytes)
        except OSError as e:
            raise PoolError(f"cannot read the KV data of pool {name!r}: {e.strerror}") from None
        finally:
            os.close(fd)
        if len(data) < nbytes:
            raise PoolError(f"the KV data file of pool {name!r} is truncated")
        return data
    from kvscope.allocator import kvdata
    from kvscope.allocator.header import config_from_header

    blob = bytes(h["cuda_ipc"])[: int(h["cuda_ipc_len"])]
    kv = kvdata.attach_cuda(blob, config_from_header(h))
    return kv.contiguous().cpu().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()


def check_target(path: str, what: str = "a dump", stdout: bool = True) -> None:
    """A dump (or `what` else kvscope writes whole: a report, a trace) goes to a new or regular
    file (or, with `stdout`, "-": standard output): writing it next to a device, FIFO or
    directory and renaming it over that would replace the node itself."""
    if path == STDOUT and stdout:
        if sys.stdout.isatty():
            raise PoolError(
                "standard output is a terminal; send the dump to a file or a pipe (-o - > pool.kvd)"
            )
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise PoolError(f"cannot write {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise PoolError(
            f"cannot write {path}: it is not a regular file ({what} replaces the file it is"
            " written to); use a file path" + (", or - for standard output" if stdout else "")
        )


def _write_stdout(parts: list[bytes | bytearray | memoryview]) -> str:
    """Write parts to standard output (a pipe or a file the shell opened)."""
    out = sys.stdout.buffer
    try:
        out.flush()
        for p in parts:
            out.write(p)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise PoolError(f"cannot write the dump to standard output: {e.strerror}") from None
    return STDOUT


def write_atomic(
    path: str, parts: list[bytes | bytearray | memoryview], mode: int | None = 0o600
) -> str:
    """Write parts to path atomically (a temporary file in its directory renamed into place),
    with `mode` (default 0600: readable by its owner only; None: as the umask gives a new
    file); a failed write (a full disk, say) leaves no file behind and is one PoolError.
    Every file kvscope writes whole (dumps, reports, traces) is written by this."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix=".kvscope-dump-", dir=directory)
    except FileNotFoundError:
        # (a directory that exists but takes no new file, as /proc, says ENOENT too)
        why = "takes no new file" if os.path.isdir(directory) else "does not exist"
        raise PoolError(f"cannot write {path}: directory {directory} {why}") from None
    except PermissionError:
        raise PoolError(f"cannot write {path}: permission denied in {directory}") from None
    except OSError as e:
        raise PoolError(f"cannot write {path}: {e.strerror}") from None
    try:
        os.fchmod(fd, _file_mode(mode))
        with os.fdopen(fd, "wb") as f:
            for p in parts:
                f.write(p)
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise PoolError(f"cannot write {path}: {e.strerror}; nothing was written") from None
    except BaseException:
        _remove(tmp)
        raise
    return path


def _file_mode(mode: int | None) -> int:
    if mode is not None:
        return mode
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def host_name() -> str:
    """This host's name, as dumps record it (socket.gethostname)."""
    # Imported here: socket costs the reading verbs' start-up, and only these two need it.
    import socket

    return socket.gethostname()
