"""Stopping `kvscope run`: signals reach the script once, a script that ignores them is killed
after the grace period, a killed kvscope takes its script with it, and a process of the run that
outlives the script is reported. Real processes and real signals throughout."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from kvscope import stopper as stopper_module
from kvscope.allocator.dumpread import read_dump_header
from kvscope.allocator.process import is_alive
from kvscope.stopper import Stopper

pytestmark = pytest.mark.slow

KVSCOPE = os.path.join(os.path.dirname(sys.executable), "kvscope")
# Only ever an upper bound for something that happens anyway: never the outcome of a test.
PATIENCE_S = 120.0


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def start_run(tmp_path, body: str, *flags: str) -> subprocess.Popen[str]:
    """kvscope run on a script, its output in files (a process the script leaves behind may
    keep a pipe open long after kvscope has exited)."""
    script = tmp_path / "script.py"
    script.write_text("import os, signal, sys, time\nready = sys.argv[1]\n" + body)
    return subprocess.Popen(
        [KVSCOPE, "run", "--dump-dir", str(tmp_path), *flags, str(script), str(tmp_path / "ready")],
        stdout=open(tmp_path / "out", "w"),
        stderr=open(tmp_path / "err", "w"),
        text=True,
        start_new_session=True,
    )


def finish(run: subprocess.Popen[str], tmp_path) -> tuple[str, str]:
    """Wait for kvscope to exit; its stdout and stderr."""
    run.wait(timeout=PATIENCE_S)
    return (tmp_path / "out").read_text(), (tmp_path / "err").read_text()


def stopped(
    run: subprocess.Popen[str], tmp_path, signum: int, said: str | None = None
) -> tuple[str, str]:
    """Once the script is ready (or kvscope has `said` this on stderr), send kvscope `signum`
    and wait for it to exit; its stdout and stderr (the run's processes killed if the test
    fails first)."""
    try:
        if said is None:
            wait_for(lambda: (tmp_path / "ready").exists(), "the script to start")
        else:
            wait_for(lambda: said in (tmp_path / "err").read_text(), repr(said))
        run.send_signal(signum)
        return finish(run, tmp_path)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


def test_sigterm_is_forwarded_and_a_script_ignoring_it_is_killed(tmp_path):
    # GIVEN a script under kvscope run that ignores SIGTERM
    run = start_run(
        tmp_path,
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nopen(ready, 'w').close()\ntime.sleep(600)\n",
        "--stop-grace",
        "0.5",
    )
    # WHEN kvscope gets SIGTERM
    _, err = stopped(run, tmp_path, signal.SIGTERM)
    # THEN it forwarded it, and after the grace period killed the script: the run ends as
    # killed by SIGKILL
    assert "SIGTERM forwarded to the script" in err
    assert "killed it with SIGKILL" in err
    assert run.returncode == 128 + signal.SIGKILL


DEADLOCK = (
    "import threading\n"
    "a, b, both = threading.Lock(), threading.Lock(), threading.Barrier(2)\n"
    "def one():\n"
    "    with a:\n"
    "        both.wait()\n"
    "        with b:\n"  # line 8 of the script (start_run's two lines first)
    "            pass\n"
    "def two():\n"
    "    with b:\n"
    "        both.wait()\n"
    "        with a:\n"  # line 13
    "            pass\n"
    "threads = [threading.Thread(target=f) for f in (one, two)]\n"
    "for t in threads:\n"
    "    t.start()\n"
    "open(ready, 'w').close()\n"
    "for t in threads:\n"
    "    t.join()\n"
)


def test_a_deadlocked_script_that_outlives_the_grace_shows_its_threads_then_is_killed(tmp_path):
    # GIVEN a script whose two threads each hold the lock the other waits for
    run = start_run(tmp_path, DEADLOCK, "--stop-grace", "0.5")
    # WHEN kvscope gets SIGINT (the main thread's KeyboardInterrupt then waits for them)
    _, err = stopped(run, tmp_path, signal.SIGINT)
    # THEN before the kill kvscope shows where each of the script's threads waits: the two
    # lines of the deadlock, without kvscope's own threads and frames
    said = err.index("did not stop; its threads now")
    assert 'script.py", line 8 in one' in err[said:]
    assert 'script.py", line 13 in two' in err[said:]
    assert "watchdog" not in err[said:] and "bootstrap" not in err[said:]
    assert err.index("killed it with SIGKILL") > said
    assert run.returncode == 128 + signal.SIGKILL


def test_a_script_that_handles_sigterm_gets_it_once_and_ends_its_own_way(tmp_path):
    # GIVEN a script that counts SIGTERMs and exits 3 after its first
    body = (
        "got = []\n"
        "def on_term(n, f):\n"
        "    got.append(n)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "open(ready, 'w').close()\n"
        "while not got:\n"
        "    time.sleep(0.05)\n"
        "print('terms', len(got), flush=True)\n"
        "sys.exit(3)\n"
    )
    run = start_run(tmp_path, body)
    out, err = stopped(run, tmp_path, signal.SIGTERM)
    # THEN the script saw it and chose its exit status, which is the run's
    assert "terms 1" in out
    assert run.returncode == 3
    assert "killing" not in err


COUNTS_SIGINTS = (
    "got = []\n"
    "signal.signal(signal.SIGINT, lambda n, f: got.append(n))\n"
    "open(ready, 'w').close()\n"
    "while not got:\n"
    "    time.sleep(0.01)\n"
    "time.sleep(1.0)\n"  # (a forwarded copy comes within milliseconds)
    "print('sigints', len(got), flush=True)\n"
)


def test_a_signal_sent_to_the_whole_process_group_reaches_the_script_once(tmp_path):
    # GIVEN a script that counts its SIGINTs, in kvscope's process group (start_run makes
    # kvscope the group's leader)
    run = start_run(tmp_path, COUNTS_SIGINTS)
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), "the script to start")
        # WHEN something sends SIGINT to the whole group, as `timeout -s INT` and `kill --
        # -PGID` do
        os.killpg(run.pid, signal.SIGINT)
        out, err = finish(run, tmp_path)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    # THEN kvscope saw that the script got it and did not send another: the script ends its
    # own way
    assert "sent to the whole process group, so also to the script" in err
    assert "sigints 1" in out
    assert run.returncode == 0


def test_a_signal_sent_to_kvscope_alone_is_forwarded_once(tmp_path):
    # GIVEN the same script WHEN only kvscope gets SIGINT THEN the script gets one, forwarded
    out, err = stopped(start_run(tmp_path, COUNTS_SIGINTS), tmp_path, signal.SIGINT)
    assert "SIGINT forwarded to the script" in err
    assert "sigints 1" in out


def test_the_same_signal_from_the_same_sender_at_once_is_one_stop(monkeypatch):
    # (`timeout` sends its signal to kvscope, then to kvscope's group: kvscope may get it twice)
    # GIVEN a stopper that forwarded a SIGTERM from pid 4242 to a live script (the repeat's
    # window as long as the test's patience: never the outcome of the test)
    monkeypatch.setattr(stopper_module, "REPEAT_S", PATIENCE_S)
    lines: list[str] = []
    stopper = Stopper(lines.append, grace_s=PATIENCE_S)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
    )
    try:
        stopper.watch(proc)
        stopper.on_signal(signal.SIGTERM, from_terminal=False, sender=4242)
        # WHEN the same sender sends it again at once THEN it is the same stop
        stopper.on_signal(signal.SIGTERM, from_terminal=False, sender=4242)
        assert proc.poll() is None and len(lines) == 1
        # WHEN another process sends one THEN it is a second stop: the script is killed
        stopper.on_signal(signal.SIGTERM, from_terminal=False, sender=4343)
        assert proc.wait(timeout=PATIENCE_S) == -signal.SIGKILL
        assert "SIGTERM again: killed the script" in lines[-1]
    finally:
        proc.kill()
        proc.wait()
        if stopper._timer is not None:
            stopper._timer.cancel()


def test_a_terminal_ctrl_c_reaches_the_script_and_is_not_sent_again():
    # GIVEN a child that blocks SIGINT, so that a signal sent to it stays pending
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys\n"
         "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
         "print('ready', flush=True)\n"
         "sys.stdin.readline()\n"
         "print(sorted(signal.sigpending()), flush=True)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        lines: list[str] = []
        stopper = Stopper(lines.append, grace_s=PATIENCE_S)
        stopper.watch(child)  # type: ignore[arg-type]
        # WHEN kvscope learns of a SIGINT the terminal sent to the whole process group
        stopper.on_signal(signal.SIGINT, from_terminal=True)
        child.stdin.write("\n")
        child.stdin.flush()
        # THEN it does not send the script another one, and says the grace period started
        assert child.stdout.readline().strip() == "[]"
        assert "SIGINT sent to the script" in lines[0]
    finally:
        child.kill()
        child.wait()
        if stopper._timer is not None:
            stopper._timer.cancel()


def test_ctrl_c_at_a_terminal_stops_the_script(tmp_path):
    # GIVEN kvscope run in a terminal (a pty, its own session), running a script that waits
    script = tmp_path / "wait.py"
    script.write_text("import sys, time\nprint('script ready', flush=True)\ntime.sleep(600)\n")
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(KVSCOPE, [KVSCOPE, "run", "--dump-dir", str(tmp_path), str(script)])
    out = b""
    try:
        deadline = time.monotonic() + PATIENCE_S
        sent = False
        while True:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            if not sent and b"script ready" in out:
                # WHEN Ctrl-C is typed
                os.write(fd, b"\x03")
                sent = True
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
    text = out.decode(errors="replace")
    # THEN the script got KeyboardInterrupt, kvscope did not send a second SIGINT, and the run
    # ended with the script's failure
    assert "KeyboardInterrupt" in text
    assert "SIGINT sent to the script" in text
    assert os.waitstatus_to_exitcode(status) == 1


def _pool_script(pool_name: str, hold: bool, then: str) -> str:
    """A script body: a pool, a request holding blocks (`hold`) or none, then `then`."""
    return (
        "from kvscope.allocator import KVPool, PoolConfig\n"
        f"pool = KVPool.create({pool_name!r}, PoolConfig(num_blocks=16, block_size=4,"
        " num_layers=1, num_kv_heads=1, head_dim=4, dtype='float32'))\n"
        + ("seq = pool.allocate('stuck', [1, 2, 3, 4, 5])\n" if hold else "")
        + then
    )


# The stall's line (kvscope.supervisor), then the script's threads' stacks.
STALL = "the script looks hung (--hang-after)"


def test_a_script_whose_requests_hold_blocks_and_that_stops_operating_is_said_hung(
    tmp_path, pool_name
):
    # GIVEN a script whose request holds blocks, then whose two threads deadlock
    body = _pool_script(pool_name, True, DEADLOCK)
    run = start_run(tmp_path, body, "--hang-after", "1", "--stop-grace", "0.5")
    # WHEN no pool operation comes for a second and more
    _, err = stopped(run, tmp_path, signal.SIGTERM, said=STALL)
    # THEN the run says so once, naming the request that holds blocks, with the threads'
    # stacks: the two lines of the deadlock
    said = err.index(STALL)
    assert err.count(STALL) == 1
    assert "1 request(s) hold blocks ('stuck'; pid" in err[:said]
    stacks = err[said:]
    # (the lines of the script, start_run's two first: each thread's inner `with`)
    lines = ["", "", *body.splitlines()]
    one = lines.index("        with b:") + 1
    two = lines.index("        with a:") + 1
    assert f'script.py", line {one} in one' in stacks, stacks
    assert f'script.py", line {two} in two' in stacks, stacks
    # (each thread named as threading names it)
    assert re.search(r"Thread 0x[0-9a-f]+ 'Thread-\d+ \(one\)' \(most recent call first\)", stacks)
    assert "'MainThread' (most recent call first)" in stacks, stacks
    # AND the dump of the stopped script says it hung, after how it ended
    (dump,) = tmp_path.glob("*.kvd")
    reason = bytes(read_dump_header(str(dump))["reason"]).decode()
    assert reason.startswith("child pid ") and "; hung " in reason, reason
    assert "with 1 request(s) holding blocks" in reason, reason


WORKERS = (
    # a forked worker and a started one (`import kvscope` gives it the run's hooks), each
    # holding a request and waiting on a pipe nothing writes to
    "import subprocess\n"
    "r, w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    KVPool.attach(pool.name).allocate('forked', [1, 2])\n"
    "    os.read(r, 1)\n"  # line 10 of the script
    "started = subprocess.Popen([sys.executable, '-c', 'import os, sys\\n'\n"
    "    'from kvscope.allocator import KVPool\\n'\n"
    "    f'KVPool.attach({pool.name!r}).allocate(\"started\", [3])\\n'\n"
    "    'sys.stdin.read()\\n'], stdin=subprocess.PIPE)\n"
    "open(ready, 'w').close()\n"
    "os.read(r, 1)\n"
)


def test_a_hung_runs_workers_holding_requests_show_their_own_stacks(tmp_path, pool_name):
    # GIVEN a script holding a request, whose forked worker and started worker each hold one,
    # all three waiting on nothing
    body = _pool_script(pool_name, True, WORKERS)
    run = start_run(tmp_path, body, "--hang-after", "1", "--stop-grace", "0.5")
    # WHEN no pool operation comes for a second and more
    # (the started worker can take more than the second to start: a stall said before it
    # allocated is said again after)
    _, err = stopped(run, tmp_path, signal.SIGTERM, said="holds 'started'): its threads now")
    # THEN the stall names each process's stacks: the script's, and each worker's by its pid
    # and the request it holds, at the line it waits on
    said = err.index(STALL)
    stacks = err[said:]
    assert "kvscope: the script (pid " in stacks, stacks
    forked = stacks.index("holds 'forked'): its threads now:")
    assert 'script.py", line 10 in <module>' in stacks[forked:], stacks
    started = stacks.index("holds 'started'): its threads now:")
    assert '"<string>", line 4 in <module>' in stacks[started:], stacks


def test_a_dead_workers_requests_do_not_make_the_script_look_hung(tmp_path, pool_name):
    # GIVEN a script whose forked worker allocates and dies without its exit check (os._exit),
    # while the script itself holds no block and waits three seconds, under --hang-after 1
    body = _pool_script(
        pool_name,
        False,
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    w = KVPool.attach({pool_name!r})\n"
        "    w.allocate('orphan', [1, 2, 3, 4, 5])\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "open(ready, 'w').close()\n"
        "time.sleep(3)\n",
    )
    run = start_run(tmp_path, body, "--hang-after", "1")
    _, err = finish(run, tmp_path)
    # THEN its death is said, and no hang: nothing alive waits on the pool
    assert "died while attached to the pool" in err, err
    assert "looks hung" not in err, err


def test_a_script_idle_with_no_request_holding_blocks_is_not_said_hung(tmp_path, pool_name):
    # GIVEN a script with a pool and no request, idle for three seconds (a server waiting for
    # requests), under --hang-after 1
    body = _pool_script(
        pool_name, False, "open(ready, 'w').close()\ntime.sleep(3)\npool.close()\npool.unlink()\n"
    )
    run = start_run(tmp_path, body, "--hang-after", "1")
    _, err = finish(run, tmp_path)
    # THEN nothing is said about a hang: no request waited on it
    assert "looks hung" not in err and run.returncode == 0, err


def test_killing_kvscope_does_not_orphan_the_script(tmp_path):
    # GIVEN a script running under kvscope run
    run = start_run(tmp_path, "open(ready, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    try:
        wait_for(lambda: (tmp_path / "ready").exists() and (tmp_path / "ready").read_text(),
                 "the script to start")  # fmt: skip
        script_pid = int((tmp_path / "ready").read_text())
        # WHEN kvscope itself is killed with SIGKILL (nothing of it runs afterwards)
        run.kill()
        run.wait(timeout=PATIENCE_S)
        # THEN the script dies with it
        wait_for(lambda: not is_alive(script_pid, 0), "the script to die")
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_process_still_attached_when_the_script_ends_is_reported(tmp_path, pool_name):
    # GIVEN a script that starts a worker of its own, which attaches to the pool and outlives it
    (tmp_path / "worker.py").write_text(
        "import sys, time\n"
        "from kvscope.allocator import KVPool\n"
        "pool = KVPool.attach(sys.argv[1])\n"
        "open(sys.argv[2], 'w').close()\n"
        "time.sleep(600)\n"
    )
    body = (
        "import subprocess\n"
        "from kvscope.allocator import KVPool, PoolConfig\n"
        f"pool = KVPool.create({pool_name!r}, PoolConfig(num_blocks=16, block_size=4,"
        " head_dim=8, num_layers=1, dtype='float32'))\n"
        f"worker = subprocess.Popen([sys.executable, {str(tmp_path / 'worker.py')!r},"
        f" {pool_name!r}, ready + '.worker'], start_new_session=True)\n"
        "while not os.path.exists(ready + '.worker'):\n"
        "    time.sleep(0.05)\n"
        "open(ready, 'w').write(str(worker.pid))\n"
        "pool.close()\n"
    )
    run = start_run(tmp_path, body)
    ready = tmp_path / "ready"
    try:
        _, err = finish(run, tmp_path)
        worker = int(ready.read_text())
    finally:
        if ready.exists() and ready.read_text():
            try:
                os.kill(int(ready.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    # THEN kvscope names it: pid, pool, still running
    assert f"pid {worker} is still attached to pool {pool_name!r} and still running" in err
    assert run.returncode == 0


def test_a_stop_signal_after_the_script_ended_still_asks_the_tui_to_close():
    # GIVEN a stopper whose script has already ended (the TUI of --live still open)
    stopper = Stopper(lambda line: None, grace_s=1.0)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stopper.watch(proc)
    # WHEN the terminal hangs up THEN nothing is forwarded, but the stop request is set
    stopper.on_signal(signal.SIGHUP, from_terminal=True)
    assert stopper.stop_requested.is_set()
    assert not stopper.stopping


def test_a_wait_that_returns_an_unfilled_siginfo_is_not_a_stop(monkeypatch):
    # GIVEN a stopper collecting signals, watching a live script, whose wait comes back with a
    # siginfo the kernel never filled (seen when a profiler's ptrace attach cut the wait short)
    class Unfilled:
        si_signo = -195724224
        si_code = 0

    lines: list[str] = []
    stopper = Stopper(lines.append, grace_s=1.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with stopper.collecting():
            stopper.watch(proc)
            monkeypatch.setattr(signal, "sigtimedwait", lambda sigs, timeout: Unfilled())
            # WHEN it sleeps THEN it neither raises nor stops the script
            stopper.sleep(0.01)
        assert not stopper.stop_requested.is_set()
        assert not stopper.stopping and lines == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_run_whose_output_lost_its_reader_still_dumps_cleans_up_and_exits_as_it_would(
    tmp_path, pool_name
):
    # GIVEN a script that leaks a block, run with kvscope's output into a pipe whose reader has
    # gone (`kvscope run ... 2>&1 | head`, once head has exited)
    script = tmp_path / "script.py"
    script.write_text(
        "from kvscope.allocator import KVPool, PoolConfig\n"
        f"pool = KVPool.create({pool_name!r}, PoolConfig(num_blocks=8, block_size=4,"
        " num_layers=1, num_kv_heads=1, head_dim=4, dtype='float32'))\n"
        "pool.allocate('leaky', [1, 2, 3])\n"
    )
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.Popen(
            [KVSCOPE, "run", "--dump-dir", str(tmp_path), str(script)],
            stdout=write,
            stderr=write,
            start_new_session=True,
        )
    finally:
        os.close(write)
    # WHEN it ends
    run.wait(timeout=PATIENCE_S)
    # THEN the run did all it does with a reader: the dump written, the pool's files removed,
    # the exit code of a leak (--fail-on leak)
    assert run.returncode == 66
    assert len(list(tmp_path.glob("*.kvd"))) == 1
    assert not os.path.exists(f"/dev/shm/kvscope.{pool_name}")


def test_an_exception_the_pool_raises_is_placed_at_the_programs_line(tmp_path, pool_name):
    # GIVEN a script whose allocation the pool refuses (a PoolError, raised in the binding)
    body = _pool_script(pool_name, False, "pool.allocate('big', list(range(100)))\n")
    run = start_run(tmp_path, body)
    _, err = finish(run, tmp_path)
    # THEN the run's verdict places it at the script's line, not at the pool's frame
    line = len(["", "", *body.splitlines()])
    assert "raised PoolError: " in err, err
    assert f"script.py:{line} in <module>)" in err, err
    assert "pool.py:" not in err.split("raised PoolError")[1].split("\n")[0], err
