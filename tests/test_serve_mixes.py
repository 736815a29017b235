"""The prompt mixes of bench/serve_mixes.py are what docs/BENCHMARKS.md says they are."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

from serve_mixes import mix_requests  # noqa: E402


def mean_prompt(mix: str) -> float:
    requests = mix_requests(mix, 400, vocab_size=32000)
    return sum(len(r.prompt) for r in requests) / len(requests)


def test_prompts_average_128_tokens_and_1024_in_the_long_mix() -> None:
    # GIVEN 400 requests of each mix, WHEN their prompts are measured
    # THEN uniform and top-10 average about 128 tokens, long about 1,024
    assert 118 <= mean_prompt("uniform") <= 138
    assert 118 <= mean_prompt("top-10") <= 138
    assert 990 <= mean_prompt("long") <= 1060


def test_the_ten_most_frequent_prompts_carry_over_60_percent_of_top10_traffic() -> None:
    # GIVEN the top-10 mix and the uniform one
    top10 = Counter(tuple(r.prompt) for r in mix_requests("top-10", 400, vocab_size=32000))
    uniform = Counter(tuple(r.prompt) for r in mix_requests("uniform", 400, vocab_size=32000))
    # WHEN the ten most frequent whole prompts are counted
    share = sum(n for _, n in top10.most_common(10)) / 400
    # THEN they are at least 60% of the top-10 mix, and in uniform no prompt repeats whole
    assert share >= 0.6
    assert uniform.most_common(1)[0][1] == 1


def test_the_same_seed_gives_the_same_requests() -> None:
    a = mix_requests("top-10", 50, vocab_size=1000)
    b = mix_requests("top-10", 50, vocab_size=1000)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    assert all(16 <= r.max_tokens <= 48 for r in a)
