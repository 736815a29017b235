"""Drive vLLM's own v1 BlockPool with KV events on and publish them with vLLM's ZmqEventPublisher.

Run by tests/test_events_vllm.py and bench/bench_events.py in a process of its own, with the
folder vLLM was installed into (bench/peer_vllm.py says how) first on sys.path:

    python tests/vllm_events_driver.py VLLM_DIR PUB_PORT REPLAY_PORT [--steps N] [--full] \
        [--rate EVENTS_PER_S] [--batch EVENTS]

It prints `ready` once vLLM is imported and the sockets are bound (then runs `--early` steps,
which no subscriber can see), and `accepted` once a
subscriber's subscription has arrived, waits for `go` on stdin, runs the
workload, prints `done BATCHES EVENTS`, and waits for `quit` (the replay socket stays up until
then). Workload (seeded, deterministic): requests drawn from a few shared prompts, admitted
as vLLM's FullAttentionManager does (prefix hits up to the first miss, `touch`, new blocks,
`cache_full_blocks`), decoded a token at a time, freed in reverse; a 64-block pool, so cached
blocks are evicted; two requests with one prompt admitted in one step store the same hashes
twice (two physical copies); `--full` re-reports prefix hits (vLLM's "full" report mode); in
the middle, everything is freed and `reset_prefix_cache` clears the cache (AllBlocksCleared).
With `--rate`, the driver instead publishes synthetic batches of `--batch` BlockStored and
BlockRemoved events built with vLLM's own event classes as fast as asked, for the recorder's
throughput target.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("vllm_dir")
    ap.add_argument("pub_port", type=int)
    ap.add_argument("replay_port", type=int)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--early", type=int, default=0, help="steps run before any subscriber")
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=50)
    args = ap.parse_args()
    sys.path.insert(0, args.vllm_dir)
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    import zmq

    pub = kv_events.ZmqEventPublisher(
        0,
        endpoint="inproc://replaced-below",
        replay_endpoint=f"tcp://*:{args.replay_port}",
    )
    # When a subscriber's subscription has arrived: vLLM's PUB socket swapped for an XPUB with
    # its high-water mark on the TCP port, which sends the same frames and also receives the
    # subscriptions (a subscription that has not arrived yet loses what is sent before it).
    assert pub._pub is not None
    pub._pub.close(linger=0)
    pub._pub = pub._ctx.socket(zmq.XPUB)
    pub._pub.set_hwm(pub._hwm)
    pub._pub.bind(f"tcp://*:{args.pub_port}")
    workload = None if args.rate else Workload(args.full)

    def publish(events: list) -> None:
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=events))

    print("ready", flush=True)
    early = (0, 0)
    if workload is not None and args.early:
        early = workload.run(args.early, publish)
    # The publisher thread is idle once every queued batch is sent: the socket is ours to read.
    pub._event_queue.join()
    while pub._pub.recv()[:1] != b"\x01":
        pass
    print("accepted", flush=True)
    for line in sys.stdin:
        if line.strip() == "go":
            break
    if workload is None:
        batches, events = synthetic(kv_events, publish, args.rate, args.seconds, args.batch)
    else:
        batches, events = workload.run(args.steps, publish)
        batches, events = batches + early[0], events + early[1]
    # The publisher thread sends what is queued; wait for it before saying done.
    while not pub._event_queue.empty():
        time.sleep(0.01)
    print(f"done {batches} {events}", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    pub.shutdown()


def synthetic(kv_events, publish, rate: float, seconds: float, batch: int) -> tuple[int, int]:
    """Batches of `batch` events (half stores of fresh hashes, half their removals) at `rate`."""
    h = 1
    batches = events = 0
    start = time.perf_counter()
    tokens = list(range(16))
    while time.perf_counter() - start < seconds:
        evs = []
        for _ in range(batch // 2):
            evs.append(
                kv_events.BlockStored(
                    block_hashes=[h],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                )
            )
            evs.append(kv_events.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0))
            h += 1
        publish(evs)
        batches += 1
        events += len(evs)
        # keep to the rate: sleep while ahead of it
        ahead = events / rate - (time.perf_counter() - start)
        if ahead > 0:
            time.sleep(ahead)
    return batches, events


class Workload:
    """vLLM's BlockPool driven as its scheduler's FullAttentionManager drives it."""

    BLOCK_SIZE = 16

    def __init__(self, full: bool):
        self.block_pool = importlib.import_module("vllm.v1.core.block_pool")
        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        hashing = importlib.import_module("vllm.utils.hashing")
        self.request_mod = importlib.import_module("vllm.v1.request")
        self.sampling = importlib.import_module("vllm.sampling_params")
        fn = hashing.get_hash_fn_by_name("sha256")
        utils.init_none_hash(fn)
        self.hasher = utils.get_request_block_hasher(self.BLOCK_SIZE, fn)
        self.full = full
        self.new_pool()

    def new_pool(self) -> None:
        self.pool = self.block_pool.BlockPool(
            64, True, self.BLOCK_SIZE, enable_kv_cache_events=True
        )

    def request(self, rid: str, tokens: list[int]):
        return self.request_mod.Request(
            rid,
            tokens,
            self.sampling.SamplingParams(max_tokens=64),
            None,
            block_hasher=self.hasher,
        )

    def admit(self, req) -> tuple[list, int] | None:
        bs = self.BLOCK_SIZE
        pool = self.pool
        hits = []
        for i in range((req.num_tokens - 1) // bs):
            cached = pool.get_cached_block(req.block_hashes[i], [0])
            if not cached:
                break
            hits.append(cached[0])
        need = -(-req.num_tokens // bs) - len(hits)
        if need > pool.get_num_free_blocks() - len(hits):
            return None
        pool.touch(hits)
        if hits and self.full:
            pool.emit_cached_block_events(req, len(hits), bs, 0)
        blocks = hits + pool.get_new_blocks(need)
        num_full = req.num_tokens // bs
        pool.cache_full_blocks(req, blocks, len(hits), num_full, bs, 0)
        return blocks, num_full

    def run(self, steps: int, publish) -> tuple[int, int]:
        rng = random.Random(7)
        prompts = [[rng.randrange(1000) for _ in range(rng.randrange(20, 70))] for _ in range(6)]
        running: list[list] = []
        batches = events = 0
        rid = 0
        bs = self.BLOCK_SIZE
        for step in range(steps):
            if step == steps // 2:
                for item in running:
                    self.pool.free_blocks(reversed(item[1]))
                running = []
                assert self.pool.reset_prefix_cache()
            # admit: sometimes two requests with one prompt in one step (two copies)
            while len(running) < 4:
                p = rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]
                for _ in range(2 if rng.random() < 0.2 else 1):
                    rid += 1
                    req = self.request(f"r{rid}", list(p))
                    got = self.admit(req)
                    if got is None:
                        break
                    running.append([req, got[0], got[1], rng.randrange(4, 40)])
                if len(running) < 4 and got is None:
                    break
            # decode one token each
            for item in running:
                req, blocks = item[0], item[1]
                req.append_output_token_ids(rng.randrange(1000))
                if len(blocks) * bs < req.num_tokens:
                    if self.pool.get_num_free_blocks() == 0:
                        item[3] = 0
                        continue
                    blocks.extend(self.pool.get_new_blocks(1))
                if req.num_tokens % bs == 0:
                    num_full = req.num_tokens // bs
                    self.pool.cache_full_blocks(req, blocks, item[2], num_full, bs, 0)
                    item[2] = num_full
                item[3] -= 1
            for item in [x for x in running if x[3] <= 0]:
                self.pool.free_blocks(reversed(item[1]))
                running.remove(item)
            if step == steps - 1:
                for item in running:
                    self.pool.free_blocks(reversed(item[1]))
            evs = self.pool.take_events()
            if evs:
                publish(evs)
                batches += 1
                events += len(evs)
        return batches, events


if __name__ == "__main__":
    main()
