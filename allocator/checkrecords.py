"""The whole-pool check's first part: block records that were overwritten or resealed."""

from __future__ import annotations

import numpy as np

from kvscope.allocator.checkreport import CheckReport
from kvscope.allocator.checksums import IDENTITY_WORDS
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import BLOCK_MAGIC, BlockState, block_checksums


def check_records(r: CheckReport) -> np.ndarray:
    """Blocks whose record has a wrong magic, a wrong checksum, or values no allocator writes;
    returns the mask of those blocks (the later parts do not judge them again)."""
    b = r.view.blocks
    heads = r.cols.heads
    n = len(b)
    ids = np.arange(n, dtype=np.int64)
    state = r.cols.state
    magic_ok = heads["magic"] == BLOCK_MAGIC
    bad_magic = ids[~magic_ok]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_magic,
        lambda x: (
            f"block magic is {int(b['magic'][x]):#010x}, expected {BLOCK_MAGIC:#010x}: the block header was overwritten"
        ),
    )
    # The heads hold each record's identity words at their offsets: what the checksum covers.
    assert heads.dtype.itemsize >= 8 * IDENTITY_WORDS
    sums = block_checksums(heads, ids)
    bad_sum = ids[(sums != heads["checksum"]) & magic_ok]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_sum,
        lambda x: (
            "block record checksum mismatch: state, refcount, generation or owner was changed outside the allocator"
        ),
    )
    corrupt = ~magic_ok
    corrupt[bad_sum] = True
    # A record that checks but holds values no allocator writes was resealed by someone else.
    bad_value = ids[
        ((state >= len(BlockState)) | (r.cols.refcount < 0) | (r.cols.indexed > 1)) & ~corrupt
    ]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_value,
        lambda x: (
            f"block record holds state {int(state[x])}, refcount {int(b['refcount'][x])}, indexed"
            f" {int(b['indexed'][x])}: no allocator writes these values (states are 0-{len(BlockState) - 1})"
        ),
    )
    corrupt[bad_value] = True
    return corrupt
