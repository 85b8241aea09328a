"""Scenario section ``memory:``: GPU memory that is not tensors (defaults in ``simulator.engine.memory``).

::

    memory:
      cuda_context_bytes: "400 MB"      # CUDA context per process (default ~400 MB, cited there)
      allocator_reserve_fraction: 0.01  # caching allocator: reserved - allocated, fraction of allocated

Without the section both take their documented defaults, and the run's summary says so
(``memory_overheads``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from simulator.config.quantities import Bytes


class MemoryConfig(BaseModel):
    """Non-tensor GPU memory: CUDA context and the caching allocator's reserve."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cuda_context_bytes: Bytes | None = Field(
        default=None, ge=0, le=1e12,
        description='CUDA context per GPU process ("400 MB"; default ~400 MB, CUDA >= 11.7 with lazy loading).')
    allocator_reserve_fraction: float | None = Field(
        default=None, ge=0, le=1,
        description="Caching-allocator reserve: (memory_reserved - memory_allocated) / memory_allocated at the "
        "peak (default 0.0078, median of public PyTorch OOM messages).")
