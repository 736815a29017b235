"""kvscope top at scale: TUI-process CPU at 10 Hz on a 100k-block pool, and the pool user's
throughput with and without the TUI attached.

    python bench/bench_top.py [--blocks 100000] [--hz 10] [--phase-s 10] [--rounds 3]

A pool user process runs allocate / append / free in a loop over a pool kept about 60% full;
phases without and with `kvscope top` (TopApp, as run_top runs it, in a 160x48 pseudo-terminal,
output drained) alternate, and each phase reports the user's operations per second; the TUI's
CPU is read from /proc/PID/stat over each attached phase, and the frames it showed meanwhile
from its `num_frames` (written on SIGUSR1): a TUI starved of CPU shows fewer frames and so
spends less, which CPU per frame tells apart. Results go to stdout as one JSON object.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import pty
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.segment import data_path, segment_path


def user(name: str, counter, stop, ready) -> None:
    """Hold ~60% of the pool in long sequences, then allocate/append/free short ones in a loop."""
    pool = KVPool.attach(name)
    n = pool.config.num_blocks
    bs = pool.block_size
    held = [
        pool.allocate(f"held-{i}", list(range(i, i + 20 * bs))) for i in range(int(0.6 * n) // 20)
    ]
    ready.set()
    i = 0
    while not stop.is_set():
        seq = pool.allocate(f"req-{i}", list(range(i % 1000, i % 1000 + 3 * bs)))
        for t in range(bs):
            pool.append(seq, [t])
        pool.free(seq)
        i += 1
        if i % 20 == 0:
            counter.value = i
    counter.value = i
    for s in held:
        pool.free(s)
    pool.close()


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_top(
    name: str, hz: float, frames_path: str, cols: int = 160, rows: int = 48
) -> tuple[subprocess.Popen, int]:
    """The TUI as run_top runs it, in a pseudo-terminal of cols x rows whose output a thread
    drains; on SIGUSR1 it appends the number of frames it has shown to `frames_path` (a first
    line once it listens)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows))
    code = f"""
import signal
from kvscope.tui.app import TopApp
from kvscope.tui.source import open_source

source = open_source({name!r})
app = TopApp(source, hz={hz})

def frames(*_):
    with open({frames_path!r}, "a") as f:
        f.write(f"{{app.num_frames}}\\n")

signal.signal(signal.SIGUSR1, frames)
frames()
app.run()
source.close()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)

    def drain() -> None:
        try:
            while os.read(master, 65536):
                pass
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    return proc, master


def main(argv: list[str] | None = None) -> int:
    """Run the phases and print the figures as JSON."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--phase-s", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    args = ap.parse_args(argv)
    name = f"bench-top-{os.getpid()}"
    pool = KVPool.create(
        name,
        PoolConfig(num_blocks=args.blocks, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8),
    )
    ctx = mp.get_context("spawn")
    counter, stop, ready = ctx.Value("q", 0, lock=False), ctx.Event(), ctx.Event()
    worker = ctx.Process(target=user, args=(name, counter, stop, ready))
    worker.start()
    ready.wait()
    rates: dict[str, list[float]] = {"without": [], "with": []}
    cpu: list[float] = []
    fps: list[float] = []
    frames_path = os.path.join(tempfile.mkdtemp(prefix="bench-top-"), "frames")
    try:
        for _ in range(args.rounds):
            for attached in (False, True):
                top = master = None
                if attached:
                    top, master = start_top(name, args.hz, frames_path)
                    while not os.path.exists(frames_path) and top.poll() is None:
                        time.sleep(0.05)
                    time.sleep(args.warmup_s)
                    c0 = proc_cpu_s(top.pid)
                    top.send_signal(signal.SIGUSR1)
                else:
                    time.sleep(1.0)
                n0, t0 = counter.value, time.perf_counter()
                time.sleep(args.phase_s)
                n1, t1 = counter.value, time.perf_counter()
                rates["with" if attached else "without"].append((n1 - n0) / (t1 - t0))
                if top is not None:
                    cpu.append((proc_cpu_s(top.pid) - c0) / (t1 - t0))
                    top.send_signal(signal.SIGUSR1)
                    time.sleep(0.2)
                    with open(frames_path) as f:
                        f0, f1 = (int(x) for x in f.read().split()[-2:])
                    fps.append((f1 - f0) / (t1 - t0))
                    os.unlink(frames_path)
                    os.write(master, b"q")
                    try:
                        top.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        top.kill()
                        top.wait()
                    os.close(master)
    finally:
        stop.set()
        worker.join(timeout=60)
        pool.close()
        for p in (segment_path(name), data_path(name)):
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(os.path.dirname(frames_path), ignore_errors=True)
    without, with_ = statistics.median(rates["without"]), statistics.median(rates["with"])
    out = {
        "blocks": args.blocks,
        "hz": args.hz,
        "phase_s": args.phase_s,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "tui_cpu_core_fraction": [round(c, 4) for c in cpu],
        "tui_cpu_median": round(statistics.median(cpu), 4),
        "tui_frames_per_s": [round(f, 2) for f in fps],
        "tui_cpu_ms_per_frame": [round(1e3 * c / f, 2) for c, f in zip(cpu, fps) if f],
        "user_ops_per_s_without": [round(r, 1) for r in rates["without"]],
        "user_ops_per_s_with": [round(r, 1) for r in rates["with"]],
        "throughput_change": round(with_ / without - 1, 4),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
