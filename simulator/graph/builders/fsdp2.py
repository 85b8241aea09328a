"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, ``fsdp.version: 2``) for the GPT builder: what differs
from FSDP1's flat parameters (``simulator/graph/builders/sharding.py`` holds the shared schedule).

Sources: pytorch/pytorch@010ae4a torch/distributed/fsdp/_fully_shard/_fsdp_param.py (``FSDPParam``),
_fsdp_collectives.py (``foreach_all_gather``, ``_get_param_all_gather_inputs``, ``foreach_all_gather_copy_out``,
``foreach_reduce``), pytorch/pytorch@002a76f _fsdp_param_group.py (``FSDPParamGroup.unshard`` /
``wait_for_unshard`` / ``post_backward`` / ``_backward_prefetch``) and pytorch/pytorch@0140b62 _fsdp_init.py
(``_get_post_forward_mesh_info``).

* **Per-parameter dim-0 sharding.** Each parameter is chunked on dim 0 over the ``W`` shard ranks with
  ``torch.chunk`` and every chunk padded to chunk 0's size (``_init_sharded_param``: ``padded_sharded_size =
  chunks[0].size()``): a parameter of ``d0`` rows of ``row`` elements holds ``ceil(d0 / W) row`` elements on each
  rank and gathers ``W ceil(d0 / W) row`` (``padded_numel``). FSDP1 pads one flat parameter per unit instead
  (``ShardingSpec.shard``). Rank 0 (the one simulated) holds the full padded chunks: its fp32 shard, gradient
  shard and AdamW moments are ``sharded_numel``. The builder's fused QKV and SwiGLU fc1 are split into the
  separate ``wq`` / ``wk`` / ``wv`` and ``w1`` / ``w3`` of torchtitan's Llama for the padding (``dim0_parts``).
* **All-gather copy-in** (on FSDP2's all-gather copy-in stream, ``fsdp.all_gather_copy_in``): with a
  ``param_dtype`` other than the fp32 parameters' (``MixedPrecisionPolicy(param_dtype=bf16)``), one
  ``_foreach_copy_`` casts the padded fp32 shards into a flat ``param_dtype`` buffer (reads 4, writes 2 bytes per
  shard element); then ``all_gather_copy_in`` copies the inputs into this rank's slice of the all-gather output
  (reads and writes ``param_bytes`` per shard element). The all-gather output (``W`` x the padded shard) is
  allocated there, before the collective.
* **All-gather copy-out** (``split_with_sizes_copy`` on the current stream, before the unit's compute): the output
  is copied into each parameter's unsharded tensor (reads and writes ``param_bytes`` per gathered element), so the
  output and the unsharded parameters are both alive then. In forward (implicit prefetch) the output is freed only
  at the next unit's copy-out (``comm_ctx.all_gather_state``), in backward right after its own.
* **Forward prefetch**: no CPU rate limiter (``limit_all_gathers`` is FSDP1's); unit ``k``'s all-gather streams wait
  for unit ``k - 2``'s copy-out event (``wait_for_unshard`` of unit ``k - 1`` makes them wait for the state of
  ``k - 2``), recorded before ``k - 2``'s compute: with the host ahead of the GPU, all-gathers run two units ahead
  (``FORWARD_PREFETCH_DEPTH``). Backward: ``_backward_prefetch`` unshards the previous unit in post-forward order
  from ``pre_backward`` (depth 1, ``BACKWARD_PRE``-like).
* **Reduce-scatter copy-in** (``foreach_reduce_scatter_copy_in``: ``torch._chunk_cat`` on the current stream after
  the unit's backward): the unsharded gradients (``param_dtype``) are copied, padded, into a ``reduce_dtype`` buffer
  (a widening cast in the same kernel); the gradients are freed after it, the buffer after the reduce-scatter.
  The reduce-scatter output is the sharded gradient (viewed, no copy); with ``reduce_dtype`` bf16 it is cast to
  the fp32 parameters' dtype on the reduce-scatter stream (``_to_dtype_if_needed``). HSDP all-reduces it over the
  replicas first. fp32 and bf16 reductions use NCCL's ``ReduceOp.AVG`` (``_get_gradient_divide_factors``): no
  divide kernels.
* **``reshard_after_forward`` int r**: after forward each block keeps its rank's ``1/r`` of the gathered
  parameters in ``param_dtype`` (``to_sharded_post_forward``: a copy on the current stream, kept until backward);
  its backward all-gather runs over ``r`` consecutive shard ranks (``mesh.view(-1, r)``, group
  ``dp_post_forward``) from that copy (no cast).

Not modelled: ``torch.compile``; torchtitan's last block kept gathered after forward (``reshard_after_forward``
false on the last ``TransformerBlock`` in older releases): every block is resharded alike here; the host
issuing a prefetched all-gather is the builder's order (the GPU-side wait is the rule above).
"""

from __future__ import annotations

from simulator.graph.builders.sharding import ROOT, ParamGather, shard_cast
from simulator.graph.ops import CostClass, OpKind, Phase, TensorAlloc

#: Units gathered ahead in forward (see the module docstring: unit ``k`` waits for ``k - 2``'s copy-out)
FORWARD_PREFETCH_DEPTH = 2
#: Stream of the all-gather copy-in kernels (``FSDPCommContext.all_gather_copy_in_stream``)
COPY_IN_STREAM = "fsdp.all_gather_copy_in"


def dim0_parts(spec, name: str, numel: int) -> tuple[list[int], int]:
    """``(dim-0 sizes, elements per dim-0 row)`` of the PyTorch parameters that the builder's parameter ``name``
    (without its ``L<i>.`` prefix; ``numel`` elements on one TP rank) stands for: torchtitan's separate ``wq``,
    ``wk``, ``wv`` for ``qkv.weight`` and ``w1``, ``w3`` for a SwiGLU ``fc1.weight`` (column-parallel: dim 0 split
    over TP), ``nn.Linear`` weights ``(out, in)``, grouped expert weights ``(experts, ...)``, embeddings
    ``(vocab / t, h)``; biases and norms are 1-D."""
    h, t = spec.hidden_size, spec.tensor_parallel_size
    leaf = name.split(".", 1)[1] if name.startswith("L") and name[1:2].isdigit() else name
    if leaf.endswith(".bias") or leaf.startswith(("ln", "ln_f")):
        return [numel], 1
    if leaf == "qkv.weight":
        d = spec.head_dim
        return [spec.attention_width // t, spec.query_groups * d // t, spec.query_groups * d // t], h
    if leaf in ("fc1.weight", "shared_expert.fc1.weight"):
        n = 2 if spec.swiglu else 1
        return [numel // h // n] * n, h
    if leaf in ("proj.weight", "fc2.weight", "shared_expert.fc2.weight"):
        return [h], numel // h
    if leaf.startswith("experts."):
        e = max(spec.local_experts, 1)
        return [e], numel // e
    if leaf in ("router.weight", "shared_expert.gate.weight", "lm_head.weight", "wte.weight", "wpe.weight"):
        return [numel // h], h
    return [numel], 1  # any other parameter: 1-D


def padded_numel(spec, name: str, numel: int, world: int) -> int:
    """Elements all-gathered for parameter ``name`` over ``world`` shard ranks: ``world x ceil(d0 / world) x row``
    summed over its ``dim0_parts`` (``FSDPParam.padded_sharded_param_size`` times the world)."""
    parts, row = dim0_parts(spec, name, numel)
    return sum(world * -(-d // world) * row for d in parts)


def unit_padded_numel(spec, params, world: int) -> int:
    """``padded_numel`` summed over ``params``: ``(name, elements)`` pairs of one FSDP unit."""
    return sum(padded_numel(spec, n, k, world) for n, k in params)


def sharded_numel(spec, world: int) -> int:
    """Elements of this rank's FSDP2 shards of every parameter of its pipeline stage (rank 0: every padded chunk
    full): the fp32 sharded parameters, their gradients and each AdamW moment."""
    from simulator.graph.builders.sharding import backward_param_order

    return sum(padded_numel(spec, n, k, world) for c in spec.model_chunks
               for n, _, k in backward_param_order(spec, c)) // world


class Fsdp2ParamGather(ParamGather):
    """``ParamGather`` with FSDP2's per-parameter padding, copy-in / copy-out kernels and post-forward reshard.

    Args:
        spec: The builder's ``TransformerSpec`` (``sharding.version`` 2).
        emitter: The builder's ``KernelEmitter``.
        builder: The graph builder (``GraphBuilder``) the kernels are added to.
        collective: ``collective(name, op, nbytes, deps, phase, uses=(), group=None) -> op id`` (``group`` None:
            the shard group).
    """

    def __init__(self, spec, emitter, builder, collective):
        super().__init__(spec, emitter, collective)
        self.spec, self.b = spec, builder
        from simulator.graph.builders.sharding import backward_param_order, layer_param_sizes

        w = self.sh.shard_size
        lay = list(layer_param_sizes(spec).items())
        root = [(n, k) for c in spec.model_chunks for n, u, k in backward_param_order(spec, c) if u == ROOT]
        #: gathered (padded) elements per unit
        self.padded = {u: unit_padded_numel(spec, lay, w) for u in self.numel if u != ROOT}
        self.padded[ROOT] = unit_padded_numel(spec, root, w)
        self._out: dict[int, str] = {}  # unit -> its all-gather output, gathered and not yet copied out
        self._held: str | None = None  # forward: the previous unit's all-gather output (all_gather_state)
        self._post: dict[int, str] = {}  # unit -> its post-forward shard (reshard_after_forward int)
        self._resharding: int | None = None  # forward: the unit whose post-forward reshard is due

    def _emit(self, phase: Phase, unit: int) -> None:
        if unit in self._live or not self.numel.get(unit):
            return
        pb, n = self.sh.param_bytes, self.padded[unit]
        post = self._post.pop(unit, None) if phase == Phase.BWD else None
        world = self.sh.post_forward_size if post is not None else self.sh.shard_size
        shard = n // world
        tag = "root" if unit == ROOT else f"L{unit}"
        deps = [self.e.last_compute] if self.e.last_compute >= 0 else []
        out = self.e.fresh(f"params.{tag}.all_gather_output.{phase.value}")
        uses: tuple[str, ...] = (post,) if post is not None else ()
        if pb == 2 and post is None:  # _foreach_copy_: fp32 padded shards -> flat param_dtype buffer
            flat = self.e.fresh(f"params.{tag}.all_gather_input.{phase.value}")
            cast = shard_cast(self.b, f"{tag}.{phase.value}.fsdp.all_gather_cast", COPY_IN_STREAM, shard, deps, phase,
                              flat, max(unit, -1))
            deps, uses = [cast], (flat,)
        cin = self.b.add(f"{tag}.{phase.value}.fsdp.all_gather_copy_in", OpKind.COMPUTE, COPY_IN_STREAM, deps=deps,
                         phase=phase, layer=max(unit, -1), cost_class=CostClass.COPY, bytes_read=float(pb * shard),
                         bytes_written=float(pb * shard), uses=uses, allocs=(TensorAlloc(out, pb * n),),
                         dtype="fp32" if pb == 4 else "bf16")
        op = self._coll(f"{tag}.{phase.value}.{self._suffix}", "all_gather", pb * n, [cin], phase, uses=(out,),
                        group="dp_post_forward" if post is not None else None)
        self._live[unit] = (op, out)
        self._out[unit] = out

    def _copy_out(self, unit: int, phase: Phase) -> None:
        """``foreach_all_gather_copy_out`` of ``unit`` on the compute stream (see the module docstring)."""
        op, out = self._live[unit]
        pb, n = self.sh.param_bytes, self.padded[unit]
        del self._out[unit]
        uses = (out, self._held) if phase == Phase.FWD and self._held else (out,)
        tensor = self.e.fresh(f"params.{'root' if unit == ROOT else f'L{unit}'}.gathered.{phase.value}")
        deps = [op] + ([self.e.last_compute] if self.e.last_compute >= 0 else [])
        co = self.b.add(f"{'root' if unit == ROOT else f'L{unit}'}.{phase.value}.fsdp.all_gather_copy_out",
                        OpKind.COMPUTE, "compute", deps=deps, phase=phase, layer=max(unit, -1),
                        cost_class=CostClass.COPY, bytes_read=float(pb * n), bytes_written=float(pb * n), uses=uses,
                        allocs=(TensorAlloc(tensor, pb * n),), dtype="fp32" if pb == 4 else "bf16")
        self.e.last_compute = co
        self._held = out if phase == Phase.FWD else None
        self._live[unit] = (co, tensor)
        self._unit_of[tensor] = unit

    def _reshard_post_forward(self) -> None:
        """``to_sharded_post_forward`` of the unit whose forward just ended (an int ``reshard_after_forward``): its
        ``1/r`` of the gathered parameters copied out on the compute stream, kept for its backward all-gather."""
        unit, self._resharding = self._resharding, None
        got = self._live.get(unit) if unit is not None else None
        if got is None or unit in self._out:
            return
        pb, n = self.sh.param_bytes, self.padded[unit] // self.sh.post_forward_size
        kept = self.e.fresh(f"params.L{unit}.sharded_post_forward")
        deps = [self.e.last_compute] if self.e.last_compute >= 0 else []
        self.e.last_compute = self.b.add(
            f"L{unit}.fwd.fsdp.reshard_post_forward", OpKind.COMPUTE, "compute", deps=deps, phase=Phase.FWD,
            layer=unit, cost_class=CostClass.COPY, bytes_read=float(pb * n), bytes_written=float(pb * n),
            uses=(got[1],), allocs=(TensorAlloc(kept, pb * n),), dtype="fp32" if pb == 4 else "bf16")
        self._post[unit] = kept

    def start_pass(self, phase: Phase) -> None:
        """``ParamGather.start_pass``, after the last forward unit's post-forward reshard; the held all-gather
        output is flushed (the root state's ``comm_ctx.all_gather_state = None`` after forward)."""
        if self._resharding is not None:
            self._reshard_post_forward()
        self._held = None
        super().start_pass(phase)

    def enter(self, hook: int, phase: Phase) -> None:
        """``ParamGather.enter``, then the unit's copy-out when its all-gather output is not copied out yet."""
        unit = self.unit_of_hook(hook)
        if phase == Phase.FWD and self._resharding is not None:
            self._reshard_post_forward()
        if unit in self._entered:
            return
        super().enter(hook, phase)
        if unit in self._out:
            self.e.wait_for = [w for w in self.e.wait_for if w != self._live[unit][0]]
            self._copy_out(unit, phase)
        if phase == Phase.FWD and self.sh.post_forward_size and unit != ROOT:
            self._resharding = unit


def fsdp2_reduce(builder, k: int, bucket, tensors: list[str], deps: list[int]) -> None:
    """``foreach_reduce`` of unit bucket ``k`` (``bucket``: its ``ParamGroup`` s, ``tensors`` their unsharded
    gradients, ``deps`` the ops finishing them) for the GPT builder ``builder``: the reduce-scatter copy-in on the
    compute stream into a ``reduce_dtype`` buffer of the padded size, the reduce-scatter over the shard group into the
    gradient shard (``builder._reduced_shard``), HSDP's all-reduce of it over the replicas, and with ``reduce_dtype``
    bf16 its cast to the fp32 ``.grad`` on the stream of the last reduction (see the module docstring)."""
    sh, s, b = builder.sh, builder.s, builder.b
    rb, w = sh.grad_bytes, sh.shard_size
    n_in = sum(g.grad_bytes for g in bucket)
    padded = sum(padded_numel(s, g.name, g.numel, w) for g in bucket)
    shard = padded // w
    rs_in = builder.e.fresh(f"grad.reduce_scatter_input.b{k}")
    cin = builder.e.kernel(f"fsdp.reduce_scatter_copy_in.{k}", CostClass.COPY, reads=float(n_in),
                           writes=float(rb * padded), out=[(rs_in, rb * padded)], uses=tensors, deps=deps,
                           dtype="fp32" if rb == 4 else None)
    out = builder._reduced_shard(k, 4 * shard) if rb == 4 else (TensorAlloc(builder.e.fresh(f"grad.rs_out.b{k}"),
                                                                              2 * shard),)
    group = builder._shard_group
    last = builder._collective(f"fsdp.grad_reduce_scatter.{k}", "reduce_scatter", rb * padded, [cin], Phase.BWD,
                               uses=(rs_in,), allocs=out, group=group, elem_bytes=rb)
    builder.comm_ops.append(last)
    if sh.replicate_size > 1:
        group = "dp_replicate"
        last = builder._collective(f"fsdp.grad_all_reduce_replicas.{k}", "all_reduce", rb * shard, [last], Phase.BWD,
                                   uses=(out[0].name,), group=group, elem_bytes=rb)
        builder.comm_ops.append(last)
    if rb == 2:  # _to_dtype_if_needed(reduce_output, orig_dtype) on the post-reduce stream
        builder.comm_ops.append(b.add(f"fsdp.grad_cast_fp32.{k}", OpKind.COMPUTE, f"comm.{group}", deps=[last],
                                      phase=Phase.BWD, cost_class=CostClass.CAST, bytes_read=2.0 * shard,
                                      bytes_written=4.0 * shard, uses=(out[0].name,),
                                      allocs=builder._reduced_shard(k, 4 * shard), dtype="fp32"))
