"""bench/bench_serve.py --mixes on the CPU: its arguments, the A100 memory regime on the tiny
model, and the report's table with Transformers' outputs compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import bench_serve  # noqa: E402
import serve_mixes  # noqa: E402
from server.checkpoint import LLAMA2_7B, random_model, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# every run on the tiny model, the engine on a step clock (the same on every machine)
QUICK = ["--mixes", "--device", "cpu", "--quick", "--step-clock"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clients", "abc"], "--clients: 'abc' is not a client count (1 or more)"),
        (["--clients", "12,0"], "--clients: '0' is not a client count (1 or more)"),
        (["--mix", "top-10,top10"], "--mix: 'top10' is none of uniform, top-10, long"),
        (["--shape", "scores"], "--shape: 'scores' is none of generate, short, score"),
        (["--hf-ways", "thread"], "--hf-ways: 'thread' is none of threads, batches"),
        (["--requests", "0"], "--requests must be 1 or more (got 0)"),
        (["--repeat", "0"], "--repeat must be 1 or more (got 0)"),
        (["--check", "-1"], "--check must be 0 or more (got -1)"),
        (["--choices", "4"], "--choices needs the score shape (--score)"),
        (["--only-profile", "4", "--mix", "top-10,long"], "--only-profile: one mix (--mix)"),
        (
            ["--only-profile", "4", "--score", "--short"],
            "--only-profile: one request shape (--shape, --score or --short)",
        ),
        (
            ["--only-profile", "4", "--table"],
            "--only-profile takes --mix and a request shape, not --table",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # WHEN a --mixes run is given a bad argument
    rc = bench_serve.main(["--mixes", "--device", "cpu", "--quick", *argv])
    # THEN it stops at once with one line that names it, and exit status 2
    err = capsys.readouterr().err
    assert rc == 2 and err == f"bench_serve.py: error: {message}\n"


@pytest.mark.parametrize("flag", [["--score"], ["--table"], ["--memory"], ["--repeat", "3"]])
def test_the_report_regimes_options_need_mixes(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # WHEN an option of the report's regime is given without --mixes (it would be ignored)
    rc = bench_serve.main(["--device", "cpu", "--quick", *flag])
    # THEN it is an error, not a run of the other table
    assert rc == 2
    assert capsys.readouterr().err == f"bench_serve.py: error: {flag[0]} needs --mixes\n"


def test_the_a100_budget_is_llama_2_7bs_in_any_model() -> None:
    # GIVEN the weights' bytes from a model's shape, which are its parameters' bytes
    for config in (serve_mixes.QUICK, tiny_model(0).config):
        model = random_model(config, "cpu", torch.float16)
        assert serve_mixes.config_weight_bytes(config, 2) == serve_mixes.weight_bytes(model)
        assert serve_mixes.weight_bytes(model.fuse()) == serve_mixes.weight_bytes(model)
    # THEN the A100 40GB's budget is 0.9 x 40 GiB less Llama-2-7B's 6.74B fp16 parameters and
    # 1 GiB of activations, in blocks of its K/V (16 tokens x 32 layers x 2 x 4096 x 2 bytes)
    weights = serve_mixes.config_weight_bytes(LLAMA2_7B, 2)
    assert weights == 6_738_415_616 * 2
    assert serve_mixes.config_block_bytes(LLAMA2_7B, 2) == 16 * 32 * 2 * 4096 * 2 == 8 * 2**20
    assert serve_mixes.a100_blocks() == int((0.9 * 40 * 2**30 - weights - 2**30) // 2**23) == 2873


@pytest.mark.slow
def test_the_a100_regime_runs_on_the_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # WHEN the A100 memory regime runs on the tiny model (its blocks 32 KiB, not 8 MiB)
    out = tmp_path / "a100.json"
    argv = ["--memory", "a100", "--mix", "top-10", "--score", "--clients", "12,16"]
    rc = bench_serve.main([*QUICK, *argv, "--requests", "24", "--table", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())
    # THEN its pool has the A100's 2,873 blocks, in this model's bytes
    block_bytes = results["block_bytes"]
    assert block_bytes == 2 * 2 * 16 * 4 * 32 * 4  # K and V, 2 layers, 16 tokens, 4 x 32, fp32
    assert results["budget"] == "fixed" and results["num_blocks"] == results["a100_blocks"] == 2873
    assert results["kv_budget_bytes"] == results["a100_kv_budget_bytes"] == 2873 * block_bytes
    # AND every case served every request, on that pool, never short of it
    assert len(results["cases"]) == 4
    for c in results["cases"]:
        assert c["num_blocks"] == 2873 and c["requests"] == 24 and c["failed"] == 0
        assert 0 < c["kv"]["peak_bytes"] <= 2873 * block_bytes and c["preemptions"] == 0
    # AND the table as the report prints it has kvscope's figures at 12 clients (no HF ran),
    # and the memory regime's table names the budget in this model's bytes
    table = capsys.readouterr().out
    off, on = (
        next(c for c in results["cases"] if c["clients"] == 12 and c["sharing"] == sharing)
        for sharing in (False, True)
    )
    held = [c["kv"]["mean_bytes"] / 2**20 for c in (off, on)]
    assert (
        f"| top-10 | score | - | {off['requests_per_s']:.1f} | {on['requests_per_s']:.1f} | "
        f"{on['requests_per_s'] / off['requests_per_s'] - 1:+.0%} | +87% | - | "
        f"{held[0]:.2f} MiB → {held[1]:.2f} MiB ({held[1] / held[0] - 1:+.0%}; the report -31%) | "
        f"- / {off['ttft_admitted_p95_ms']:.0f} / {on['ttft_admitted_p95_ms']:.0f} ms |"
    ) in table
    assert "2873 blocks of 16 tokens (89.78 MiB of this model's K/V)" in table


def test_a_profile_of_one_mix_in_one_request_shape(tmp_path: Path) -> None:
    # WHEN the top-10 mix's scoring requests are profiled
    out = tmp_path / "profile.json"
    argv = ["--only-profile", "6", "--mix", "top-10", "--score", "--json", str(out)]
    assert bench_serve.main(["--mixes", "--device", "cpu", "--quick", *argv]) == 0
    (profile,) = json.loads(out.read_text())["profiles"]
    # THEN the profile served 6 of them (scored, nothing generated), its hottest functions listed
    assert (profile["mix"], profile["shape"]) == ("top-10", "score")
    assert profile["served"]["requests"] == 6 and profile["served"]["output_tokens"] == 0
    assert profile["served"]["scored_tokens"] > 0 and "paged_prefill" in profile["cprofile_tottime"]


@pytest.mark.slow  # importing transformers takes seconds
def test_the_table_says_whether_transformers_outputs_are_the_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", exc_type=ImportError)
    # WHEN the report's table runs with Transformers beside, its outputs compared on 4 requests
    # (at 12 clients both ways; at 16 in padded batches, in the memory regime's table)
    out = tmp_path / "hf.json"
    argv = ["--baseline", "hf", "--mix", "top-10", "--shape", "short,score", "--requests", "12"]
    argv += ["--clients", "12,16", "--hf-requests", "6", "--table", "--json", str(out)]
    assert bench_serve.main([*QUICK, *argv]) == 0
    table = capsys.readouterr().out
    results = json.loads(out.read_text())
    hf = [c for c in results["cases"] if c["engine"].startswith("hf-")]
    assert sorted(c["engine"] for c in hf) == ["hf-batches"] * 4 + ["hf-threads"] * 2
    for c in hf:
        # THEN Transformers served its 6 requests, 4 of them compared and equal to the engine's
        assert c["requests"] == 6 and c["ttft_admitted_p95_ms"] > 0
        if c["clients"] == 12:
            assert c["check"]["equal"] == c["check"]["requests"] == 4
    rows = [line for line in table.splitlines() if line.startswith("| top-10 |")]
    # AND the table as the report prints it has the better HF way as the baseline, beside
    # kvscope without and with sharing, at 12 clients
    for row, shape in zip(rows[:2], ["short", "score"]):
        best = max(
            (c for c in hf if c["shape"] == shape and c["clients"] == 12),
            key=lambda c: c["requests_per_s"],
        )
        off, on = (
            next(
                c
                for c in results["cases"]
                if (c["engine"], c["shape"], c["clients"], c["sharing"])
                == ("kvscope", shape, 12, sharing)
            )
            for sharing in (False, True)
        )
        q_hf, q_off, q_on = (c["requests_per_s"] for c in (best, off, on))
        label = serve_mixes.SHAPE_LABELS[shape]
        assert row.startswith(
            f"| top-10 | {label} | {q_hf:.1f} | {q_off:.1f} | {q_on:.1f} | "
            f"{q_on / q_off - 1:+.0%} | +87% | {q_on / q_hf:.1f}x | "
        )
        ttfts = " / ".join(f"{c['ttft_admitted_p95_ms']:.0f}" for c in (best, off, on))
        assert row.endswith(f"| {ttfts} ms |")
    # AND the full table's row of each shape says Transformers' outputs were the engine's
    assert [row.split(" | ")[1] for row in rows[2:4]] == ["short", "score"]
    assert all(row.endswith("| 4/4, 4/4 |") for row in rows[2:4])
    # AND the memory regime's rows give Transformers' TTFT p95 beside the engine's
    memory = {tuple(row.split(" | ")[1:3]): row for row in rows[4:]}
    assert sorted(memory) == [("score", "12"), ("score", "16"), ("short", "12"), ("short", "16")]
    for (shape, n), row in memory.items():
        (ttft,) = [
            c["ttft_admitted_p95_ms"]
            for c in hf
            if (c["engine"], c["shape"], c["clients"]) == ("hf-batches", shape, int(n))
        ]
        assert row.endswith(f"| {ttft:.1f} |")
