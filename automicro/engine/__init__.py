"""The FSDP2 engine: torch's `fully_shard` with explicit prefetch, async unshard,
record-stream-free collectives and `recover()` after a failed attempt.

```python
from automicro.engine import FSDP2Config, shard
sharded = shard(model, FSDP2Config(...), mesh=None)   # mesh None = all ranks, 1-D
sharded.fsdp_modules      # FSDP2 modules in forward order
sharded.recover()         # back to a clean state after a failed forward/backward
offload_to_host(sharded, [optimizer])   # FSDP2's CPU offload switched on between two steps
```
"""

from automicro.engine.compile import CompileConfig, CompileConfigError
from automicro.engine.config import FSDP2Config, FSDP2ConfigError
from automicro.engine.offload import offload_to_host
from automicro.engine.sharding import ShardedModel, adopt, ensure_record_stream_free, set_unshard_async, shard, sharded_of

__all__ = ["adopt", "CompileConfig", "CompileConfigError", "FSDP2Config", "FSDP2ConfigError", "ShardedModel", "ensure_record_stream_free", "offload_to_host", "set_unshard_async", "shard", "sharded_of"]
