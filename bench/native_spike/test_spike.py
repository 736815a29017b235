"""Correctness of the spike: operations, consistency, and crash rollback at every journaled write."""
import os, random, signal, sys, uuid
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvcore
from nativepool import NativePool, check, BS

def test_ops(c_api=False):
    p = NativePool(uuid.uuid4().hex[:8], 65536, c_api=c_api)
    try:
        rng = random.Random(1)
        live = []
        for i in range(3000):
            r = rng.random()
            if (r < 0.4 and len(live) < 150) or not live:
                toks = [rng.randrange(30000) for _ in range(rng.randint(1, 300))]
                s = p.allocate(f"r{i}", toks)
                assert len(s.block_table) == -(-len(toks) // BS)
                b = p.blocks()
                assert (b["state"][s.block_table] == 1).all() and (b["refcount"][s.block_table] == 1).all()
                flat = b["tokens"][s.block_table].reshape(-1)[: len(toks)]
                assert flat.tolist() == toks
                live.append((s, toks))
            elif r < 0.8:
                s, toks = rng.choice(live)
                new = [rng.randrange(30000) for _ in range(rng.randint(1, 20))]
                p.append(s, new)
                toks += new
                b = p.blocks()
                assert b["tokens"][s.block_table].reshape(-1)[: len(toks)].tolist() == toks
                assert s.num_tokens == len(toks) and len(s.block_table) == -(-len(toks) // BS)
            else:
                s, _ = live.pop(rng.randrange(len(live)))
                p.free(s)
            if i % 500 == 0:
                errs = check(p, [s.block_table for s, _ in live])
                assert not errs, errs
        # full blocks carry a prefix key, a chain: parent of block j is the key of block j-1
        s, toks = max(live, key=lambda x: len(x[1]))
        b = p.blocks()
        keys = b["prefix_hash"][s.block_table].tolist(); parents = b["parent_hash"][s.block_table].tolist()
        full = len(toks) // BS
        assert all(k != 0 for k in keys[:full]) and parents[0] == 0
        assert all(parents[j] == keys[j - 1] for j in range(1, full)), "chain"
        for s, _ in live:
            p.free(s)
        assert not check(p), check(p)
        try:
            p._free(0, [1]); raise AssertionError("free of a dead slot accepted")
        except ValueError:
            pass
        try:
            p.free(s); raise AssertionError("double free of a handle accepted")
        except Exception:
            pass
        print(f"ops ok (c_api={c_api}):", p.core.stats())
    finally:
        p.close()

def region_snapshot(p):
    raw = np.frombuffer(p.mm, np.uint8)
    o = p.off
    # everything but the lock records (a dead holder stays named: recovery clears it) and the
    # crashed client's journal/seq/op bookkeeping
    c1 = o["clients"] + o["client_rec"]
    return (raw[o["blocks"]: o["clients"]].copy(), raw[:o["locks"]].copy(),
            raw[c1 + 40: c1 + 44].copy(), raw[c1 + 64: c1 + 64 + 4 * 64].copy())

def test_crash(points=200):
    """A child (client 1) allocates / frees / appends, SIGKILLed at its n-th journal save; the
    parent rolls its journal back and the segment must equal the pre-operation bytes."""
    p = NativePool(uuid.uuid4().hex[:8], 1024)
    try:
        fired = {}
        for op, n in [(op, n) for op in (0, 1, 2) for n in range(1, points + 1)]:
            if fired.get(op, (0, False))[1]:
                continue  # this op already ran to completion: every save point is covered
            # warm child state: first run each op without a crash to learn nothing; simple: each
            # child does a fixed script; the parent snapshots before the child's crashing op.
            r, w = os.pipe()
            r2, w2 = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    os.close(w2)
                    q = NativePool(p.name, 1024, create=False, client=1)
                    s1 = q.allocate("pre", list(range(40)))
                    q.append(s1, [7] * 24)  # 64 tokens: the next append opens a block
                    os.write(w, b"x")  # the parent snapshots now
                    os.read(r2, 1)
                    q.core.set_crash(n)
                    if op == 0:
                        q.allocate("big", list(range(64 * BS)))
                    elif op == 1:
                        q.free(s1)
                    else:
                        q.append(s1, [5])  # journaled (a new block); the in-block decode step is not journaled, as in kvscope
                finally:
                    os._exit(0)
            os.close(r2)
            os.close(w)
            os.read(r, 1)
            snap = region_snapshot(p)
            os.write(w2, b"g")
            os.close(w2)
            _, status = os.waitpid(pid, 0)
            os.close(r)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            nroll = p.core.rollback_client(1)
            after = region_snapshot(p)
            same = all((a == b).all() for a, b in zip(snap, after))
            if killed:
                assert same, f"op {op} crash at save {n}: segment differs after rollback ({nroll} entries)"
                fired[op] = (fired.get(op, (0, False))[0] + 1, False)
            else:
                fired[op] = (fired.get(op, (0, False))[0], True)
            # clean up: the child's blocks and slots leak in this test; reset the whole pool
            for i, name in enumerate(("seqs", "free")):
                lo = p.off["locks"] + 96 * i
                np.frombuffer(p.mm, np.int32, 1, lo + 24)[0] = 0
            p.core.init_segment()
        names = {0: "allocate 64 blocks", 1: "free 4 blocks", 2: "append opening a block"}
        for op, (k, done) in fired.items():
            assert done, f"op {op}: more than {points} save points"
            print(f"crash test ok: {names[op]}: SIGKILL at each of its {k} journal saves, rollback restored the exact bytes")
    finally:
        p.close()

if __name__ == "__main__":
    test_ops()
    test_ops(c_api=True)
    test_crash()
