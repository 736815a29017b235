"""Publish a prefix cache's lifecycle with SGLang's own ZmqEventPublisher and record it.

Run by tests/test_events_sglang.py in a process of its own (SGLang's modules are loaded under
their own names), with the folder SGLang was installed into:

    python tests/sglang_events_driver.py SGLANG_DIR OUT.kvev [--fault FAULT] [--steps N]

SGLang's package `__init__` files import its whole runtime (torch, its kernels); its KV-event
module needs only msgspec, pyzmq, pydantic and its `runtime_context` and `utils.network`
modules (psutil). So the driver makes `sglang`, `sglang.srt`, `sglang.srt.utils`,
`sglang.srt.arg_groups` and `sglang.srt.disaggregation` plain packages of the installed
folders, their `__init__` not run, and imports `sglang.srt.disaggregation.kv_events` itself:
every line that runs is SGLang's own.

The workload (seeded, deterministic) is a radix cache of 4-token pages as SGLang's
`KVCacheEventRecorder` (mem_cache/events.py) reports one: a node's new pages as one
`BlockStored` chain whose parent is the page before them (None at the root), signed 64-bit
hashes (the first 16 hex digits of a page's sha256, as `hash_str_to_int64`), medium "GPU";
evicting a leaf page is a `BlockRemoved`; once, midway, `AllBlocksCleared`. Each step is one
`KVEventBatch` published by SGLang's publisher thread.

The driver subscribes (a plain SUB socket), publishes empty batches until one arrives (so no
batch after it is lost to a subscription still on its way), then the workload, and hands
every message it receives to kvscope's `Recorder` (`on_message`), which fills what it missed
from SGLang's replay socket: the heartbeats before the first one received, and the batch the
driver drops on purpose (`--fault lost-batch` drops it with no replay socket given, so it
stays lost). Faults planted in the stream: `remove-unstored` (a removal of a hash never
stored), `store-conflict` (a stored hash stored again over other tokens), `unknown-parent`
(a chain whose parent was never stored). Prints `done BATCHES EVENTS`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import random
import sys
import tempfile
import time
import types

PAGE = 4
CAPACITY = 48
SHELLS = (
    "sglang",
    "sglang.srt",
    "sglang.srt.utils",
    "sglang.srt.arg_groups",
    "sglang.srt.disaggregation",
)
RECV_TIMEOUT_MS = 10_000


def load_kv_events(folder: str):
    """SGLang's `sglang.srt.disaggregation.kv_events`, its packages' `__init__` not run."""
    sys.path.insert(0, folder)
    for name in SHELLS:
        shell = types.ModuleType(name)
        shell.__path__ = [os.path.join(folder, *name.split("."))]
        sys.modules[name] = shell
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def page_hash(parent_hex: str, tokens: list[int]) -> str:
    """A page's hash, chained on its parent's (sha256 hex)."""
    h = hashlib.sha256(parent_hex.encode())
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.hexdigest()


def as_int64(hex_digest: str) -> int:
    """The signed 64-bit event hash of a page (SGLang's `hash_str_to_int64`)."""
    value = int(hex_digest[:16], 16)
    return value - 2**64 if value >= 2**63 else value


class RadixPages:
    """The pages a radix cache holds: hash -> (parent hash, children, last use)."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.used: dict[int, int] = {}

    def insert(self, prompt: list[int], now: int, kv) -> list:
        """The BlockStored chain of the prompt's pages not cached yet (none if all are)."""
        parent_hex, parent = "", None
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        chain_parent = None
        for start in range(0, len(prompt) - len(prompt) % PAGE, PAGE):
            tokens = prompt[start : start + PAGE]
            hex_digest = page_hash(parent_hex, tokens)
            h = as_int64(hex_digest)
            if h not in self.parent:
                if not new_hashes:
                    chain_parent = parent
                self.parent[h] = parent
                self.children[h] = 0
                if parent is not None:
                    self.children[parent] += 1
                new_hashes.append(h)
                new_tokens.extend(tokens)
            self.used[h] = now
            parent_hex, parent = hex_digest, h
        if not new_hashes:
            return []
        return [
            kv.BlockStored(
                block_hashes=new_hashes,
                parent_block_hash=chain_parent,
                token_ids=new_tokens,
                block_size=PAGE,
                lora_id=None,
                medium=kv.StorageMedium.GPU,
            )
        ]

    def evict(self, kv) -> list:
        """Least recently used leaf pages until the cache fits, as one BlockRemoved."""
        gone: list[int] = []
        while len(self.parent) > CAPACITY:
            leaf = min((h for h, n in self.children.items() if n == 0), key=self.used.get)
            parent = self.parent.pop(leaf)
            del self.children[leaf], self.used[leaf]
            if parent is not None:
                self.children[parent] -= 1
            gone.append(leaf)
        return [kv.BlockRemoved(block_hashes=gone, medium=kv.StorageMedium.GPU)] if gone else []

    def clear(self, kv) -> list:
        self.parent.clear()
        self.children.clear()
        self.used.clear()
        return [kv.AllBlocksCleared()]


def workload(kv, steps: int, fault: str) -> list[list]:
    """Each step's events (one batch each), seeded."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([8, 12, 16]))] for _ in range(4)]
    cache = RadixPages()
    batches: list[list] = []
    for step in range(steps):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(2, 14))]
        events = cache.insert(prompt, step, kv) + cache.evict(kv)
        if step == steps // 2:
            events += cache.clear(kv)
        batches.append(events)
    last = batches[-1]
    if fault == "remove-unstored":
        last.append(kv.BlockRemoved(block_hashes=[12345], medium=kv.StorageMedium.GPU))
    elif fault == "store-conflict":
        # a page the cache holds at the end, under its own parent, over other tokens
        h = min(cache.parent)
        last.append(
            kv.BlockStored(
                block_hashes=[h],
                parent_block_hash=cache.parent[h],
                token_ids=[999_999] * PAGE,
                block_size=PAGE,
                lora_id=None,
                medium=kv.StorageMedium.GPU,
            )
        )
    elif fault == "unknown-parent":
        last.append(
            kv.BlockStored(
                block_hashes=[-77],
                parent_block_hash=-78,
                token_ids=[1] * PAGE,
                block_size=PAGE,
                lora_id=None,
                medium=kv.StorageMedium.GPU,
            )
        )
    return batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sglang_dir")
    ap.add_argument("out")
    ap.add_argument("--fault", default="")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    kv = load_kv_events(args.sglang_dir)
    import zmq

    from kvscope.events.recorder import Recorder

    where = tempfile.mkdtemp(prefix="kvscope-sglang-")
    endpoint, replay = f"ipc://{where}/pub", f"ipc://{where}/replay"
    pub = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    lost = args.fault == "lost-batch"
    rec = Recorder([endpoint], args.out, replay=None if lost else [replay])
    published = 0
    try:
        # Empty batches until one arrives: the subscription is then in place.
        while True:
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[]))
            published += 1
            if sub.poll(50):
                break
        batches = workload(kv, args.steps, args.fault)
        for events in batches:
            pub.publish(kv.KVEventBatch(ts=time.time(), events=events))
        published += len(batches)
        drop = published - len(batches) // 3  # a batch of the workload's first third
        while True:
            if not sub.poll(RECV_TIMEOUT_MS):
                raise SystemExit(f"no batch from SGLang's publisher in {RECV_TIMEOUT_MS} ms")
            frames = sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if seq != drop:
                rec.on_message(0, frames, time.time_ns())
            if seq == published - 1:
                break
    finally:
        rec.close()
        pub.shutdown()
        ctx.destroy(linger=0)
    stats = rec.stats
    print(f"done {published} {sum(len(b) for b in batches)} {stats.gaps} {stats.filled}")


if __name__ == "__main__":
    main()
