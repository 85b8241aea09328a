"""Registries of policies by YAML ``kind``, and the two places the run pipeline calls them.

Two kinds of extension exist:

* **Graph policies** rewrite the step graph before it runs (offload, overlap, recompute). A
  graph policy is a class with ``applies(cfg) -> bool`` and ``transform(graph, cfg, hw) ->
  OpGraph``, registered with ``@register_graph_policy(name, order)``; they run in ``order``.
* **Runtime components** attach to the engine (DVFS controllers, dataloaders, power meters).
  A runtime component class has ``applies(cfg) -> bool``, is constructed as
  ``cls(cfg, hw, env, system)`` and may define ``hooks()`` (objects with ``on_op_start``/
  ``on_op_end``), ``host_handlers()`` (op kind -> generator function) and
  ``summarize(result_parts) -> dict`` to add metrics to the summary.

Modules register themselves on import; ``simulator.policies`` imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from simulator.config.errors import PolicyError

GRAPH_POLICIES: dict[str, tuple[int, type]] = {}
RUNTIME_COMPONENTS: dict[str, type] = {}


def register_graph_policy(name: str, order: int) -> Callable[[type], type]:
    """Class decorator: register a graph policy under ``name``, run in ascending ``order``."""

    def deco(cls: type) -> type:
        GRAPH_POLICIES[name] = (order, cls)
        return cls

    return deco


def register_runtime(name: str) -> Callable[[type], type]:
    """Class decorator: register a runtime component under ``name``."""

    def deco(cls: type) -> type:
        RUNTIME_COMPONENTS[name] = cls
        return cls

    return deco


def apply_graph_policies(graph, cfg, hw):
    """Run every applicable graph policy in order; returns the rewritten graph."""
    for name, (_, cls) in sorted(GRAPH_POLICIES.items(), key=lambda kv: kv[1][0]):
        if cls.applies(cfg):
            graph = cls().transform(graph, cfg, hw)
            graph = graph.with_changes(policies=graph.policies + (name,))
    return graph


def policies_reuse_key(cfg, hw) -> tuple | None:
    """What the applicable graph policies read of ``cfg`` and ``hw``, as one hashable value: two scenarios with
    the same key rewrite the same graph into the same graph (``api.reusing_graphs`` keeps the rewritten graph by
    it). A policy opts in with ``reuse_key(cfg, hw)`` (every setting its ``transform`` reads beside the graph);
    None when an applicable policy has none (or says None): the graph is rewritten afresh.

    Raises:
        PolicyError: a policy's ``reuse_key`` refused the settings (the caller rewrites afresh, which raises the
            error ``apply_graph_policies`` raises).
    """
    key = []
    for name, (_, cls) in sorted(GRAPH_POLICIES.items(), key=lambda kv: kv[1][0]):
        if cls.applies(cfg):
            reuse_key = getattr(cls, "reuse_key", None)
            part = reuse_key(cfg, hw) if reuse_key is not None else None
            if part is None:
                return None
            key.append((name, part))
    return tuple(key)


def kernels_needed(cfg) -> bool:
    """Whether a graph policy that applies to ``cfg`` reads the builder's kernel-level ops (a policy says it
    does not with a ``needs_kernels(cfg)`` that returns False; without one it does)."""
    return any(cls.applies(cfg) and getattr(cls, "needs_kernels", lambda c: True)(cfg)
               for _, cls in GRAPH_POLICIES.values())


@dataclass
class Runtime:
    """The runtime components attached to one run."""

    components: list[Any]

    def hooks(self) -> list[Any]:
        return [h for c in self.components for h in (c.hooks() if hasattr(c, "hooks") else [])]

    def host_handlers(self) -> dict:
        out: dict = {}
        for c in self.components:
            if hasattr(c, "host_handlers"):
                out.update(c.host_handlers())
        return out


def build_runtime(cfg, hw, env, system) -> Runtime:
    """Instantiate the applicable runtime components for a run."""
    return Runtime([cls(cfg, hw, env, system) for cls in RUNTIME_COMPONENTS.values() if cls.applies(cfg)])
