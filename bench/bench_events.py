"""`kvscope events check` throughput, and `events record` against vLLM's own publisher.

    python bench/bench_events.py check [--events N] [--runs R] [--pure]
    python bench/bench_events.py record --vllm DIR [--rate 100000] [--seconds 5] [--batch 50]

check: a recorded stream of N events (default 1,000,000) shaped like vLLM's block pool's
(kvscope's encoder, tagged maps, int hashes, 16-token blocks): requests storing chains of 1-8
blocks under shared prefixes, evictions one block per BlockRemoved, a second copy now and then;
written once, then checked R times end to end (read, decode, check): events/s per run, by the
wall clock and per second of the process's CPU time (what a loaded machine does not change
much), with the load average. The check reads the file with the compiled path
(kvscope/csrc/kvevents.c) where it is built, and says so; `--pure` measures the checker
without it (msgspec and Python for every event).

record: tests/vllm_events_driver.py publishes `--rate` events/s in batches of `--batch`
through vLLM's ZmqEventPublisher (installed as bench/peer_vllm.py says) for `--seconds`;
`kvscope events record` records them; the file is then checked for gaps and counted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_stream(path: str, num_events: int) -> int:
    """A vLLM-shaped stream of about num_events events; the number written."""
    from kvscope.events.streamfile import PUBLISHED, StreamWriter
    from kvscope.events.wire import Encoder

    enc = Encoder(maps=True)
    rng = random.Random(1)
    w = StreamWriter(path, {"endpoints": ["tcp://127.0.0.1:5557"], "topic": ""})
    stored: list[int] = []
    next_hash = 1
    seq = 0
    written = 0
    while written < num_events:
        events = []
        for _ in range(rng.randrange(1, 40)):
            if stored and (len(stored) > 4000 or rng.random() < 0.45):
                h = stored.pop(rng.randrange(len(stored)))
                events.append(enc.removed([h], group=0))
            else:
                n = rng.randrange(1, 9)
                parent = stored[-1] if stored and rng.random() < 0.7 else None
                hashes = list(range(next_hash, next_hash + n))
                next_hash += n
                events.append(enc.stored(hashes, parent, [7] * (16 * n), 16, group=0))
                stored.extend(hashes)
        w.write(time.time_ns(), PUBLISHED, 0, enc.message(seq, enc.payload(events, ts=seq)))
        seq += 1
        written += len(events)
    w.close()
    return written


def bench_check(num_events: int, runs: int, pure: bool) -> None:
    from kvscope.events.checker import StreamChecker, check_file

    if pure:
        StreamChecker.native = None
    print(f"checker: {'compiled path' if StreamChecker.native is not None else 'pure Python'}")

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.kvev")
        n = write_stream(path, num_events)
        size = os.path.getsize(path)
        print(f"stream: {n:,} events, {size / 2**20:.1f} MiB")
        rates, cpu_rates = [], []
        for _ in range(runs):
            t, c = time.perf_counter(), time.process_time()
            report = check_file(path)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            assert report["summary"]["events"] == n and report["healthy"], report["summary"]
            rates.append(n / dt)
            cpu_rates.append(n / dc)
            # the CPU time says what the check costs when other processes share the cores
            print(
                f"  check: {n / dt:,.0f} events/s ({dt:.2f} s), {n / dc:,.0f} per CPU second"
                f" ({dc:.2f} s); load average {os.getloadavg()[0]:.2f}"
            )
        print(
            f"events check: median {statistics.median(rates):,.0f} events/s,"
            f" min {min(rates):,.0f}, max {max(rates):,.0f} over {runs} runs;"
            f" per CPU second median {statistics.median(cpu_rates):,.0f},"
            f" min {min(cpu_rates):,.0f}, max {max(cpu_rates):,.0f}"
        )


def bench_record(vllm: str, rate: float, seconds: float, batch: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_events_vllm import record_vllm  # type: ignore[import-not-found]

    from kvscope.events.checker import check_file

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rec.kvev"
        t = time.perf_counter()
        batches, events = record_vllm(
            vllm, out, "--rate", str(rate), "--seconds", str(seconds), "--batch", str(batch)
        )
        report = check_file(str(out))
        s = report["summary"]
        print(
            f"published {events:,} events in {batches:,} batches over {seconds} s"
            f" ({events / seconds:,.0f}/s asked {rate:,.0f}/s); recorded {s['events']:,} events,"
            f" {s['batches']:,} batches, gaps {s['gaps']}, replayed {s['replayed']},"
            f" findings {s['findings_by_kind']} ({time.perf_counter() - t:.0f} s with vLLM's import)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check")
    c.add_argument("--events", type=int, default=1_000_000)
    c.add_argument("--runs", type=int, default=5)
    c.add_argument("--pure", action="store_true", help="without the compiled path")
    r = sub.add_parser("record")
    r.add_argument("--vllm", required=True, help="folder vLLM is installed in")
    r.add_argument("--rate", type=float, default=100_000)
    r.add_argument("--seconds", type=float, default=5.0)
    r.add_argument("--batch", type=int, default=50)
    args = ap.parse_args()
    if args.what == "check":
        bench_check(args.events, args.runs, args.pure)
    else:
        bench_record(args.vllm, args.rate, args.seconds, args.batch)


if __name__ == "__main__":
    main()
