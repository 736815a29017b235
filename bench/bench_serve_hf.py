"""The prefix-sharing report's own baseline: Hugging Face Transformers serving the same requests.

    python bench/bench_serve.py --mixes --baseline hf --device cuda   # beside the engine's table

Transformers' `LlamaForCausalLM` with its own `DynamicCache` (`past_key_values` per request: a
shared prefix is computed and stored once per request), on the very weights the kvscope engine
serves (its parameters are the engine model's tensors: nothing copied). Two ways, as a service
built on it would run:
- a thread per client, each calling `generate` (or, for a scoring request, one forward over
  prompt + continuation and a log-softmax gather, as lm-eval-harness's HF backend does) on one
  request at a time;
- padded batches of one request per client (generation left-padded, scoring right-padded); a
  batch ends when its longest request does.
Greedy; outputs and scores come back for the comparison with the engine's (`compare`).

KV memory: `peak_kv_bytes` is what the caches of the requests in flight reach (a padded batch's
cache holds every row at the batch's longest length); on CUDA `peak_memory_above_weights` is
measured (torch's peak allocation less the weights: KV and the forward's activations).

transformers is installed at benchmark time (`pip install -e '.[hf]'`), not vendored.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch
from server.model import LlamaModel
from server.report import RequestResult, percentile
from server.workload import Request


class FirstToken:
    """A `generate` streamer that notes when the first generated token is out (its first
    `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at_s = -1.0

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at_s = time.monotonic()

    def end(self) -> None:
        if self.at_s < 0:
            self.at_s = time.monotonic()


class HFBaseline:
    """Transformers' Llama on the weights of a kvscope `LlamaModel`."""

    def __init__(self, model: LlamaModel) -> None:
        import transformers

        self.device = model.lm_head.weight.device
        config = transformers.LlamaConfig(**model.config.to_hf())
        with torch.device("meta"):
            hf = transformers.LlamaForCausalLM(config)
        # the engine model's tensors themselves (its fused projections' views)
        missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False, assign=True)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        if config.tie_word_embeddings:
            hf.tie_weights()
        # the rotary frequencies are a buffer outside the state dict: made again on the device
        with torch.device(self.device):
            hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
        self.hf = hf.eval()
        cfg = model.config
        itemsize = model.lm_head.weight.element_size()
        self.kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        self.cuda = self.device.type == "cuda"

    # -- one request, one batch ------------------------------------------------------------

    @torch.inference_mode()
    def _one(self, request: Request) -> tuple[Any, float]:
        """One request alone: its tokens (or (logprobs, is_greedy)) and when its first token
        (its scores) was out."""
        tokens = request.prompt + request.continuation
        ids = torch.tensor([tokens], device=self.device)
        if request.is_scoring:
            logits = self.hf(ids).logits[0]
            return self._scores(logits, request), time.monotonic()
        streamer = FirstToken()
        out = self.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer,
        )  # fmt: skip
        return out[0, len(tokens) :].tolist(), streamer.at_s

    @staticmethod
    def _scores(logits: torch.Tensor, request: Request) -> tuple[list[float], bool]:
        """Log-probabilities of the continuation from one sequence's logits [T, vocab]."""
        first, n = len(request.prompt) - 1, len(request.continuation)
        rows = logits[first : first + n].float().log_softmax(-1)
        target = torch.tensor(request.continuation, device=rows.device)
        logprobs = rows.gather(1, target[:, None])[:, 0].tolist()
        return logprobs, bool((rows.argmax(-1) == target).all())

    @torch.inference_mode()
    def _batch(self, requests: list[Request]) -> tuple[list[Any], float]:
        """A padded batch: every request's tokens (or scores), and when the first token was out."""
        lengths = [r.num_tokens for r in requests]
        width = max(lengths)
        ids = torch.zeros((len(requests), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        scoring = requests[0].is_scoring
        for i, r in enumerate(requests):
            tokens = torch.tensor(r.prompt + r.continuation)
            # scoring right-padded (positions as alone); generation left-padded
            cols = slice(0, lengths[i]) if scoring else slice(width - lengths[i], width)
            ids[i, cols], mask[i, cols] = tokens, 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if scoring:
            logits = self.hf(ids, attention_mask=mask).logits
            return [self._scores(logits[i], r) for i, r in enumerate(requests)], time.monotonic()
        streamer = FirstToken()
        out = self.hf.generate(
            ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in requests),
            do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer,
        )  # fmt: skip
        return [out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(requests)], (
            streamer.at_s
        )

    # -- serving ---------------------------------------------------------------------------

    def serve_threads(self, requests: list[Request], clients: int) -> dict[str, Any]:
        """A thread per client, each serving one request at a time until none is left."""
        queue = deque(requests)
        lock = threading.Lock()
        results: dict[str, Any] = {}
        ttfts: list[float] = []
        in_flight = [0, 0]  # KV bytes of the requests in flight, and its peak
        errors: list[str] = []

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    request = queue.popleft()
                    kv = self._kv_bytes(request, request.num_tokens + request.max_tokens)
                    in_flight[0] += kv
                    in_flight[1] = max(in_flight)
                began = time.monotonic()
                try:
                    out, first_s = self._one(request)
                except RuntimeError as exc:
                    # (cuDNN's attention has failed in one of several threads on an H200)
                    with lock:
                        errors.append(f"{request.request_id}: {exc}")
                        in_flight[0] -= kv
                    continue
                with lock:
                    results[request.request_id] = out
                    ttfts.append((first_s - began) * 1000.0)
                    in_flight[0] -= kv

        def run() -> None:
            threads = [threading.Thread(target=client) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        out = self._measured(run, requests, results, ttfts, in_flight)
        out["failed"] = len(errors)
        out["errors"] = errors[:3]
        return out

    def serve_batches(self, requests: list[Request], batch: int) -> dict[str, Any]:
        """Padded batches of `batch` requests, one after another."""
        results: dict[str, Any] = {}
        ttfts: list[float] = []
        peak = [0, 0]

        def run() -> None:
            for i in range(0, len(requests), batch):
                group = requests[i : i + batch]
                began = time.monotonic()
                outs, first_s = self._batch(group)
                ttfts.extend([(first_s - began) * 1000.0] * len(group))
                results.update({r.request_id: o for r, o in zip(group, outs, strict=True)})
                width = max(r.num_tokens for r in group) + max(r.max_tokens for r in group)
                peak[1] = max(peak[1], len(group) * self._kv_bytes(group[0], width))

        return self._measured(run, requests, results, ttfts, peak)

    def _kv_bytes(self, request: Request, length: int) -> int:
        """The cache of `length` tokens (a scoring forward keeps all but none past the last)."""
        return self.kv_token_bytes * (length - 1)

    def _measured(
        self, run: Any, requests: list[Request], results: dict, ttfts: list, kv: list
    ) -> dict[str, Any]:
        """Time `run`, and on CUDA its peak allocation above what was allocated before."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        began = time.monotonic()
        run()
        if self.cuda:
            torch.cuda.synchronize()
        duration_s = time.monotonic() - began
        out = {
            "requests": len(results),
            "duration_s": round(duration_s, 3),
            # requests served (a failed one is not counted)
            "requests_per_s": round(len(results) / duration_s, 3),
            "output_tokens": sum(len(v) for v in results.values() if isinstance(v, list)),
            "ttft_admitted_p95_ms": round(percentile(ttfts, 95), 1),
            "ttft_admitted_p50_ms": round(percentile(ttfts, 50), 1),
            "peak_kv_bytes": kv[1],
            "preemptions": 0,
            "results": results,
        }
        if self.cuda:
            out["peak_memory_above_weights"] = torch.cuda.max_memory_allocated() - base
        return out

    @staticmethod
    def compare(
        requests: list[Request], ours: dict[str, RequestResult], theirs: dict[str, Any]
    ) -> dict[str, Any]:
        """The engine's outputs against Transformers' on the same requests: how many are equal
        (tokens; scores: is_greedy the same and log-probabilities within 1e-3 + 1% of their
        size), the largest log-probability difference, and where each generation first
        differs (-1: nowhere)."""
        equal, worst, first_diff = 0, 0.0, []
        for r in requests:
            if r.request_id not in theirs:
                continue
            mine, hers = ours[r.request_id], theirs[r.request_id]
            if r.is_scoring:
                logprobs, greedy = hers
                diffs = [abs(a - b) for a, b in zip(mine.logprobs, logprobs, strict=True)]
                worst = max(worst, *diffs)
                close = all(d <= 1e-3 + 0.01 * abs(b) for d, b in zip(diffs, logprobs, strict=True))
                equal += close and mine.is_greedy == greedy
            else:
                tokens = mine.outputs[0]
                equal += tokens == hers
                diff = [i for i, (a, b) in enumerate(zip(tokens, hers, strict=True)) if a != b]
                first_diff.append(diff[0] if diff else -1)
        out: dict[str, Any] = {"requests": len(requests), "equal": equal}
        if any(r.is_scoring for r in requests):
            out["max_logprob_diff"] = round(worst, 5)
        else:
            out["first_difference"] = first_diff
        return out
