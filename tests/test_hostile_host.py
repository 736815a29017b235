"""A host that is not on the pool's side: symlinks, other users' files, things that are not
files, odd names, truncated files. Each is one clear refusal, never a file written or removed
that kvscope did not make, and never a hang or a SIGBUS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvscope.allocator import KVPool, PoolConfig, PoolError
from kvscope.allocator.segment import SHM_DIR, check_name, data_path, segment_path
from kvscope.cli import main

NOBODY = 65534
CFG = dict(num_blocks=16, block_size=4, head_dim=8, num_layers=1, dtype="float32")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user needs root"
)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: "), err
    return lines[0]


def give_away(name: str, mode: int = 0o600) -> None:
    """Make both files of pool `name` another user's, as if that user had created them."""
    for p in (segment_path(name), data_path(name)):
        os.chown(p, NOBODY, NOBODY)
        os.chmod(p, mode)


@pytest.mark.parametrize("name", ["-x", ".hidden", "..", "x\n", "a\x01b", "a b", "é"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(PoolError, match="invalid pool name"):
        check_name(name)
    with pytest.raises(PoolError, match="invalid pool name"):
        KVPool.create(name, PoolConfig(**CFG))


def test_a_symlink_at_the_segment_path_is_not_followed(capsys, make_pool, pool_name, tmp_path):
    # GIVEN a symlink named like a pool, pointing at a real pool's segment
    pool = make_pool(16)
    os.symlink(segment_path(pool.name), segment_path(pool_name + "-link"))
    try:
        # WHEN it is attached or checked THEN one line refuses it
        with pytest.raises(PoolError, match="symbolic link"):
            KVPool.attach(pool_name + "-link")
        assert main(["check", pool_name + "-link"]) == 2
        assert "symbolic link" in one_line_error(capsys)
    finally:
        os.unlink(segment_path(pool_name + "-link"))


def test_a_symlink_loop_is_one_line(capsys, tmp_path):
    loop = tmp_path / "loop.kvd"
    os.symlink(loop, loop)
    assert main(["analyze", str(loop)]) == 2
    assert "symbolic links" in one_line_error(capsys)


def test_a_symlink_planted_at_the_data_path_is_neither_written_nor_removed(pool_name, tmp_path):
    # GIVEN a symlink at the pool's data path, pointing at a file someone cares about
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, data_path(pool_name))
    try:
        # WHEN a pool of that name is created
        with pytest.raises(PoolError, match="already exists"):
            KVPool.create(pool_name, PoolConfig(**CFG))
        # THEN the file it points at is untouched, the link is still there, and the segment
        # that create made is gone again
        assert victim.read_bytes() == b"precious"
        assert os.path.islink(data_path(pool_name))
        assert not os.path.lexists(segment_path(pool_name))
    finally:
        os.unlink(data_path(pool_name))


def test_attach_refuses_a_data_file_that_is_a_symlink(make_pool):
    pool = make_pool(16)
    real = os.path.join(SHM_DIR, f"elsewhere-{pool.name}")
    os.rename(data_path(pool.name), real)
    os.symlink(real, data_path(pool.name))
    try:
        with pytest.raises(PoolError, match="symbolic link"):
            KVPool.attach(pool.name)
    finally:
        os.unlink(data_path(pool.name))
        os.unlink(real)


@needs_root
def test_a_failed_create_never_removes_another_users_file(pool_name):
    # GIVEN another user's data file where the new pool's would go
    with open(data_path(pool_name), "wb") as f:
        f.write(b"theirs")
    os.chown(data_path(pool_name), NOBODY, NOBODY)
    try:
        # WHEN create fails on it
        with pytest.raises(PoolError, match="already exists"):
            KVPool.create(pool_name, PoolConfig(**CFG))
        # THEN their file is still there, and only what create made was removed
        assert open(data_path(pool_name), "rb").read() == b"theirs"
        assert not os.path.lexists(segment_path(pool_name))
    finally:
        os.unlink(data_path(pool_name))


@needs_root
@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_another_users_pool_is_attached_only_when_trusted(capsys, pool_name, monkeypatch, mode):
    # GIVEN a pool another user created (mode 0600, or 0666 for anyone to use)
    pool = KVPool.create(pool_name, PoolConfig(**CFG))
    pool.close()
    give_away(pool_name, mode)
    # WHEN root attaches to it, checks it or dumps it THEN each is refused in one line
    with pytest.raises(PoolError, match="belongs to user nobody"):
        KVPool.attach(pool_name)
    for argv in (["check", pool_name], ["analyze", pool_name], ["dump", pool_name, "-o", "x"]):
        assert main(argv) == 2
        assert "--trust-owner" in one_line_error(capsys)
    # AND with trust asked for (keyword, flag or environment) it works
    KVPool.attach(pool_name, trust_owner=True).close()
    assert main(["check", pool_name, "--trust-owner"]) == 0
    monkeypatch.setenv("KVSCOPE_TRUST_OWNER", "1")
    KVPool.attach(pool_name).close()


@needs_root
def test_a_data_file_of_another_user_behind_your_segment_is_refused(make_pool):
    # GIVEN your pool, whose data file someone else's file replaced
    pool = make_pool(16)
    pool.close()
    os.chown(data_path(pool.name), NOBODY, NOBODY)
    # THEN attach refuses it, even when asked to trust other users' pools
    with pytest.raises(PoolError, match="belongs to user nobody"):
        KVPool.attach(pool.name)
    with pytest.raises(PoolError, match="belongs to user nobody but its pool to user root"):
        KVPool.attach(pool.name, trust_owner=True)


def test_a_world_writable_pool_file_is_refused_unless_trusted(make_pool):
    pool = make_pool(16)
    os.chmod(segment_path(pool.name), 0o666)
    pool.close()
    with pytest.raises(PoolError, match="writable by every user"):
        KVPool.attach(pool.name)
    KVPool.attach(pool.name, trust_owner=True).close()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_things_that_are_not_files_are_skipped_by_ls_and_refused_by_verbs(capsys, kind, tmp_path, pool_name):  # fmt: skip
    # GIVEN a directory or a FIFO named like a pool, next to a real pool
    pool = KVPool.create(pool_name, PoolConfig(**CFG))
    odd = f"{pool_name}-{kind}"
    (os.mkdir if kind == "directory" else os.mkfifo)(segment_path(odd))
    try:
        # WHEN the pools are listed THEN it is not among them, and ls still lists the real one
        assert main(["ls", "--json"]) == 0
        names = [r["name"] for r in json.loads(capsys.readouterr().out)]
        assert pool_name in names and odd not in names
        # WHEN a verb is pointed at it THEN one line, at once (a FIFO is never opened to wait)
        for argv in (["check", odd], ["analyze", odd], ["dump", odd, "-o", str(tmp_path / "d")]):
            assert main(argv) == 2
            assert f"is a {kind.replace('fifo', 'FIFO')}" in one_line_error(capsys)
        with pytest.raises(PoolError, match="not a pool file"):
            KVPool.attach(odd)
    finally:
        (os.rmdir if kind == "directory" else os.unlink)(segment_path(odd))
        pool.close()


def test_a_truncated_segment_is_refused_at_attach(make_pool):
    pool = make_pool(16)
    name = pool.name
    pool.close()
    os.truncate(segment_path(name), os.path.getsize(segment_path(name)) // 2)
    with pytest.raises(PoolError, match="truncated"):
        KVPool.attach(name)


def test_a_truncated_data_file_is_refused_at_attach_and_reported_by_analyze(capsys, make_pool):
    # GIVEN a pool whose KV data file was cut short after it was created
    pool = make_pool(16)
    name = pool.name
    pool.close()
    os.truncate(data_path(name), 100)
    # WHEN a process attaches THEN it is refused before mapping (not killed by SIGBUS later)
    with pytest.raises(PoolError, match="truncated"):
        KVPool.attach(name)
    # AND analyze of the live pool reports it as an error
    assert main(["analyze", name, "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    (f,) = [f for f in rep["findings"] if f["kind"] == "out_of_bounds"]
    assert "holds 100 bytes" in f["message"] and f["severity"] == "error"


@pytest.mark.slow
def test_a_pool_file_truncated_under_a_running_script_is_not_read_by_the_supervisor(tmp_path, pool_name):  # fmt: skip
    # GIVEN a script that cuts its own pool's segment short while kvscope run watches it
    script = tmp_path / "shrink.py"
    script.write_text(
        "import os, sys\n"
        "from kvscope.allocator import KVPool, PoolConfig\n"
        "from kvscope.allocator.segment import segment_path\n"
        f"pool = KVPool.create(sys.argv[1], PoolConfig(**{CFG!r}))\n"
        "os.truncate(segment_path(sys.argv[1]), 4096)\n"
        "os._exit(0)\n"
    )
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    done = subprocess.run(
        [kvscope, "run", "--dump-dir", str(tmp_path), str(script), pool_name],
        capture_output=True,
        text=True,
    )
    # THEN kvscope says so (whether it first saw the pool before or after the cut) and ends
    # normally: it never touched the lost pages (no SIGBUS)
    assert "4096 bytes" in done.stderr and "SIGBUS" in done.stderr, done.stderr
    assert done.returncode in (0, 2), done.stderr
    assert "Traceback" not in done.stderr


def test_shm_dir_is_the_one_the_tests_use():
    assert SHM_DIR == os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
