"""Requests to serve: a seeded synthetic generator, or a JSONL file.

The generator draws Poisson arrivals, uniform prompt and output lengths, and a shared-prefix
mix: `num_prefixes` system prompts, one of which starts `prefix_share` of the requests.
A JSONL file holds one request per line:

    {"id": "a", "prompt": "text" | "prompt_tokens": [1, 2], "max_tokens": 16,
     "arrival_s": 0.0, "n": 1, "temperature": 0.0, "cancel_after": 0}

`cancel_after` > 0: the client cancels the request once it has that many output tokens (the
server then aborts it in the pool).

A scoring request (lm-eval-harness's loglikelihood) gives a continuation instead of
`max_tokens`: `"continuation": "text" | "continuation_tokens": [3, 4]`. The server computes the
prompt and the continuation in one pass and returns each continuation token's log-probability
given what precedes it, and whether greedy decoding would have produced the continuation
(`RequestResult.logprobs`, `is_greedy`); it generates nothing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ServeError


@dataclass
class Request:
    """One request: a prompt of token ids, how many tokens to generate, when it arrives.

    A scoring request has a `continuation` and `max_tokens == 0`: the continuation's tokens are
    scored (log-likelihoods, one forward over prompt + continuation), nothing is generated.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    n: int = 1
    temperature: float = 0.0
    prefix_id: int = -1
    cancel_after: int = 0
    # scoring request: the tokens to score after the prompt (empty: a generation request)
    continuation: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.prompt and self.n >= 1 and self.cancel_after >= 0
        if self.continuation:
            assert self.max_tokens == 0 and self.n == 1, "a scoring request generates nothing"
        else:
            assert self.max_tokens >= 1

    @property
    def is_scoring(self) -> bool:
        """Whether the request scores a continuation instead of generating."""
        return bool(self.continuation)

    @property
    def num_tokens(self) -> int:
        """Prompt and continuation tokens: what the request's sequence starts with."""
        return len(self.prompt) + len(self.continuation)


@dataclass
class WorkloadSpec:
    """Knobs of the synthetic generator; lengths are inclusive (low, high) ranges."""

    num_requests: int = 64
    rate: float = 200.0
    prompt_len: tuple[int, int] = (8, 48)
    output_len: tuple[int, int] = (8, 24)
    num_prefixes: int = 10
    prefix_share: float = 0.7
    prefix_len: tuple[int, int] = (16, 48)
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    cancel_share: float = 0.0


def generate_workload(spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """Seeded synthetic requests sorted by arrival; `rate <= 0` means all arrive at once."""
    rng = random.Random(spec.seed)
    prefixes = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(*spec.prefix_len))]
        for _ in range(spec.num_prefixes)
    ]
    requests: list[Request] = []
    now = 0.0
    for i in range(spec.num_requests):
        if spec.rate > 0 and i > 0:
            now += rng.expovariate(spec.rate)
        prefix_id = -1
        if prefixes and rng.random() < spec.prefix_share:
            prefix_id = rng.randrange(len(prefixes))
        suffix = [rng.randrange(vocab_size) for _ in range(rng.randint(*spec.prompt_len))]
        prompt = (prefixes[prefix_id] if prefix_id >= 0 else []) + suffix
        max_tokens = rng.randint(*spec.output_len)
        cancel_after = 0
        # drawn only when asked for, so that other workloads keep their seeded requests
        if spec.cancel_share > 0 and rng.random() < spec.cancel_share and max_tokens > 1:
            cancel_after = rng.randint(1, max_tokens - 1)
        requests.append(
            Request(
                request_id=f"r{i}",
                prompt=prompt or [rng.randrange(vocab_size)],
                max_tokens=max_tokens,
                arrival_s=now,
                n=spec.n,
                temperature=spec.temperature,
                prefix_id=prefix_id,
                cancel_after=cancel_after,
            )
        )
    return requests


def read_jsonl(path: Path, vocab_size: int) -> list[Request]:
    """Requests from a JSONL file; a bad line is a `ServeError` naming the file and line."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc.__class__.__name__
        raise ServeError(f"--jsonl {path}: cannot read it ({reason})") from exc
    requests: list[Request] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ServeError(f"{where}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ServeError(f"{where}: expected a JSON object per line")
        request = _request_from(record, f"r{len(requests)}", vocab_size, where)
        if request.request_id in seen:
            raise ServeError(f"{where}: duplicate id {request.request_id!r}")
        seen.add(request.request_id)
        requests.append(request)
    if not requests:
        raise ServeError(f"--jsonl {path}: no requests in it")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def write_jsonl(requests: list[Request], path: Path) -> None:
    """Write requests in the format `read_jsonl` reads."""
    with open(path, "w") as f:
        for r in requests:
            record = {
                "id": r.request_id,
                "prompt_tokens": r.prompt,
                "max_tokens": r.max_tokens,
                "arrival_s": r.arrival_s,
                "n": r.n,
                "temperature": r.temperature,
                "cancel_after": r.cancel_after,
            }
            if r.continuation:
                record["continuation_tokens"] = r.continuation
            f.write(json.dumps(record) + "\n")


def _request_from(record: dict[str, Any], default_id: str, vocab_size: int, where: str) -> Request:
    """Validate one JSONL record into a Request."""
    if "prompt_tokens" in record:
        prompt = record["prompt_tokens"]
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and 0 <= t < vocab_size for t in prompt
        ):
            raise ServeError(f"{where}: prompt_tokens must be a list of ints in [0, {vocab_size})")
    elif isinstance(record.get("prompt"), str):
        # No tokenizer here: a text prompt is its UTF-8 bytes, folded into the vocabulary.
        prompt = [b % vocab_size for b in record["prompt"].encode()]
    else:
        raise ServeError(f"{where}: needs 'prompt' (a string) or 'prompt_tokens' (a list)")
    if not prompt:
        raise ServeError(f"{where}: empty prompt")
    continuation = _continuation(record, vocab_size, where)
    # a scoring request generates nothing: max_tokens 0 (and only 0)
    fields = {
        "max_tokens": (0, 0) if continuation else (16, 1),
        "n": (1, 1),
        "cancel_after": (0, 0),
    }
    values: dict[str, Any] = {}
    for name, (default, least) in fields.items():
        value = record.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ServeError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
        values[name] = value
    if continuation and (values["max_tokens"] or values["n"] != 1):
        raise ServeError(f"{where}: a scoring request (continuation) takes no max_tokens and n=1")
    for name in ("arrival_s", "temperature"):
        value = record.get(name, 0.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ServeError(f"{where}: {name} must be a number >= 0, got {value!r}")
        values[name] = float(value)
    return Request(
        request_id=str(record.get("id", default_id)),
        prompt=prompt,
        max_tokens=values["max_tokens"],
        arrival_s=values["arrival_s"],
        n=values["n"],
        temperature=values["temperature"],
        cancel_after=values["cancel_after"],
        continuation=continuation,
    )


def _continuation(record: dict[str, Any], vocab_size: int, where: str) -> list[int]:
    """A scoring request's continuation tokens ([] for a generation request)."""
    if "continuation_tokens" in record:
        tokens = record["continuation_tokens"]
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                for t in tokens
            )
        ):
            raise ServeError(
                f"{where}: continuation_tokens must be a non-empty list of ints in [0, {vocab_size})"
            )
        return tokens
    if "continuation" in record:
        text = record["continuation"]
        if not isinstance(text, str) or not text:
            raise ServeError(f"{where}: continuation must be a non-empty string")
        return [b % vocab_size for b in text.encode()]
    return []
