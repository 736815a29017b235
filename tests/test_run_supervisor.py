"""`kvscope run`: a supervised child, its findings, and the dump it leaves when it goes wrong."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from kvscope.allocator.segment import segment_path
from kvscope.analysis import analyze_view
from kvscope.cli import main
from kvscope.dumpfile import alive_for, read_dump
from kvscope.errors import EXIT_FAIL_ON
from kvscope.supervisor import LIVE_LINES_PER_KIND

PRELUDE = """
import os, signal, sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seq = pool.allocate("req-1", list(range(10)))
"""

SCRIPTS = {
    "clean": "pool.free(seq)\nprint('args', sys.argv[2:])\npool.close()\npool.unlink()\n",
    "leak": "print('leaving req-1 behind')\n",
    "close_leak": "pool.close()\n",
    "lease_leak": ("pool.lease(seq, 'read', holder='offload')\npool.free(seq)\npool.close()\n"),
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)\n",
    "exception": "raise ValueError('the model exploded')\n",
    "double_free": "pool.free(seq)\npool.free(seq)\n",
    "double_free_caught": (
        "pool.free(seq)\n"
        "try:\n"
        "    pool.free(seq)\n"
        "except Exception:\n"
        "    pass\n"
        "pool.close()\npool.unlink()\n"
    ),
    "late_write": (
        "pool.kv[:, :, seq.block_table, :4] = 1.0\n"
        "pool.mark_computed(seq, 8)\n"
        "first = seq.block_table[0]\n"
        "pool.free(seq)\n"
        "pool.kv[0, 0, first, 1] = 7.0\n"
    ),
    "guard_writes": (
        "pool.free(seq)\n"
        "for i in range(14):\n"
        "    s = pool.allocate(f'w{i}', [100 + i] * 4)\n"
        "    pool.kv[:, :, s.block_table[0], pool.block_size] = 1.0  # its guard slot\n"
        "    pool.free(s)\n"
        "pool.close()\npool.unlink()\n"
    ),
    "scribble": (
        "from kvscope.allocator.segment import segment_path\n"
        "with open(segment_path(sys.argv[1]), 'r+b') as f:\n"
        "    f.write(b'\\xde\\xad' * 8)\n"
        "pool.free(seq)\n"
    ),
}


def script(tmp_path, kind: str) -> str:
    path = tmp_path / f"{kind}.py"
    path.write_text(PRELUDE + SCRIPTS[kind])
    return str(path)


def dumps(tmp_path) -> list[str]:
    return sorted(glob.glob(str(tmp_path / "kvscope-*.kvd")))


def analysis_of(path: str) -> dict:
    view, dh = read_dump(path)
    return analyze_view(view, alive=alive_for(dh), dump_header=dh)


@pytest.mark.slow
def test_clean_script_runs_with_its_args_and_leaves_nothing(capfd, tmp_path, pool_name):
    code = main(
        ["run", "--dump-dir", str(tmp_path), script(tmp_path, "clean"), pool_name, "x", "--y"]
    )
    out, err = capfd.readouterr()
    assert code == 0
    assert "args ['x', '--y']" in out
    assert dumps(tmp_path) == []
    # the script's unlink was deferred to the supervisor, which removed the files afterwards
    assert not glob.glob(segment_path(pool_name) + "*")


@pytest.mark.slow
def test_leak_at_exit_is_reported_and_dumped(capfd, tmp_path, pool_name):
    # GIVEN a script that exits without freeing its sequence
    # WHEN run with --fail-on error (leaks fail a run by default: tests/test_run_verdict.py)
    code = main(
        ["run", "--fail-on", "error", "--dump-dir", str(tmp_path), script(tmp_path, "leak"),
         pool_name]
    )  # fmt: skip
    err = capfd.readouterr().err
    # THEN it succeeds, but the leak is printed as it is found and a dump names the request;
    # the printed verdict agrees with the exit code: the leak is a warning under this --fail-on
    assert code == 0
    assert "leak_finished" in err and "req-1" in err
    assert "UNHEALTHY" not in err and "health: OK with" in err
    assert "warning: leak_finished" in err and "(warning under --fail-on error)" in err
    (path,) = dumps(tmp_path)
    assert path.endswith(".kvd") and f"kvscope-{pool_name}-" in path
    rep = analysis_of(path)
    # one finding per cause: the request the exit check reported is not also a dead owner's
    assert [(f["kind"], f["request"]) for f in rep["findings"]] == [("leak_finished", "req-1")]
    assert "blocks leaked" in rep["pool"]["dump"]["reason"]


@pytest.mark.slow
def test_a_lease_left_held_is_dumped_as_a_lease_leaked_not_blocks(capfd, tmp_path, pool_name):
    # GIVEN a script that frees its request but never releases a transfer's lease on it
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "lease_leak"), pool_name])
    capfd.readouterr()
    # THEN the run fails on the leak, and its dump's reason says what leaked: a lease
    assert code == EXIT_FAIL_ON
    (path,) = dumps(tmp_path)
    rep = analysis_of(path)
    assert [f["kind"] for f in rep["findings"]] == ["lease_leak"]
    reason = rep["pool"]["dump"]["reason"]
    assert "leases leaked" in reason and "blocks leaked" not in reason


@pytest.mark.slow
def test_closing_a_pool_with_a_live_sequence_is_a_leak(capfd, tmp_path, pool_name):
    # GIVEN a script that closes its pool without freeing its sequence (close frees nothing)
    code = main(
        ["run", "--fail-on", "leak", "--dump-dir", str(tmp_path), script(tmp_path, "close_leak"),
         pool_name]
    )  # fmt: skip
    err = capfd.readouterr().err
    # THEN the request is reported when the pool is closed, and the run fails on it
    assert code == EXIT_FAIL_ON
    assert "leak_finished" in err and "req-1" in err and "when the pool was closed" in err


@pytest.mark.slow
def test_fail_on_leak_turns_a_leak_into_a_failure(capfd, tmp_path, pool_name):
    code = main(
        [
            "run",
            "--fail-on",
            "leak",
            "--dump-dir",
            str(tmp_path),
            script(tmp_path, "leak"),
            pool_name,
        ]
    )
    assert code == EXIT_FAIL_ON
    err = capfd.readouterr().err
    assert "but leaks matched --fail-on leak" in err and "health: UNHEALTHY" in err


@pytest.mark.slow
def test_fail_on_never_ignores_a_leak(capfd, tmp_path, pool_name):
    code = main(
        [
            "run",
            "--fail-on",
            "never",
            "--dump-dir",
            str(tmp_path),
            script(tmp_path, "leak"),
            pool_name,
        ]
    )
    assert code == 0
    assert len(dumps(tmp_path)) == 1


@pytest.mark.slow
def test_sigkilled_child_leaves_a_dump_naming_the_dead_owner(capfd, tmp_path, pool_name):
    # GIVEN a script killed with SIGKILL while it holds blocks
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "sigkill"), pool_name])
    err = capfd.readouterr().err
    # THEN the exit code is the shell's for SIGKILL, and the dump says who died holding what
    assert code == 128 + 9
    assert "killed by SIGKILL" in err
    (path,) = dumps(tmp_path)
    rep = analysis_of(path)
    assert "SIGKILL" in rep["pool"]["dump"]["reason"]
    dead = [f for f in rep["findings"] if f["kind"] == "leak_dead_owner"]
    assert (
        dead
        and dead[0]["request"] == "req-1"
        and dead[0]["owner_pid"] == rep["pool"]["dump"]["pid"]
    )
    assert rep["summary"]["blocks_by_owner"][0]["alive"] is False


@pytest.mark.slow
def test_uncaught_exception_leaves_a_dump_naming_it(capfd, tmp_path, pool_name):
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "exception"), pool_name])
    err = capfd.readouterr().err
    assert code == 1
    # the script's own traceback, without the bootstrap's frames
    assert "ValueError: the model exploded" in err and "bootstrap.py" not in err
    (path,) = dumps(tmp_path)
    rep = analysis_of(path)
    assert "ValueError: the model exploded" in rep["pool"]["dump"]["reason"]
    assert any(f["kind"] == "leak_finished" and f["request"] == "req-1" for f in rep["findings"])


@pytest.mark.slow
def test_double_free_is_rejected_and_reported(capfd, tmp_path, pool_name):
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "double_free"), pool_name])
    err = capfd.readouterr().err
    assert code == 1
    assert "already finished" in err and "raised PoolError" in err


@pytest.mark.slow
@pytest.mark.parametrize("fail_on", ["leak", "error"])
def test_a_double_free_without_a_leak_fails_the_run_naming_what_matched(
    capfd, tmp_path, pool_name, fail_on
):
    # GIVEN a script that frees a request twice, catches the refusal, and ends clean (no leak)
    path = script(tmp_path, "double_free_caught")
    # WHEN it runs under the default --fail-on (leak), or under --fail-on error
    code = main(["run", "--fail-on", fail_on, "--dump-dir", str(tmp_path), path, pool_name])
    err = capfd.readouterr().err
    # THEN it fails with 66 as before, and the last line names the double free's severity
    # as what matched, and what the policy fails on; it says no leak
    assert code == EXIT_FAIL_ON, err
    assert "double_free" in err
    last = [line for line in err.splitlines() if "exit 66" in line]
    what = {"leak": "errors and leaks", "error": "errors other than leaks"}[fail_on]
    said = (
        r"kvscope: child pid \d+ exited normally, but findings of severity error matched"
        rf" --fail-on {fail_on} \(it fails a run on {what}\): exit 66"
    )
    assert len(last) == 1 and re.fullmatch(said, last[0]), last


@pytest.mark.slow
def test_header_scribble_is_found_while_running_and_analyzed(capfd, tmp_path, pool_name):
    # GIVEN a script that overwrites its pool's header magic and exits 0
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "scribble"), pool_name])
    err = capfd.readouterr().err
    # THEN the corruption is an error finding: --fail-on error exits 66, and the dump says so
    assert code == EXIT_FAIL_ON
    assert "header_corrupt" in err
    (path,) = dumps(tmp_path)
    assert main(["analyze", path]) == 1
    assert "header_corrupt" in capfd.readouterr().out


@pytest.mark.slow
def test_installed_command_runs_a_module_and_fails_on_leak(tmp_path, pool_name):
    # GIVEN a module (run with -m) that leaks, and the installed `kvscope` command
    (tmp_path / "leaky_mod.py").write_text(PRELUDE + SCRIPTS["leak"])
    exe = shutil.which("kvscope") or os.path.join(os.path.dirname(os.sys.executable), "kvscope")
    r = subprocess.run(
        [exe, "run", "--fail-on", "leak", "-m", "leaky_mod", pool_name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == EXIT_FAIL_ON, r.stderr
    assert "Traceback" not in r.stderr
    (path,) = dumps(tmp_path)
    r = subprocess.run([exe, "analyze", "--json", path], capture_output=True, text=True)
    assert r.returncode == 1
    assert any(f["kind"] == "leak_finished" for f in json.loads(r.stdout)["findings"])


@pytest.mark.slow
def test_installed_command_reports_a_sigkill(tmp_path, pool_name):
    exe = shutil.which("kvscope") or os.path.join(os.path.dirname(os.sys.executable), "kvscope")
    r = subprocess.run(
        [exe, "run", "--dump-dir", str(tmp_path), script(tmp_path, "sigkill"), pool_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 137
    assert "killed by SIGKILL" in r.stderr and "leak_dead_owner" in r.stderr
    assert len(dumps(tmp_path)) == 1


@pytest.mark.slow
def test_missing_module_is_exit_2(capfd, tmp_path):
    code = main(["run", "--dump-dir", str(tmp_path), "-m", "no_such_module_xyz"])
    assert code == 2
    assert "no module named 'no_such_module_xyz'" in capfd.readouterr().err


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.slow
def test_live_shows_the_first_pool_in_the_tui(capfd, tmp_path, pool_name, monkeypatch):
    # GIVEN a TUI that records what it was asked to show
    import kvscope.verbs.run as run_verb

    shown = []
    monkeypatch.setattr(
        run_verb,
        "load_run_top",
        lambda what="": lambda target, hz, script=None, stop=None: shown.append((target, hz)) or 0,
    )
    # WHEN a script runs with --live THEN the TUI opens on the pool the script created
    code = main(["run", "--live", "--hz", "4", script(tmp_path, "clean"), pool_name])
    assert code == 0
    assert shown == [(pool_name, 4.0)]


@pytest.mark.slow
def test_a_finding_only_the_exit_check_sees_is_no_leak(capfd, tmp_path, pool_name):
    # GIVEN a script that writes into a published, cached block after its last operation
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "late_write"), pool_name])
    err = capfd.readouterr().err
    # THEN the exit check finds it, the run fails on it, and nothing calls it a leak
    assert code == EXIT_FAIL_ON
    assert "published_block_modified" in err
    (path,) = dumps(tmp_path)
    reason = analysis_of(path)["pool"]["dump"]["reason"]
    assert "findings of severity error" in reason and "leak" not in reason


@pytest.mark.slow
def test_many_findings_of_one_kind_print_the_first_ten_as_they_land(capfd, tmp_path, pool_name):
    # GIVEN a script whose 14 requests each write their block's guard slot (guard mode)
    code = main(["run", "--dump-dir", str(tmp_path), script(tmp_path, "guard_writes"), pool_name])
    err = capfd.readouterr().err
    # THEN ten are printed as they land, then one line for the rest of that kind
    assert code != 0
    live = [x for x in err.splitlines() if x.startswith("kvscope: pool") and "guard_violation" in x]
    assert len(live) == LIVE_LINES_PER_KIND + 1 == 11
    assert "more guard_violation findings: not printed as they land" in live[-1]
    # AND every one is in the dump
    (path,) = dumps(tmp_path)
    kinds = [f["kind"] for f in analysis_of(path)["findings"]]
    assert kinds.count("guard_violation") == 14
