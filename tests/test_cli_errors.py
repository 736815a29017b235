"""Every bad input gives one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvscope.allocator.layout import DUMP_HEADER_DTYPE, FORMAT_VERSION, HEADER_DTYPE
from kvscope.allocator.segment import segment_path
from kvscope.cli import main
from kvscope.dumpfile import write_dump


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvscope: error: ")
    return lines[0]


@pytest.fixture
def dump(make_pool, tmp_path):
    """A healthy pool's dump file."""
    pool = make_pool(32)
    seq = pool.allocate("req-1", list(range(9)))
    path = write_dump(pool, tmp_path / "pool.kvd")
    pool.free(seq)
    return tmp_path / "pool.kvd" if path else None


def test_analyze_missing_pool(capsys):
    assert main(["analyze", "no-such-pool-xyz"]) == 2
    assert "no pool named 'no-such-pool-xyz'" in one_line_error(capsys)


def test_analyze_missing_file(capsys, tmp_path):
    assert main(["analyze", str(tmp_path / "missing.kvd")]) == 2
    assert "no dump file at" in one_line_error(capsys)


def test_analyze_directory(capsys, tmp_path):
    assert main(["analyze", str(tmp_path)]) == 2
    assert "is a directory" in one_line_error(capsys)


@pytest.mark.parametrize("keep", [4, 300, DUMP_HEADER_DTYPE.itemsize + 100, -10])
def test_analyze_truncated_file(capsys, dump, keep):
    data = dump.read_bytes()
    dump.write_bytes(data[:keep])
    assert main(["analyze", str(dump)]) == 2
    assert "truncated" in one_line_error(capsys)


@pytest.mark.parametrize("content", [b"", b"hello world\n" * 100, os.urandom(5000)])
def test_analyze_foreign_file(capsys, tmp_path, content):
    path = tmp_path / "foreign.kvd"
    path.write_bytes(content)
    assert main(["analyze", str(path)]) == 2
    line = one_line_error(capsys)
    assert "not a kvscope dump" in line or "truncated" in line


def test_analyze_other_dump_version(capsys, dump):
    raw = bytearray(dump.read_bytes())
    off = DUMP_HEADER_DTYPE.fields["version"][1]
    raw[off : off + 4] = (99).to_bytes(4, "little")
    dump.write_bytes(bytes(raw))
    assert main(["analyze", str(dump)]) == 2
    assert "version 99 dump" in one_line_error(capsys)


def test_analyze_other_segment_version(capsys, dump):
    # An older format's dump (6: before the header recorded PoolExhausted) is one line.
    old = FORMAT_VERSION - 1
    raw = bytearray(dump.read_bytes())
    off = DUMP_HEADER_DTYPE.itemsize + HEADER_DTYPE.fields["version"][1]
    raw[off : off + 4] = old.to_bytes(4, "little")
    # The saved header copy names that version too: nothing in the file is readable by us.
    saved = DUMP_HEADER_DTYPE.fields["segment_header_prefix"][1] + HEADER_DTYPE.fields["version"][1]
    raw[saved : saved + 4] = old.to_bytes(4, "little")
    dump.write_bytes(bytes(raw))
    assert main(["analyze", str(dump)]) == 2
    assert f"format version {old}; this kvscope reads version {FORMAT_VERSION}" in (
        one_line_error(capsys)
    )


def test_analyze_no_permission(capsys, dump, monkeypatch):
    os.chmod(dump, 0)
    if os.geteuid() == 0:
        # root reads any file: make the open fail the way it fails for everyone else.
        real_open = os.open

        def denied(path, *a, **kw):
            if os.fspath(path) == str(dump):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *a, **kw)

        monkeypatch.setattr(os, "open", denied)
    assert main(["analyze", str(dump)]) == 2
    assert "permission denied" in one_line_error(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "--bogus", "x"],
        ["frobnicate"],
        ["ls", "--nope"],
        ["dump", "somepool"],
        ["analyze", "x.kvd", "--block", "notanumber"],
        ["run", "--fail-on", "sometimes", "x.py"],
        ["run"],
    ],
)
def test_bad_command_line(capsys, argv):
    assert main(argv) == 2
    one_line_error(capsys)


@pytest.mark.parametrize(
    "argv, helps",
    [
        (["analyze", "x.kvd", "--bogus"], "kvscope analyze"),
        (["events", "record", "--endpoint", "x", "-o", "y"], "kvscope events record"),
        (["--bogus"], "kvscope"),
    ],
)
def test_an_argument_nobody_takes_points_at_the_help_of_the_verb_given(capsys, argv, helps):
    assert main(argv) == 2
    assert one_line_error(capsys).endswith(f"(see `{helps} --help`)")


def test_no_verb_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_invalid_pool_name(capsys):
    assert main(["check", "../etc/passwd"]) == 2
    assert "invalid pool name" in one_line_error(capsys)


def test_dump_missing_pool(capsys, tmp_path):
    assert main(["dump", "no-such-pool-xyz", "-o", str(tmp_path / "x.kvd")]) == 2
    assert "no pool named" in one_line_error(capsys)
    assert not (tmp_path / "x.kvd").exists()


def test_dump_into_missing_directory(capsys, make_pool, tmp_path):
    pool = make_pool(16)
    assert main(["dump", pool.name, "-o", str(tmp_path / "nodir" / "x.kvd")]) == 2
    assert "does not exist" in one_line_error(capsys)


def test_dump_redact_with_data_refused(capsys, make_pool, tmp_path):
    pool = make_pool(16)
    assert main(["dump", pool.name, "-o", str(tmp_path / "x.kvd"), "--redact", "--with-data"]) == 2
    assert "--redact cannot be combined" in one_line_error(capsys)


def test_check_missing_pool(capsys):
    assert main(["check", "no-such-pool-xyz", "--repair"]) == 2
    assert "no pool named" in one_line_error(capsys)


def test_check_foreign_pool_file(capsys, pool_name):
    with open(segment_path(pool_name), "wb") as f:
        f.write(os.urandom(4096))
    assert main(["check", pool_name]) == 2
    assert "not a kvscope pool" in one_line_error(capsys)


def test_check_pool_whose_header_was_scribbled_in_this_process(capsys, make_pool):
    # GIVEN a pool this process has open, whose header magic was overwritten
    pool = make_pool(16)
    pool.view.raw[:8] = 0xAB
    # WHEN it is checked THEN the check reports the corruption as a finding (exit 1)
    assert main(["check", pool.name]) == 1
    assert "header_corrupt" in capsys.readouterr().out
    pool.view.header["magic"] = np.uint64(0x4B56_5343_4F50_4531)


def test_analyze_out_of_range_block(capsys, dump):
    assert main(["analyze", str(dump), "--block", "100000"]) == 2
    assert "out of range" in one_line_error(capsys)


def test_run_missing_script(capsys, tmp_path):
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "no script at" in one_line_error(capsys)


def test_run_unknown_fault(capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["run", "--inject", "gremlins", str(script)]) == 2
    assert "unknown fault 'gremlins'" in one_line_error(capsys)


def test_run_dump_dir_that_is_a_file_or_cannot_be_made(capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["run", "--dump-dir", str(script), str(script)]) == 2
    assert "is not a directory" in one_line_error(capsys)
    assert main(["run", "--dump-dir", str(script / "under"), str(script)]) == 2
    assert "cannot be made: Not a directory" in one_line_error(capsys)


def test_run_makes_a_missing_dump_dir(capsys, tmp_path):
    # GIVEN a script and a dump directory that does not exist yet, two levels down
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    where = tmp_path / "runs" / "one"
    # WHEN it runs THEN the directory is made before the script starts, and the run is clean
    assert main(["run", "--dump-dir", str(where), str(script)]) == 0
    assert where.is_dir()


def test_top_bad_rate(capsys):
    assert main(["top", "x", "--hz", "0"]) == 2
    assert "--hz must be positive" in one_line_error(capsys)


def test_top_without_a_terminal_is_one_line_exit_2(capsys, tmp_path, make_pool):
    # GIVEN a live pool, and stdin and stdout that are not terminals (pytest's capture)
    pool = make_pool(8)
    # WHEN top, top --events or run --live would draw THEN each refuses in one line, naming
    # the text commands, and the script does not run
    assert main(["top", pool.name]) == 2
    line = one_line_error(capsys)
    assert "top draws in a terminal" in line and "kvscope analyze" in line
    assert main(["top", "--events", "tcp://127.0.0.1:1"]) == 2
    assert "top --events draws in a terminal" in one_line_error(capsys)
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert main(["run", "--live", str(script)]) == 2
    assert "run --live draws in a terminal" in one_line_error(capsys)


def test_run_bad_rate(capsys, tmp_path):
    # --hz is top's rate under --live: a value top refuses is refused before the script starts
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert main(["run", "--live", "--hz", "-1", str(script)]) == 2
    assert "--hz must be positive" in one_line_error(capsys)


def test_write_into_a_directory_that_takes_no_file_says_so(capsys, make_pool):
    # /proc exists but a file cannot be created there (ENOENT): not "does not exist"
    pool = make_pool(16)
    assert main(["dump", pool.name, "-o", "/proc/x.kvd"]) == 2
    err = one_line_error(capsys)
    assert "directory /proc takes no new file" in err and "does not exist" not in err


@pytest.mark.parametrize("relative", [False, True])
def test_check_of_a_dump_file_points_at_analyze(dump, capsys, monkeypatch, relative):
    # GIVEN a dump file, named by path or by its bare name in the current directory
    if relative:
        monkeypatch.chdir(dump.parent)
    target = dump.name if relative else str(dump)
    # WHEN it is given to check, which opens live pools only
    assert main(["check", target]) == 2
    # THEN the one line says it is a file and names the verb that reads it (not "no pool named")
    line = one_line_error(capsys)
    assert "is a file" in line and f"kvscope analyze {target}" in line


def test_one_of_a_thing_is_said_in_the_singular(make_pool, capsys):
    # GIVEN a one-layer pool and a repair that reclaimed one block of one sequence
    from kvscope.verbs.check import describe_repair

    pool = make_pool(16, num_layers=1)
    done = {
        "journals_rolled_back": [],
        "processes": 1,
        "dead_owners": [7],
        "blocks": 1,
        "sequences": 1,
    }
    # THEN neither says "1 layers" nor "1 sequences"
    said = describe_repair(done)
    assert "reclaimed 1 sequence from 1 dead process(es) (pid 7): 1 block freed" in said
    assert main(["analyze", pool.name]) == 0
    assert "x 4 tokens, 1 layer, 2 kv heads" in capsys.readouterr().out


def test_several_dumps_to_a_verb_of_one_are_named_in_one_line(capsys):
    # (a glob over a --dump-dir that two runs wrote into)
    assert main(["analyze", "a.kvd", "b.kvd", "c.kvd"]) == 2
    line = one_line_error(capsys)
    assert "kvscope analyze takes one FILE|NAME, and 2 more were given (b.kvd, c.kvd)" in line
    assert "name one at a time" in line
    # (a verb of no such argument keeps argparse's words)
    assert main(["ls", "foo"]) == 2
    assert "unrecognized arguments: foo" in one_line_error(capsys)
