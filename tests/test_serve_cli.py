"""serve.py end to end: flags, output, user errors, worker processes sharing one pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from serve import main  # noqa: E402
from server import worker  # noqa: E402
from server.checkpoint import save_model, tiny_model  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.model import generate_reference  # noqa: E402
from server.runconfig import RunConfig  # noqa: E402
from server.runner import run  # noqa: E402
from server.workload import Request  # noqa: E402

from kvscope.allocator import KVPool  # noqa: E402
from kvscope.allocator.segment import segment_path  # noqa: E402

SMALL = ["--requests", "12", "--output-len", "2:6", "--rate", "0", "--no-progress"]


def pool_name() -> str:
    return f"test-serve-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*SMALL, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_summary_table_has_every_metric(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    for label in (
        "requests",
        "output tokens/s",
        "time to first token p50",
        "time to first token p95",
        "KV utilization",
        "internal fragmentation",
        "peak concurrent requests",
        "prompt tokens cached",
        "preemptions",
    ):
        assert label in out


def test_json_summary_of_paged_and_static(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the same workload on the paged pool and on static reservations
    paged = run_json(capsys, "--num-blocks", "32")
    static = run_json(capsys, "--num-blocks", "32", "--baseline", "static")
    # THEN both serve everything; paging packs the cache tighter and shares prefixes
    assert paged["requests"] == static["requests"] == 12
    assert paged["failed"] == static["failed"] == 0
    assert paged["output_tokens"] == static["output_tokens"] > 0
    assert paged["kv_utilization"] > static["kv_utilization"]
    assert paged["internal_fragmentation"] < static["internal_fragmentation"]
    assert paged["peak_concurrent_requests"] >= static["peak_concurrent_requests"]
    assert static["prefix_hit_rate"] == 0.0 and static["extra"]["max_len"] > 0
    assert paged["extra"]["cache_findings"] == 0


def test_jsonl_requests_and_outputs_file(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # GIVEN a JSONL file of text prompts
    jsonl = tmp_path / "requests.jsonl"
    jsonl.write_text(
        '{"id": "x", "prompt": "Hello, pool", "max_tokens": 5}\n'
        '{"id": "y", "prompt": "Hello, pool!", "max_tokens": 3, "n": 2}\n'
    )
    outputs = tmp_path / "out.jsonl"
    # WHEN served with the outputs written out
    assert main(["--jsonl", str(jsonl), "--outputs", str(outputs), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2
    # THEN each request's tokens are the greedy reference continuation
    model = tiny_model(0)
    lines = {d["id"]: d for d in map(json.loads, outputs.read_text().splitlines())}
    assert lines["x"]["outputs"] == [generate_reference(model, list(b"Hello, pool"), 5)]
    assert lines["y"]["outputs"] == [generate_reference(model, list(b"Hello, pool!"), 3)] * 2


def test_a_checkpoint_directory_serves(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    save_model(tiny_model(9), tmp_path / "ckpt")
    summary = run_json(capsys, "--model", str(tmp_path / "ckpt"), "--threads", "1")
    assert summary["requests"] == 12 and summary["failed"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: not a directory"),
        (
            ["--jsonl", "/nonexistent.jsonl"],
            "--jsonl /nonexistent.jsonl: cannot read it (No such file or directory)",
        ),
        (["--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"serve.py: error: {message}"


def test_a_model_dir_without_config_is_a_user_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--model", str(tmp_path), "--no-progress"]) == 2
    assert "no config.json there" in capsys.readouterr().err


def test_bad_jsonl_is_a_user_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert main(["--jsonl", str(tmp_path / "bad.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: not JSON" in err and "Traceback" not in err


def test_keep_pool_leaves_it_for_kvscope_top(capsys: pytest.CaptureFixture[str]) -> None:
    name = pool_name()
    run_json(capsys, "--pool-name", name, "--keep-pool")
    pool = KVPool.attach(name)
    try:
        assert pool.config.num_blocks == 64
        assert pool.check() == []
    finally:
        pool.close()
        pool.unlink()
    # without --keep-pool the pool is gone after the run
    run_json(capsys, "--pool-name", name)
    assert not os.path.lexists(segment_path(name))


@pytest.mark.slow
def test_workers_reuse_each_others_prefixes() -> None:
    # GIVEN two workers; the first request goes to worker 0, the second, later, to worker 1
    model = tiny_model(0)
    prefix = list(range(40, 80))
    requests = [
        Request("first", prefix + [1, 2, 3], max_tokens=4, arrival_s=0.0),
        Request("second", prefix + [7, 8], max_tokens=4, arrival_s=0.5),
        Request("third", [5, 6, 7], max_tokens=3, arrival_s=0.0),
    ]
    config = RunConfig(workers=2, pool_name=pool_name(), block_size=16)
    # WHEN they serve from one pool
    summary, results = run(config, requests)
    by_id = {r.request_id: r for r in results}
    # THEN worker 1 found the 32 prefix tokens (two full blocks) worker 0 computed
    assert by_id["first"].worker == 0 and by_id["second"].worker == 1
    assert by_id["first"].num_hit_tokens == 0 and by_id["second"].num_hit_tokens == 32
    # AND every output is still the reference, and the summary counts both workers
    for request in requests:
        expected = generate_reference(model, request.prompt, request.max_tokens)
        assert by_id[request.request_id].outputs == [expected]
    assert summary.workers == 2 and summary.requests == 3
    assert summary.extra["cache_findings"] == 0


def test_when_every_worker_dies_the_run_fails_and_removes_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN workers that die before serving (forked, so they inherit the patch)
    monkeypatch.setattr(worker, "build_model", lambda config: os._exit(3))
    name = pool_name()
    # WHEN the run starts, THEN it fails naming the exit code, and the pool is gone
    with pytest.raises(RuntimeError, match="every worker died: worker 0 exited with code 3"):
        run(RunConfig(workers=2, pool_name=name), [Request("a", [1, 2], max_tokens=2)])
    assert not os.path.lexists(segment_path(name))


@pytest.mark.slow
def test_the_other_workers_keep_serving_after_one_is_killed(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # GIVEN two workers, and worker 1 SIGKILLed in the middle of its third step (the patch is
    # inherited by the forked workers)
    real_step = Engine.step
    steps = {"n": 0}

    def step(self: Engine) -> int:
        steps["n"] += 1
        if self.worker == 1 and steps["n"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    model = tiny_model(0)
    requests = [Request(f"r{i}", [i + 1] * 20, max_tokens=6) for i in range(6)]
    config = RunConfig(workers=2, pool_name=pool_name(), block_size=16, clock="steps")
    # WHEN they serve
    summary, results = run(config, requests)
    # THEN worker 0 served all its requests exactly, worker 1's three failed, naming the kill
    by_id = {r.request_id: r for r in results}
    for rid in ("r0", "r2", "r4"):
        request = requests[int(rid[1:])]
        assert by_id[rid].outputs == [generate_reference(model, request.prompt, 6)]
    for rid in ("r1", "r3", "r5"):
        assert "worker 1 killed by SIGKILL" in by_id[rid].error
    assert summary.requests == 3 and summary.failed == 3
    assert summary.extra["workers_died"] == [{"worker": 1, "how": "killed by SIGKILL", "failed": 3}]
    # AND the dead worker's blocks went back to the pool: it ends with no findings
    assert summary.extra["cache_findings"] == 0
    assert "worker 1" in capfd.readouterr().err


@pytest.mark.slow
def test_serve_py_runs_as_a_script() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "serve.py"), *SMALL, "--workers", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 12 and summary["workers"] == 2
