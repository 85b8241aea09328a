"""Layer fidelity (``run.fidelity: layer``): consecutive compute kernels of one layer and phase become one op.

At kernel fidelity (the default) the engine runs every kernel the builder emits. At layer fidelity this
graph policy, which runs after every other one, replaces each maximal run of consecutive ``compute``-stream
kernels with the same ``layer`` (>= 0) and ``phase`` by one *block* op, cutting the op count (and the
engine's work) by the number of kernels per block:

* **What stays separate.** Only ``COMPUTE`` ops on stream ``compute`` with no measured duration and no
  collective / rendezvous / previous-step metadata are merged. A block ends at a kernel that an op on
  another stream (a collective, copy, send/recv, host op) or of the next step waits for, and a new block
  starts at a kernel that waits for an op on another stream: every cross-stream dependency keeps its
  exact endpoints. A micro-batch boundary always falls between blocks (another layer, phase, or a
  send/recv dependency lies between two micro-batches' kernels of one layer).
* **Time.** The block's parts (the original ops) travel in ``meta["fused"]``; the roofline prices the block
  as the sum of its parts' kernel-level times at the current clocks (``RooflineCostModel.duration_s``),
  cached by the parts' signature (``meta["fused_key"]``), so identical layers and micro-batches are priced
  once per clock. DVFS: the clock is read when the block starts (a change lands at the next block, not the
  next kernel). Interference: the block is re-rated as a whole while collectives are in flight (each
  part priced beside them and summed), i.e. the collectives' SM and HBM share is spread evenly over the
  block rather than over the kernels they overlap.
* **Host launches.** The host pays one launch per part (``meta["launches"]``); the block may start after
  the first part's launch, and does not end before the last part could have run after its own launch
  (``Executor``), so a launch-bound stream keeps its kernel-fidelity time.
* **Memory per block.** The block allocates, when it starts, every tensor of its parts that outlives it;
  the tensors used only inside it are replaced by one scratch tensor, freed when the block ends, that brings
  the block's demand up to the high-water mark its parts reach one after another at kernel fidelity; tensors
  it reads are freed when it (or their last later user) ends. The in-block peak is kept; what is live
  between its kernels is not (the block holds its high-water mark from start to end).
* **TP collectives** (with a collective model, ``hw.collectives``). A blocking TP all-reduce / reduce-scatter /
  all-gather between two kernels of one block (Megatron without ``tp_comm_overlap``: the compute stream waits
  for it; conditions in ``foldable_tp``) is folded into the block (``Op.folded_comm``, its place in
  ``meta["folded_at"]``) instead of splitting it, which cuts a 175B layer from ~14 ops to 2-3. The block takes
  its kernels' time plus each folded collective's NCCL-model time alone (``System.folded_comm_s``: alone on
  its links a collective's flows take exactly that); the host pays the collective's dispatch as well as the
  kernels' launches. With interference the engine runs the block's kernels between two folded collectives as
  one stretch re-rated beside the collectives in flight and each folded collective in its place with the
  compute stream idle (``System.folded_stretches``), so a collective on another stream (FSDP's prefetched
  all-gather) runs at its own rate and slows no kernel then, as at kernel fidelity. The power meter draws the
  block's mean activity over its kernels and its folded collectives, each collective at its own kernel
  activity (``PowerMeter.block_activity``), so the power-limit firmware sees the kernel-fidelity energy.
  Measured on the 405B FSDP x TP8 scenario: with the folded collectives after the kernels and drawn at their
  activity, +3.9 % step time (more clock throttling, the prefetch slowed for the whole block); either fix alone
  +0.8 % (power) or +2.6 % (stretches); both -0.4 %. The recorder reports the block's kernels as one span and
  each folded collective as a span of its stream at the block's end, so ``comm_s_by_group["tp"]``,
  ``exposed_comm_s`` and the compute utilisation count the folded time as at kernel fidelity. Approximated: the
  trace shows the folded collectives at the block's end, not between their kernels; during them the GPU counts
  as idle, their SM and HBM load does not slow a kernel on another stream, compute on another stream does not
  stretch them, and they share no link (NVLink, NIC) with other transfers of the rank (a DP collective
  overlapping one keeps its full rate, where at kernel fidelity the two would share a link they both cross).
  Collectives that another stream, the next step or other ranks wait for (rendezvous: TP collectives have none,
  ``api._meet_across_classes`` meets only data-parallel and expert groups), or that run inside a fused GEMM
  (``tp_comm_overlap``) stay separate ops.
* **TP collectives beside compute** (``simulator.graph.side_blocks``, after the above). Megatron's asynchronous
  column-parallel backward (``async_tensor_model_parallel_allreduce``) issues the input-gradient all-reduce /
  reduce-scatter (and, with sequence parallelism, the all-gather of the saved input shard) beside the next GEMM;
  each such collective, and the blocking ones around it, is folded into one block per run of the layer's blocks
  it would cut (``meta["side"]``: the part it starts after, the part waiting for it), and the engine prices the
  block with its collectives' timeline (``simulator.cost.overlap``, ``System.side_timeline``): kernels one after
  another, each collective from the end of the part it waits for (and of the one before it on the stream), the
  kernels beside it slowed by its SMs and HBM traffic and it by ``1 + gamma`` while they run, as kernel fidelity
  does on an otherwise idle GPU; the part waiting for it starts when it ends. A collective waiting for the op
  right before a run (sequence parallelism's all-gather at the start of a layer's backward) starts with the block.
  The block's spans are the timeline's, stretched to the block (its kernels' busy stretches, each collective in
  flight), so the TP busy time, the exposed communication and the compute utilisation are its. Approximated as for
  the blocking ones: the collectives share no link with other transfers of the rank, and the other collectives in
  flight re-rate the block as a whole; its collectives' spans draw the block's power activity (measured: energy
  -0.9 % to +0.9 % of kernel fidelity where they fold). A collective that another stream's op waits for in
  between, or that the next step waits for, stays separate (``side_blocks`` lists the conditions). The GPT builder
  stamps most layer passes with these already folded (``simulator.graph.builders.stamp_blocks``, check 6), so this
  policy gives the same graph from far fewer ops.

Measured on the bundled scenarios (``tests/simulator/policies/test_fidelity.py``): step time within 2 % and
peak memory within a few % of kernel fidelity; with TP collectives beside compute folded (the 175B scenario cut
down, the TP2 scenario with 4 micro-batches, with and without sequence parallelism) step time within 0.4 %.
"""

from __future__ import annotations

from simulator.graph.blocks import blocks_of, coarsen, foldable_tp
from simulator.graph.side_blocks import coarsen_folded
from simulator.graph.op_graph import OpGraph
from simulator.policies.registry import register_graph_policy

__all__ = ["FIDELITIES", "LayerFidelity", "blocks_of", "coarsen", "foldable_tp"]

FIDELITIES = ("kernel", "layer")


@register_graph_policy("layer_fidelity", order=1000)
class LayerFidelity:
    """``run.fidelity: layer``: merge each layer's consecutive compute kernels (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return getattr(cfg.run, "fidelity", "kernel") == "layer"

    @staticmethod
    def needs_kernels(cfg) -> bool:
        """False: the builder may emit stamped layer passes as blocks already (``simulator.graph.blocks``)."""
        return False

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        # TP collectives are folded only where the engine prices them with its NCCL model
        if getattr(hw, "collectives", None) is None:
            return coarsen(graph)
        return coarsen_folded(graph)  # ``fold_overlapped_tp(coarsen(graph, fold_tp=True)``, one renumbering
