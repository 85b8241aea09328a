"""Policies (graph rewrites) and runtime components, registered by name on import."""

from simulator.policies.registry import (  # noqa: F401
    GRAPH_POLICIES,
    RUNTIME_COMPONENTS,
    PolicyError,
    apply_graph_policies,
    build_runtime,
    register_graph_policy,
    register_runtime,
)

# Policy modules register themselves when imported; add new ones here.
_MODULES: list[str] = ["dataloader", "dvfs", "recompute", "offload_optimizer", "offload_param", "offload_nvme", "offload_fsdp",
                     "fidelity"]

for _m in _MODULES:
    __import__(f"simulator.policies.{_m}")
