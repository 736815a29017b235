"""Integrity of the KV data: digests of published blocks, poison of freed ones, guard canaries.

Three probes prove that nothing writes into a block its writer does not own:

- **digest** (`KVSCOPE_DIGEST`): a block's K/V is hashed when it is published
  (`mark_computed`) and the hash stored in its record (`kv_digest`: the hash's high 32 bits over
  the block's generation, so a digest left by an older allocation of the block never counts);
  it is verified on a prefix hit, on eviction, when a request releases the block, and by
  `check` / `analyze`. A mismatch is `published_block_modified`.
- **poison** (guard mode): a freed block's token slots are filled with NaN and it waits in
  quarantine (`poisoned` = 1); the poison is verified before the block is reused and by
  `check` / `analyze`. A changed poison is a write after free (`use_after_free`).
- **canaries** (guard mode): every block's guard slot holds the canary; `pool.verify()` and
  `check` / `analyze` scan them all, not only the blocks being freed (`guard_violation`).

The C core runs these checks inside its operations (csrc/kvdata.c, with the messages defined
here). Functions here take a segment view's block records and the pool's KV tensor (live, or
rebuilt from a dump's data with `kv_from_bytes`): `check_kv` is the whole-pool pass, and
`pool.verify()` scans the canaries here where the core does not map the K/V (a CUDA pool's; the
core scans a CPU pool's itself, csrc/entry.c verify_canaries). The KV data is a torch tensor (a live pool's) or its bits in
numpy (kvbits.KVBits: a data file or a dump's data, which `check` and `analyze` read without
torch); each function below takes either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import kvbits
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.kvbits import KVBits
from kvscope.allocator.layout import BlockState, SegmentView

# torch is imported where a tensor is made: `kvscope check` and `analyze` read bits with numpy.
if TYPE_CHECKING:
    import torch

    KV = torch.Tensor | KVBits

GENERATION_MASK = 0xFFFF_FFFF
# Findings per kind from one whole-pool pass (check.py's MAX_PER_KIND).
MAX_PER_KIND = 50

# (a finding's message holds 200 bytes: it names who published the block and where to look for
# who wrote into it, and leaves the digests out)
MODIFIED_MESSAGE = (
    "K/V changed since {published} (seen at {when}): written by its publisher or by a request "
    "that mapped it since (its prefix_hit events)"
)
POISON_MESSAGE = (
    "written after it was freed: pid {pid} request {request!r} freed it at {when}, and "
    "{slots} element(s) of its poison (NaN) were overwritten in quarantine"
)
CANARY_MESSAGE = (
    "the guard slot after the block's last token was overwritten: a KV write ran past the end "
    "of the block"
)


def cpu_bits(kv: KV) -> KV:
    """A CPU tensor as its bits (KVBits, numpy, no copy); other inputs unchanged.

    kvscope's work on a CPU pool's K/V runs inside the user's processes, where torch's CPU ops
    would use GNU OpenMP, which is not fork-safe: a parent that ran a parallel region forks
    children that wait forever in their first one. numpy runs these passes on the calling thread
    (kernels/backend.serial_cpu covers the kernels' own CPU paths).
    """
    if isinstance(kv, KVBits) or kv.device.type != "cpu":
        return kv
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[kv.element_size()]
    return KVBits(kv.view(ints).numpy(), str(kv.dtype).removeprefix("torch."))


# -- digests ---------------------------------------------------------------------------------


def digests_of(kv: KV, ids: np.ndarray, block_size: int) -> list[int]:
    """Digests (u64) of the K/V of blocks `ids` (kernels/digest.py)."""
    kv = cpu_bits(kv)
    if isinstance(kv, KVBits):
        return kvbits.block_digests(kv, ids, block_size)
    from kvscope.kernels import block_digests

    return block_digests(kv, [int(x) for x in ids], block_size)


def has_digest(blocks: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Mask of `ids` whose record holds a digest taken in the block's current generation."""
    word = blocks["kv_digest"][ids]
    return (word != 0) & ((word & np.uint64(GENERATION_MASK)) == blocks["generation"][ids])


def modified(
    blocks: np.ndarray, kv: KV, ids: np.ndarray, block_size: int
) -> list[tuple[int, int, int]]:
    """Published blocks among `ids` whose K/V no longer matches their digest:
    (block, high half found, high half recorded)."""
    ids = np.asarray(ids, np.int64)
    ids = ids[has_digest(blocks, ids)]
    if len(ids) == 0:
        return []
    return changed(ids.tolist(), digests_of(kv, ids, block_size), blocks["kv_digest"][ids].tolist())


def changed(ids: list[int], found: list[int], words: list[int]) -> list[tuple[int, int, int]]:
    """The blocks whose digest (`found`) differs from their record's `kv_digest` word: (block,
    high half found, high half recorded)."""
    return [
        (int(b), d >> 32, int(w) >> 32)
        for b, d, w in zip(ids, found, words)
        if d >> 32 != int(w) >> 32
    ]


_BLANK: dict[tuple, dict[int, str]] = {}


def _blank_digests(kv: KV, block_size: int) -> dict[int, str]:
    """High halves of the digests a block has before anything is written into it (zeros, as
    created; NaN, as poisoned), for this cache's geometry."""
    kv = cpu_bits(kv)
    shape = (*kv.shape[:2], 1, *kv.shape[3:])
    if isinstance(kv, KVBits):
        one = np.zeros(1, np.int64)
        blank = {digests_of(kvbits.blank_block(kv, 0), one, block_size)[0] >> 32: "zero"}
        if can_poison(kv):
            poisoned_block = kvbits.blank_block(kv, kvbits.NAN_BITS[kv.dtype])
            blank[digests_of(poisoned_block, one, block_size)[0] >> 32] = "NaN (poison)"
        return blank
    key = (shape, kv.dtype, str(kv.device), block_size)
    if key not in _BLANK:
        blank = {
            digests_of(kv.new_zeros(shape), np.zeros(1, np.int64), block_size)[0] >> 32: "zero"
        }
        if can_poison(kv):
            nan = kv.new_full(shape, float("nan"))
            blank[digests_of(nan, np.zeros(1, np.int64), block_size)[0] >> 32] = "NaN (poison)"
        _BLANK[key] = blank
    return _BLANK[key]


# How a `published_block_modified` message begins when the block was published blank (readers
# key on it: kvscope/analysis.py names the requests that read the block before it was written).
UNWRITTEN_AT_PUBLISH = "published before its K/V was written"
# A digest taken of a block nothing had been written into ({blank}: "zero", "NaN (poison)").
BLANK_MODIFIED_MESSAGE = (
    UNWRITTEN_AT_PUBLISH + ": mark_computed digested an all-{blank} block, and its K/V changed "
    "since (seen at {when}; digest now {found:#010x})"
)


# Where a `published_block_modified` message says its change was seen (`{when}` of either form
# above): the words before, the place, the words after. (The publisher's name is a repr, so
# it is matched as one: it may hold "(seen at " itself.)
_REPR = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_SEEN_AT = re.compile(
    r"^(?P<head>(?:K/V changed since (?:its publication|request " + _REPR + r" published it)"
    r"|" + re.escape(UNWRITTEN_AT_PUBLISH) + r": mark_computed digested an all-(?:zero|NaN "
    r"\(poison\)) block, and its K/V changed since) \(seen at )(?P<when>.*)"
    r"(?P<tail>; digest now 0x[0-9a-f]+\)|\): written by its publisher or by a request that "
    r"mapped it since \(its prefix_hit events\))$",
    re.DOTALL,
)


def seen_apart(message: str) -> tuple[tuple[str, str], str] | None:
    """A `published_block_modified` message's words before and after where its change was
    seen, and that place; None for any other message (or one the ring cut short)."""
    m = _SEEN_AT.match(message)
    if m is None:
        return None
    return (m["head"], m["tail"]), m["when"]


def seen_together(words: tuple[str, str], places: list[str]) -> str:
    """The message of `seen_apart`'s words with every place the same change was seen ("seen at
    a prefix hit by request 'r2' and at a prefix hit by request 'r0'")."""
    said = places[0] if len(places) == 1 else ", at ".join(places[:-1]) + " and at " + places[-1]
    return words[0] + said + words[1]


def modified_message(
    when: str, found: int, want: int, kv: KV, block_size: int, rec: np.void
) -> str:
    """The `published_block_modified` message, naming the request that published the block
    (its record's, `rec`: a finding's request is the block's record's, which is not who wrote);
    says so when the digest was taken of a block nothing had been written into (published
    before its K/V was written)."""
    blank = _blank_digests(kv, block_size).get(want)
    if blank is None:
        publisher = bytes(rec["request"]).decode(errors="replace")
        published = f"request {publisher!r} published it" if publisher else "its publication"
        return MODIFIED_MESSAGE.format(published=published, when=when)
    return BLANK_MODIFIED_MESSAGE.format(blank=blank, when=when, found=found)


# -- poison ----------------------------------------------------------------------------------


def freed_by(rec: np.void) -> int:
    """The pid that freed a free block: its owner while it is quarantined in the ring (guard
    mode: `freed_at` is then the ring's count); else the record's `freed_at`, which a release
    outside guard mode, a refill out of the ring and an eviction set and an allocation clears
    (0: the owner) (csrc/blocks.c freed_by)."""
    if int(rec["state"]) != BlockState.QUARANTINED and int(rec["freed_at"]) != 0:
        return int(np.uint32(int(rec["freed_at"]) & 0xFFFFFFFF).view(np.int32))
    return int(rec["owner_pid"])


def poison_message(rec: np.void, count: int) -> str:
    """The write-after-free message: who freed the block (`freed_by`) and when (its last
    access is the release)."""
    when = datetime.fromtimestamp(int(rec["access_ns"]) / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")
    return POISON_MESSAGE.format(
        pid=freed_by(rec),
        request=bytes(rec["request"]).decode(errors="replace"),
        when=when[:-3],
        slots=count,
    )


def can_poison(kv: KV) -> bool:
    """Freed blocks are poisoned only in floating-point caches."""
    if isinstance(kv, KVBits):
        return kvbits.can_poison(kv)
    return kv.dtype.is_floating_point


def _not_poisoned(kv: torch.Tensor, ids: np.ndarray | list[int], block_size: int) -> torch.Tensor:
    """Which elements of the token slots of blocks `ids` no longer hold the poison: bool
    [L, 2, len(ids), block_size, H, D] (kvbits.poisoned answers the opposite for bits, by block
    and slot). Few launches: on a GPU each costs the host several microseconds, and a check runs
    in every allocation and release."""
    from kvscope.kernels.backend import block_ids
    from kvscope.kernels.checks import poison_bits
    from kvscope.kernels.digest import int_view

    idx = block_ids(np.asarray(ids, np.int64), kv.device)
    return int_view(kv)[:, :, idx, :block_size] != poison_bits(kv.dtype)


def unpoisoned_counts(kv: torch.Tensor, ids: np.ndarray, block_size: int) -> torch.Tensor:
    """int64 [len(ids)] on the cache's device: how many elements of each block's token slots no
    longer hold the poison (launched, not waited for on a GPU)."""
    return _not_poisoned(kv, ids, block_size).sum((0, 1, 3, 4, 5))


def poison_broken(kv: KV, ids: np.ndarray, block_size: int) -> list[tuple[int, int]]:
    """Blocks of `ids` whose token slots no longer all hold the poison: (block, elements)."""
    kv = cpu_bits(kv)
    if len(ids) == 0 or not can_poison(kv):
        return []
    if isinstance(kv, KVBits):
        counts = (~kvbits.poisoned(kv, ids, block_size)).reshape(len(ids), -1).sum(1).tolist()
    else:
        counts = unpoisoned_counts(kv, ids, block_size).tolist()
    return [(int(b), int(c)) for b, c in zip(np.asarray(ids).tolist(), counts) if c]


# `positions`: "position 48", "positions 32-36" (every one of them), or "2 positions between
# 32 and 36" (the others in between written), composed by the core (csrc/kvdata.c).
# (at most 200 bytes, a finding's message in the ring: a 32-byte request id and the longest
# positions leave room for the rest)
UNWRITTEN_MESSAGE = (
    "request {request!r} finished with {positions} of this block never written: the K/V went"
    " elsewhere or was never stored"
)
# How kvscope.analysis reads those positions back: (first, last) from any of the three forms,
# and from the form of dumps written before them ("positions 32-36 (2 slot(s))").
UNWRITTEN_FORMS = (
    re.compile(r"finished with position (\d+)() of this block"),
    re.compile(r"finished with positions (\d+)-(\d+) (?:\((\d+) slot\(s\)\) )?"),
    re.compile(r"finished with (\d+) positions between (\d+) and (\d+) of this block"),
)


def unwritten_positions(message: str) -> tuple[int, int, int] | None:
    """The first and last position a kv_never_written's message names, and how many of those
    from the first to the last were never written; None for another message."""
    one, run, some = (form.search(message) for form in UNWRITTEN_FORMS)
    if one is not None:
        return int(one.group(1)), int(one.group(1)), 1
    if run is not None:
        first, last = int(run.group(1)), int(run.group(2))
        return first, last, int(run.group(3) or last - first + 1)
    if some is not None:
        return int(some.group(2)), int(some.group(3)), int(some.group(1))
    return None


def unwritten_span(message: str) -> tuple[int, int] | None:
    """The first and last position a kv_never_written's message names, else None."""
    got = unwritten_positions(message)
    return None if got is None else got[:2]


# -- canaries --------------------------------------------------------------------------------


def has_guard(view: SegmentView) -> bool:
    """True when the pool's blocks carry a guard slot."""
    return int(view.h["slots_per_block"]) > view.layout.block_size


def broken_canaries(kv: KV, ids: np.ndarray | None = None) -> list[int]:
    """Blocks (of `ids`, or all) whose guard slot no longer holds the canary (read-only)."""
    kv = cpu_bits(kv)
    if isinstance(kv, KVBits):
        return kvbits.broken_canaries(kv, ids)
    from kvscope.kernels import guard_scan

    if ids is not None and len(ids) == 0:
        return []
    return guard_scan(kv, blocks=None if ids is None else [int(x) for x in ids])


# -- the whole-pool pass ---------------------------------------------------------------------


def _finding(view: SegmentView, kind: str, b: int, message: str, **extra) -> Finding:
    rec = view.blocks[b]
    pid = freed_by(rec) if kind == FindingKind.USE_AFTER_FREE else int(rec["owner_pid"])
    return Finding(
        kind,
        message,
        block=int(b),
        owner_pid=pid or None,
        request=bytes(rec["request"]).decode(errors="replace") or None,
        extra=extra,
    )


def _unchanged(view: SegmentView, again: SegmentView | None, b: int) -> bool:
    """True when block b has the same generation and state in `again` (a later read of the
    live pool): its data could not have been legitimately rewritten in between."""
    if again is None:
        return True
    old, new = view.blocks[b], again.blocks[b]
    return all(old[f] == new[f] for f in ("generation", "state", "kv_digest", "poisoned"))


def check_kv(
    view: SegmentView,
    kv: KV,
    again: Callable[[], SegmentView] | None = None,
) -> list[Finding]:
    """Digests of published blocks, poison of freed ones and every guard canary, over a whole
    pool; findings, empty when its data is intact.

    `again`, for a live pool, reads its records once more: a block whose data looks wrong is
    reported only if it kept its generation and state meanwhile (a block evicted and reused
    while its data was read is not a finding).
    """
    b = view.blocks
    bs = view.layout.block_size
    n = len(b)
    ids = np.arange(n, dtype=np.int64)
    state = b["state"]
    published = ids[(b["indexed"] == 1) & has_digest(b, ids)]
    changed = modified(b, kv, published, bs)
    freed = (state == BlockState.FREE) | (state == BlockState.QUARANTINED)
    freed |= state == BlockState.LOCAL
    poisoned = ids[freed & (b["poisoned"] == 1)]
    written = poison_broken(kv, poisoned, bs) if has_guard(view) else []
    canaries = broken_canaries(kv) if has_guard(view) else []
    later = again() if again is not None and (changed or written) else None
    out: list[Finding] = []
    for blk, found, want in changed[:MAX_PER_KIND]:
        if _unchanged(view, later, blk):
            msg = modified_message("a check", found, want, kv, bs, b[blk])
            out.append(_finding(view, FindingKind.PUBLISHED_BLOCK_MODIFIED, blk, msg))
    for blk, count in written[:MAX_PER_KIND]:
        if _unchanged(view, later, blk):
            rec = b[blk]
            msg = poison_message(rec, count)
            out.append(
                _finding(view, FindingKind.USE_AFTER_FREE, blk, msg, freed_ns=int(rec["access_ns"]))
            )
    for blk in canaries[:MAX_PER_KIND]:
        out.append(_finding(view, FindingKind.GUARD_VIOLATION, blk, CANARY_MESSAGE))
    return out
