"""One definition of the segment layout: records.py feeds both layout.py's dtypes and the C
core's generated header, and a core built for another layout refuses to load."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvscope.allocator import _native, layout, native, records
from tests.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_core_has_todays_layout():
    # GIVEN the core pip built / WHEN its exported constants are compared with the dtypes
    built = _native.LAYOUT
    # THEN every offset, size and constant the core compiled in is the layout's
    assert built == native.expected_layout()
    assert built["CHUNK"] == layout.CHUNK and built["EVICT_BATCH"] == layout.EVICT_BATCH
    assert built["LF_WAIT"] == layout.LOCK_DTYPE.fields["wait_ns"][1]


@pytest.mark.parametrize(
    "change",
    [
        ("BF_STATE", 5),  # a block field moved
        ("LOCK_SIZE", 104),  # a record grew
        ("CHUNK", 64),  # a constant changed on one side
        ("EVICT_BATCH", None),  # a constant the core does not know
        ("HDR_NEXT_SEQ_ID", 1380),  # a header field moved
        ("CF_OP", 40),  # a client record field moved
        ("FD_MESSAGE_BYTES", 100),  # a text field shrank
        ("SITE_SIZE", 136),  # a record of the probes' sections grew
        ("NUM_SITES", 512),  # a section's capacity changed
        ("CL_DETACHED", 3),  # a state's value changed
    ],
)
def test_a_core_built_for_another_layout_raises(change):
    # GIVEN a core's constants with one deliberately altered (or missing)
    name, value = change
    built = dict(native.expected_layout())
    if value is None:
        del built[name]
    else:
        built[name] = value
    # WHEN the import-time check compares them / THEN it raises, naming the constant
    with pytest.raises(native.LayoutMismatch, match=name) as err:
        native.check_layout(built)
    assert "pip install" in str(err.value)
    assert isinstance(err.value, ImportError)


def test_the_core_takes_no_record_offsets_at_run_time(make_pool, monkeypatch):
    # GIVEN a pool, and a core whose construction is watched
    pool = make_pool(16)
    seen = {}

    class Watch:
        def __init__(self, mm, fd, layout):
            seen.update(layout)

    monkeypatch.setattr(native, "_native", type("M", (), {"Native": Watch}))
    # WHEN a handle's core is made
    native.core_for(pool, SimpleNamespace(mm=None, fd=-1), {})
    # THEN its run-time layout holds what depends on the pool (geometry, sections, this client)
    assert seen["off_clients"] == pool.view.offsets["clients"] and seen["client"] == pool.client
    # AND none of the records' fixed offsets and sizes, which layout.h holds
    fixed = ("cf_", "fd_", "lg_", "c_", "off_hdr", "site_", "finding", "lockgraph_")
    assert [k for k in seen if k.startswith(fixed)] == ["finding_severity"]
    assert not {"header_fields", "header_check_bytes", "journal_entries", "num_sites"} & set(seen)


@pytest.mark.slow
def test_a_missing_core_is_one_line_at_import_saying_how_to_rebuild(tmp_path):
    # GIVEN a Python that cannot find the built core (a finder that refuses it)
    code = (
        "import sys, importlib.abc\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'kvscope.allocator._native':\n"
        "            raise ImportError('no such module')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "try:\n"
        "    from kvscope.allocator import KVPool\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
        "else:\n"
        "    print('IMPORTED')\n"
    )
    (tmp_path / "refuse.py").write_text(code)
    # WHEN the pool is imported
    out = run_script("refuse.py", tmp_path)
    # THEN the import fails with one line that says how to rebuild (no pure-Python pool)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERR kvscope: the pool's C core"), out.stdout
    assert "pip install -e ." in lines[0]


def test_the_generator_packs_as_numpy_does():
    # GIVEN the header generator's own offset arithmetic (setup.py has no numpy)
    # WHEN compared with numpy's packing of the same fields at several geometries
    for bs in (1, 2, 4, 16, 33):
        want = layout.block_dtype(bs)
        got = records.packed_offsets(records.block_fields(bs))
        # THEN every field and the record size agree
        assert got[""] == want.itemsize
        assert all(got[f] == want.fields[f][1] for f in want.names)
    for mb in (1, 8, 129):
        want = layout.seq_dtype(mb)
        got = records.packed_offsets(records.seq_fields(mb))
        assert got[""] == want.itemsize
    assert records.c_constants() == native.expected_layout()


def test_setup_writes_the_header_from_records_without_numpy(tmp_path):
    # GIVEN records.py run on its own, in an interpreter that cannot import numpy or kvscope
    blocker = tmp_path / "numpy.py"
    blocker.write_text("raise ImportError('no numpy in the build environment')\n")
    code = (
        f"import runpy; print(runpy.run_path({str(ROOT / 'allocator/records.py')!r})['c_header']())"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # WHEN the header is generated / THEN it defines every constant with the layout's value
    defines = {
        line.split()[1]: int(line.split()[2].rstrip("u"), 0)
        for line in out.splitlines()
        if line.startswith("#define ") and len(line.split()) == 3
    }
    assert defines == native.expected_layout()
    assert all(f'{{"{name}", {name}}}' in out for name in defines)
    assert defines["BF_TOKENS"] == 120 and defines["CHUNK"] == 128


def test_chunk_and_evict_batch_are_defined_once():
    # GIVEN the allocator's modules / WHEN CHUNK and EVICT_BATCH are looked for
    # THEN records.py alone defines them, as the layout has them
    for path in ROOT.glob("allocator/*.py"):
        if path.name != "records.py":
            text = path.read_text()
            assert "\nCHUNK = " not in text and "\nEVICT_BATCH = " not in text, path.name
    assert runpy.run_path(str(ROOT / "allocator/records.py"))["CHUNK"] == layout.CHUNK


@pytest.mark.parametrize("num_blocks, max_blocks_per_seq", [(81, 0), (7, 0), (64, 5)])
def test_an_odd_table_length_makes_a_working_pool(make_pool, num_blocks, max_blocks_per_seq):
    # GIVEN a geometry whose block tables hold an odd number of entries (the defaults give a
    # pool of 81 blocks 81 of them), whose sequence records numpy packs to 4 bytes past a word
    pool = make_pool(num_blocks, max_blocks_per_seq=max_blocks_per_seq)
    # THEN every record starts on an 8-byte word (the core reads num_tokens as one)
    assert pool.view.seqs.dtype.itemsize % 8 == 0 and pool.view.offsets["seqs"] % 8 == 0
    # AND the pool works: allocate, publish, hit, free, and the whole check is clean
    seq = pool.allocate("a", list(range(13)))
    pool.mark_computed(seq, 12)
    hit = pool.allocate("b", list(range(12)) + [99])
    assert hit.num_cached_tokens == 12
    pool.free(hit)
    pool.free(seq)
    assert pool.check() == []
