"""torchtitan's per-op selective activation checkpointing (``[activation_checkpoint] mode = "selective"``,
``selective_ac_option = "op"``) of its Llama ``TransformerBlock``, for the GPT builder (``TransformerSpec.recompute``
``op``).

**The policy** (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py
``_apply_ac_to_transformer_block``, ``_save_list``; later torchtitan/distributed/activation_checkpoint.py
``_apply_op_sac``): each block runs under ``checkpoint_wrapper(context_fn=...)`` with
``create_selective_checkpoint_contexts``: an op's outputs are stored (``MUST_SAVE``) when the op is in ``_save_list``
(``aten.mm``, SDPA flash / efficient attention, ``_c10d_functional.reduce_scatter_tensor``, ``aten.max``), except
every second ``aten.mm``: a counter per block and forward (``meta["forward_mm_count"]``, a fresh ``defaultdict`` per
call) saves the 1st, 3rd, 5th ... mm and recomputes the others (``PREFER_RECOMPUTE``, as every op not in the list).

**The block's mm order** (pytorch/torchtitan@018740b7 torchtitan/models/llama3/model/model.py): ``Attention.forward``
runs ``self.wq(x), self.wk(x), self.wv(x)`` then ``self.wo(output)``; ``FeedForward.forward`` is
``self.w2(F.silu(self.w1(x)) * self.w3(x))``, evaluated w1, w3, w2. A bias-free ``nn.Linear`` on ``[b, s, i]`` is one
``aten.mm`` (``F.linear`` -> ``matmul`` folds the batch into ``mm``; with a bias it would be ``addmm``, not counted:
refused). So the seven mm are wq 1, wk 2, wv 3, wo 4, w1 5, w3 6, w2 7: **wq, wv, w1, w2 saved; wk, wo, w3
recomputed** (a later revision of torchtitan/distributed/activation_checkpoint.py, read without its commit, drops the
counter for module names and lists the same four, ``save_mm_modules`` {"wq", "wv", "w1", "w2"} "for Llama3"). Under tensor parallelism the
``RowwiseParallel(output_layouts=Shard(1))`` outputs of wo and w2 are reduce-scattered (saved); the sequence-parallel
all-gathers before wq / w1 (``PrepareModuleInput``) are not in the list: recomputed, so they run again in backward.

**Kept from forward to backward**, per block (``saved_outputs``; beside the block input, kept by the wrapper): the
outputs of wq (``[T, a d / t]``), wv (``[T, g d / t]``), SDPA (``[T, a d / t]`` and its fp32 log-sum-exp ``[b, a /
t, s]``), w1 (``[T, f / t]``), w2 (``[T, h]``, before its reduce-scatter) and, with TP, the two reduce-scatter outputs
(``[T / t, h]`` each), all 16-bit but the log-sum-exp.

**Recomputed** before the block's backward (``recompute``): non-reentrant checkpointing re-runs the block's forward
in order, returning stored outputs for the saved ops (torch/utils/checkpoint.py ``_CachingTorchDispatchMode``: a
``MUST_SAVE`` op's output is popped from the storage, not computed). It runs: attention norm, (all-gather), wk, rope
on q and k, repeat_kv's copies, the transpose of the SDPA output, wo (run although with TP its output feeds only the
stored reduce-scatter: the caching mode re-runs every ``PREFER_RECOMPUTE`` op), the residual add, FFN norm,
(all-gather), w3 and the SwiGLU product: three GEMMs (``T x kv x h``, ``T x h x a d / t``, ``T x f / t x h``), not
the block's forward. Where it ends is ``early_stop`` (``TransformerSpec.recompute_early_stop``):

* **off**, torchtitan's default (``[activation_checkpoint] early_stop = false``, passed to ``ptd_checkpoint_wrapper``
  for every block: pytorch/torchtitan@cfb93265 torchtitan/distributed/activation_checkpoint.py ``_apply_op_sac``):
  the forward runs to its end, so w2's stored output (and with TP its stored reduce-scatter output) is popped and
  the second residual add ``h + ffn_out`` (``PREFER_RECOMPUTE``) re-runs, one more ``[T / t, h]`` elementwise
  kernel; the popped outputs are freed when it has run (its own output is dropped);
* **on** (``early_stop = true``; torch's own default, ``set_checkpoint_early_stop``: "non-reentrant checkpoint stops
  recomputation as soon as it has computed all needed Tensors", which torchtitan before the key ran with:
  pytorch/torchtitan@81c12433 passes ``preserve_rng_state=False`` alone): the recompute stops once every tensor its backward
  unpacks exists again (``_recomputation_hook`` raises ``_StopRecomputationError``), i.e. at w2, whose autograd node
  saves its input before the op is dispatched, so the add is not run and the stored outputs it never reaches (w2's
  output and its reduce-scatter) stay in the checkpoint's storage until the block's backward is done (the frame is
  released with the block's autograd nodes): held by the block's last backward kernel here.

Stored outputs the recompute reads (wq, wv, the SDPA out, w1, the first reduce-scatter) are freed when their last
reader has run. The builder prices SwiGLU's silu and product as one kernel, after w3.
The philox state SDPA returns (two 8-byte tensors) is not counted. Under ``torch.autocast`` (fp32 weights not
gathered as bf16 by FSDP) every Linear's weight cast is an op outside the list, so all seven re-run (the recompute's
autocast context has a fresh cast cache: torch/utils/checkpoint.py restores the autocast state, not its cache); the
activations' casts follow the builder's forward, one per projection group (q/k/v, w1/w3).
"""

from __future__ import annotations

from simulator.graph.builders import qkv_layout
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpRole

def check_spec(s) -> None:
    """Raises: ValueError: a ``TransformerSpec`` with ``recompute`` op that is not torchtitan's dense Llama block
    (separate q / k / v, SwiGLU, flash attention with rope, no biases, no MoE / LoRA / fp8 / context parallelism,
    sequence parallelism with TP, no dropout, fused kernels)."""
    bad = [name for name, ok in (
        ("qkv_separate", qkv_layout.separate(s)), ("swiglu", s.swiglu), ("no bias", not s.bias and not s.qkv_bias),
        ("dense", s.num_experts is None), ("no lora", s.lora is None), ("no fp8", s.fp8 is None),
        ("cp 1", s.context_parallel_size == 1), ("sp with tp", s.tensor_parallel_size == 1 or s.sequence_parallel),
        ("no dropout", s.attention_dropout == 0 and s.hidden_dropout == 0), ("fused kernels", s.kernels == "fused"),
        ("no tp_comm_overlap", s.tp_comm_overlap == "none"), ("no vit", s.vit is None)) if not ok]
    if bad:
        raise ValueError(f"recompute op (torchtitan's per-op checkpointing) needs torchtitan's dense Llama block: "
                         f"{', '.join(bad)} not met")


#: The tensors one block's forward keeps for ``recompute`` (module docstring), the one table the builder
#: (``saved_outputs``) and the memory estimate (``kept_bytes``) read: name -> (what it is, kept only with TP). Without
#: TP the reductions are identities: ``proj_rs`` is then wo's output, recomputed, and ``w2_rs`` is ``w2``.
KEPT = {"x": ("the block input", False), "q": ("wq's output", False), "v": ("wv's output", False),
        "att": ("SDPA's output", False), "lse": ("SDPA's fp32 log-sum-exp", False),
        "proj_rs": ("wo's reduce-scatter output", True), "w1": ("w1's output", False),
        "w2": ("w2's output, before its reduce-scatter", False), "w2_rs": ("w2's reduce-scatter output", True)}


def kept(tp: int) -> tuple[str, ...]:
    """The names of ``KEPT`` a block keeps under TP size ``tp``."""
    return tuple(k for k, (_, tp_only) in KEPT.items() if tp > 1 or not tp_only)


def saved_outputs(bld, *, x: str, q: str, v: str, att: str, lse: str, proj_rs: str, w1: str, w2: str,
                  w2_rs: str) -> dict:
    """What the forward of one block keeps for ``recompute`` (``KEPT``: its input ``x``, the wq / wv outputs ``q`` /
    ``v``, the SDPA output and log-sum-exp, the wo reduce-scatter output ``proj_rs``, the w1 output, the w2 output and
    its reduce-scatter output ``w2_rs``), the tensor names by role; ``held``: those the recompute never reads."""
    names = dict(x=x, q=q, v=v, att=att, lse=lse, proj_rs=proj_rs, w1=w1, w2=w2, w2_rs=w2_rs)
    k = kept(bld.tp)
    out = {r: names[r] if r in k else None for r in ("x", "q", "v", "att", "lse", "proj_rs", "w1")}
    return {**out, "held": tuple(names[r] for r in ("w2", "w2_rs") if r in k)}


def kept_bytes(s, w: int, act: int) -> dict[str, int]:
    """Bytes per micro-batch of each tensor of ``KEPT`` a block of ``TransformerSpec`` ``s`` keeps (``kept``): the
    block input ``[T_n, h]`` in the residual dtype, q ``[T, a d / t]``, v ``[T, g d / t]``, the SDPA output ``[T,
    a d / t]``, the fp32 log-sum-exp ``[b, a / t, s]``, w1 ``[T, f / t]``, w2 ``[T, h]`` and the two
    reduce-scatter outputs ``[T_n, h]``: ``w`` bytes per element (the GEMM output dtype), ``act`` for the block
    input (the residual dtype), 4 for the log-sum-exp (``T_n = T / t`` under sequence parallelism, which op mode
    needs with TP: ``check_spec``)."""
    t = s.tensor_parallel_size
    T = s.micro_batch_size * s.seq_length
    Tn, h = T // t, s.hidden_size
    sizes = {"x": act * Tn * h, "q": w * T * s.attention_width // t, "v": w * T * s.query_groups * s.head_dim // t,
             "att": w * T * s.attention_width // t,
             "lse": 4 * s.micro_batch_size * (s.num_attention_heads // t) * s.seq_length,
             "proj_rs": w * Tn * h, "w1": w * T * s.ffn_hidden_size // t, "w2": w * T * h, "w2_rs": w * Tn * h}
    return {k: sizes[k] for k in kept(t)}


def recompute(bld, c: dict) -> dict:
    """Re-run the ops torchtitan's policy did not save of the current block (``bld.e.layer``, backward phase), from
    ``c`` (``saved_outputs``), up to w2 with ``recompute_early_stop``, else to the block's end (module docstring).
    Returns the tensors its backward reads (``_GptBuilder._layer_bwd``'s ``sv``)."""
    s, e, T, t = bld.s, bld.e, bld.T, bld.tp
    f, hf = s.ffn_hidden_size // t, s.hidden_size
    h, kv = s.attention_width // t, s.query_groups * s.head_dim // t
    bld._gather_layer_params(e.layer, e.phase)
    ln1s, ln1_st = bld._norm_fwd("ln1", c["x"], OpRole.BLOCK_INPUT_NORM)
    ln1 = bld._tp_gather("ln1", ln1s)
    bld._weight16("wq_wv", hf * (h + kv))  # autocast: the stored wq, wv mm's weight casts re-run (else no kernel)
    k, sv_qkv = bld._linear_fwd("wk", ln1, hf, kv, x_fp32=True, save=True)
    sv_qkv = bld._save_shard(sv_qkv, ln1s)
    attn_in = qkv_layout.separate_fwd(bld, [c["q"], k], c["v"], h, kv)
    attc = e.fresh("attn.out_contig")
    e.kernel("attn.transpose", C.COPY, reads=bld.w * T * h, writes=bld.w * T * h, out=[(attc, bld.w * T * h)],
             uses=[c["att"]])
    proj, sv_proj = bld._linear_fwd("proj", attc, h, hf, x_fp32=False, save=True)
    x2 = bld._add("residual1", c["x"], c["proj_rs"] or proj, bld.act, bld.w, bld.act)
    ln2s, ln2_st = bld._norm_fwd("ln2", x2)
    ln2 = bld._tp_gather("ln2", ln2s)
    bld._weight16("w1", hf * f)
    w3, sv_fc1 = bld._linear_fwd("w3", ln2, hf, f, x_fp32=True, save=True)
    sv_fc1 = bld._save_shard(sv_fc1, ln2s)
    g = bld._act_fwd("", (c["w1"], w3), T, f)
    w_fc2 = bld._weight16("fc2", f * hf)  # w2's weight for its backward (autocast: its cast re-runs; its mm is stored)
    held = c["held"]
    if not s.recompute_early_stop:  # the forward runs to its end: h + ffn_out again, reading the popped w2 (RS) output
        bld._add("residual2", x2, held[-1], bld.act, bld.w, bld.act, held=held[:-1])
        held = ()
    return dict(x=c["x"], qkv=None, qk=attn_in[0], att=c["att"], sv_qkv=sv_qkv, sv_proj=sv_proj, x2=x2,
                fc1=(c["w1"], w3), sv_fc1=sv_fc1, sv_fc2=(g, w_fc2, None), moe=None, core=None, mask1=None,
                mask2=None, lse=c["lse"], ln1_stats=ln1_st, ln2_stats=ln2_st, attn_in=attn_in, held=held)
