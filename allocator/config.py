"""PoolConfig: the geometry and options a pool is created with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvscope.allocator.errors import PoolError
from kvscope.allocator.geometry import ELEMENT_BYTES

if TYPE_CHECKING:
    import torch

# KV dtypes by name, with their element size (the one table, shared with the header checks).
# torch is imported only where a tensor is made: the CLI reads pools (numpy) and must start
# without it.
DTYPES: dict[str, int] = ELEMENT_BYTES


def dtype_name(dtype: Any) -> str:
    """Return the canonical name of a KV dtype given as a string or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise PoolError(f"unsupported KV dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return name


# The ZMQ transports a KV-event endpoint may name (vLLM's `KVEventsConfig.endpoint`).
KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")
# The most events one process's flight recorder keeps (64 bytes each, for every client).
MAX_EVENT_CAPACITY = 1 << 20


@dataclass(frozen=True)
class KVEventsConfig:
    """Where a pool publishes its KV events, as one of vLLM's data-parallel ranks does
    (`PoolConfig(kv_events=KVEventsConfig(...))`; a plain endpoint string is
    `KVEventsConfig(endpoint)`). docs/EVENTS.md, "kvscope as a publisher".

    Args:
        endpoint: the PUB endpoint (`tcp://*:5557`, `ipc://PATH`, `inproc://NAME`).
        replay_endpoint: the ROUTER that resends buffered batches from a seq ("": none), as
            vLLM's `replay_endpoint`; it binds.
        rank: the data-parallel rank in every batch; both endpoints are offset by it as vLLM
            offsets them (a TCP port plus the rank, `_dp<rank>` after an ipc/inproc name).
        topic: the topic frame of every message (vLLM's default: none).
    """

    endpoint: str
    replay_endpoint: str = ""
    rank: int = 0
    topic: str = ""


def _check_endpoint(endpoint: Any, what: str) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(KV_EVENTS_SCHEMES):
        raise PoolError(
            f"{what} must be a ZMQ endpoint such as 'tcp://*:5557',"
            f" 'ipc:///tmp/kv-events' or 'inproc://name' (or '' for none), got {endpoint!r}"
        )
    if endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit():
        raise PoolError(f"{what} {endpoint!r} names no port (tcp://*:5557)")


def check_kv_events(option: Any, what: str = "PoolConfig.kv_events") -> None:
    """A PoolError (naming `what`) unless `option` is "", a ZMQ endpoint a KV-event publisher
    can use, or a `KVEventsConfig` of such endpoints, a rank >= 0 and a text topic."""
    if option == "":
        return
    if not isinstance(option, KVEventsConfig):
        _check_endpoint(option, what)
        return
    _check_endpoint(option.endpoint, f"{what}.endpoint")
    if option.replay_endpoint != "":
        _check_endpoint(option.replay_endpoint, f"{what}.replay_endpoint")
        if option.replay_endpoint == option.endpoint:
            raise PoolError(f"{what}.replay_endpoint must differ from its endpoint")
    if type(option.rank) is not int or option.rank < 0:
        raise PoolError(f"{what}.rank must be a data-parallel rank >= 0, got {option.rank!r}")
    if not isinstance(option.topic, str):
        raise PoolError(f"{what}.topic must be text, got {option.topic!r}")


@dataclass
class PoolConfig:
    """Geometry and options of a pool; everything but `num_blocks` has a default."""

    num_blocks: int
    block_size: int = 16
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: Any = "float16"
    device: str = "cpu"
    # 0 means "derive from num_blocks" (see `resolved`).
    max_seqs: int = 0
    max_blocks_per_seq: int = 0
    max_clients: int = 32
    local_cache_size: int = 4
    num_shards: int = 8
    event_capacity: int = 1024
    guard: bool = False
    events: bool = False
    lockdep: bool = False
    quarantine: int = 0
    # Sampled guard mode: guard, poison and quarantine one allocation in N (0 or 1: every one);
    # N > 1 turns guard mode on. Applies to the creating handle (KVSCOPE_GUARD_SAMPLE: to every
    # handle of a process). docs/PROBES.md.
    guard_sample: int = 0
    group: str | None = None
    # Publish the pool's prefix index as vLLM's KV-event stream on this ZMQ endpoint
    # ("tcp://*:5557"; "": off), or as a KVEventsConfig (a replay socket, a data-parallel
    # rank, a topic), from create to close (docs/EVENTS.md, "kvscope as a publisher").
    kv_events: str | KVEventsConfig = ""
    # Record every operation of the creating handle into this operation log ("": off;
    # docs/REPLAY.md). KVSCOPE_RECORD_OPS=PATH records every handle of a process.
    record_ops: str = ""
    # With record_ops: bound the log to about twice this many bytes on disk (0: unbounded;
    # docs/REPLAY.md "A bounded log"). KVSCOPE_RECORD_OPS_LIMIT bounds every handle's.
    record_ops_limit: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> PoolConfig:
        """Validate and fill derived defaults; raises PoolError on a geometry that cannot work."""
        c = PoolConfig(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        c.dtype = dtype_name(c.dtype)
        c.device = str(c.device)
        for name in ("num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(c, name)
            if not isinstance(value, int) or value <= 0:
                raise PoolError(f"PoolConfig.{name} must be a positive integer, got {value!r}")
        if c.num_blocks >= 2**31 - 1:
            raise PoolError(f"PoolConfig.num_blocks={c.num_blocks} is too large (max 2**31-2)")
        if not isinstance(c.event_capacity, int) or not 0 <= c.event_capacity <= MAX_EVENT_CAPACITY:
            raise PoolError(
                f"PoolConfig.event_capacity must be an integer in [0, {MAX_EVENT_CAPACITY}] (events"
                f" each process's flight recorder keeps), got {c.event_capacity!r}"
            )
        if c.block_size > 1024:
            raise PoolError(f"PoolConfig.block_size={c.block_size} is too large (max 1024)")
        if not (c.device == "cpu" or c.device.startswith("cuda")):
            raise PoolError(f"PoolConfig.device must be 'cpu' or 'cuda[:N]', got {c.device!r}")
        if c.max_blocks_per_seq <= 0:
            c.max_blocks_per_seq = min(c.num_blocks, 2048)
        if c.max_seqs <= 0:
            c.max_seqs = min(max(64, c.num_blocks // 2), 4096)
        if not 1 <= c.max_clients <= 1024:
            raise PoolError(f"PoolConfig.max_clients must be in [1, 1024], got {c.max_clients}")
        if not isinstance(c.guard_sample, int) or c.guard_sample < 0:
            raise PoolError(
                f"PoolConfig.guard_sample must be an integer >= 0, got {c.guard_sample!r}"
            )
        if c.guard_sample > 1:
            c.guard = True
        if not 0 <= c.local_cache_size <= 64:
            raise PoolError(
                f"PoolConfig.local_cache_size must be in [0, 64], got {c.local_cache_size}"
            )
        if c.num_shards <= 0 or c.num_shards & (c.num_shards - 1) or c.num_shards > 32:
            raise PoolError(
                f"PoolConfig.num_shards must be a power of two up to 32, got {c.num_shards}"
            )
        check_kv_events(c.kv_events)
        return c

    @property
    def slots_per_block(self) -> int:
        """Slots per block: `block_size`, plus one guard slot in guard mode."""
        return self.block_size + (1 if self.guard else 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV tensor's torch dtype."""
        import torch

        return getattr(torch, dtype_name(self.dtype))

    @property
    def data_bytes(self) -> int:
        """Bytes of the KV data tensor."""
        elem = DTYPES[dtype_name(self.dtype)]
        return (
            self.num_layers
            * 2
            * self.num_blocks
            * self.slots_per_block
            * self.num_kv_heads
            * self.head_dim
            * elem
        )
