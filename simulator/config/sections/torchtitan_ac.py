"""Scenario key ``activation_checkpoint``: torchtitan's ``[activation_checkpoint]`` section, under its own names.

::

    activation_checkpoint:
      mode: selective            # none | selective | full (torchtitan's default: selective)
      selective_ac_option: op    # "op", or an int n: every n-th block checkpointed (torchtitan's default: "2")

torchtitan wraps each ``TransformerBlock`` (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py
``apply_ac``, ``_apply_ac_to_transformer_block``; since moved to torchtitan/distributed/activation_checkpoint.py
``_apply_op_sac`` / ``_apply_layer_sac``, called from llama3/infra/parallelize.py with its ``_op_sac_save_list``,
pytorch/torchtitan@018740b7):

* ``full``: every block through ``checkpoint_wrapper`` (its input kept, its forward re-run before its backward):
  the builder's ``recompute: full``, the same graph as ``training.recompute_granularity: full``;
* ``selective`` with an int ``n``: a counter over the wrapped blocks (``ptd_checkpoint_wrapper._count``, from 1)
  checkpoints block ``i`` (0-based) whole when ``(i + 1) % n == 0``, or every block when ``n`` is 0
  (``not ac_freq``); the others keep all their activations. The counter runs over every block the process
  wraps, across pipeline chunks: refused with pipeline parallelism (not modelled);
* ``selective`` with ``op``: per-op selective checkpointing (``simulator/graph/builders/op_sac.py``).

The defaults are torchtitan's (pytorch/torchtitan@0011fb90 torchtitan/config_manager.py
``--activation_checkpoint.mode`` "selective", ``--activation_checkpoint.selective_ac_option`` "2"). ``memory_budget``
(later torchtitan; needs torch.compile) is refused. The section stands for torchtitan's model (``fsdp.version 2``:
separate ``wq`` / ``wk`` / ``wv``, SwiGLU ``w1`` / ``w3`` / ``w2``), so it needs ``fsdp.version 2``, and it replaces
``training.recompute_granularity`` (one of them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from simulator.config.limits import MAX_NUM_LAYERS, MODEL_CONFIG

#: torchtitan's ``[activation_checkpoint] mode`` values (``memory_budget``: refused, needs torch.compile)
MODES = ("none", "selective", "full", "memory_budget")


class TorchtitanActivationCheckpoint(BaseModel):
    """torchtitan's ``[activation_checkpoint]``: ``mode`` and ``selective_ac_option`` (module docstring)."""

    model_config = MODEL_CONFIG

    mode: Literal["none", "selective", "full", "memory_budget"] = Field(
        default="selective", description="torchtitan [activation_checkpoint] mode: none, full (every TransformerBlock "
        "checkpointed whole), selective (selective_ac_option); memory_budget (torch.compile's partitioner) is refused. "
        "Default selective, torchtitan's.")
    selective_ac_option: Literal["op"] | int = Field(
        default=2, description="torchtitan [activation_checkpoint] selective_ac_option with mode selective: op "
        "(per-op: the outputs of every other aten.mm, of SDPA, of the TP reduce-scatters and of aten.max saved, the "
        "rest recomputed in backward; simulator/graph/builders/op_sac.py) or an int n >= 0 (every n-th block "
        "checkpointed whole, 0: every block). A string of digits (TOML) is read as the int. Default 2, torchtitan's.")

    @field_validator("selective_ac_option", mode="before")
    @classmethod
    def _option(cls, v):
        """``"op"``, an int ``0..MAX_NUM_LAYERS``, or its digits as a string (torchtitan's TOML writes ``"2"``)."""
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if v == "op" or (type(v) is int and 0 <= v <= MAX_NUM_LAYERS):
            return v
        raise ValueError(f"{v!r} is not a torchtitan selective_ac_option (allowed: 'op', or an int n with "
                         f"0 <= n <= {MAX_NUM_LAYERS}: every n-th block checkpointed)")

    @property
    def recompute(self) -> tuple[str, int]:
        """``(TransformerSpec.recompute, recompute_every)``: ``("none", 1)``, ``("full", 1)``, ``("op", 1)`` or
        ``("full", n)`` for every ``n``-th block (``n`` 0 or 1: every block, ``("full", 1)``)."""
        if self.mode == "none":
            return "none", 1
        if self.mode == "full":
            return "full", 1
        if self.selective_ac_option == "op":
            return "op", 1
        n = self.selective_ac_option
        return "full", 1 if n in (0, 1) else n


def recompute_of(cfg) -> tuple[str, int]:
    """The recompute a scenario (``ScenarioConfig``) builds: ``(TransformerSpec.recompute, recompute_every)`` from
    ``activation_checkpoint`` when given, else from ``training.recompute_granularity`` (``("none", 1)`` unset)."""
    ac = cfg.activation_checkpoint
    if ac is not None:
        return ac.recompute
    return cfg.training.recompute_granularity or "none", 1


def check_scenario(cfg) -> None:
    """The scenario-level checks of ``activation_checkpoint`` (a ``ScenarioConfig``).

    Raises:
        ValueError: naming the key and what is allowed: no fsdp.version 2, beside training.recompute_granularity or
            DeepSpeed's activation_checkpointing.cpu_checkpointing, mode memory_budget, an int option under pipeline
            parallelism, or the op option outside what ``op_sac`` models.
    """
    ac = cfg.activation_checkpoint
    if ac is None:
        return
    if ac.mode == "memory_budget":
        raise ValueError("activation_checkpoint.mode: memory_budget (torch.compile's partitioner under an activation "
                         "memory budget) is torchtitan's but not modelled (allowed here: none, selective, full)")
    if cfg.fsdp is None or cfg.fsdp.version != 2:
        raise ValueError("activation_checkpoint is torchtitan's [activation_checkpoint] for its FSDP2 Llama: it needs "
                         "fsdp: {version: 2} (allowed: add it, or training.recompute_granularity for Megatron-LM)")
    if cfg.training.recompute_granularity is not None:
        raise ValueError("activation_checkpoint and training.recompute_granularity both set the recompute (allowed: "
                         "one of them; activation_checkpoint.mode full is recompute_granularity full)")
    if cfg.activation_checkpointing.cpu_checkpointing:
        raise ValueError("activation_checkpointing.cpu_checkpointing (DeepSpeed) with torchtitan's "
                         "activation_checkpoint is not modelled (allowed: cpu_checkpointing false)")
    mode, every = ac.recompute
    p = cfg.parallelism
    if every > 1 and p.pipeline_model_parallel_size > 1:
        raise ValueError(f"activation_checkpoint.selective_ac_option: {every} with pipeline_model_parallel_size > 1 is "
                         "not modelled (torchtitan's block counter runs across the process's pipeline chunks; "
                         "allowed: op, 0 or 1, or pipeline_model_parallel_size 1)")
    if mode == "op":
        _check_op(cfg)


def _check_op(cfg) -> None:
    """What ``selective_ac_option: op`` is modelled for (``op_sac.py``): torchtitan's dense Llama block."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    refused = [(k, v) for k, v, on in (
        ("model.swiglu", False, not m.swiglu),
        ("model.position_embedding_type", m.position_embedding_type, m.position_embedding_type != "rope"),
        ("model.attention_backend", m.attention_kernel, m.attention_kernel != "flash"),
        ("model.add_bias_linear", True, m.add_bias_linear),  # Linear with bias is aten.addmm, not aten.mm
        ("model.add_qkv_bias", True, m.add_qkv_bias),
        ("model.num_experts", m.num_experts, m.num_experts is not None),
        ("model.kernels", m.kernels, m.kernels != "fused"),
        ("model.attention_dropout", m.attention_dropout, m.attention_dropout > 0),
        ("model.hidden_dropout", m.hidden_dropout, m.hidden_dropout > 0),
        ("parallelism.context_parallel_size", p.context_parallel_size, p.context_parallel_size > 1),
        ("parallelism.sequence_parallel", False, p.tensor_model_parallel_size > 1 and not p.sequence_parallel),
        ("parallelism.tp_comm_overlap", p.tp_comm_overlap, p.tp_comm_overlap is not False),
        ("fsdp.mixed_precision param_dtype", "fp32", cfg.fsdp.dtypes[0] != "bf16"),
        ("training.lora", "set", t.lora is not None)) if on]
    if refused:
        k, v = refused[0]
        raise ValueError(f"activation_checkpoint.selective_ac_option: op with {k} {v} is not modelled (allowed: "
                         "torchtitan's dense Llama block: SwiGLU, rope, flash attention, no biases or dropout, bf16 "
                         "FSDP parameters, tensor parallelism with sequence_parallel, no context parallelism, LoRA or "
                         "tp_comm_overlap)")
