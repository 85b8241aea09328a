"""Activation recompute (full, selective) and activation offload to host memory.

The GPT builder emits the recompute itself (``TransformerSpec.recompute``, from
``training.recompute_granularity``): ``full`` keeps each block's input and re-runs the block's
forward before its backward (Megatron-LM ``--recompute-granularity full``); ``selective`` re-runs
only the attention core (Korthikanti et al., MLSys 2023). This policy checks that the graph has
blocks to recompute and adds **activation offload** (DeepSpeed
``activation_checkpointing.cpu_checkpointing``):

* after the block's forward no longer needs its checkpointed input ``x_l``, a D2H copy (stream
  ``d2h``, ``host_pinned``) moves it to the host and the GPU copy is freed;
* an H2D copy (stream ``h2d``) brings it back one block ahead of use: it is issued when the
  backward of block ``l+1`` starts (for the last block, when backward starts), and block ``l``'s
  recompute waits for it.

Both copies share the PCIe links with everything else (gradient and parameter offload, input
batches). GPU memory falls by one block input per layer (minus the one or two in flight).
"""

from __future__ import annotations

from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind, OpRole, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.registry import PolicyError, register_graph_policy


@register_graph_policy("recompute", order=20)
class Recompute:
    """Validate recompute and add activation offload (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        ac = getattr(cfg, "activation_checkpointing", None)
        return bool(cfg.training.recompute_granularity) or bool(ac and ac.cpu_checkpointing)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        ac = getattr(cfg, "activation_checkpointing", None)
        return recompute(graph, cfg.training.recompute_granularity, bool(ac and ac.cpu_checkpointing))


def recompute(graph: OpGraph, granularity: str | None, cpu_checkpointing: bool = False) -> OpGraph:
    """Check the recompute setting against the graph and add activation offload if asked.

    Raises:
        PolicyError: no transformer blocks, or cpu_checkpointing without full recompute.
    """
    if not any(op.layer >= 0 for op in graph.ops):
        raise PolicyError("training.recompute_granularity: the model has no transformer blocks to recompute")
    spec = graph.meta.get("spec")
    if spec is not None and granularity and spec.recompute != granularity:
        raise PolicyError(
            f"training.recompute_granularity: the graph was built with recompute {spec.recompute!r}, not {granularity!r}"
        )
    if not cpu_checkpointing:
        return graph
    if granularity != "full":
        raise PolicyError("activation_checkpointing.cpu_checkpointing: needs training.recompute_granularity: full")
    return offload_activations(graph)


def offload_activations(graph: OpGraph) -> OpGraph:
    """Move each checkpointed block input to pinned host memory between forward and backward."""
    size = {t.name: t.nbytes for op in graph.ops for t in op.allocs}
    producer = {t.name: op.id for op in graph.ops for t in op.allocs}
    plans = []  # per checkpoint: tensor, last forward user, backward users, prefetch point
    for op in graph.ops:
        if op.phase == Phase.FWD and op.layer >= 0 and op.role is OpRole.BLOCK_INPUT_NORM:
            x = op.uses[0]
            users = [o for o in graph.ops if x in o.uses]
            fwd_users = [o.id for o in users if o.phase == Phase.FWD]
            bwd_users = [o.id for o in users if o.phase == Phase.BWD]
            if not bwd_users or x not in size:
                continue
            last_fwd = max(fwd_users)
            after = [o for o in graph.ops[last_fwd + 1:] if o.phase == Phase.BWD]
            nxt = [o.id for o in after if o.layer == op.layer + 1]
            first_bwd = after[0].id if after else min(bwd_users)
            at = nxt[0] if nxt else first_bwd
            at = min(at, min(bwd_users))
            plans.append(dict(x=x, layer=op.layer, last_fwd=last_fwd, bwd=set(bwd_users), at=at, nbytes=size[x]))
    if not plans:
        raise PolicyError("activation_checkpointing.cpu_checkpointing: no checkpointed block inputs found")
    after_op = {}
    before_op = {}
    for k, p in enumerate(plans):
        p["host"] = f"offload.act.L{p['layer']}#{k}"
        p["back"] = f"act.reloaded.L{p['layer']}#{k}"
        after_op.setdefault(p["last_fwd"], []).append(p)
        before_op.setdefault(p["at"], []).append(p)
    rename = {}
    for p in plans:
        for u in p["bwd"]:
            rename.setdefault(u, {})[p["x"]] = p
    rw = GraphRewriter(graph)
    for op in graph.ops:
        for p in before_op.get(op.id, []):
            p["h2d"] = rw.add(f"L{p['layer']}.bwd.act_offload.h2d", OpKind.MEMCPY_H2D, "h2d", deps=[p["d2h"]],
                              phase=Phase.BWD, layer=p["layer"], cost_class=CostClass.COPY,
                              bytes_read=float(p["nbytes"]), allocs=(TensorAlloc(p["back"], p["nbytes"]),),
                              uses=(p["host"],))
        changes, extra = {}, []
        if op.id in rename:
            m = rename[op.id]
            changes["uses"] = tuple(m[u]["back"] if u in m else u for u in op.uses)
            extra = [m[u]["h2d"] for u in op.uses if u in m]
        rw.copy(op, extra_deps=extra, **changes)
        for p in after_op.get(op.id, []):
            p["d2h"] = rw.add(f"L{p['layer']}.fwd.act_offload.d2h", OpKind.MEMCPY_D2H, "d2h",
                              deps=list(rw.new(producer[p["x"]])), phase=Phase.FWD, layer=p["layer"],
                              cost_class=CostClass.COPY, bytes_read=float(p["nbytes"]), uses=(p["x"],),
                              allocs=(TensorAlloc(p["host"], p["nbytes"], "host_pinned"),))
    meta = dict(graph.meta)
    meta["activation_offload"] = {"checkpoints": len(plans), "bytes": sum(p["nbytes"] for p in plans)}
    return rw.finish(meta=meta)
