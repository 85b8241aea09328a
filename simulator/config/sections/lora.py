"""Scenario key ``training.lora``: a LoRA fine-tune with Hugging Face PEFT ``LoraConfig`` names.

::

    training:
      lora:
        rank: 16                # PEFT r
        alpha: 32               # PEFT lora_alpha (adapter output scaled by alpha / rank)
        target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
        dropout: 0.05           # PEFT lora_dropout (default 0: no dropout kernel)

It sits under ``training`` because it changes what is trained, not the model: ``num_parameters`` stays the
model's count and the summary adds ``num_trainable_parameters``. The model (kernels, memory, sources) is
``simulator/graph/builders/lora.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, PositiveInt, field_validator

from simulator.config.limits import MAX_HIDDEN_SIZE, MODEL_CONFIG, no_bool
from simulator.graph.builders import lora as lora_model


class LoraConfig(BaseModel):
    """LoRA (PEFT names): base weights frozen; adapters A [in, rank], B [rank, out] on the targets of every block."""

    model_config = MODEL_CONFIG

    rank: PositiveInt = Field(le=MAX_HIDDEN_SIZE, description="PEFT r: inner dimension of A and B (at most min(in, "
                              "out) of every targeted Linear).")
    alpha: float = Field(default=8.0, gt=0, le=1e6, description="PEFT lora_alpha: the adapter output is scaled by "
                         "alpha / rank (PEFT default 8).")
    target_modules: list[str] = Field(
        min_length=1, max_length=16, description="Hugging Face names q_proj, k_proj, v_proj, o_proj, gate_proj "
        "(SwiGLU only), up_proj, down_proj (one adapter per projection), or Megatron names linear_qkv, linear_proj, "
        "linear_fc1, linear_fc2 (one adapter per fused Linear), or [all-linear]; not both families.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="PEFT lora_dropout on the adapter input (0: none).")

    _no_bool = field_validator("rank", "alpha", "dropout", mode="before")(no_bool)


def check_lora_scenario(cfg) -> None:
    """The scenario-level checks of ``training.lora`` (a ``ScenarioConfig``): modules of this model, the rank
    against their shapes, and the combinations not modelled.

    Raises:
        ValueError: naming the key and what is allowed.
    """
    lo = cfg.training.lora
    if lo is None:
        return
    m = cfg.model
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    try:
        shapes = lora_model.adapter_shapes(tuple(lo.target_modules), m.hidden_size, m.ffn_hidden_size or
                                           4 * m.hidden_size, m.num_attention_heads * d, m.query_groups * d, m.swiglu)
    except ValueError as err:
        raise ValueError(f"training.lora.target_modules: {err}") from None
    try:
        lora_model.check_rank(lo.rank, shapes)
    except ValueError as err:
        raise ValueError(f"training.lora.rank: {err}") from None
    p, z = cfg.parallelism, cfg.zero_optimization
    dp = p.data_parallel_size or 1
    refused = [(k, v) for k, v, on in (
        ("parallelism.sequence_parallel", True, p.sequence_parallel and p.tensor_model_parallel_size > 1),
        ("parallelism.pipeline_model_parallel_size", p.pipeline_model_parallel_size, p.pipeline_model_parallel_size > 1),
        ("parallelism.context_parallel_size", p.context_parallel_size, p.context_parallel_size > 1),
        ("zero_optimization.stage", z.stage, z.stage > 0 and dp > 1),
        ("zero_optimization.offload_optimizer.device", z.offload_optimizer.device, z.offload_optimizer.device != "none"),
        ("zero_optimization.offload_param.device", z.offload_param.device, z.offload_param.device != "none"),
        ("fsdp", "set", cfg.fsdp is not None),
        ("ddp.use_distributed_optimizer", True, cfg.ddp.use_distributed_optimizer),
        ("model.num_experts", m.num_experts, m.num_experts is not None),
        ("training.fp8", cfg.training.fp8, cfg.training.fp8 is not None)) if on]
    if refused:
        k, v = refused[0]
        raise ValueError(f"training.lora with {k} {v} is not modelled yet (allowed with LoRA: one GPU or DDP data "
                         "parallelism, tensor parallelism without sequence_parallel, pp = cp = 1, no ZeRO/FSDP/"
                         "distributed optimizer/offload, dense models, no fp8)")
