"""Bad input gets one clear PoolError each: names, files, versions, geometry, permissions."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig, PoolError
from kvscope.allocator.layout import HEADER_DTYPE
from kvscope.allocator.segment import data_path, segment_path


def test_create_over_existing_pool_fails(make_pool):
    pool = make_pool(8)
    with pytest.raises(PoolError, match="already exists"):
        KVPool.create(pool.name, PoolConfig(num_blocks=8))


def test_attach_missing_pool_fails(pool_name):
    with pytest.raises(PoolError, match=f"no pool named '{pool_name}'"):
        KVPool.attach(pool_name)


def test_a_missing_pool_lists_ten_of_the_hosts_pools_and_says_how_many_more(tmp_path, monkeypatch):
    from kvscope.allocator import segment

    monkeypatch.setattr(segment, "SHM_DIR", str(tmp_path))
    for i in range(15):
        (tmp_path / f"kvscope.p{i:02d}").write_bytes(b"")
    with pytest.raises(PoolError) as e:
        KVPool.attach("nosuch")
    text = str(e.value)
    assert "p09" in text and "p10" not in text and "and 5 more: kvscope ls" in text
    assert "\n" not in text


@pytest.mark.parametrize("name", ["", "a/b", "../etc", "x" * 65, "p.data"])
def test_invalid_names_are_rejected(name):
    with pytest.raises(PoolError, match="invalid pool name"):
        KVPool.create(name, PoolConfig(num_blocks=4))


def test_attach_truncated_file_fails(pool_name):
    with open(segment_path(pool_name), "wb") as f:
        f.write(b"\0" * 100)
    with pytest.raises(PoolError, match="truncated"):
        KVPool.attach(pool_name)


def test_attach_foreign_file_fails(pool_name):
    with open(segment_path(pool_name), "wb") as f:
        f.write(os.urandom(HEADER_DTYPE.itemsize + 100))
    with pytest.raises(PoolError, match="not a kvscope pool"):
        KVPool.attach(pool_name)


def test_attach_other_format_version_fails(make_pool):
    pool = make_pool(8)
    name = pool.name
    pool.close()
    with open(segment_path(name), "r+b") as f:
        f.seek(8)
        f.write(np.uint32(99).tobytes())
    with pytest.raises(PoolError, match="format version 99"):
        KVPool.attach(name)


def test_attach_corrupt_header_checksum_fails(make_pool):
    pool = make_pool(8)
    name = pool.name
    pool.close()
    off = HEADER_DTYPE.fields["num_blocks"][1]
    with open(segment_path(name), "r+b") as f:
        f.seek(off)
        f.write(np.uint32(9999).tobytes())
    with pytest.raises(PoolError, match="checksum mismatch"):
        KVPool.attach(name)


def test_geometry_that_does_not_fit_fails_and_leaves_nothing(pool_name):
    huge = PoolConfig(num_blocks=10_000_000, num_layers=80, head_dim=256, num_kv_heads=64)
    with pytest.raises(PoolError, match="GiB"):
        KVPool.create(pool_name, huge)
    assert not os.path.exists(segment_path(pool_name))
    assert not os.path.exists(data_path(pool_name))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_blocks", 0),
        ("block_size", -1),
        ("head_dim", 0),
        ("num_shards", 3),
        ("dtype", "int8"),
        ("event_capacity", -1),
        ("event_capacity", (1 << 20) + 1),
    ],
)
def test_bad_config_values_are_rejected(pool_name, field, value):
    kw = {"num_blocks": 8, field: value}
    with pytest.raises(PoolError):
        KVPool.create(pool_name, PoolConfig(**kw))


def test_the_event_capacity_floor_raises_a_smaller_one_and_keeps_a_larger(pool_name, monkeypatch):
    # GIVEN KVSCOPE_EVENT_CAPACITY=64, as kvscope run sets it (8,192 there)
    monkeypatch.setenv("KVSCOPE_EVENT_CAPACITY", "64")
    # WHEN pools are created with a smaller and a larger event_capacity THEN each process's
    # flight recorder keeps at least 64 events, and a larger capacity its own
    for asked, kept in ((16, 64), (100, 100)):
        pool = KVPool.create(pool_name, PoolConfig(num_blocks=8, head_dim=8, event_capacity=asked))
        try:
            assert pool.view.events.shape[1] == kept
            assert pool.config.event_capacity == kept
        finally:
            pool.close()
            pool.unlink()


@pytest.mark.parametrize("value", ["lots", "-5", str((1 << 20) + 1)])
def test_a_bad_event_capacity_floor_is_one_pool_error_and_no_pool(pool_name, monkeypatch, value):
    monkeypatch.setenv("KVSCOPE_EVENT_CAPACITY", value)
    with pytest.raises(PoolError, match="KVSCOPE_EVENT_CAPACITY=.*give a number of events"):
        KVPool.create(pool_name, PoolConfig(num_blocks=8, head_dim=8))
    assert not os.path.exists(segment_path(pool_name))


def test_files_are_private_by_default(make_pool):
    pool = make_pool(8)
    for p in (segment_path(pool.name), data_path(pool.name)):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_group_config_makes_files_group_accessible(pool_name):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    pool = KVPool.create(pool_name, PoolConfig(num_blocks=8, head_dim=8, group=group))
    try:
        assert stat.S_IMODE(os.stat(segment_path(pool_name)).st_mode) == 0o660
    finally:
        pool.close()
        pool.unlink()


def test_attach_to_another_users_pool_fails_clearly(make_pool):
    # GIVEN a pool created 0600 by this user, WHEN another user attaches THEN one clear error.
    pool = make_pool(8)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            KVPool.attach(pool.name)
            msg = b"attached"
        except PoolError as e:
            msg = str(e).encode()
        except BaseException as e:  # noqa: BLE001
            msg = repr(e).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    out = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    if os.getuid() != 0:
        pytest.skip("needs root to impersonate another user")
    assert "belongs to user" in out


def test_closed_pool_and_forked_handle_are_rejected(make_pool):
    pool = make_pool(8)
    seq = pool.allocate("r", [1])
    pid = os.fork()
    if pid == 0:
        try:
            pool.allocate("x", [1])
            os._exit(1)
        except PoolError as e:
            os._exit(0 if "KVPool.attach" in str(e) else 2)
        except BaseException:  # noqa: BLE001 - the child never returns into the test run
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pool.free(seq)
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.allocate("y", [1])
