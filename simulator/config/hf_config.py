"""``model.from_hf``: a Hugging Face ``config.json`` read into the scenario's model section.

Supported ``model_type`` values and the keys read (``transformers`` configuration classes
``LlamaConfig``, ``MistralConfig``, ``MixtralConfig``, ``Qwen2Config``, ``GPT2Config``):

* ``hidden_size`` / ``n_embd`` -> ``hidden_size``; ``num_hidden_layers`` / ``n_layer`` -> ``num_layers``;
  ``num_attention_heads`` / ``n_head`` -> ``num_attention_heads``; ``intermediate_size`` / ``n_inner``
  -> ``ffn_hidden_size``; ``vocab_size``; ``max_position_embeddings`` / ``n_positions`` ->
  ``max_position_embeddings`` and, unless the scenario sets it, ``seq_length``;
* ``num_key_value_heads`` below the head count -> ``group_query_attention: true`` and
  ``num_query_groups``;
* ``tie_word_embeddings`` (class default: false for llama, mistral, qwen2; true for gpt2) ->
  ``untie_embeddings_and_output_weights``;
* llama / mistral / qwen2: ``hidden_act`` must be ``silu`` (-> ``swiglu: true``), RMSNorm
  (``rms_norm_eps``) and rotary embeddings (``rope_theta``; ``rope_scaling`` changes the
  frequencies, not the cost, and is ignored); biases: llama ``attention_bias`` / ``mlp_bias``
  (both or neither), qwen2 a QKV bias only (``add_qkv_bias``), mistral none;
* ``head_dim`` other than ``hidden_size / num_attention_heads`` -> ``kv_channels`` (Mistral-Nemo, Qwen3 style);
* mistral / mixtral ``sliding_window`` -> ``window_size`` (sliding-window attention; null: none);
* mixtral: as mistral, with ``num_local_experts`` -> ``num_experts`` and ``num_experts_per_tok`` ->
  ``moe_router_topk`` (``MixtralConfig`` defaults 8 and 2); ``intermediate_size`` is each expert's
  width; ``router_aux_loss_coef``, ``output_router_logits`` and ``router_jitter_noise`` change the
  loss, not the cost, and are ignored;
* gpt2: LayerNorm, GELU, learned positions, biases everywhere;
* mpt (MosaicML ``MPTConfig``, ``MPTForCausalLM``): see ``_read_mpt`` (ALiBi -> ``position_embedding_type: none``);
* vit (``ViTConfig``, ``ViTForImageClassification``) -> ``architecture: vit``: ``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size`` -> ``ffn_hidden_size``,
  ``image_size``, ``patch_size``, ``num_channels`` (``ViTConfig`` defaults 224, 16, 3); ``num_labels``, else
  the size of ``id2label``, else the ``PretrainedConfig`` default 2 -> ``num_classes``; ``hidden_act`` must be
  a GELU and ``qkv_bias`` true (the class defaults; a QKV without bias beside biased layers is not modelled).
  ``encoder_stride``, ``layer_norm_eps``, dropouts and ``label2id`` do not change the cost and are ignored.
* qwen2_moe (Qwen1.5-MoE, Qwen2-57B-A14B): as qwen2, with ``num_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size`` -> ``moe_ffn_hidden_size``, ``shared_expert_intermediate_size`` and its sigmoid
  gate (``moe_shared_expert_gate``), ``decoder_sparse_step`` / ``mlp_only_layers`` -> ``moe_layer_freq`` (one
  0/1 per block; a dense block is an MLP of ``intermediate_size``); see ``_qwen2_moe``;
* deepseek (DeepSeek-MoE 16B): as llama, with ``n_routed_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size``, ``n_shared_experts`` x ``moe_intermediate_size`` -> the shared expert,
  ``first_k_dense_replace`` / ``moe_layer_freq`` -> ``moe_layer_freq``; see ``_deepseek_moe``;
* gpt2: LayerNorm, GELU, learned positions, biases everywhere.

Other keys (token ids, dtype, initialiser ranges...) do not change the step's cost and are ignored.
Refused, in one line naming the key: mixture-of-experts keys outside mixtral, qwen2_moe and deepseek; deepseek_v2 /
deepseek_v3 (MLA attention, not modelled); another ``model_type``; a
qwen2 sliding window (``use_sliding_window``; Qwen2 applies it above ``max_window_layers`` only, not
modelled) shorter than ``seq_length``.
The file is read with ``hardware_models.safe_yaml`` (JSON is YAML 1.2: size, depth and integer
limits, duplicate keys refused).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from hardware_models import safe_yaml
from hardware_models.presets import FILE_PREFIXES, is_file_reference
from simulator.config.errors import ScenarioWarning

SUPPORTED = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "deepseek", "vit", "mpt")
#: model types with mixture-of-experts keys read here
MOE_TYPES = ("mixtral", "qwen2_moe", "deepseek")
#: MLA attention (Multi-head Latent Attention, DeepSeek-V2 section 2.1): not modelled
MLA_TYPES = ("deepseek_v2", "deepseek_v3")
#: Mixture-of-experts keys of Qwen2-MoE, DeepSeek and others: refused outside MOE_TYPES
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_shared_experts", "shared_expert_intermediate_size")
#: The config.json names each model-section key is read from, per reader (``read_hf_config``): an error
#: about a key the scenario took from the file names the file's key too (``hf_origin``)
HF_NAMES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "expansion_ratio"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "seq_length": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "window_size": ("sliding_window",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size", "n_shared_experts"),
    "image_size": ("image_size",), "patch_size": ("patch_size",), "num_channels": ("num_channels",),
    "num_classes": ("num_labels",),
}
_GELU = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")


def _get(cfg: dict, where: str, *names: str, required: bool = True) -> int | None:
    """The first of ``names`` present (not null) in ``cfg``, as a positive int."""
    for n in names:
        v = cfg.get(n)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {n}: expected a positive integer, got {v!r}")
        return v
    if required:
        raise ValueError(f"{where}: required key {' / '.join(names)} is missing")
    return None


def _flag(cfg: dict, where: str, name: str, default: bool) -> bool:
    v = cfg.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: {name}: expected true or false, got {v!r}")  # noqa: TRY004 (pydantic reports ValueError)
    return v


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Model-section keys (Megatron-LM names) of a Hugging Face ``config.json``.

    Args:
        path: The file.

    Returns:
        ``{"hidden_size": ..., "num_layers": ..., ...}`` plus ``sliding_window`` (int or None, a
        check for ``merge_hf``, not a model key) and ``moe_layers`` (None, or ``num_layers -> [0/1 per block]``
        for ``merge_hf``, which applies it to the scenario's ``num_layers``).

    Raises:
        ValueError: one line starting with the path: unreadable file, unsupported architecture or key.
    """
    where = str(path)
    try:
        cfg = safe_yaml.load_mapping(path, "a Hugging Face config.json mapping")
    except safe_yaml.YamlInputError as exc:
        raise ValueError(f"{where}: {exc}") from None
    mt = cfg.get("model_type")
    if mt in MLA_TYPES:
        raise ValueError(f"{where}: model_type: {mt!r} uses MLA attention (multi-head latent attention, kv_lora_rank) "
                         f"which is not modelled (supported: {', '.join(SUPPORTED)})")
    for k in MOE_KEYS:
        if mt not in MOE_TYPES and cfg.get(k) not in (None, 0):
            raise ValueError(f"{where}: {k}: mixture-of-experts configs of model_type {mt!r} are not modelled yet "
                             f"(supported model_type: {', '.join(SUPPORTED)}; mixture of experts: "
                             f"{', '.join(MOE_TYPES)})")
    if mt not in SUPPORTED:
        arch = cfg.get("architectures")
        name = f"{mt!r}" + (f" ({', '.join(map(str, arch))})" if isinstance(arch, list) and arch else "")
        raise ValueError(f"{where}: model_type: {name} is not supported (supported: {', '.join(SUPPORTED)})")
    if mt == "vit":
        return _read_vit(cfg, where)
    if mt == "mpt":
        return _read_mpt(cfg, where)
    gpt2 = mt == "gpt2"
    h = _get(cfg, where, "n_embd" if gpt2 else "hidden_size")
    a = _get(cfg, where, "n_head" if gpt2 else "num_attention_heads")
    out: dict[str, Any] = {
        "num_layers": _get(cfg, where, "n_layer" if gpt2 else "num_hidden_layers"),
        "hidden_size": h,
        "num_attention_heads": a,
        "vocab_size": _get(cfg, where, "vocab_size"),
    }
    pos = _get(cfg, where, "n_positions" if gpt2 else "max_position_embeddings")
    out["max_position_embeddings"] = pos
    out["seq_length"] = pos
    f = _get(cfg, where, "n_inner" if gpt2 else "intermediate_size", required=not gpt2)
    if f is not None:
        out["ffn_hidden_size"] = f
    out["untie_embeddings_and_output_weights"] = not _flag(cfg, where, "tie_word_embeddings", gpt2)
    hd = _get(cfg, where, "head_dim", required=False)
    if hd is not None and (h % a or hd != h // a):
        out["kv_channels"] = hd
    elif h % a:
        raise ValueError(f"{where}: num_attention_heads ({a}) must divide hidden_size ({h}) (or set head_dim)")
    out["sliding_window"] = None
    out["moe_layers"] = None
    if gpt2:
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GELU:
            raise ValueError(f"{where}: activation_function: {act!r} is not supported (allowed: {', '.join(_GELU)})")
        out.update(normalization="LayerNorm", position_embedding_type="learned_absolute", add_bias_linear=True)
        return out
    kv = _get(cfg, where, "num_key_value_heads", required=False) or a
    if a % kv:
        raise ValueError(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({a})")
    if kv != a:
        out.update(group_query_attention=True, num_query_groups=kv)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act: {act!r} is not supported for {mt} (allowed: silu, i.e. SwiGLU)")
    out.update(swiglu=True, normalization="RMSNorm", position_embedding_type="rope")
    if mt == "deepseek":
        if _flag(cfg, where, "attention_bias", False):
            raise ValueError(f"{where}: attention_bias: true with experts is not modelled (allowed: false)")
        out["add_bias_linear"] = False
        _deepseek_moe(cfg, where, out)
    elif mt == "llama":
        ab, mb = _flag(cfg, where, "attention_bias", False), _flag(cfg, where, "mlp_bias", False)
        if ab != mb:
            raise ValueError(f"{where}: attention_bias ({ab}) with mlp_bias ({mb}): biases on one of the two only "
                             "are not modelled (allowed: both true or both false)")
        out["add_bias_linear"] = ab
    elif mt in ("qwen2", "qwen2_moe"):  # q/k/v projections have a bias, o_proj and the MLP none (Qwen2Attention)
        out.update(add_bias_linear=False, add_qkv_bias=True)
        if _flag(cfg, where, "use_sliding_window", False):
            out["sliding_window"] = _get(cfg, where, "sliding_window")
        if mt == "qwen2_moe":
            _qwen2_moe(cfg, where, out)
    else:  # mistral, mixtral
        out["add_bias_linear"] = False
        w = _get(cfg, where, "sliding_window", required=False)
        if w is not None:
            out["window_size"] = w
    if mt == "mixtral":  # MixtralConfig defaults: 8 experts, top-2
        out["num_experts"] = _get(cfg, where, "num_local_experts", required=False) or 8
        out["moe_router_topk"] = _get(cfg, where, "num_experts_per_tok", required=False) or 2
    return out


def _read_vit(cfg: dict, where: str) -> dict[str, Any]:
    """Model keys of a ``ViTConfig`` (module docstring); ``ViTConfig`` defaults for the image keys."""
    act = cfg.get("hidden_act", "gelu")
    if act not in _GELU:
        raise ValueError(f"{where}: hidden_act: {act!r} is not supported for vit (allowed: {', '.join(_GELU)})")
    if not _flag(cfg, where, "qkv_bias", True):
        raise ValueError(f"{where}: qkv_bias: false (a QKV without bias beside biased layers) is not modelled "
                         "(allowed: true)")
    labels = _get(cfg, where, "num_labels", required=False)
    if labels is None:
        id2label = cfg.get("id2label")
        if id2label is not None and not (isinstance(id2label, dict) and id2label):
            raise ValueError(f"{where}: id2label: expected a non-empty mapping of class ids to names")
        labels = len(id2label) if id2label else 2  # PretrainedConfig: num_labels 2 without id2label
    return {"architecture": "vit", "num_layers": _get(cfg, where, "num_hidden_layers"),
            "hidden_size": _get(cfg, where, "hidden_size"), "num_attention_heads": _get(cfg, where,
                                                                                         "num_attention_heads"),
            "ffn_hidden_size": _get(cfg, where, "intermediate_size"),
            "image_size": _get(cfg, where, "image_size", required=False) or 224,
            "patch_size": _get(cfg, where, "patch_size", required=False) or 16,
            "num_channels": _get(cfg, where, "num_channels", required=False) or 3,
            "num_classes": labels, "sliding_window": None}


def _qwen2_moe(cfg: dict, where: str, out: dict) -> None:
    """Qwen2-MoE (``Qwen2MoeConfig`` defaults: 60 experts, top-4, expert width 1408, shared expert 5632):
    ``Qwen2MoeSparseMoeBlock`` = router ``gate`` ``[E, h]``, ``E`` SwiGLU experts of ``moe_intermediate_size``, one
    shared SwiGLU expert of ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``
    (``[1, h]``). Block ``i`` is MoE unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
    a dense block is an MLP of ``intermediate_size``. ``norm_topk_prob`` renormalises the top-k weights inside
    the top-k kernel (no cost of its own) and is ignored."""
    out["num_experts"] = _get(cfg, where, "num_experts", required=False) or 60
    out["moe_router_topk"] = _get(cfg, where, "num_experts_per_tok", required=False) or 4
    out["moe_ffn_hidden_size"] = _get(cfg, where, "moe_intermediate_size", required=False) or 1408
    fs = cfg.get("shared_expert_intermediate_size", 5632)
    if fs:
        out["moe_shared_expert_intermediate_size"] = _get(cfg, where, "shared_expert_intermediate_size",
                                                          required=False) or 5632
        out["moe_shared_expert_gate"] = True
    step = _get(cfg, where, "decoder_sparse_step", required=False) or 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"{where}: mlp_only_layers: expected a list of layer indices, got {only!r}")
    out["moe_layers"] = lambda n: [int(i not in only and (i + 1) % step == 0) for i in range(n)]


def _deepseek_moe(cfg: dict, where: str, out: dict) -> None:
    """DeepSeek-MoE (``deepseek-ai/deepseek-moe-16b-base``, ``DeepseekConfig``; Dai et al., *DeepSeekMoE*, 2024):
    ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size``, top ``num_experts_per_tok`` by softmax
    (``scoring_func`` must be ``softmax``), ``n_shared_experts`` shared experts fused into one of
    ``n_shared_experts x moe_intermediate_size`` (``DeepseekMoE.shared_experts``, no gate). Block ``i`` is MoE when
    ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``, else a dense MLP of ``intermediate_size``.
    ``aux_loss_alpha`` / ``seq_aux`` (the loss, not the cost) and ``norm_topk_prob`` are ignored."""
    E = _get(cfg, where, "n_routed_experts", required=False)
    if E is None:
        return
    sf = cfg.get("scoring_func", "softmax")
    if sf != "softmax":
        raise ValueError(f"{where}: scoring_func: {sf!r} is not modelled (allowed: softmax)")
    fe = _get(cfg, where, "moe_intermediate_size")
    out.update(num_experts=E, moe_router_topk=_get(cfg, where, "num_experts_per_tok"), moe_ffn_hidden_size=fe)
    ns = cfg.get("n_shared_experts")
    if ns:
        out["moe_shared_expert_intermediate_size"] = _get(cfg, where, "n_shared_experts") * fe
    k = cfg.get("first_k_dense_replace", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{where}: first_k_dense_replace: expected an integer >= 0, got {k!r}")
    freq = _get(cfg, where, "moe_layer_freq", required=False) or 1
    out["moe_layers"] = lambda n: [int(i >= k and i % freq == 0) for i in range(n)]


#: MPT attention implementations (``attn_config.attn_impl``) read as the fused flash-attention kernel; see ``_read_mpt``
MPT_ATTN_IMPLS = ("flash", "triton", "torch")
#: MPT ``norm_type`` values (llm-foundry ``NORM_CLASS_REGISTRY``) and the normalization each is priced as
MPT_NORMS = {"layernorm": "LayerNorm", "low_precision_layernorm": "LayerNorm", "rmsnorm": "RMSNorm",
             "low_precision_rmsnorm": "RMSNorm"}


def _mpt_attn(cfg: dict, where: str) -> dict:
    """``attn_config`` with the ``MPTConfig`` defaults (``attn_config_defaults``) for absent keys."""
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise ValueError(f"{where}: attn_config: expected a mapping, got {attn!r}")  # noqa: TRY004
    defaults = {"attn_type": "multihead_attention", "attn_impl": "triton", "qk_ln": False, "prefix_lm": False,
                "alibi": False, "rope": False}
    return {**defaults, **{k: v for k, v in attn.items() if v is not None}}


def _read_mpt(cfg: dict, where: str) -> dict[str, Any]:
    """Model keys of a MosaicML MPT ``config.json`` (``MPTConfig`` of the checkpoint's ``configuration_mpt.py`` /
    llm-foundry ``llmfoundry/models/mpt/configuration_mpt.py``; ``MPTModel`` of ``modeling_mpt.py``).

    ``d_model`` -> ``hidden_size``, ``n_heads``, ``n_layers``, ``expansion_ratio`` x ``d_model`` ->
    ``ffn_hidden_size`` (GELU MLP, ``MPTMLP``), ``max_seq_len`` -> ``max_position_embeddings`` and
    ``seq_length``, ``vocab_size``; ``no_bias`` (``MPTConfig`` default false) -> ``add_bias_linear`` (MPT strips
    the norms' biases too); ``norm_type`` (default ``low_precision_layernorm``) -> ``normalization`` (the
    low-precision variants run the norm in the autocast dtype; priced as the plain norm); ``tie_word_embeddings``
    (default true: ``SharedEmbedding``).

    Positions: ``attn_config.alibi`` true -> ``position_embedding_type: none``: ALiBi (Press et al., *Train
    Short, Test Long*, ICLR 2022) adds a fixed per-head linear bias to the attention scores, computed inside the
    Triton / flash kernel, and has no parameters; ``MPTConfig`` sets ``learned_pos_emb`` false when ALiBi is on
    (so MPT-7B, which publishes ``learned_pos_emb: true`` beside ``alibi: true``, has no position table: its
    6,649,286,656 parameters). Without ALiBi ``learned_pos_emb`` (default true) -> a learned table of
    ``max_seq_len`` rows (``wpe``).

    ``attn_impl`` (``flash``, ``triton``, ``torch``) picks MPT's runtime kernel, like the ``attn_implementation``
    Hugging Face reads for Llama: every value is priced as the fused flash-attention kernel (what llm-foundry's
    training runs set); ``flash`` -> ``attention_backend: flash_varlen``, as MPT's ``flash_attn_fn`` calls it
    between flash-attn's ``bert_padding`` unpad / pad helpers (``simulator/graph/builders/varlen.py``);
    ``torch`` is MPT's unfused reference path (scores materialised), not modelled separately.
    ``clip_qkv`` (an elementwise clamp), ``softmax_scale``, ``alibi_bias_max``, ``attn_uses_sequence_id``,
    ``embedding_fraction``, ``logit_scale``, dropouts and init keys do not change the step's cost and are ignored.

    Raises:
        ValueError: one line naming the key: no positions (``alibi`` and ``learned_pos_emb`` both false),
            rotary MPT (``attn_config.rope``), ``qk_ln``, ``prefix_lm``, an ``attn_type`` other than
            ``multihead_attention``, an unknown ``attn_impl`` or ``norm_type``, an ``ffn_config.ffn_type`` other
            than ``mptmlp``, a non-integer FFN width.
    """
    attn = _mpt_attn(cfg, where)
    for key in ("qk_ln", "prefix_lm", "rope"):
        if not isinstance(attn[key], bool):
            raise ValueError(f"{where}: attn_config.{key}: expected true or false, got {attn[key]!r}")  # noqa: TRY004
        if attn[key]:
            what = {"qk_ln": "LayerNorms on q and k", "prefix_lm": "prefix-LM (bidirectional prefix) attention",
                    "rope": "rotary MPT"}[key]
            raise ValueError(f"{where}: attn_config.{key}: true ({what}) is not modelled for mpt (allowed: false)")
    if attn["attn_type"] != "multihead_attention":
        raise ValueError(f"{where}: attn_config.attn_type: {attn['attn_type']!r} is not supported for mpt "
                         "(allowed: multihead_attention)")
    if attn["attn_impl"] not in MPT_ATTN_IMPLS:
        raise ValueError(f"{where}: attn_config.attn_impl: {attn['attn_impl']!r} is not supported for mpt "
                         f"(allowed: {', '.join(MPT_ATTN_IMPLS)})")
    if attn["attn_impl"] == "torch":  # the published MPT-7B file has it; llm-foundry's training runs set triton/flash
        warnings.warn(f"{where}: attn_config.attn_impl torch (MPT's unfused reference path) is priced as the fused "
                      "flash-attention kernel that llm-foundry trains with; set model.attention_backend: unfused to "
                      "price materialised scores (ALiBi's bias add is not priced)", ScenarioWarning, stacklevel=2)
    ffn = cfg.get("ffn_config") or {}
    if not isinstance(ffn, dict) or ffn.get("ffn_type", "mptmlp") != "mptmlp":
        raise ValueError(f"{where}: ffn_config: {ffn!r}: only the GELU MLP is modelled for mpt "
                         "(allowed: ffn_type mptmlp)")
    norm = cfg.get("norm_type", "low_precision_layernorm")
    if not isinstance(norm, str) or norm.lower() not in MPT_NORMS:
        raise ValueError(f"{where}: norm_type: {norm!r} is not supported for mpt (allowed: {', '.join(MPT_NORMS)})")
    h = _get(cfg, where, "d_model")
    a = _get(cfg, where, "n_heads")
    if h % a:
        raise ValueError(f"{where}: n_heads ({a}) must divide d_model ({h})")
    ratio = cfg.get("expansion_ratio", 4)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0 or (ratio * h) % 1:
        raise ValueError(f"{where}: expansion_ratio: expected a positive number with expansion_ratio x d_model an "
                         f"integer, got {ratio!r}")
    alibi = _flag({"attn_config.alibi": attn["alibi"]}, where, "attn_config.alibi", False)
    learned = _flag(cfg, where, "learned_pos_emb", True)
    if not alibi and not learned:
        raise ValueError(f"{where}: learned_pos_emb: false with attn_config.alibi: false gives a model without "
                         "positional information, not modelled for mpt (allowed: alibi true, or learned_pos_emb true)")
    pos = _get(cfg, where, "max_seq_len")
    bias = not _flag(cfg, where, "no_bias", False)
    return {"num_layers": _get(cfg, where, "n_layers"), "hidden_size": h, "num_attention_heads": a,
            "vocab_size": _get(cfg, where, "vocab_size"), "ffn_hidden_size": int(ratio * h),
            "max_position_embeddings": pos, "seq_length": pos,
            "position_embedding_type": "none" if alibi else "learned_absolute",
            "normalization": MPT_NORMS[norm.lower()], "add_bias_linear": bias,
            "untie_embeddings_and_output_weights": not _flag(cfg, where, "tie_word_embeddings", True),
            **({"attention_backend": "flash_varlen"} if attn["attn_impl"] == "flash" else {}),
            "sliding_window": None}


def merge_hf(model: dict) -> dict:
    """The model section with ``from_hf`` expanded: the file's keys, then the scenario's explicit keys.

    Raises:
        ValueError: one line starting with ``from_hf:`` (see ``read_hf_config``; also a path not
            starting with ``./``, ``../`` or ``/``, or a sliding window shorter than ``seq_length``).
    """
    path = model.get("from_hf")
    if path is None:
        return model
    if not is_file_reference(path):
        raise ValueError(f"from_hf: {path!r}: expected a path starting with {', '.join(FILE_PREFIXES)} "
                         "(e.g. ./scenarios/models/llama-3.1-8b.json)")
    try:
        keys = read_hf_config(path)
    except ValueError as exc:
        raise ValueError(f"from_hf: {exc}") from None
    window = keys.pop("sliding_window")
    moe_layers = keys.pop("moe_layers", None)  # mixture-of-experts readers only (not vit)
    merged = {**keys, **model}
    n = merged.get("num_layers")
    if moe_layers is not None and "moe_layer_freq" not in model and isinstance(n, int) and not isinstance(n, bool) \
            and 0 < n <= 100_000:  # the pattern of the blocks built (num_layers may be cut down by the scenario)
        pat = moe_layers(n)
        if not all(pat):
            merged["moe_layer_freq"] = pat
    if "max_position_embeddings" in model and "seq_length" not in model:
        merged["seq_length"] = model["max_position_embeddings"]
    seq = merged.get("seq_length")
    if "seq_length" not in model and "seq_length" in keys:  # trained at the full context unless the scenario says
        warnings.warn(f"model.seq_length: not set, so {seq:,} from the max_position_embeddings of {path} (set "
                      "model.seq_length for the sequences you train on)", ScenarioWarning, stacklevel=2)
    if window is not None and isinstance(seq, int) and seq > window:
        raise ValueError(f"from_hf: {path}: sliding_window {window} is shorter than seq_length {seq}; Qwen2's "
                         f"sliding window (on the layers above max_window_layers) is not modelled yet (allowed: "
                         f"seq_length <= {window})")
    return merged


def hf_origin(model: dict, key: str) -> str | None:
    """``"num_experts_per_tok in PATH"`` when the model-section ``key`` of a scenario's ``model`` mapping was
    taken from its ``from_hf`` file (not set in the scenario) under another name there, else None.

    Never raises: an unreadable file gives None (its own error is reported where it is read).
    """
    path = model.get("from_hf") if isinstance(model, dict) else None
    if not isinstance(path, str) or key in model or key not in HF_NAMES:
        return None
    try:
        cfg = safe_yaml.load_mapping(path, "a Hugging Face config.json mapping")
    except (safe_yaml.YamlInputError, OSError, ValueError):
        return None
    name = next((n for n in HF_NAMES[key] if n in cfg), None)
    return f"{name} in {path}" if name is not None and name != key else None
