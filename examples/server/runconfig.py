"""RunConfig: how a run is set up, and the model, caches and engine built from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_config, load_model, random_model, tiny_model
from .engine import Engine, StepClock
from .errors import ServeError
from .graphs import StepGraphs
from .model import LlamaModel, ModelConfig
from .offload import Offloader
from .static import StaticCache, StaticGeometry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RunConfig:
    """Everything a run needs besides its requests."""

    model_path: Path | None = None
    # the geometry of a random-weight model built on the device instead of a checkpoint
    # (checkpoint.random_model: timing a large shape without writing and loading its weights)
    model_shape: ModelConfig | None = None
    model_seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    baseline: str = "paged"
    num_blocks: int = 64
    block_size: int = 16
    max_len: int = 0
    workers: int = 1
    pool_name: str = ""
    keep_pool: bool = False
    guard: bool = False
    prefix_cache: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    prefill_chunk: int = 64
    seed: int = 0
    # torch threads per process; 0: one for the tiny model (OpenMP only slows tiny matmuls)
    threads: int = 0
    # "wall": arrivals on the wall clock; "steps": on a virtual clock advancing per engine step
    # (the same schedule on every machine: engine.StepClock)
    clock: str = "wall"
    # replay steps as CUDA graphs (graphs.StepGraphs: decode steps and steps holding prompt
    # chunks; on CUDA)
    cuda_graphs: bool = False
    # engine processes each with its own pool, on cuda:0..ranks-1 (or all on the CPU)
    ranks: int = 1
    # with ranks > 1: the rank where `kvscope run --inject` faults fire (-1: every rank)
    fault_rank: int = -1
    # publish the pool's prefix index as vLLM's KV-event stream here (`tcp://*:5557`; "": off);
    # with ranks, rank r on the port plus r (publisher.offset_endpoint)
    kv_events: str = ""
    # the publisher's replay (ROUTER) endpoint, offset by rank as kv_events ("": none)
    kv_events_replay: str = ""
    # copy finished requests' K/V to host memory under read leases (server/offload.py)
    offload: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def num_threads(self) -> int:
        """Threads each serving process should run torch with (0: leave torch's default)."""
        if self.threads > 0:
            return self.threads
        tiny = self.model_path is None and self.model_shape is None
        return 1 if tiny or self.workers > 1 else 0


def rank_devices(config: RunConfig) -> list[str]:
    """The device of each rank: cuda:0..N-1 on CUDA, the CPU for all on the CPU."""
    if config.device.startswith("cuda"):
        return [f"cuda:{i}" for i in range(config.ranks)]
    return [config.device] * config.ranks


def model_config(config: RunConfig) -> ModelConfig:
    """The geometry of the run's model, read without loading its weights."""
    if config.model_shape is not None:
        return config.model_shape
    if config.model_path is None:
        return ModelConfig()
    return load_config(config.model_path)


def resolve_dtype(config: RunConfig) -> str:
    """`--dtype auto` made explicit: float32 on the CPU (half matmuls there are slow); on CUDA
    the checkpoint's half dtype, else float16, because the Triton kernels take fp16/bf16 only."""
    if config.dtype != "auto":
        return config.dtype
    if config.device == "cpu":
        return "float32"
    extra = model_config(config).extra
    wanted = extra.get("torch_dtype") or extra.get("dtype")
    return wanted if wanted in ("float16", "bfloat16") else "float16"


def build_model(config: RunConfig) -> LlamaModel:
    """The checkpoint at `model_path`, or the built-in tiny model, on the configured device,
    its projections fused for serving (`LlamaModel.fuse`)."""
    dtype = DTYPES[resolve_dtype(config)]
    if config.model_shape is not None:
        model = random_model(config.model_shape, config.device, dtype, config.model_seed)
    elif config.model_path is not None:
        model = load_model(config.model_path, dtype=dtype, device=config.device)
    else:
        model = tiny_model(config.model_seed).to(device=config.device, dtype=dtype)
    return model.fuse()


def build_cache(config: RunConfig, max_len: int, workers: int = 1) -> StaticCache:
    """The static baseline's private cache (a 1/workers share of the blocks each)."""
    model = model_config(config)
    geometry = StaticGeometry(
        num_blocks=config.num_blocks // workers,
        block_size=config.block_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=DTYPES[resolve_dtype(config)],
        device=config.device,
    )
    return StaticCache(geometry, max_len)


def create_pool(config: RunConfig, max_n: int = 1) -> Any:
    """A new shared pool shaped for the model, with sequence slots for every worker's streams."""
    from kvscope.allocator import KVPool, PoolConfig, PoolError

    model = model_config(config)
    # the workers, the supervisor and a few attached tools (kvscope top, analyze)
    max_clients = max(8, 2 * config.workers + 2)
    pool_config = PoolConfig(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=resolve_dtype(config),
        device=config.device,
        # A process keeps a reserve of sequence slots only when max_seqs >= 4 x max_clients
        # (docs/POOL.md); without one, every allocation and free takes the sequence table's
        # lock. 16 slots at a time per process here.
        max_clients=max_clients,
        max_seqs=max(2 * config.workers * config.max_num_seqs * max_n, 4 * max_clients * 16),
        guard=config.guard,
    )
    try:
        return KVPool.create(config.pool_name, pool_config)
    except PoolError as exc:
        raise ServeError(f"--pool-name {config.pool_name}: {exc}") from exc


def make_engine(
    config: RunConfig, model: LlamaModel, cache: Any, worker: int, max_len: int = 0
) -> Engine:
    """An engine with the run's batching limits (and its step graphs, captured here)."""
    graphs = None
    if config.cuda_graphs:
        assert max_len > 0, "step graphs need the longest sequence's length"
        graphs = StepGraphs(
            model,
            cache,
            config.max_num_seqs,
            max_len,
            max_tokens=config.max_num_batched_tokens,
            max_chunk=config.prefill_chunk,
        )
    engine = Engine(
        model,
        cache,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk=config.prefill_chunk,
        seed=config.seed,
        exclusive=config.workers == 1 or config.baseline == "static",
        worker=worker,
        prefix_cache=config.prefix_cache,
        clock=StepClock() if config.clock == "steps" else time.monotonic,
        graphs=graphs,
    )
    if config.offload and config.baseline != "static":
        engine.offload(Offloader(cache))
    return engine


def start_time(config: RunConfig, wall_start_s: float) -> float | None:
    """Where an engine's clock starts: the run's common wall-clock start, or (steps) its own."""
    return wall_start_s if config.clock == "wall" else None


def cache_extra(cache: Any) -> dict[str, Any]:
    """The cache's own counters and health at the end of the run."""
    stats = dict(cache.stats())
    return {"cache_stats": stats, "cache_findings": len(cache.check())}


def engine_extra(engine: Engine) -> dict[str, Any]:
    """Where a step's time went in the engine's thread (mean milliseconds per step and phase),
    and the streams the scheduler deferred."""
    timer = engine.timer
    steps = max(timer.num_steps, 1)
    phases = {k: round(v * 1000.0 / steps, 3) for k, v in timer.phase_s.items()}
    out: dict[str, Any] = {"engine_steps": timer.num_steps, "step_phase_ms": phases}
    # streams that waited for a prefix a running stream was computing (server/scheduler.py)
    out["deferred"] = engine.scheduler.num_deferred
    if engine.offloader is not None:
        out["offload"] = engine.offloader.extra()
    gpu = timer.gpu_seconds()
    if gpu:
        out["gpu_s"] = round(sum(seconds for _, seconds in gpu.values()), 4)
        out["gpu_step_ms"] = {k: round(s * 1000.0 / n, 3) for k, (n, s) in gpu.items()}
        out["steps_by_kind"] = {k: n for k, (n, _) in gpu.items()}
    if engine.graphs is not None:
        out["graph_replays"] = engine.graphs.num_replays
        out["static_forwards"] = engine.graphs.num_forwards
        out["mixed_step_forwards"] = engine.graphs.num_mixed
    return out


def start_kv_events(config: RunConfig, cache: Any, thread: bool = False, rank: int = 0) -> Any:
    """The pool's KV-event publisher (kvscope/events/publisher.py), or None without
    --kv-events; under `kvscope run` its stream is checked against the pool as it runs. With
    `thread` it polls on its own thread (a pool of worker processes), else the caller polls it
    once per engine step. Data-parallel rank `rank` publishes on its offset endpoint with its
    rank in every batch, as a vLLM rank does."""
    if not config.kv_events or config.baseline != "paged":
        return None
    from kvscope.child import run_dir
    from kvscope.errors import UsageError
    from kvscope.events.publisher import KVEventPublisher

    try:
        pub = KVEventPublisher(
            cache,
            config.kv_events,
            rank=rank,
            check=run_dir() is not None,
            replay_endpoint=config.kv_events_replay or None,
        )
    except UsageError as exc:
        raise ServeError(f"--kv-events {config.kv_events}: {exc}") from exc
    if thread:
        pub.start()
    return pub


def stop_kv_events(pub: Any, cache: Any) -> dict[str, Any]:
    """Close the publisher (its check's findings into the pool); its counts for the summary."""
    if pub is None:
        return {}
    from kvscope.events.publisher import finish

    return {"kv_events": finish(pub, cache)}


def release_cache(config: RunConfig, cache: Any) -> None:
    """Close the cache; remove the shared pool unless the user keeps it for `kvscope top`."""
    cache.close()
    if not config.keep_pool:
        cache.unlink()
