"""Where a dump goes: regular files only, `-o -` to stdout, and a full disk is one line with no
partial file left (for `kvscope dump` and at the end of `kvscope run`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from kvscope.cli import main
from kvscope.dumpfile import read_dump

KVSCOPE = os.path.join(os.path.dirname(sys.executable), "kvscope")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: "), err
    return lines[0]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: too small for any dump (needs root and mount; skipped without)."""
    where = tmp_path / "tiny"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("target", ["/dev/full", "/dev/null"])
def test_dump_refuses_a_device_and_leaves_it_alone(capsys, make_pool, target):
    # GIVEN a pool WHEN it is dumped onto a device node
    pool = make_pool(16)
    assert main(["dump", pool.name, "-o", target]) == 2
    # THEN one line says why, and the node is still the device it was
    assert "not a regular file" in one_line_error(capsys)
    assert stat.S_ISCHR(os.stat(target).st_mode)


def test_dump_refuses_a_fifo_and_a_directory(capsys, make_pool, tmp_path):
    pool = make_pool(16)
    os.mkfifo(tmp_path / "fifo")
    assert main(["dump", pool.name, "-o", str(tmp_path / "fifo")]) == 2
    assert "not a regular file" in one_line_error(capsys)
    assert main(["dump", pool.name, "-o", str(tmp_path)]) == 2
    assert "not a regular file" in one_line_error(capsys)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


@pytest.mark.slow
def test_dump_to_stdout(make_pool, tmp_path):
    # GIVEN a pool with a live sequence
    pool = make_pool(16)
    pool.allocate("req-stdout", list(range(7)))
    # WHEN `kvscope dump NAME -o -` runs
    done = subprocess.run(
        [KVSCOPE, "dump", pool.name, "-o", "-"], capture_output=True, cwd=tmp_path
    )
    # THEN the dump is on stdout (no file named "-"), and reads back as the pool
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "-").exists()
    (tmp_path / "copy.kvd").write_bytes(done.stdout)
    view, _ = read_dump(tmp_path / "copy.kvd")
    assert bytes(view.seqs["request"][view.seqs["state"] != 0][0]) == b"req-stdout"
    assert "standard output" in done.stderr.decode()


def test_dump_onto_a_full_disk_is_one_line_and_leaves_nothing(capsys, make_pool, tiny_disk):
    pool = make_pool(16)
    # WHEN the dump does not fit
    assert main(["dump", pool.name, "-o", str(tiny_disk / "p.kvd")]) == 2
    # THEN one line names the cause, and no file, partial or temporary, is left
    assert "No space left on device" in one_line_error(capsys)
    assert os.listdir(tiny_disk) == []


LEAKY = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=16, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seq = pool.allocate("req-1", list(range(10)))
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("status", [0, 3])
def test_run_onto_a_full_disk_still_prints_the_analysis(tmp_path, pool_name, tiny_disk, status):
    # GIVEN a script that leaks (so the run dumps) and exits with `status`
    script = tmp_path / "leaky.py"
    script.write_text(LEAKY)
    # WHEN its dump directory is full
    done = subprocess.run(
        [KVSCOPE, "run", "--dump-dir", str(tiny_disk), str(script), pool_name, str(status)],
        capture_output=True,
        text=True,
    )
    # THEN the failed write is one line, the analysis is printed all the same, nothing is left
    # behind, and the exit code is the script's when it failed, else 2
    assert "Traceback" not in done.stderr
    assert "No space left on device" in done.stderr
    assert "health:" in done.stderr and "leak_finished" in done.stderr
    assert os.listdir(tiny_disk) == []
    assert done.returncode == (status or 2)


@pytest.mark.parametrize("verb", ["report", "timeline"])
def test_report_and_timeline_refuse_a_device_a_fifo_and_a_directory(
    capsys, make_pool, tmp_path, verb
):
    # GIVEN a pool WHEN its report or trace is written onto a device, a FIFO or a directory
    pool = make_pool(16)
    os.mkfifo(tmp_path / "fifo")
    for target in ("/dev/full", "/dev/null", str(tmp_path / "fifo"), str(tmp_path)):
        assert main([verb, pool.name, "-o", target]) == 2
        # THEN one line says why, and nothing is written or replaced
        assert "not a regular file" in one_line_error(capsys)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


@pytest.mark.parametrize("verb", ["report", "timeline"])
def test_report_and_timeline_onto_a_full_disk_leave_nothing(capsys, make_pool, tiny_disk, verb):
    # GIVEN a pool, and a disk with a few hundred bytes left
    pool = make_pool(64)
    pool.allocate("req-1", list(range(9)))
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    # WHEN the report or trace is written there
    assert main([verb, pool.name, "-o", str(tiny_disk / "out")]) == 2
    # THEN one line names the cause, and no file, partial or temporary, is left
    assert "No space left on device" in one_line_error(capsys)
    assert os.listdir(tiny_disk) == ["filler"]


@pytest.mark.parametrize("verb", ["report", "timeline"])
def test_report_and_timeline_replace_a_regular_file(capsys, make_pool, tmp_path, verb):
    # GIVEN an existing file WHEN a report or trace is written over it
    pool = make_pool(16)
    out = tmp_path / "out"
    out.write_text("old")
    assert main([verb, pool.name, "-o", str(out)]) == 0
    # THEN it holds the new content, readable as files the umask allows, and nothing else
    assert out.read_text() != "old"
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~_umask()
    assert os.listdir(tmp_path) == ["out"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
