"""``model.architecture: vit``: the vision-transformer keys of the model section and what is refused with them.

A ViT (Dosovitskiy et al., ICLR 2021; Hugging Face ``ViTConfig`` names) is described by ``image_size``,
``patch_size``, ``num_channels`` (default 3), ``num_classes`` and the encoder's ``hidden_size``,
``num_layers``, ``num_attention_heads``, ``ffn_hidden_size`` (HF ``intermediate_size``). The sequence is
derived: ``seq_length = (image_size / patch_size)^2 + 1`` (patches and the CLS token); there is no vocabulary.
The blocks are pre-LayerNorm with biases and a GELU MLP; attention is bidirectional.

Refused in one line (``expand_model`` / ``scenario_scope``): decoder-only keys (``vocab_size``,
``max_position_embeddings``, grouped-query attention, SwiGLU, RMSNorm, rotary embeddings, untied output
layer, ``add_bias_linear: false``, ``add_qkv_bias``, ``kv_channels``, a sliding window, experts), a
``seq_length`` other than the derived one, ``patch_size`` not dividing ``image_size``; and, not modelled
yet, pipeline, context and sequence parallelism, ZeRO-3, FSDP, the distributed optimizer and ZeRO offload.
Tensor parallelism is modelled (the blocks' Megatron split; the patch embedding and head replicated).
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = ("decoder", "vit")
#: ViT-only model keys (None: not set)
VIT_KEYS = ("image_size", "patch_size", "num_channels", "num_classes")
#: decoder-only model keys refused with architecture vit when set to anything but their default
DECODER_ONLY = ("vocab_size", "max_position_embeddings", "group_query_attention", "num_query_groups", "swiglu",
                "normalization", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
                "add_qkv_bias", "kv_channels", "window_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor",
                "moe_router_load_balancing_type")
_WHY = {"vocab_size": "a ViT has no vocabulary (num_classes sizes the head)",
        "max_position_embeddings": "the position table has seq_length rows",
        "normalization": "ViT blocks use LayerNorm", "position_embedding_type": "ViT learns absolute positions",
        "add_bias_linear": "ViT layers all have biases", "untie_embeddings_and_output_weights": "a ViT head is "
        "never tied"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _misspelt(key: str, data: dict, fields: dict) -> bool:
    """Whether ``data`` writes an unknown key (not one of ``fields``) that is a misspelling of ``key`` (difflib's
    closest field name to it, as the unknown-key line suggests): that line names the problem, a "missing" here
    would hide it (pydantic reports no field error once a before-validator refused)."""
    import difflib

    return any(difflib.get_close_matches(str(k), list(fields), n=1) == [key] for k in data if k not in fields)


def expand_model(data: dict, defaults: dict[str, Any]) -> dict:
    """The model section with the family's rules applied (before field validation).

    Decoder (``architecture`` absent or ``decoder``): ``seq_length`` and ``vocab_size`` are required, ViT
    keys refused. ViT: ``image_size``, ``patch_size`` and ``num_classes`` required, ``num_channels``
    defaults to 3, ``seq_length`` derived (a given one must equal it), decoder-only keys refused.

    Args:
        data: The model mapping (``from_hf`` already merged).
        defaults: Each model field's default (keys left at it are not "set": model dumps round-trip).

    Raises:
        ValueError: one line naming the key and what is allowed.
    """
    arch = data.get("architecture", "decoder")
    if arch == "decoder":
        for k in VIT_KEYS:
            if data.get(k) is not None:
                raise ValueError(f"{k}: needs architecture: vit (a vision transformer; allowed with decoder: omit it)")
        for k in ("seq_length", "vocab_size"):
            if k not in data and not _misspelt(k, data, defaults):
                raise ValueError(f"{k}: required key is missing (architecture decoder)")
        return data
    if arch != "vit":
        return data  # the field's Literal names the allowed values
    for k in DECODER_ONLY:
        if k in data and data[k] != defaults.get(k):
            why = _WHY.get(k, "a decoder-only key")
            raise ValueError(f"{k}: not allowed with architecture vit ({why}; allowed: omit it)")
    for k in ("image_size", "patch_size", "num_classes"):
        if data.get(k) is None:
            raise ValueError(f"{k}: required key is missing (architecture vit)")
    img, patch = data["image_size"], data["patch_size"]
    if not (_is_int(img) and _is_int(patch)):
        return data  # the fields' own checks name the bad value
    if img % patch:
        raise ValueError(f"patch_size: {patch} must divide image_size {img} (the image is cut into whole patches; "
                         f"allowed: a divisor of {img})")
    seq = (img // patch) ** 2 + 1
    given = data.get("seq_length")
    if given is not None and given != seq:
        raise ValueError(f"seq_length: {given!r} does not match (image_size / patch_size)^2 + 1 = {seq} of a ViT "
                         f"(patches and the CLS token; allowed: {seq}, or omit it)")
    out = {**data, "seq_length": seq}
    if out.get("num_channels") is None:
        out["num_channels"] = 3
    return out


def scenario_scope(cfg) -> None:
    """What is not modelled with ``architecture: vit`` in the rest of the scenario.

    Raises:
        ValueError: one line naming the key: pipeline / context / sequence parallelism, ZeRO-3, FSDP, the
            distributed optimizer, ZeRO offload, LoRA.
    """
    if cfg.model.architecture != "vit":
        return
    p, z = cfg.parallelism, cfg.zero_optimization
    bad = [("parallelism.pipeline_model_parallel_size", p.pipeline_model_parallel_size, p.pipeline_model_parallel_size > 1),
           ("parallelism.context_parallel_size", p.context_parallel_size, p.context_parallel_size > 1),
           ("parallelism.sequence_parallel", p.sequence_parallel, p.sequence_parallel),
           ("zero_optimization.stage", z.stage, z.stage == 3),
           ("fsdp", "set", cfg.fsdp is not None),
           ("ddp.use_distributed_optimizer", True, cfg.ddp.use_distributed_optimizer),
           ("zero_optimization.offload_optimizer.device", z.offload_optimizer.device, z.offload_optimizer.device != "none"),
           ("zero_optimization.offload_param.device", z.offload_param.device, z.offload_param.device != "none"),
           ("training.lora", "set", cfg.training.lora is not None)]
    for key, value, on in bad:
        if on:
            raise ValueError(f"{key}: {value} with model.architecture vit is not modelled yet (allowed with a ViT: "
                             "one GPU, tensor and data parallelism with DDP or ZeRO stage 1/2, no offload)")
