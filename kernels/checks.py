"""One kernel for the probes' per-block checks of a pool's K/V, with its block ids read from, and
its answers written to, one int64 buffer `ring` (on a GPU: page-locked host memory, which the
kernel reaches directly), so that a check costs the host one launch and nothing else.

A check of a few blocks runs in every allocation, publication and release of a probed CUDA
pool. Done with torch ops, each took the host ~130 us (measured on an H200: the ids' upload,
a gather, a compare, a sum, the answer's copy back and its event, each a launch): most of what
`kvscope run` cost a serving loop. Here the ids are written into `ring` with numpy and the
answer is read from it once the GPU is past the launch (allocator/devicechecks.py).

`mode` (each one program per block, over the block's token slots `[0, block_size)` in every
layer, K and V, read as integers of the element's width):

- DIGEST: the raw digest (kernels/digest.py: sum of bits x coefficient, wrapping int64);
- COUNTS: per token slot, how many of its elements no longer hold the poison (`block_size`
  words per block);
- CANARY: 1 if the block's guard slot (the last slot) lost its canary (kernels/guard.py);
- POISON: fill the token slots with the poison (no answer);
- SLOTS: per token slot, the raw digest of that slot alone (`block_size` words per block):
  its elements in every layer, K and V, in that order, as one row of the digest's (the
  coefficient of a slot's element e of row r is that of element r * H * D + e): slot
  provenance's K/V hash of a CUDA pool's slot (allocator/csrc/provenance.c prov_kv_hash takes
  the same sum over a CPU pool's bytes);
- DIGEST_SLOTS: both, from one read of the block (`block_size + 1` words per block: the
  DIGEST word, then the SLOTS words): a publication's digests and its slots' hashes in one
  launch;
- CANARY_POISON: CANARY's answer, then POISON's fill of the token slots (the guard slot is not
  one of them: the fill leaves what CANARY read): a guarded release's two checks of the blocks
  it frees in one launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .digest import DIGEST_ADD, DIGEST_MUL, int_view
from .guard import canary_loaded

DIGEST, COUNTS, CANARY, POISON, SLOTS, DIGEST_SLOTS, CANARY_POISON = 0, 1, 2, 3, 4, 5, 6
MODES = (DIGEST, COUNTS, CANARY, POISON, SLOTS, DIGEST_SLOTS, CANARY_POISON)


def answer_words(mode: int, num_blocks: int, block_size: int) -> int:
    """How many int64 words the answer of a check of `num_blocks` blocks takes."""
    per_block = {COUNTS: block_size, SLOTS: block_size, DIGEST_SLOTS: block_size + 1}
    # (CANARY_POISON: CANARY's word)
    return num_blocks * per_block.get(mode, 0 if mode == POISON else 1)


@triton.jit(do_not_specialize=["ids_at", "out_at"])
def _check_kernel(
    kv_ptr, ring_ptr, ids_at, out_at, num_rows, stride_row, stride_n, guard_offset,
    MODE: tl.constexpr, BS: tl.constexpr, HD: tl.constexpr,
    BS_TILE: tl.constexpr, HD_TILE: tl.constexpr,
    POISON_BITS: tl.constexpr, CANARY_BITS: tl.constexpr, MUL: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blk = tl.load(ring_ptr + ids_at + pid).to(tl.int64)
    base = kv_ptr + blk * stride_n
    e = tl.arange(0, HD_TILE)
    # rows (layer x K/V) are walked by pointer increments: a row index times the row stride
    # overflows int32 in a large pool
    if MODE == 2 or MODE == 6:  # CANARY (CANARY_POISON): the guard slot of every row
        bad = tl.zeros([HD_TILE], tl.int32)
        row = base + guard_offset
        for _ in range(0, num_rows):
            for h0 in range(0, HD, HD_TILE):
                m = (h0 + e) < HD
                bits = tl.load(row + h0 + e, mask=m, other=CANARY_BITS)
                bad = bad | (bits != CANARY_BITS).to(tl.int32)
            row += stride_row
        tl.store(ring_ptr + out_at + pid, tl.max(bad, 0).to(tl.int64))
    if MODE != 2:
        s = tl.arange(0, BS_TILE)
        digest = tl.zeros([BS_TILE, HD_TILE], tl.int64)
        for s0 in range(0, BS, BS_TILE):
            slots = s0 + s
            counts = tl.zeros([BS_TILE], tl.int64)
            per_slot = tl.zeros([BS_TILE, HD_TILE], tl.int64)
            row = base
            first = tl.full([], 0, tl.int64)  # the row's first element in the digest's order
            slot_first = tl.full([], 0, tl.int64)  # the same in a slot's own digest (SLOTS)
            for _ in range(0, num_rows):
                for h0 in range(0, HD, HD_TILE):
                    cols = h0 + e
                    m = (slots[:, None] < BS) & (cols[None, :] < HD)
                    offs = slots[:, None] * HD + cols[None, :]
                    if MODE == 3 or MODE == 6:  # POISON (CANARY_POISON)
                        fill = tl.full([BS_TILE, HD_TILE], POISON_BITS, kv_ptr.dtype.element_ty)
                        tl.store(row + offs, fill, mask=m)
                    else:
                        bits = tl.load(row + offs, mask=m, other=POISON_BITS)
                        if MODE == 0 or MODE == 5:  # DIGEST (DIGEST_SLOTS)
                            coef = ((first + offs) * MUL + ADD) | 1
                            digest += tl.where(m, bits.to(tl.int64) * coef, 0)
                        if MODE == 4 or MODE == 5:  # SLOTS (DIGEST_SLOTS)
                            coef = ((slot_first + cols[None, :]) * MUL + ADD) | 1
                            per_slot += tl.where(m, bits.to(tl.int64) * coef, 0)
                        if MODE == 1:  # COUNTS
                            counts += tl.sum((bits != POISON_BITS).to(tl.int64), 1)
                row += stride_row
                first += BS * HD
                slot_first += HD
            if MODE == 1:
                tl.store(ring_ptr + out_at + pid * BS + slots, counts, mask=slots < BS)
            if MODE == 4:
                tl.store(ring_ptr + out_at + pid * BS + slots, tl.sum(per_slot, 1), mask=slots < BS)
            if MODE == 5:
                at = out_at + pid * (BS + 1) + 1
                tl.store(ring_ptr + at + slots, tl.sum(per_slot, 1), mask=slots < BS)
        if MODE == 0:
            tl.store(ring_ptr + out_at + pid, tl.sum(tl.sum(digest, 1), 0))
        if MODE == 5:
            tl.store(ring_ptr + out_at + pid * (BS + 1), tl.sum(tl.sum(digest, 1), 0))


def raw_stream(device: torch.device) -> int:
    """The current stream's raw handle on `device`, as Triton's launcher takes it (a Stream
    object costs the host several microseconds a call)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def poison_bits(dtype: torch.dtype) -> int:
    """The bits a poisoned element holds: NaN of `dtype` as the integer of its width (`int_view`:
    signed for 2, 4 and 8 bytes), as the kernels load and compare it."""
    return int(int_view(torch.full((1,), float("nan"), dtype=dtype))[0])


class Checks:
    """The check kernel bound to one pool tensor and one ring, its arguments worked out once:
    a probe launches it in every allocation, publication and release, where each microsecond
    of the host's counts."""

    def __init__(self, kv_cache: torch.Tensor, ring: torch.Tensor, block_size: int):
        assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, H, D]"
        layers, _, _, slots, heads, head_dim = kv_cache.shape
        assert kv_cache.stride(3) == heads * head_dim and kv_cache.stride(4) == head_dim
        assert kv_cache.stride(5) == 1 and kv_cache.stride(0) == 2 * kv_cache.stride(1)
        assert 0 < block_size <= slots and ring.dtype == torch.int64
        self.ring = ring
        self.block_size = block_size
        bits = int_view(kv_cache)
        width = kv_cache.element_size()
        hd = heads * head_dim
        bs_tile = min(triton.next_power_of_2(block_size), 64)
        floating = kv_cache.is_floating_point()
        # the kernel's arguments but the ring offsets, and its constants by mode, in its order
        self._head = (bits, ring)
        self._tail = (layers * 2, bits.stride(1), bits.stride(2), (slots - 1) * bits.stride(3))
        self._consts = {
            mode: dict(
                MODE=mode,
                BS=block_size,
                HD=hd,
                BS_TILE=bs_tile,
                HD_TILE=min(triton.next_power_of_2(hd), max(16, 4096 // bs_tile)),
                POISON_BITS=poison_bits(kv_cache.dtype) if floating else 0,
                CANARY_BITS=canary_loaded(kv_cache.dtype) if width <= 4 else 0,
                MUL=DIGEST_MUL,
                ADD=DIGEST_ADD,
            )
            for mode in MODES
        }
        self._compiled: dict[int, Any] = {}
        # mode -> launch(num_blocks, raw stream, ids_at, out_at) straight through Triton's
        # launcher (`_direct`), where it gave the JIT's answer at warm-up
        self._direct: dict[int, Callable[[int, int, int, int], None]] = {}
        self._device = kv_cache.device
        # block 0's raw digest through the JIT at warm-up (what a launch made elsewhere must
        # give: devicechecks' C core), or None
        self.block0_digest: int | None = None

    def launch(
        self, mode: int, ids_at: int, num_blocks: int, out_at: int, stream: int | None = None
    ) -> None:
        """Check `mode` of the blocks whose ids are `ring[ids_at:]`, the answer into
        `ring[out_at:]` (answer_words); launched, not waited for, on the current stream
        (`stream`: its raw handle, where the caller has it)."""
        if not num_blocks:
            return
        direct = self._direct.get(mode)
        if direct is not None:
            direct(
                num_blocks, raw_stream(self._device) if stream is None else stream, ids_at, out_at
            )
            return
        compiled = self._compiled.get(mode)
        if compiled is not None:
            consts = self._consts[mode].values()
            compiled[(num_blocks, 1, 1)](*self._head, ids_at, out_at, *self._tail, *consts)
        else:
            _check_kernel[(num_blocks,)](
                *self._head, ids_at, out_at, *self._tail, **self._consts[mode], num_warps=4
            )

    def warm_up(self, modes: list[int]) -> None:
        """Compile (or load from Triton's cache) each mode, on a GPU without launching it, and
        launch it from then on through its compiled kernel where that gives the same answer.

        Triton's JIT launcher works out each call's specialization from its arguments again
        (a launch cost the H200 machine's host 25 us through it, 13 us without); here they
        are the same every call, so the compiled kernel is called directly, and, where that
        agrees too, straight through its launcher (`_direct`). Their calling conventions (the
        constants after the arguments, the launcher's leading arguments) are Triton's, not
        documented ones: a digest of block 0 taken each way must agree with the JIT's, or
        the launches stay with the last way that did.
        """
        self._compiled, self._direct = {}, {}
        compiled = {}
        for mode in sorted({*modes, DIGEST}):  # (the digest for the comparison below)
            compiled[mode] = _check_kernel.warmup(
                *self._head, 0, 1, *self._tail, grid=(1,), **self._consts[mode], num_warps=4
            )
        if not self.ring.is_pinned():
            return
        ring = self.ring
        keep = ring[:4].clone()
        ring[:4] = torch.tensor([0, -1, -1, -1])  # block 0's id, and its digest taken 3 ways
        self.launch(DIGEST, 0, 1, 1)
        direct: dict[int, Callable[[int, int, int, int], None]] = {}
        try:
            digest = compiled[DIGEST]
            digest[(1, 1, 1)](*self._head, 0, 2, *self._tail, *self._consts[DIGEST].values())
            try:
                direct = {mode: self._launcher(c, mode) for mode, c in compiled.items()}
                direct[DIGEST](1, raw_stream(self._device), 0, 3)
            except (TypeError, ValueError, RuntimeError, AttributeError):
                direct = {}
            torch.cuda.synchronize()
            jit, via_compiled, via_direct = (int(x) for x in ring[1:4])
            self.block0_digest = jit
            same = via_compiled == jit != -1
            direct = direct if same and via_direct == jit else {}
        except (TypeError, ValueError, RuntimeError, AttributeError):
            same = False
        finally:
            ring[:4] = keep
        self._compiled = compiled if same else {}
        self._direct = direct

    def _launcher(self, compiled: Any, mode: int) -> Callable[[int, int, int, int], None]:
        """A launch of `compiled` straight through Triton's launcher, the pointers as integers:
        what `compiled[grid](...)` does per call is left out (a new closure, the current
        device's stream looked up, launch metadata built for the launch hooks, and, per
        tensor, its data pointer asked for and checked with the driver). A profiler's launch
        hooks (Triton's `knobs.runtime.launch_enter_hook`) do not see these launches."""
        compiled._init_handles()
        run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
        head = tuple(t.data_ptr() for t in self._head)
        tail = (*self._tail, *self._consts[mode].values())

        def launch(num_blocks: int, stream: int, ids_at: int, out_at: int) -> None:
            run(
                num_blocks,
                1,
                1,
                stream,
                function,
                meta,
                None,
                None,
                None,
                *head,
                ids_at,
                out_at,
                *tail,
            )

        return launch

    def native_launch(self, ring: torch.Tensor) -> dict[str, Any] | None:
        """What a launch of the compiled modes from C needs (allocator/csrc/devchecks.c:
        cuLaunchKernel), with `ring` for this one's: per mode (MODES)
        the function handle, threads and shared memory; the kernel's parameters in its order
        (sizes, values), and which two take the ids' and the answer's ring offsets (a mode not
        compiled: handle 0, which the core never launches). None where no mode is compiled, a
        compiled one is not plain (one CTA, no scratch memory, no cooperative or dependent
        launch), or a parameter is of a type not known here.

        A kernel's parameters are its arguments less its constants (constexprs, and what Triton
        specialized away), in order, then Triton's hidden scratch pointers (passed as null by
        the C core): Triton's conventions, not documented ones, so devicechecks compares a
        digest launched that way with block0_digest before it uses them."""
        modes = MODES
        if not self._direct or not ring.is_pinned():
            return None
        values = {
            "kv_ptr": self._head[0].data_ptr(),
            "ring_ptr": ring.data_ptr(),
            "ids_at": 0,
            "out_at": 0,
            **dict(zip(("num_rows", "stride_row", "stride_n", "guard_offset"), self._tail)),
        }
        spec = None
        out: dict[str, Any] = {"functions": [], "threads": [], "shared": []}
        for mode in modes:
            compiled = self._compiled.get(mode)
            if compiled is None:  # (a mode the handle's probes never check: no handle, 0)
                for key in out:
                    out[key].append(0)
                continue
            try:
                compiled._init_handles()
                meta = compiled.metadata
                plain = getattr(meta, "num_ctas", 1) == 1 and not any(
                    getattr(meta, name, 0)
                    for name in (
                        "global_scratch_size",
                        "profile_scratch_size",
                        "launch_cooperative_grid",
                        "launch_pdl",
                    )
                )
                plain &= tuple(getattr(meta, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) == (1, 1, 1)
                params = _parameters(compiled)
            except (AttributeError, TypeError, ValueError, KeyError):
                return None
            if not plain or params is None or (spec is not None and params != spec):
                return None
            spec = params
            out["functions"].append(int(compiled.function))
            out["threads"].append(int(meta.num_warps) * 32)
            out["shared"].append(int(meta.shared))
        if spec is None:
            return None
        names = [name for name, _ in spec]
        if not {"ids_at", "out_at"} <= set(names) or not set(names) <= set(values):
            return None
        return {
            "functions": tuple(out["functions"]),
            "threads": tuple(out["threads"]),
            "shared": tuple(out["shared"]),
            "param_sizes": tuple(size for _, size in spec),
            "param_values": tuple(values[name] for name in names),
            "ids_param": names.index("ids_at"),
            "out_param": names.index("out_at"),
        }


# the bytes of a kernel parameter of each Triton type the check kernel's can have
_PARAM_BYTES = {"i32": 4, "u32": 4, "i64": 8, "u64": 8}


def _parameters(compiled: Any) -> list[tuple[str, int]] | None:
    """(name, bytes) of each parameter of a compiled check kernel, in order: its arguments less
    the constants (Triton's ASTSource signature and constants); None for a type not known."""
    src = compiled.src
    names = list(src.fn.arg_names)

    def name_of(key: Any) -> str:
        if isinstance(key, tuple):
            key = key[0]
        return names[key] if isinstance(key, int) else key

    constants = {name_of(k) for k in getattr(src, "constants", {})}
    out = []
    for key, ty in src.signature.items():
        name = name_of(key)
        if ty == "constexpr" or name in constants:
            continue
        size = 8 if ty.startswith("*") else _PARAM_BYTES.get(ty)
        if size is None:
            return None
        out.append((name, size))
    return out


def run_check(kv_cache: torch.Tensor, ids: list[int], mode: int, block_size: int) -> torch.Tensor:
    """The answer of check `mode` of blocks `ids` (int64, waited for): the kernel through a
    buffer of its own, for tests and one-off use."""
    n = len(ids)
    ring = torch.zeros(n + answer_words(mode, n, block_size), dtype=torch.int64)
    ring[:n] = torch.as_tensor(ids, dtype=torch.int64)
    if kv_cache.is_cuda:
        ring = ring.pin_memory()
    Checks(kv_cache, ring, block_size).launch(mode, 0, n, n)
    if kv_cache.is_cuda:
        torch.cuda.current_stream(kv_cache.device).synchronize()
    return ring[n:].clone()
