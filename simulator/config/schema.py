"""The scenario schema (pydantic v2, ``extra="forbid"``): one YAML file = one ``ScenarioConfig``.

Key names follow the field's tools: Megatron-LM arguments for the model and parallelism, PyTorch
for precision and the optimizer, DeepSpeed ZeRO names for offload, PyTorch DataLoader arguments
for the input pipeline. Quantities accept units (``"4.8 TB/s"``, ``"141 GB"``, ``"700 W"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, Field, NonNegativeInt, PositiveInt, PrivateAttr, field_validator, model_serializer,
                      model_validator)

from hardware_models.presets import FILE_PREFIXES
from simulator.config.limits import (
    MAX_DATA_PARALLEL_SIZE,
    MAX_FFN_HIDDEN_SIZE,
    MAX_GLOBAL_BATCH_SIZE,
    MAX_GRADIENT_ACCUMULATION,
    MAX_HIDDEN_SIZE,
    MAX_LAYER_PASSES,
    MAX_LAUNCH_OVERHEAD_S,
    MAX_MICRO_BATCH_SIZE,
    MAX_CAPACITY_FACTOR,
    MAX_NUM_EXPERTS,
    MAX_NUM_LAYERS,
    MAX_SEED,
    MAX_SEQ_LENGTH,
    MAX_STEPS,
    MAX_VOCAB_SIZE,
    MAX_IMAGE_SIZE,
    MAX_NUM_CHANNELS,
    MODEL_CONFIG,
    no_bool,
)
from simulator.config.errors import refuse_each
from simulator.config.foreign_keys import drop_default_only_keys, no_step_effect_keys, no_step_effect_notes, put_keys
from simulator.config.quantities import Seconds

from simulator.config.sections.nvme import AioConfig, NvmeConfig
from simulator.config.sections.offload import ActivationCheckpointingConfig, ZeroOptimizationConfig

from simulator.config.sections.cluster import ClusterConfig, DdpConfig, NcclSectionConfig
from simulator.config.sections.dataloader import DataLoaderConfig
from simulator.config.sections.dvfs import DvfsConfig
from simulator.config.sections.fsdp import FsdpConfig, FsdpOffloadPolicy
from simulator.config.sections.fsdp import precision_problem as fsdp_precision_problem
from simulator.config.sections.lora import LoraConfig, check_lora_scenario
from simulator.config.sections.half_precision import Bf16SectionConfig, Fp16SectionConfig, check_master_weights
from simulator.config.sections import torchtitan_ac
from simulator.graph.builders.lora import hf_names as lora_hf_names
from simulator.config.sections.memory import MemoryConfig
from simulator.config.sections.ranks import MAX_RANK_OVERRIDES, MAX_SIMULATED_RANKS, RankOverride
from simulator.config.sections import vit as vit_section


#: Megatron-Core ``--attention-backend`` choices (megatron/core/transformer/enums.py ``AttnBackend``: flash, fused,
#: unfused, local, auto) that this simulator runs as one of its own: fused is Transformer Engine's FusedAttention
#: (cuDNN's flash kernels; the H200 profile's assumed attention rates match the cuDNN sm90 flash kernels of the
#: measured trace, simulator/studies/validation.py _MCORE_GAP), auto lets Transformer Engine pick flash or fused, local is Megatron-Core's
#: DotProductAttention (batched Q K^T and attention x V GEMMs with the fused softmax, the unfused path).
MEGATRON_ATTENTION_ALIASES = {"fused": "flash", "auto": "flash", "local": "unfused"}
_ALIAS_WHAT = {"fused": "Transformer Engine's cuDNN fused attention", "auto": "Transformer Engine's choice of its "
               "flash or cuDNN fused attention", "local": "Megatron-Core's local DotProductAttention"}


def attention_alias_note(backend: str) -> str | None:
    """The run's warning when ``model.attention_backend`` is a Megatron-Core name simulated as another backend
    (``MEGATRON_ATTENTION_ALIASES``); None for the simulator's own names."""
    kernel = MEGATRON_ATTENTION_ALIASES.get(backend)
    if kernel is None:
        return None
    how = ("one flash-attention kernel per pass at the GPU profile's attention rates (assumed, not fitted; on the "
           "measured H200 trace they match cuDNN's sm90 flash kernels at head dim 64, 1k tokens; other GPUs, head "
           "dimensions and lengths not measured)"
           if kernel == "flash" else "batched Q K^T and attention x V GEMMs with the fused causal softmax")
    return (f"model.attention_backend {backend} (Megatron-Core: {_ALIAS_WHAT[backend]}) is simulated as "
            f"attention_backend {kernel}: {how}")


class _Model(BaseModel):
    model_config = MODEL_CONFIG


class PresetRef(_Model):
    """A preset by name, with per-field overrides (units allowed: ``hbm_bandwidth_bytes_per_s: "3 TB/s"``)."""

    preset: str = Field(description="Preset name (see `simulate presets`).")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Field -> value to replace "
                                      "(a mapping such as peak_flops_per_s is merged key by key; not name or sources, which "
                                      "label the preset).")


class PcieSwitchConfig(_Model):
    """One PCIe switch of the host (``hardware_models.pcie_switches``)."""

    gpus: list[NonNegativeInt] = Field(default_factory=list, description="Node-local GPU indices behind the switch.")
    nics: list[NonNegativeInt] = Field(default_factory=list, description="Node-local NIC indices behind it.")
    drives: list[NonNegativeInt] = Field(default_factory=list, description="Indices of the NVMe array's drives "
                                         "behind it (0..drives-1).")
    uplink_bytes_per_s: float | str = Field(description='Its uplink to the CPU, per direction ("63 GB/s").')


class HostRef(PresetRef):
    """A host preset with the CPU optimizer's thread count and NUMA binding (what-ifs)."""

    threads: PositiveInt | None = Field(default=None, description="Intra-op threads of the CPU optimizer step "
                                        "(torch.set_num_threads / OMP_NUM_THREADS); default: all physical cores.")
    numa_node: int | None = Field(default=None, ge=0, description="Bind the CPU step's threads and memory to this "
                                  "NUMA node (numactl --cpunodebind=N --membind=N); default: not bound.")
    bind_cores_to_rank: bool | None = Field(
        default=None, description="Several ranks of a node offloading to its host: each bound to its own cores / "
        "ranks cores and their NUMA node (true, default: DeepSpeed's launcher --bind_cores_to_rank, which also sets "
        "OMP_NUM_THREADS to that count), or not bound (false: the launcher without the flag, torchrun): each rank's "
        "threads (threads, default all the host's cores) float over all cores, so ranks x threads above the cores "
        "time-share them (each rank's CPU step priced on cores / ranks cores' worth) and the memory has no NUMA "
        "locality (hardware_models/host_kernels.py shared_stream_bandwidth). DeepSpeed's --bind_core_list of N "
        "cores is threads: N / ranks with binding on.")
    pcie_switches: list[PcieSwitchConfig] | None = Field(
        default=None, description="The host's PCIe switches: which of the node's GPUs, NICs and NVMe drives (indices) "
        "sit behind each and its uplink's rate per direction (hardware_models/pcie_switches.py); replaces the host "
        "preset's. NVMe swaps then share the uplinks with the GPUs' host copies.")


class HardwareConfig(_Model):
    """The machine: GPU, its efficiency profile, the host link and the host."""

    gpu: PresetRef | str = Field(description="GPU preset name or {preset, overrides}.")
    profile: str | None = Field(
        default=None,
        description="Efficiency profile: a preset name (looked up under presets/profiles only), or a YAML "
        f"file written by `simulate calibrate`, given as a path starting with {', '.join(FILE_PREFIXES)} "
        "(relative paths: from the current folder, else the scenario's folder). "
        "Default: the GPU's shipped profile if any, else a generic one.",
    )
    pcie: PresetRef | str = Field(default="pcie-gen5-x16", description="Host link preset (a pcie-* links preset). "
                                  "Given explicitly, its rates replace the host-copy rates the GPU profile measured, "
                                  "unless it is the link they were measured over (the profile's copy_link).")
    host: HostRef | str = Field(default="h200-measured-host", description="Host CPU + memory preset "
                                "(with threads / numa_node / bind_cores_to_rank for the CPU optimizer step).")
    launch_overhead_s: Seconds | None = Field(
        default=None, ge=0, le=MAX_LAUNCH_OVERHEAD_S,
        description='Override the host\'s per-op launch time ("10 us"; default: the host preset\'s, else 10 us).'
    )
    nvme: NvmeConfig | None = Field(default=None, description="The host's NVMe drives for ZeRO-Infinity offload "
                                    "({storage, drives}; default, and each key left out: the host preset's, if it names any).")
    cluster: ClusterConfig | None = Field(
        default=None, description="Cluster of identical nodes for data-parallel runs (absent: one GPU). Its preset's "
        "GPU must be hardware.gpu. One representative rank is simulated; its collectives are priced over the topology.")


class ModelConfig(_Model):
    """A dense decoder (Megatron-LM argument names): GPT-2 style by default (LayerNorm, GELU MLP,
    multi-head attention, learned positions, tied embeddings), Llama style with
    ``group_query_attention``, ``swiglu``, ``normalization: RMSNorm``, ``position_embedding_type: rope``,
    ``untie_embeddings_and_output_weights`` and ``add_bias_linear: false``; or read from a Hugging Face
    ``config.json`` with ``from_hf`` (``simulator/config/hf_config.py``). ``architecture: vit``: a vision
    transformer (``simulator/config/sections/vit.py``)."""

    architecture: Literal["decoder", "vit"] = Field(
        default="decoder", description="Model family: decoder (a GPT/Llama-style causal language model) or vit (a "
        "vision transformer for image classification, Hugging Face ViTForImageClassification / Megatron-LM "
        "pretrain_vision_classify: patch embedding, CLS token, bidirectional pre-LayerNorm encoder blocks with GELU "
        "MLP, head on the CLS token; keys image_size, patch_size, num_channels, num_classes; seq_length is derived, "
        "no vocab_size).")

    from_hf: str | None = Field(
        default=None, description="A Hugging Face config.json (llama, mistral, mixtral, qwen2, gpt2, vit, mpt), given as a path "
        f"starting with {', '.join(FILE_PREFIXES)} (relative: from the current folder, else the scenario's folder); "
        "its keys fill this section, keys set here override them (seq_length defaults to max_position_embeddings).")
    num_layers: PositiveInt = Field(le=MAX_NUM_LAYERS)
    hidden_size: PositiveInt = Field(le=MAX_HIDDEN_SIZE)
    num_attention_heads: PositiveInt = Field(le=MAX_HIDDEN_SIZE, description="Must divide hidden_size.")
    seq_length: PositiveInt | None = Field(
        default=None, le=MAX_SEQ_LENGTH, description="Tokens per sample; required with architecture decoder; vit: "
        "(image_size / patch_size)^2 + 1 (patches and the CLS token), derived.")
    vocab_size: PositiveInt | None = Field(default=None, le=MAX_VOCAB_SIZE, description="Required with architecture "
                                           "decoder; refused with vit.")
    image_size: PositiveInt | None = Field(default=None, le=MAX_IMAGE_SIZE, description="vit: image height = width, "
                                           "pixels (HF image_size); required.")
    patch_size: PositiveInt | None = Field(default=None, le=MAX_IMAGE_SIZE, description="vit: patch height = width, "
                                           "pixels (HF patch_size); must divide image_size; required.")
    num_channels: PositiveInt | None = Field(default=None, le=MAX_NUM_CHANNELS, description="vit: image channels (HF "
                                             "num_channels); default 3.")
    num_classes: PositiveInt | None = Field(default=None, le=MAX_VOCAB_SIZE, description="vit: classes of the "
                                            "classification head (HF num_labels / id2label); required.")
    ffn_hidden_size: PositiveInt | None = Field(default=None, le=MAX_FFN_HIDDEN_SIZE,
                                                description="Default 4 * hidden_size.")
    max_position_embeddings: PositiveInt | None = Field(
        default=None, le=MAX_SEQ_LENGTH, description="Rows of the learned position table (default seq_length; "
        "unused with rope).")
    group_query_attention: bool = Field(default=False, description="Megatron --group-query-attention.")
    num_query_groups: PositiveInt | None = Field(
        default=None, le=MAX_HIDDEN_SIZE, description="K/V head groups with group_query_attention (default 1, "
        "multi-query, as Megatron); must divide num_attention_heads (and be divisible by the TP size).")
    swiglu: bool = Field(default=False, description="Megatron --swiglu: gated MLP silu(x W1) * (x W3) W2.")
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = Field(
        default="learned_absolute", description="Megatron-LM --position-embedding-type (megatron/training/"
        "arguments.py choices learned_absolute, rope, mrope, relative, none; mrope and relative not modelled): "
        "learned_absolute: a learned table of max_position_embeddings rows; rope: rotary kernels on q and k, no "
        "table; none: no position parameters and no position kernel (NoPE, or ALiBi, whose per-head bias the "
        "flash kernel adds to the scores in-kernel: MPT; priced as plain flash attention).")
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = Field(default=False, description="Megatron --add-qkv-bias: a QKV bias even with "
                               "add_bias_linear false (Qwen2).")
    kv_channels: PositiveInt | None = Field(
        default=None, le=MAX_HIDDEN_SIZE, description="Megatron --kv-channels: head dimension d when it is not "
        "hidden_size / num_attention_heads (Qwen3, Gemma, Mistral-Nemo): QKV is h x (a d + 2 g d), the output "
        "projection a d x h. Default hidden_size / num_attention_heads.")
    window_size: PositiveInt | None = Field(
        default=None, le=MAX_SEQ_LENGTH, description="Sliding-window attention (Mistral): each query attends to "
        "its window_size most recent keys, itself included (the Hugging Face sliding_window); the flash-attention "
        "FLOPs count w (2 s - w) / 2 pairs per head instead of s^2 / 2. Default: full causal attention.")
    num_experts: PositiveInt | None = Field(
        default=None, le=MAX_NUM_EXPERTS, description="Megatron --num-experts: every block's MLP is a mixture of this "
        "many routed experts (grouped GEMMs unless moe_grouped_gemm false, all-to-all dispatch with "
        "expert_model_parallel_size > 1 unless moe_token_dispatcher_type allgather; routing "
        "balanced unless moe_tokens_per_expert: each expert gets T x topk / num_experts tokens). Needs training.precision bf16 or fp16, "
        "add_bias_linear false, and sequence_parallel with tensor_model_parallel_size > 1.")
    moe_router_topk: PositiveInt = Field(default=2, le=MAX_NUM_EXPERTS, description="Megatron --moe-router-topk: "
                                         "experts per token (at most num_experts).")
    moe_ffn_hidden_size: PositiveInt | None = Field(default=None, le=MAX_FFN_HIDDEN_SIZE, description="Megatron "
                                                    "--moe-ffn-hidden-size: width of one expert (default "
                                                    "ffn_hidden_size).")
    moe_shared_expert_intermediate_size: PositiveInt | None = Field(
        default=None, le=MAX_FFN_HIDDEN_SIZE, description="Megatron --moe-shared-expert-intermediate-size: width of "
        "the shared expert every token passes through (default: none).")
    moe_expert_capacity_factor: float | None = Field(
        default=None, gt=0, le=MAX_CAPACITY_FACTOR, description="Megatron --moe-expert-capacity-factor: each expert "
        "takes at most ceil(factor x T x topk / num_experts) tokens of a rank's T, the rest are dropped (no "
        "padding); null: dropless.")
    attention_backend: Literal["flash", "flash_varlen", "unfused", "fused", "auto", "local"] = Field(
        default="flash", description="Megatron-Core --attention-backend: flash (one flash-attention kernel, the "
        "default; Megatron's fused and auto, Transformer Engine's cuDNN fused attention and its automatic choice, run "
        "as it, and local, Megatron-Core's own DotProductAttention, as unfused: the run's warnings say so), flash_varlen (the same kernel called through flash-attn's bert_padding unpad_input / pad_input, "
        "as llm-foundry's MPT flash_attn_fn does even without padding: three gathers of q, k, v and a zero-filled "
        "padded output, their scatters and the QKV concatenation in backward, in place of the output transpose; "
        "not with rope or context parallelism: simulator/graph/builders/varlen.py) or unfused (Megatron-LM before flash attention, 2020-2022: Q K^T and attention x V batched GEMMs "
        "over the whole s x s square, the fused causal softmax, attention dropout; the [b, a, s, s] scores in HBM "
        "and 5 a s^2 b bytes per layer saved for backward: simulator/graph/builders/attention.py). unfused: not "
        "with group_query_attention, window_size or context parallelism; needed by precision fp32 / tf32.")
    kernels: Literal["fused", "hf_eager"] = Field(
        default="fused", description="How the memory-bound ops run: fused (Megatron-LM's fused kernels: scaled "
        "masked softmax, bias-GELU, bias_dropout_add) or hf_eager (Hugging Face transformers 4.15 GPT-2 in PyTorch "
        "eager mode, one kernel per tensor op: the head copies, score division, torch.where causal mask and "
        "softmax of GPT2Attention._attn, gelu_new as 8 elementwise kernels (11 in backward), dropout and residual "
        "add apart, Conv1D's addmm copying the expanded bias before its GEMM (PyTorch 1.10): "
        "simulator/graph/builders/hf_eager.py). hf_eager needs attention_backend unfused; not with "
        "swiglu, num_experts or rope.")
    repeat_kv: bool | None = Field(
        default=None, description="torchtitan's repeat_kv: with group_query_attention, k and v are copied out to the "
        "query heads before the flash kernel (a copy kernel each, the flash kernel reads and saves a heads of K and V, "
        "their gradients summed back in backward: simulator/graph/builders/qkv_layout.py); null: the framework's "
        "default, true with fsdp.version 2 (torchtitan before pytorch/torchtitan#2259, January 2026; set false for "
        "later releases, which pass enable_gqa to SDPA), false otherwise (Megatron / Transformer Engine and Hugging "
        "Face's sdpa_attention_forward with torch >= 2.5 and no mask use grouped K/V as they are). Needs "
        "attention_backend flash and position_embedding_type rope.")
    attention_dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Megatron --attention-dropout (its default is 0.1; 0 here, no "
        "dropout): with unfused a dropout kernel and a 1-byte mask over the attention probabilities; with flash "
        "inside the kernel (no mask), not priced: the run's warnings say so, with the slowdown FlashAttention-1 "
        "measured (simulator/graph/builders/attention.py flash_dropout_note).")
    hidden_dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Megatron --hidden-dropout (its default is 0.1; 0 here): dropout after "
        "the attention projection and fc2, fused with the residual add (bias_dropout_add): a 1-byte mask per "
        "element saved for backward and one elementwise kernel per dropout in backward.")
    moe_router_load_balancing_type: Literal["aux_loss", "none"] = Field(
        default="aux_loss", description="Megatron --moe-router-load-balancing-type (aux_loss: the Switch "
        "auxiliary loss kernels; sinkhorn and seq_aux_loss are not modelled).")

    moe_shared_expert_gate: bool = Field(default=False, description="Megatron --moe-shared-expert-gate: a sigmoid "
                                         "gate (an h x 1 weight per layer) scales the shared expert's output "
                                         "(Qwen2-MoE).")
    moe_layer_freq: PositiveInt | list[Literal[0, 1]] = Field(
        default=1, description="Megatron --moe-layer-freq: an integer N (block i is MoE when i % N == 0) or one 0 "
        "(dense MLP of ffn_hidden_size) / 1 (MoE) per block, e.g. DeepSeek-MoE's first dense block [0, 1, 1, ...].")
    moe_grouped_gemm: bool = Field(
        default=True, description="Megatron --moe-grouped-gemm: true runs each block's local experts as grouped "
        "GEMMs (GroupedMLP / TEGroupedMLP, priced as one GEMM of the stacked rows); false as Megatron's SequentialMLP: "
        "one MLP per local expert (its fc1, activation and fc2 GEMMs forward and backward, at its own token count), "
        "one after another, and a torch.cat of their outputs (and of the input gradients) with more than one local "
        "expert. Megatron's own default (the flag absent) is false; here true, as the bundled MoE scenarios run.")
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "alltoall_seq", "flex"] = Field(
        default="alltoall", description="Megatron --moe-token-dispatcher-type: alltoall (MoEAlltoAllTokenDispatcher: "
        "all-to-alls over the EP group, the expert-TP all-gather / reduce-scatter) or allgather "
        "(MoEAllGatherTokenDispatcher: the routing map, probabilities (moe_router_dtype) and tokens all-gathered "
        "over the expert_tensor_parallel x expert_model_parallel ranks, every rank picking its local experts' copies, "
        "the probability-weighted combine reduce-scattered back; backward the mirror: simulator/graph/builders/moe_allgather.py). "
        "alltoall_seq and flex (DeepEP) are not modelled. Megatron's own default is allgather; here alltoall.")
    moe_router_dtype: Literal["fp32"] | None = Field(
        default=None, description="Megatron --moe-router-dtype: the dtype of the router's logits and of the routing "
        "probabilities the dispatcher permutes, gathers and multiplies into the combine (null, Megatron's default: "
        "the model dtype, 2 bytes in bf16 / fp16; fp32: 4 bytes, and with the allgather dispatcher the "
        "probability-weighted combine and its reduce-scatter in fp32). The router GEMM itself is priced in the model "
        "dtype either way (the run's warnings say so). fp64 is not modelled (no fp64 GEMM rate).")
    moe_tokens_per_expert: list[float] | None = Field(
        default=None, max_length=MAX_NUM_EXPERTS, description="Routed tokens per expert, num_experts non-negative "
        "counts or fractions (normalised by their sum), e.g. pasted from Megatron's per-expert token counts of a "
        "router log: the grouped GEMMs of an EP rank follow its experts' tokens, the all-to-alls the uneven split, "
        "and the step follows the busiest EP rank (the others wait at the combine all-to-all). The same split is "
        "used for every layer. Default: balanced routing.")

    @field_validator("moe_layer_freq", mode="before")
    @classmethod
    def _moe_layer_freq_value(cls, v):
        ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 1) or (
            isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x in (0, 1) for x in v))
        if not ok:  # one line instead of pydantic's union report
            raise ValueError(f"{v!r} (allowed: an integer >= 1, or a list of 0 / 1, one per layer)")
        return v

    @field_validator("moe_router_dtype", mode="before")
    @classmethod
    def _router_dtype(cls, v):
        if v == "fp64":  # Megatron accepts it; no GPU preset has an fp64 GEMM rate to price the router GEMM
            raise ValueError("fp64 is not modelled (no fp64 GEMM rate in the GPU presets; allowed: fp32, or null for "
                             "the model dtype)")
        return v

    _moe_no_bool = field_validator("kv_channels", "window_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                   "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor",
                                   mode="before")(no_bool)

    @model_validator(mode="before")
    @classmethod
    def _expand_from_hf(cls, data):
        from simulator.config.hf_config import merge_hf

        if not isinstance(data, dict):
            return data
        return vit_section.expand_model(merge_hf(data), {k: f.default for k, f in cls.model_fields.items()})

    @property
    def attention_kernel(self) -> str:
        """The attention implementation simulated: ``attention_backend`` with Megatron-Core's other names mapped
        (``MEGATRON_ATTENTION_ALIASES``): flash, flash_varlen or unfused."""
        return MEGATRON_ATTENTION_ALIASES.get(self.attention_backend, self.attention_backend)

    @property
    def query_groups(self) -> int:
        """K/V head groups: ``num_query_groups`` (default 1) with GQA, else the head count."""
        return (self.num_query_groups or 1) if self.group_query_attention else self.num_attention_heads

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size}) "
                "(or set kv_channels, the head dimension)"
            )
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ValueError(f"num_query_groups ({self.num_query_groups}) needs group_query_attention: true")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_query_groups ({self.query_groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        moe_keys = sorted(k for k, f in type(self).model_fields.items()  # not their defaults (round trips of dumps)
                          if k.startswith("moe_") and getattr(self, k) != f.default)
        if self.num_experts is None and moe_keys:
            raise ValueError(f"{moe_keys[0]} needs model.num_experts (a mixture-of-experts model)")
        if self.moe_token_dispatcher_type in ("alltoall_seq", "flex"):
            raise ValueError(f"moe_token_dispatcher_type: {self.moe_token_dispatcher_type} is not modelled (allowed: "
                             "alltoall, allgather)")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) exceeds num_experts ({self.num_experts}) "
                             f"(allowed: 1..{self.num_experts})")
        if self.attention_kernel == "unfused":
            if self.group_query_attention:
                raise ValueError("attention_backend: unfused with group_query_attention is not modelled (allowed: "
                                 "flash, or group_query_attention false)")
            if self.window_size is not None and self.window_size < self.seq_length:
                raise ValueError("attention_backend: unfused with window_size is not modelled (allowed: flash)")
        if self.attention_backend == "flash_varlen" and self.position_embedding_type == "rope":
            raise ValueError("attention_backend: flash_varlen with position_embedding_type rope is not modelled "
                             "(allowed: learned_absolute or none; or attention_backend flash)")
        if self.kernels == "hf_eager":
            bad = [k for k, on in (("attention_backend flash", self.attention_kernel != "unfused"),
                                   ("swiglu", self.swiglu), ("num_experts", self.num_experts is not None),
                                   ("rope", self.position_embedding_type == "rope")) if on]
            if bad:
                raise ValueError(f"kernels: hf_eager with {bad[0]} is not modelled (allowed: Hugging Face GPT-2: "
                                 "attention_backend unfused, a GELU MLP, no experts, learned positions)")
        f = self.moe_layer_freq
        if isinstance(f, list) and len(f) != self.num_layers:
            raise ValueError(f"moe_layer_freq: {len(f)} values for num_layers {self.num_layers} (allowed: an integer, "
                             "or one 0/1 per layer)")
        if isinstance(f, list) and 1 not in f:
            raise ValueError("moe_layer_freq: no MoE layer (allowed: at least one 1; or drop num_experts)")
        w = self.moe_tokens_per_expert
        if self.num_experts is not None and w is not None:
            if len(w) != self.num_experts:
                raise ValueError(f"moe_tokens_per_expert: {len(w)} numbers for num_experts {self.num_experts} "
                                 f"(allowed: one count or fraction per expert)")
            bad = [x for x in w if not (x >= 0 and x < float("inf"))]
            if bad or not sum(w) > 0:
                raise ValueError(f"moe_tokens_per_expert: {bad[0] if bad else 'all 0'} (allowed: finite numbers >= 0, "
                                 "not all 0)")
            k = self.moe_router_topk
            top = max(w) / sum(w)
            if top > 1 / k + 1e-9:  # each token picks k different experts: one expert gets at most T of the k T
                raise ValueError(f"moe_tokens_per_expert: one expert gets {top:.3g} of the routed tokens, more than "
                                 f"1 / moe_router_topk = {1 / k:.3g} (each token goes to {k} different experts; "
                                 f"allowed: every share at most 1/{k})")
        mp = self.max_position_embeddings
        if self.position_embedding_type == "learned_absolute" and mp is not None and mp < self.seq_length:
            raise ValueError(f"seq_length ({self.seq_length}) exceeds max_position_embeddings ({mp}) of the learned "
                             "position table (allowed: seq_length <= max_position_embeddings)")
        return self


class OptimizerConfig(_Model):
    """Optimizer (PyTorch names)."""

    type: Literal["adamw"] = "adamw"
    impl: Literal["fused", "foreach", "single"] = Field(
        default="fused", description="fused: torch.optim.AdamW(fused=True), one kernel, 28 bytes per fp32 "
        "parameter; foreach: torch.optim.AdamW(foreach=True) (_multi_tensor_adamw, PyTorch's default on CUDA), "
        "eight multi-tensor elementwise passes, 80 bytes per fp32 parameter; single: a Python loop over the "
        "parameter tensors, the same eight passes per tensor (sqrt and div into new tensors), 80 bytes per fp32 "
        "parameter (torch.optim.AdamW(foreach=False) _single_tensor_adamw; Composer's DecoupledAdamW, llm-foundry's "
        "decoupled_adamw). foreach and single need fp32 parameters (training.precision amp_fp32_params, fp32 or "
        "tf32); Megatron's bf16/fp16 optimizer is fused.")


class TrainingConfig(_Model):
    """Batch, precision, optimizer and recompute."""

    micro_batch_size: PositiveInt = Field(le=MAX_MICRO_BATCH_SIZE)
    global_batch_size: PositiveInt | None = Field(
        default=None, le=MAX_GLOBAL_BATCH_SIZE,
        description="Default micro_batch_size * data_parallel_size (no gradient accumulation); at most "
        f"{MAX_GRADIENT_ACCUMULATION:,} micro-batches per step.",
    )
    precision: Literal["amp_fp32_params", "bf16", "fp16", "fp32", "tf32"] = Field(
        default="amp_fp32_params",
        description="amp_fp32_params: torch.autocast(bf16) over fp32 params; bf16: Megatron --bf16; fp16: Megatron "
        "--fp16 (fp16 params and activations, fp32 master weights, dynamic loss scaling); fp32: plain fp32 training "
        "(fp32 params, activations and Adam state; GEMMs at the GPU's fp32 rate); tf32: the same with "
        "torch.backends.cuda.matmul.allow_tf32 = True (GEMMs at the TF32 tensor-core rate; needs a GPU with one, "
        "Ampere and later). fp32 / tf32 need model.attention_backend: unfused (no fp32 flash attention). With fsdp.version "
        "2 the gathered dtype is the compute dtype (torchtitan runs FSDP without autocast): param_dtype bf16 takes "
        "amp_fp32_params, param_dtype fp32 (torchtitan's mixed_precision_param float32) fp32 or tf32.",
    )
    fp8: Literal["hybrid", "e4m3"] | None = Field(
        default=None, description="Megatron-LM --fp8-format (Transformer Engine): the transformer blocks' Linear "
        "GEMMs in fp8 (e4m3 forward; hybrid: e5m2 gradients) with per-tensor scaling; needs precision bf16 and a GPU "
        "with an fp8 rate. Attention, embeddings and the LM head stay bf16. The fp8 weights stay cached for the run "
        "(Transformer Engine under Megatron), with their transposes where fp8 GEMMs are TN-only (Hopper: 2 B per "
        "weight element; Blackwell: 1 B); with fp8_param_gather the fp8 parameters replace the bf16 weights and the "
        "cached copies.")
    fp8_amax_history_len: PositiveInt = Field(
        default=1, le=1_000_000, description="Megatron-LM --fp8-amax-history-len (Transformer Engine DelayedScaling "
        "amax_history_len; Megatron's default 1): fp32 amax entries kept per fp8 tensor, read and rolled by the scale "
        "update after each forward and backward.")
    fp8_param_gather: bool = Field(
        default=False, description="Megatron-LM --fp8-param-gather (Transformer Engine fp8_model_init): the blocks' "
        "Linear weights are kept as fp8 parameters (1 B, plus their transposes where fp8 GEMMs are TN-only) in place "
        "of bf16 weights and their cached fp8 copies; after the step each rank casts its fp32 master shard to fp8 "
        "(fp32 -> bf16 -> fp8, quantize_param_shard, with an amax all-reduce over the data-parallel group) and the "
        "parameter all-gather moves 1 B per fp8 element. Needs training.fp8 and ddp.use_distributed_optimizer "
        "(Megatron-LM's asserts); dense models only.")
    optimizer: OptimizerConfig = OptimizerConfig()
    clip_grad: float | None = Field(
        default=None, ge=0.0, description="Gradient clipping by the global L2 norm, max norm (0: none); the "
        "framework of the scenario decides the kernels. Megatron-LM --clip-grad (default 1.0; the default here "
        "without fsdp): with Megatron's optimizer (precision bf16 / fp16 without DeepSpeed ZeRO or FSDP) the norm "
        "kernel (multi_tensor_l2norm, 4 B per fp32 main grad of the rank), its 4-byte all-reduce over the "
        "model-parallel group (tp x pp; every rank with ddp.use_distributed_optimizer) and total_norm.item(); the "
        "clip's rescale (only when the norm exceeds clip_grad) is not priced. With pipeline parallelism that "
        "all-reduce is the cross-stage sync that makes the optimizer start together on every stage; with 0 and bf16 "
        "there is none (fp16 keeps the found-inf all-reduce), and a stage that ends its step early (the last "
        "stage, after its cool-down) starts the next one: step_latency_s exceeds step_time_s by that overlap. "
        "With fsdp (default 0: FSDP clips only when the loop calls it): FullyShardedDataParallel.clip_grad_norm_"
        "(max_norm), as Composer's gradient_clipping algorithm with clipping_type norm and clipping_threshold this "
        "value calls it: the shard's norm (4 B per fp32 grad), a 4-byte all-reduce over the FSDP group, the "
        "clip coefficient's mul_ on every grad (8 B), no host sync. With zero_optimization.stage 1-3, or stage 0 "
        "with bf16 / fp16 (BF16_Optimizer with bf16 and pipeline stages, else FP16_Optimizer), the default is "
        "DeepSpeed's gradient_clipping default 0 (deepspeedai/DeepSpeed@ac2f3a34 deepspeed/runtime/"
        "constants.py GRADIENT_CLIPPING_DEFAULT): set clip_grad for the value of the ds_config. FP16_Optimizer's "
        "step runs the same kernels whatever the value (its norm, then one unscale mul_ with the clip folded in). "
        "DeepSpeed ZeRO-1/2 (its gradient_clipping): the "
        "step's norm runs whatever the value: a fp64 norm of each 16-bit gradient view of the partition (18 B per "
        "element), a 4-byte all-reduce over the data-parallel group (and tp x pp), the fp32 copy of the partition "
        "(10 B) and the unscale / clip mul_ (8 B); fp16 adds the overflow check (28 B, a 1-byte all-reduce, "
        ".item()). A PyTorch loop without fsdp (torch DDP, one GPU) given a value: torch.nn.utils.clip_grad_norm_, "
        "one foreach norm (4 B per fp32 grad), the all-reduce over tp x pp only, one foreach mul_ (8 B), no host "
        "sync; not given, no clipping (only the cross-stage all-reduce with pipeline stages).")
    cross_entropy: Literal["megatron", "megatron_fused", "pytorch"] | None = Field(
        default=None, description="The LM head's loss. megatron (the default with precision bf16, fp16, fp32 or tf32 "
        "without fsdp, DeepSpeed ZeRO or model.kernels hf_eager): "
        "Megatron-LM's vocab-parallel cross-entropy: the logits cast to fp32 once, made softmax in place and saved "
        "(4 B per logit), its gradient made in place and cast to the 16-bit logits dtype (megatron/core/"
        "tensor_parallel/cross_entropy.py); the max, shift, exponent, row sum and division one pass each. "
        "megatron_fused: --cross-entropy-loss-fusion (--cross-entropy-fusion-impl native, "
        "megatron/core/fusions/fused_cross_entropy.py @0cb4a9c): the same memory, the max fused with the cast, the "
        "shift and exponent in one in-place pass, the row sum and the division one pass each, one all-reduce for the target logits and sums with TP. pytorch (the default "
        "with fsdp, zero_optimization (DeepSpeed takes the model's loss: a Megatron-DeepSpeed model sets megatron), "
        "model.kernels hf_eager, precision amp_fp32_params (torch.autocast) or training.lora (Hugging Face PEFT)): "
        "F.cross_entropy on the fp32 logits, log_softmax then nll_loss: the "
        "saved log-softmax, the NLL gradient and the log-softmax gradient, three fp32 logits-sized tensors, live "
        "together in backward. --cross-entropy-fusion-impl te (Transformer Engine's Triton kernel) is not modelled.")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        default=None, description="Megatron-LM --recompute-granularity (full = every block)."
    )
    enable_cpu_offload: bool = Field(
        default=False, description="torchtitan's [training] enable_cpu_offload (pytorch/torchtitan@81c12433 "
        "torchtitan/models/llama3/infra/parallelize.py apply_fsdp: fully_shard(offload_policy=CPUOffloadPolicy())): "
        "true is fsdp.offload_policy {kind: cpu, pin_memory: true}; needs fsdp: {version: 2}.")
    lora: LoraConfig | None = Field(default=None, description="LoRA fine-tune (Hugging Face PEFT names; "
                                    "simulator/config/sections/lora.py): base weights frozen, low-rank adapters "
                                    "trained. Default: every parameter is trained.")

    @model_validator(mode="after")
    def _single_tensor_optimizer_scope(self):
        if self.optimizer.impl != "fused" and self.precision not in SINGLE_TENSOR_PRECISIONS:
            raise ValueError(f"training.optimizer.impl: {self.optimizer.impl} needs fp32 parameters (allowed "
                             f"training.precision: "
                             f"{', '.join(SINGLE_TENSOR_PRECISIONS)}; got {self.precision})")
        return self


def clip_grad_of(cfg: "ScenarioConfig") -> float:
    """``training.clip_grad`` in force: the value given, else the framework's default: 0 with ``fsdp`` (PyTorch FSDP
    clips only when the training loop calls ``clip_grad_norm_``), 0 where DeepSpeed runs the step (``zero_optimization
    .stage`` 1-3, or stage 0 as ``BF16_Optimizer`` / ``FP16_Optimizer``, ``deepspeed_bf16_optimizer`` /
    ``deepspeed_fp16_optimizer``: DeepSpeed's ``gradient_clipping``
    default, deepspeedai/DeepSpeed@ac2f3a34 ``deepspeed/runtime/constants.py`` ``GRADIENT_CLIPPING_DEFAULT = 0.``;
    ZeRO-1/2/3 still price their norm, ``graph.builders.grad_norm.deepspeed_zero_step``), else Megatron-LM's
    ``--clip-grad`` default 1.0 (megatron/training/arguments.py ``_add_regularization_args``; also for a stage-0
    section otherwise, whose step is priced as Megatron's optimizer). The stage, not the section's presence, decides:
    a dumped and re-validated config carries a stage-0 section whatever the original had."""
    v = cfg.training.clip_grad
    if v is not None:
        return v
    return 0.0 if cfg.fsdp is not None or deepspeed_runs_step(cfg) else 1.0


def deepspeed_runs_step(cfg: "ScenarioConfig") -> bool:
    """DeepSpeed's engine runs backward and the step: ``zero_optimization.stage`` 1-3, or stage 0 as
    ``BF16_Optimizer`` / ``FP16_Optimizer`` (``deepspeed_bf16_optimizer`` / ``deepspeed_fp16_optimizer``); the
    config-level ``TransformerSpec.deepspeed_engine``."""
    return cfg.zero_optimization.stage > 0 or deepspeed_bf16_optimizer(cfg) or deepspeed_fp16_optimizer(cfg)


def deepspeed_bf16_optimizer(cfg: "ScenarioConfig") -> bool:
    """DeepSpeed runs the step with ``BF16_Optimizer``: a DeepSpeed config (a ``zero_optimization`` section given)
    with stage 0, ``training.precision: bf16`` and a pipeline (deepspeedai/DeepSpeed@007cca6a
    ``deepspeed/runtime/engine.py`` ``_do_optimizer_sanity_check``: ZeRO off, model and gradient-accumulation dtype
    both bf16 and a ``PipelineModule`` -> ``BFLOAT16``); priced by ``graph.builders.bf16_optimizer``."""
    return ("zero_optimization" in cfg.model_fields_set and cfg.zero_optimization.stage == 0
            and cfg.training.precision == "bf16" and cfg.parallelism.pipeline_model_parallel_size > 1)


def deepspeed_fp16_optimizer(cfg: "ScenarioConfig") -> bool:
    """DeepSpeed runs the step with ``FP16_Optimizer``: a DeepSpeed config (a ``zero_optimization`` section given,
    no ``fsdp`` section nor Megatron's distributed optimizer) with stage 0 and ``training.precision: fp16``, or bf16
    without a pipeline (deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``_do_optimizer_sanity_check``:
    ZeRO off, model and gradient-accumulation dtype equal -> ``FP16``, or ``DDP_BFLOAT16`` for bf16 without a
    ``PipelineModule``; ``_configure_optimizer`` wraps both in ``FP16_Optimizer``); priced by
    ``graph.builders.fp16_optimizer``."""
    z, prec = cfg.zero_optimization, cfg.training.precision
    return ("zero_optimization" in cfg.model_fields_set and z.stage == 0 and cfg.fsdp is None
            and not cfg.ddp.use_distributed_optimizer
            and (prec == "fp16" or (prec == "bf16" and cfg.parallelism.pipeline_model_parallel_size == 1)))


def stage0_wrapper_gaps(cfg: "ScenarioConfig") -> list[str]:
    """What a scenario run by DeepSpeed's ZeRO-0 optimizer wrappers (``deepspeed_bf16_optimizer``,
    ``deepspeed_fp16_optimizer``) sets that they are not modelled with, one phrase each: a pipeline schedule other
    than DeepSpeed's one (``TrainSchedule``, 1F1B-like: ``1f1b`` / ``gpipe`` without interleaving), experts (their
    separate expert-data-parallel reductions and norms), LoRA, fp8, context parallelism (FP16_Optimizer: DeepSpeed's
    own sequence parallelism is not Megatron's context parallelism)."""
    p, m, t = cfg.parallelism, cfg.model, cfg.training
    pp = p.pipeline_model_parallel_size > 1
    return [w for c, w in (
        (pp and (p.virtual_pipeline_model_parallel_size > 1 or p.schedule not in ("1f1b", "gpipe")),
         f"pipeline_schedule {p.schedule}"),
        (bool(m.num_experts), "model.num_experts"), (t.lora is not None, "training.lora"),
        (t.fp8 is not None, "training.fp8"),
        (p.context_parallel_size > 1 and deepspeed_fp16_optimizer(cfg),
         f"context_parallel_size {p.context_parallel_size}")) if c]


def cross_entropy_of(cfg: "ScenarioConfig") -> str:
    """``training.cross_entropy`` in force: the value given, else the framework's: ``pytorch`` (``F.cross_entropy``)
    with ``fsdp``, DeepSpeed ZeRO (which takes the model's own loss: set ``megatron`` for a Megatron-DeepSpeed
    model), ``model.kernels: hf_eager``, ``amp_fp32_params`` (torch.autocast: a PyTorch loop; Megatron-LM has no
    autocast) or ``training.lora`` (Hugging Face PEFT: the model's ``CrossEntropyLoss``), else ``megatron`` (Megatron-LM's GPTModel always calls its
    vocab-parallel cross-entropy, fused or not: megatron/core/models/common/language_module/language_module.py
    ``compute_language_model_loss``)."""
    v = cfg.training.cross_entropy
    if v is not None:
        return v
    pytorch = (cfg.fsdp is not None or cfg.zero_optimization.stage > 0 or cfg.model.kernels == "hf_eager"
               or cfg.training.precision == "amp_fp32_params" or cfg.training.lora is not None)
    return "pytorch" if pytorch else "megatron"


#: Precisions whose parameters, gradients and moments are fp32: what ``optimizer.impl: single`` and ``foreach`` are priced for.
SINGLE_TENSOR_PRECISIONS = ("amp_fp32_params", "fp32", "tf32")


class ParallelismConfig(_Model):
    """Megatron-LM parallel sizes (rank order tp-cp-ep-dp-pp: tensor-parallel ranks are consecutive, inside a
    node; expert-parallel ranks lie inside the data-parallel dimension; pipeline stages are the outermost).

    """

    tensor_model_parallel_size: PositiveInt = Field(
        default=1, le=MAX_DATA_PARALLEL_SIZE, description="Megatron --tensor-model-parallel-size. > 1 needs "
        "hardware.cluster, must divide the GPUs per node, num_attention_heads and ffn_hidden_size (the vocabulary "
        "is padded to a multiple of 128 x tp as Megatron does), and training.precision bf16 or fp16.")
    sequence_parallel: bool = Field(default=False, description="Megatron --sequence-parallel (with tp > 1; "
                                    "tp must divide seq_length).")
    tp_comm_overlap: Any = Field(
        default=False, description="true: Megatron --tp-comm-overlap (Transformer Engine userbuffers: the "
        "sequence-parallel all-gathers / reduce-scatters run beside their GEMMs and interfere with them); fused: a "
        "fused GEMM + collective kernel (Triton-distributed, async-TP) that overlaps without taking SMs. Needs "
        "sequence_parallel and tp > 1.")
    async_tensor_model_parallel_allreduce: bool = Field(
        default=True, description="Megatron-LM's asynchronous column-parallel backward (on since Megatron-LM 2021; "
        "--no-async-tensor-model-parallel-allreduce: false): the qkv / fc1 / LM-head input-gradient all-reduce "
        "runs beside the weight-gradient GEMM; with sequence_parallel (and tp_comm_overlap false) the layer input "
        "is saved as its 1/t shard, all-gathered again beside the input-gradient GEMM and the input gradient "
        "reduce-scattered beside the weight-gradient GEMM (not with amp_fp32_params or fp8 under sequence_parallel, "
        "nor for MoE shared experts or LoRA: blocking there). false: the 2020 code (blocking, after the layer's "
        "backward).")
    pipeline_model_parallel_size: PositiveInt = Field(
        default=1, le=MAX_DATA_PARALLEL_SIZE, description="Megatron --pipeline-model-parallel-size. > 1 needs "
        "hardware.cluster; the layers are split evenly unless pipeline_layers_per_stage is given.")
    virtual_pipeline_model_parallel_size: PositiveInt = Field(
        default=1, le=MAX_DATA_PARALLEL_SIZE, description="Model chunks per pipeline rank (Megatron "
        "--num-layers-per-virtual-pipeline-stage = num_layers / (pp x this)); > 1 uses interleaved_1f1b; "
        "zero_bubble_v derives 2 (1 or 2 allowed with it).")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_h2",
                               "zero_bubble_v"] | None = Field(
        default=None, description="Default 1f1b (Megatron forward_backward_pipelining_without_interleaving), "
        "interleaved_1f1b with virtual_pipeline_model_parallel_size > 1; zero_bubble_h1: ZB-H1 of Qi et al., "
        "ICLR 2024 (weight gradients split from the backward and deferred into 1F1B's bubbles; not with "
        "tp_comm_overlap); zero_bubble_h2: their ZB-H2 (extra warm-up forwards, W passes moved to the tail: a "
        "parallelogram with 2p - 1 micro-batches in flight on every stage; the reference's automatic counterpart is "
        "--zero-bubble-max-pending-backward 2p; not with tp_comm_overlap); zero_bubble_v: their ZB-V "
        "(--zero-bubble-v-schedule: 2 model chunks per rank in a V, "
        "virtual_pipeline_model_parallel_size derived 2; needs pp > 1, an even number of layers per stage and "
        "untied embeddings; not with tp_comm_overlap).")
    pipeline_layers_per_stage: list[PositiveInt] | None = Field(
        default=None, max_length=MAX_DATA_PARALLEL_SIZE, description="Custom split: transformer blocks of each "
        "pipeline stage (pp x virtual numbers, model-chunk order) summing to model.num_layers.")
    context_parallel_size: PositiveInt = Field(
        default=1, le=MAX_DATA_PARALLEL_SIZE, description="Megatron --context-parallel-size: each sequence split over "
        "cp ranks (needs hardware.cluster; 2 x cp must divide seq_length); world = tp x cp x dp x pp.")
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = Field(
        default="p2p", description="Megatron --cp-comm-type: p2p (ring attention: K/V passed around the CP ring "
        "beside the partial attention kernels), all_gather (K/V all-gathered before attention), a2a (Ulysses: "
        "all-to-all to split heads instead of the sequence; cp must divide the heads per TP rank).")
    expert_model_parallel_size: PositiveInt = Field(
        default=1, le=MAX_DATA_PARALLEL_SIZE, description="Megatron --expert-model-parallel-size: each rank holds "
        "num_experts / ep experts; must divide model.num_experts, and ep x expert_tensor_parallel_size must divide "
        "tp x dp (Megatron's expert grid etp-ep-edp over the ranks of a stage); tokens go to their experts by "
        "all-to-all.")
    expert_tensor_parallel_size: PositiveInt | None = Field(
        default=None, le=MAX_DATA_PARALLEL_SIZE, description="Megatron --expert-tensor-parallel-size: ranks each "
        "expert's width is split over (the dispatcher all-gathers the tokens over them after the all-to-all and "
        "reduce-scatters the outputs before it); default tensor_model_parallel_size; at most it.")
    data_parallel_size: PositiveInt | None = Field(
        default=None, le=MAX_DATA_PARALLEL_SIZE, description="Data-parallel replicas. > 1 needs hardware.cluster and "
        "must equal its world size / (tp x pp); default: that (1 without a cluster).")
    data_parallel_shard_degree: int | None = Field(
        default=None, ge=-1, le=MAX_DATA_PARALLEL_SIZE, description="torchtitan [parallelism] "
        "data_parallel_shard_degree (PyTorch init_device_mesh's dp_shard dimension): data-parallel ranks FSDP shards "
        "over, consecutive ranks (a group may span nodes); -1: data_parallel_size / data_parallel_replicate_degree. "
        "Needs fsdp; shard x replicate = data_parallel_size. Default: FSDP1 HYBRID_SHARD the data-parallel ranks of "
        "a node, else all of them.")
    data_parallel_replicate_degree: PositiveInt | None = Field(
        default=None, le=MAX_DATA_PARALLEL_SIZE, description="torchtitan [parallelism] data_parallel_replicate_degree "
        "(init_device_mesh's dp_replicate dimension): shard groups whose gradients are all-reduced (HSDP; ranks "
        "strided by the shard degree). Needs fsdp (version 1: sharding_strategy HYBRID_SHARD when > 1). Default 1.")

    _no_bool = field_validator("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                               "expert_model_parallel_size", "virtual_pipeline_model_parallel_size",
                               "expert_tensor_parallel_size", "data_parallel_shard_degree",
                               "data_parallel_replicate_degree", mode="before")(no_bool)

    @field_validator("tp_comm_overlap", mode="before")
    @classmethod
    def _tp_comm_overlap_value(cls, v):
        if v is True or v is False or v == "fused":
            return v
        raise ValueError(f"{v!r} is not allowed (allowed: true, false, fused)")

    @property
    def schedule(self) -> str:
        """The pipeline schedule in force (``pipeline_schedule``, else by the virtual size)."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved_1f1b" if self.virtual_pipeline_model_parallel_size > 1 else "1f1b"

    @property
    def data_context_parallel_size(self) -> int:
        """Ranks of the gradient reduce group, data x context parallel (``data_parallel_size`` or 1, times
        ``context_parallel_size``): what ZeRO, FSDP and the distributed optimizer shard over (Megatron-LM
        ``parallel_state.get_data_parallel_world_size(with_context_parallel=True)``)."""
        return (self.data_parallel_size or 1) * self.context_parallel_size

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks per pipeline rank: ``virtual_pipeline_model_parallel_size``, 2 with ``zero_bubble_v``
        (derived when the virtual size is left at 1, as the reference sets it: sail-sg/zero-bubble-pipeline-
        parallelism ``megatron/core/zbpp_utils.py`` ``validate_arguments``)."""
        return 2 if self.schedule == "zero_bubble_v" else self.virtual_pipeline_model_parallel_size



class RunConfig(_Model):
    """How long to simulate, and which ranks and ops are simulated (``rank_folding``, ``fidelity``).
    ``rank_folding`` symmetric: one representative rank per pipeline stage, every data-parallel replica identical
    (a ``rank_overrides`` entry with ``dp_rank`` is refused: it would make a replica differ); classes (default):
    ranks that behave identically share one representative and a ``dp_rank`` override adds one rank class per
    stage (a slow GPU costs one more representative per stage, not a full-rank run); none: every data-parallel
    replica of every stage is its own representative (tensor-parallel ranks stay folded). Without ``dp_rank``
    overrides the three give the same results; the cost is linear in the representatives simulated
    (``benchmarks/bench_folding.py``).
    """

    steps: PositiveInt = Field(default=5, le=MAX_STEPS, description="Steps simulated (including warmup).")
    warmup_steps: int = Field(default=1, ge=0, description="Leading steps excluded from the metrics.")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of the run's random generator (64-bit).")
    rank_folding: Literal["symmetric", "classes", "none"] = Field(
        default="classes", description="symmetric: one simulated representative per pipeline stage, every "
        "data-parallel replica identical (a dp_rank override is refused; pp_rank overrides allowed); classes: ranks "
        "that behave identically share one simulated representative (a dp_rank override adds one class per stage); "
        "none: every data-parallel replica of every stage is simulated (tensor-parallel ranks stay folded), at most "
        "MAX_SIMULATED_RANKS.")
    fidelity: Literal["kernel", "layer"] = Field(
        default="kernel", description="kernel: every kernel is an op; layer: each layer's consecutive compute "
        "kernels of one phase and micro-batch run as one op priced as the sum of its kernels (fewer ops, faster "
        "at scale; collectives, copies and send/recv stay separate; simulator/policies/fidelity.py).")

    @model_validator(mode="after")
    def _warmup_below_steps(self):
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")
        return self


def world_size_of(cluster: dict | ClusterConfig) -> int | None:
    """Ranks of a ``hardware.cluster`` mapping: nodes x the preset's ``gpus_per_node`` (None: unknown preset)."""
    from hardware_models.presets import PresetError
    from hardware_models.topology import load_cluster

    c = cluster.model_dump() if isinstance(cluster, ClusterConfig) else cluster
    if not isinstance(c, dict) or not isinstance(c.get("preset"), str):
        return None
    nodes = c.get("nodes", 1)
    if not isinstance(nodes, int) or nodes < 1:
        return None
    try:
        spec = load_cluster(c["preset"], c.get("overrides") or None)
    except (PresetError, ValueError, TypeError):
        return None
    return nodes * spec.gpus_per_node


class ScenarioConfig(_Model):
    """One simulated training setup."""

    name: str
    description: str = ""
    hardware: HardwareConfig
    model: ModelConfig
    training: TrainingConfig
    parallelism: ParallelismConfig = ParallelismConfig()
    run: RunConfig = RunConfig()
    zero_optimization: ZeroOptimizationConfig = ZeroOptimizationConfig()  # simulator/config/sections/offload.py
    fp16: Fp16SectionConfig | None = Field(default=None, description="DeepSpeed's fp16 section: "
                                           "fp16_master_weights_and_grads (simulator/config/sections/half_precision.py).")
    bf16: Bf16SectionConfig | None = Field(default=None, description="DeepSpeed's bf16 section: "
                                           "bf16_master_weights_and_grads, bf16_optimizer_states "
                                           "(simulator/config/sections/half_precision.py).")
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    activation_checkpoint: torchtitan_ac.TorchtitanActivationCheckpoint | None = Field(
        default=None, description="torchtitan's [activation_checkpoint] (mode, selective_ac_option, early_stop, ...), "
        "in place of training.recompute_granularity; needs fsdp.version 2 (simulator/config/sections/torchtitan_ac.py).")
    dataloader: DataLoaderConfig | None = None
    dvfs: DvfsConfig | None = None
    memory: MemoryConfig = MemoryConfig()  # simulator/config/sections/memory.py
    ddp: DdpConfig = DdpConfig()  # simulator/config/sections/cluster.py
    fsdp: FsdpConfig | None = None  # simulator/config/sections/fsdp.py
    nccl: NcclSectionConfig = NcclSectionConfig()
    aio: AioConfig = AioConfig()  # simulator/config/sections/nvme.py (DeepSpeed's aio section)
    rank_overrides: list[RankOverride] = Field(default_factory=list, max_length=MAX_RANK_OVERRIDES,
                                               description="Ranks that differ (stragglers, capped GPUs); "
                                               "simulator/config/sections/ranks.py.")

    @model_serializer(mode="wrap")
    def _dump_without_unwritten_deepspeed(self, handler):
        """Every dump (``model_dump``, ``model_dump_json``) leaves out the ``zero_optimization`` section when the
        scenario gave none: its presence decides who runs the step (a DeepSpeed config at stage 0 with 16-bit
        training is DeepSpeed's BF16_Optimizer / FP16_Optimizer: ``deepspeed_bf16_optimizer`` /
        ``deepspeed_fp16_optimizer``; none is Megatron-LM's or PyTorch's DDP), so a dumped default section would turn
        a Megatron-LM run reloaded from its dump into another run."""
        out = handler(self)
        if isinstance(out, dict) and "zero_optimization" not in self.model_fields_set:
            out.pop("zero_optimization", None)
        if isinstance(out, dict):  # DeepSpeed's fp16 / bf16 sections (half_precision.py): only when given
            for k in ("fp16", "bf16"):
                if out.get(k, 0) is None:
                    out.pop(k)
        if isinstance(out, dict) and self._no_step_effect:  # the keys accepted without effect, for their warnings
            out = put_keys(out, self._no_step_effect)
        return out

    #: DeepSpeed keys accepted without effect on a step, as written (``foreign_keys.no_step_effect_keys``):
    #: ``_resolve_data_parallel`` drops them, every dump puts them back, so a config dumped and validated again
    #: (``with_overrides``, sweep / what-if points) warns as the scenario did
    _no_step_effect: dict[str, object] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _note_no_step_effect(cls, data, handler):
        """Keep ``no_step_effect_keys`` of the mapping as written (``_resolve_data_parallel`` drops the keys)."""
        keys = no_step_effect_keys(data)
        out = handler(data)
        if keys:
            out._no_step_effect = keys
        return out

    @property
    def no_step_effect_notes(self) -> tuple[str, ...]:
        """One line per DeepSpeed key accepted although it does not change a training step (``run_warnings``)."""
        return no_step_effect_notes(self._no_step_effect, fp16_in_use=self.fp16 is not None and self.fp16.enabled
                                    is not False)

    @model_validator(mode="before")
    @classmethod
    def _resolve_data_parallel(cls, data):
        """Fill ``parallelism.data_parallel_size`` (the one place it is resolved) and check it.

        Without a cluster it is 1 and > 1 is refused; with one it is world size / (tp x pp), where
        world size = nodes x the cluster preset's ``gpus_per_node``. An unknown preset is left to
        ``resolve_hardware`` (which names the key).

        First, DeepSpeed's keys accepted at their defaults only (``prescale_gradients``, ``zero_optimization.
        reduce_scatter``, ...) are dropped (``foreign_keys.DEFAULT_ONLY_KEYS``: what every run prices), any other
        value refused; those without effect on a step (``foreign_keys.NO_STEP_EFFECT_KEYS``, the fp16 loss-scaling
        keys at values DeepSpeed accepts: ``foreign_keys.FP16_LOSS_SCALING``) dropped, and DeepSpeed's
        ``gradient_clipping`` moved to ``training.clip_grad`` (the one before-validator: ``loader.scenario_errors``
        runs it and reports every problem of those keys, ``foreign_keys.deepspeed_key_problems``;
        ``_note_no_step_effect`` keeps the warnings).
        """
        if not isinstance(data, dict):
            return data
        data = drop_default_only_keys(data)
        hw = data.get("hardware")
        if data.get("parallelism") is not None and not isinstance(data.get("parallelism"), dict):
            return data  # not a mapping: the field refuses it (filling data_parallel_size would replace it)
        par = data.get("parallelism") or {}
        dp = par.get("data_parallel_size")
        cl = hw.get("cluster") if isinstance(hw, dict) else None
        if cl is None:
            # out-of-range values are left to the field's bound, which names the limit
            if isinstance(dp, int) and not isinstance(dp, bool) and 1 < dp <= MAX_DATA_PARALLEL_SIZE:
                raise ValueError(f"parallelism.data_parallel_size: {dp} > 1 needs hardware.cluster "
                                 "(e.g. {preset: dgx-h100, nodes: 1}); without it one GPU is simulated (allowed: 1)")
            return data
        world = world_size_of(cl)
        if world is None:
            return data
        tp = par.get("tensor_model_parallel_size", 1) or 1
        pp = par.get("pipeline_model_parallel_size", 1) or 1
        cp = par.get("context_parallel_size", 1) or 1
        sizes = (tp, pp, cp)
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes)
        want = world // (tp * pp * cp) if ok else None
        if want is not None and world % (tp * pp * cp):  # they do not divide the world: their own check names it
            want = None
        if dp is None:
            if want is not None:
                data = {**data, "parallelism": {**par, "data_parallel_size": want}}
        elif isinstance(dp, int) and want is not None and dp != want:
            raise ValueError(f"parallelism.data_parallel_size: {dp} does not match the world size {world} of "
                             f"hardware.cluster ({cl.get('nodes', 1)} node(s) x {world // cl.get('nodes', 1)} GPUs) / "
                             f"(tp {tp} x pp {pp} x cp {cp}) = {want} (allowed: {want}, or omit it)")
        return data

    @model_validator(mode="after")
    def _torchtitan_cpu_offload(self):
        """torchtitan's ``training.enable_cpu_offload: true`` is ``fsdp.offload_policy: {kind: cpu, pin_memory:
        true}`` (``CPUOffloadPolicy()``'s default), filled in here; beside an ``offload_policy`` it must say the
        same (one given as no offload, ``OffloadPolicy`` / null, is refused: not overridden in silence). Runs before the sharding checks (pydantic runs after-validators in the order defined)."""
        if not self.training.enable_cpu_offload:
            return self
        f = self.fsdp
        if f is None or f.version != 2:
            raise ValueError("training.enable_cpu_offload: true is torchtitan's FSDP2 CPUOffloadPolicy(): it needs "
                             "fsdp: {version: 2} (allowed: add it, or fsdp.cpu_offload with fsdp.version 1)")
        if f.offload_policy is None and "offload_policy" in f.model_fields_set:
            raise ValueError("training.enable_cpu_offload: true (torchtitan's CPUOffloadPolicy()) contradicts "
                             "fsdp.offload_policy given as no offload (OffloadPolicy / null) (allowed: one of them: "
                             "training.enable_cpu_offload false, or omit fsdp.offload_policy)")
        if f.offload_policy is None:
            # the section is frozen: the filled-in policy replaces it once, at validation
            object.__setattr__(self, "fsdp", f.model_copy(update={"offload_policy": FsdpOffloadPolicy()}))
        elif not f.offload_policy.pin_memory:
            raise ValueError("training.enable_cpu_offload: true (torchtitan's CPUOffloadPolicy(), pinned) contradicts "
                             "fsdp.offload_policy pin_memory false (allowed: one of them, or pin_memory true)")
        return self

    @model_validator(mode="after")
    def _data_parallel_scope(self):
        self._sharding_scope(self.parallelism.data_context_parallel_size)  # sharded over dp x cp
        return self

    def _fsdp_mesh_scope(self) -> None:
        """``parallelism.data_parallel_shard_degree`` / ``data_parallel_replicate_degree`` (torchtitan's 2-D FSDP
        mesh): with fsdp only, shard x replicate = data_parallel_size, and what FSDP1 and FSDP2 each allow; an int
        ``fsdp.reshard_after_forward`` divides the shard group (``_get_post_forward_mesh_info``)."""
        p, f = self.parallelism, self.fsdp
        shard, rep = p.data_parallel_shard_degree, p.data_parallel_replicate_degree
        if shard is not None or rep is not None:
            self._fsdp_degrees(shard, rep)
        raf = f.reshard_after_forward if f is not None else None
        if isinstance(raf, int) and not isinstance(raf, bool):
            n = ((p.data_parallel_size or 1) // (rep or 1) if shard in (None, -1) else shard) * p.context_parallel_size
            if n % raf:
                raise ValueError(f"fsdp.reshard_after_forward: {raf} is not a factor of the shard group size {n} "
                                 f"(fully_shard; allowed: {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}, "
                                 "true or false)")

    def _fsdp_degrees(self, shard: int | None, rep: int | None) -> None:
        """The checks of ``_fsdp_mesh_scope`` on the two degrees."""
        p, f = self.parallelism, self.fsdp
        key = "parallelism.data_parallel_shard_degree" if shard is not None else \
            "parallelism.data_parallel_replicate_degree"
        if f is None:
            raise ValueError(f"{key} is FSDP's 2-D mesh (torchtitan HSDP): it needs an fsdp section (allowed: "
                             "fsdp: {version: 2}, or omit it)")
        dp = p.data_parallel_size or 1
        divisors = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        if shard == 0:
            raise ValueError(f"parallelism.data_parallel_shard_degree: 0 (allowed: {divisors}, or -1: the rest)")
        r = rep or 1
        if dp % r:
            raise ValueError(f"parallelism.data_parallel_replicate_degree: {r} does not divide data_parallel_size "
                             f"{dp} (allowed: {divisors})")
        if shard not in (None, -1) and dp % shard:
            raise ValueError(f"parallelism.data_parallel_shard_degree: {shard} does not divide data_parallel_size "
                             f"{dp} (allowed: {divisors}, or -1)")
        s = dp // r if shard in (None, -1) else shard
        if s * r != dp:
            raise ValueError(f"parallelism.data_parallel_shard_degree: {s} x data_parallel_replicate_degree {r} = "
                             f"{s * r} is not data_parallel_size {dp} (allowed: shard x replicate = {dp}, e.g. "
                             f"data_parallel_shard_degree {dp // r} or -1)")
        if s == 1 and r > 1:
            alt = "fsdp.sharding_strategy NO_SHARD" if f.version == 1 else "no fsdp section (plain DDP)"
            raise ValueError(f"parallelism.data_parallel_shard_degree: 1 with replicate {r} is DDP, not FSDP (allowed: "
                             f"a shard degree > 1, or {alt})")
        if f.version == 1 and f.sharding_strategy == "NO_SHARD" and s > 1:
            raise ValueError(f"{key} with fsdp.sharding_strategy NO_SHARD: NO_SHARD does not shard (allowed: omit "
                             "the degrees, or another strategy)")
        if f.version == 1 and r > 1 and f.sharding_strategy != "HYBRID_SHARD":
            raise ValueError(f"parallelism.data_parallel_replicate_degree: {r} > 1 with fsdp.sharding_strategy "
                             f"{f.sharding_strategy}: FSDP1 replicates shards only under HYBRID_SHARD (allowed: "
                             "HYBRID_SHARD, or fsdp.version 2)")
        if f.version == 1 and r == 1 and f.sharding_strategy == "HYBRID_SHARD":
            raise ValueError(f"{key}: a shard degree of all {dp} ranks (replicate degree 1) with fsdp.sharding_strategy "
                             "HYBRID_SHARD replicates nothing: it is FULL_SHARD (allowed: a replicate degree > 1, "
                             "FULL_SHARD, or omit the degrees for HYBRID_SHARD's shard per node)")

    def _fsdp_offload_scope(self, dp: int) -> None:
        """``fsdp.cpu_offload`` / ``fsdp.offload_policy``: what is modelled (``simulator/policies/offload_fsdp.py``)."""
        f, par = self.fsdp, self.parallelism
        key = f.offload_key
        if f.sharding_strategy == "NO_SHARD":
            raise ValueError(f"{key} with sharding_strategy NO_SHARD is not modelled yet (allowed: FULL_SHARD, "
                             "SHARD_GRAD_OP, HYBRID_SHARD)")
        if dp < 2:
            raise ValueError(f"{key} needs data_parallel_size x context_parallel_size > 1 (FSDP over one rank is "
                             "built without sharding; allowed: a cluster with dp > 1)")
        if par.pipeline_model_parallel_size > 1:
            raise ValueError(f"{key} with pipeline_model_parallel_size > 1 is not modelled yet (allowed: 1)")
        if self.model.num_experts or self.training.lora is not None:
            what = "model.num_experts" if self.model.num_experts else "training.lora"
            raise ValueError(f"{key} with {what} is not modelled yet (allowed: a dense model, every parameter trained)")
        # FSDP2 accumulates on the CPU: foreach_reduce adds each later micro-batch's reduced shard into the CPU
        # .grad (pytorch/pytorch@8fc2039d torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
        if f.version == 1 and (self.training.global_batch_size or 0) > self.training.micro_batch_size * (
                par.data_parallel_size or 1):
            raise ValueError(f"{key} with gradient accumulation: FSDP1 does not accumulate gradients outside "
                             "no_sync() with CPU offload (torch FullyShardedDataParallel docs: it uses the newly "
                             "reduced gradient); allowed: global_batch_size = micro_batch_size x data_parallel_size, "
                             "or fsdp.version 2 (fully_shard adds each micro-batch's reduced shard on the CPU)")

    def _sharding_scope(self, dp: int) -> None:
        """ZeRO-3, FSDP and the Megatron distributed optimizer: one of them at a time, and what is not modelled."""
        z, f, ddp = self.zero_optimization, self.fsdp, self.ddp
        pp = self.parallelism.pipeline_model_parallel_size
        par = self.parallelism
        if pp > 1 and f is not None and (par.virtual_pipeline_model_parallel_size > 1
                                         or par.schedule not in ("gpipe", "1f1b")):
            raise ValueError(f"fsdp: with parallelism.pipeline_schedule {par.schedule} is not modelled yet (allowed "
                             "with fsdp and pipeline_model_parallel_size > 1: gpipe, 1f1b)")
        if pp > 1 and f is not None and not self.model.untie_embeddings_and_output_weights:
            raise ValueError("fsdp: with parallelism.pipeline_model_parallel_size > 1 needs "
                             "model.untie_embeddings_and_output_weights: true (torch.distributed.pipelining ties no "
                             "weights across stages)")
        prec, tp = self.training.precision, self.parallelism.tensor_model_parallel_size
        if f is not None and z.stage > 0:
            raise ValueError(f"fsdp: exclusive with zero_optimization.stage {z.stage} (FSDP and DeepSpeed ZeRO both "
                             "shard the model states; allowed: one of them)")
        if f is not None and ddp.use_distributed_optimizer:
            raise ValueError("fsdp: exclusive with ddp.use_distributed_optimizer (allowed: one of them)")
        if ddp.use_distributed_optimizer and z.stage > 0:
            raise ValueError(f"ddp.use_distributed_optimizer: exclusive with zero_optimization.stage {z.stage} "
                             "(allowed: one of them)")
        # DeepSpeed's BF16_Optimizer keeps its own gradient buffer and fp32 partition (graph.builders.bf16_optimizer):
        # Megatron-LM's distributed optimizer describes an optimizer that does not run. Its grad-buffer keys
        # (accumulate_allreduce_grads_in_fp32, grad_reduce_in_bf16) are warned, not refused, as under FP16_Optimizer
        # (api._grad_reduce_in_bf16_without_effect): Megatron-DeepSpeed accepts --accumulate-allreduce-grads-in-fp32
        # under --deepspeed (validate_args even sets it for --bf16) and never reads it there (deepspeedai/
        # Megatron-DeepSpeed@207b2d5a megatron/arguments.py validate_args; megatron/training.py get_model:
        # ``if args.deepspeed: return model`` before LocalDDP(..., args.accumulate_allreduce_grads_in_fp32, ...))
        if ddp.use_distributed_optimizer and deepspeed_bf16_optimizer(self):
            raise ValueError("ddp.use_distributed_optimizer: Megatron-LM's optimizer, but zero_optimization "
                             "stage 0 with bf16 and a pipeline runs DeepSpeed's BF16_Optimizer (its own gradient "
                             "buffer and fp32 partition; allowed: omit it, or no zero_optimization section for "
                             "Megatron-LM's optimizer)")
        # without a pipeline (or with fp16) the same DeepSpeed config is FP16_Optimizer, which
        # deepspeed_fp16_optimizer leaves to Megatron's distributed optimizer when that is set: Megatron-DeepSpeed
        # builds none under --deepspeed (microsoft/Megatron-DeepSpeed@8fd352da megatron/optimizer/__init__.py
        # get_megatron_optimizer: ``if args.deepspeed: return optimizer``)
        if (ddp.use_distributed_optimizer and "zero_optimization" in self.model_fields_set and z.stage == 0
                and f is None and prec in ("bf16", "fp16") and not deepspeed_bf16_optimizer(self)):
            raise ValueError(f"ddp.use_distributed_optimizer: Megatron-LM's optimizer, but zero_optimization stage 0 "
                             f"with {prec} runs DeepSpeed's FP16_Optimizer (Megatron-DeepSpeed builds no distributed "
                             "optimizer under --deepspeed; allowed: omit it, or no zero_optimization section for "
                             "Megatron-LM's optimizer)")
        acc = ddp.accumulate_allreduce_grads_in_fp32
        if acc is not None and (prec not in ("bf16", "fp16") or z.stage > 0 or f is not None
                                or self.training.lora is not None):
            raise ValueError("ddp.accumulate_allreduce_grads_in_fp32 is Megatron-LM's: it needs training.precision "
                             "bf16 or fp16 without zero_optimization.stage, fsdp or training.lora (allowed: omit it)")
        if acc is False and prec == "bf16" and not ddp.grad_reduce_in_bf16:
            raise ValueError("ddp.accumulate_allreduce_grads_in_fp32: false with training.precision bf16: Megatron-LM "
                             "forces it on for bf16 (allowed: true, omit it, or ddp.grad_reduce_in_bf16: true)")
        if ddp.grad_reduce_in_bf16 and (z.stage > 0 or f is not None or self.training.lora is not None):
            raise ValueError("ddp.grad_reduce_in_bf16 is Megatron-LM's: it needs Megatron's optimizer, without "
                             "zero_optimization.stage, fsdp or training.lora (allowed: omit it)")
        if ddp.overlap_param_gather and not ddp.use_distributed_optimizer:
            raise ValueError("ddp.overlap_param_gather needs ddp.use_distributed_optimizer: true (Megatron-LM)")
        if dp > 1 and z.stage == 3:
            if prec == "amp_fp32_params":
                raise ValueError("zero_optimization.stage: 3 with data_parallel_size > 1 needs training.precision bf16 "
                                 "or fp16 (16-bit parameter partitions; allowed: bf16, fp16)")
        self._fsdp_mesh_scope()
        if f is not None and f.offload_params:
            self._fsdp_offload_scope(dp)
        if f is not None and dp > 1:
            if prec not in ("amp_fp32_params", "fp32", "tf32"):
                raise ValueError(f"fsdp: training.precision {prec} is not modelled with FSDP (allowed: amp_fp32_params: "
                                 "fp32 sharded parameters under torch.autocast; with fsdp.version 2 and param_dtype "
                                 "fp32: fp32 or tf32)")
            if f.sharding_strategy == "NO_SHARD" and f.dtypes[0] == "bf16" and pp > 1:
                raise ValueError("fsdp: sharding_strategy NO_SHARD with param_dtype bf16 and "
                                 "pipeline_model_parallel_size > 1 is not modelled yet (allowed: mixed_precision FULL, "
                                 "or no pipeline)")
            if (f.sharding_strategy == "NO_SHARD" and f.dtypes[1] == "bf16" and pp == 1 and (
                    self.training.global_batch_size or 0) > self.training.micro_batch_size * (par.data_parallel_size or 1)):
                raise ValueError("fsdp: sharding_strategy NO_SHARD with reduce_dtype bf16 with gradient accumulation "
                                 "is not modelled yet (the fp32 .grad each bf16 all-reduce adds into; allowed: "
                                 "reduce_dtype fp32, e.g. mixed_precision DEFAULT, or global_batch_size = "
                                 "micro_batch_size x data_parallel_size)")
            if tp > 1 and f.sharding_strategy == "NO_SHARD":
                raise ValueError(f"fsdp: tensor_model_parallel_size {tp} > 1 with sharding_strategy NO_SHARD is not "
                                 "modelled yet (allowed with TP: FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD)")
        p = self.parallelism
        own_experts = bool(self.model.num_experts) and (
            p.expert_model_parallel_size > 1 or (p.expert_tensor_parallel_size or tp) != tp)  # moe.own_expert_grads
        if dp > 1 and z.stage == 2 and own_experts and (self.training.global_batch_size or 0) > \
                self.training.micro_batch_size * dp:
            raise ValueError("zero_optimization.stage: 2 with gradient accumulation and experts reduced over their "
                             "own group (expert_model_parallel_size > 1) is not modelled yet (allowed: stage 0 or 1, "
                             "or no accumulation)")
        if ddp.use_distributed_optimizer and dp > 1 and prec == "amp_fp32_params":
            raise ValueError("ddp.use_distributed_optimizer needs training.precision bf16 or fp16 (Megatron-LM; "
                             "allowed: bf16, fp16)")

    @model_validator(mode="after")
    def _sequence_parallel_scope(self):
        """Megatron's rules for sequence parallelism and ``tp_comm_overlap`` (a check of their own, so that a
        misspelt ``sequence_parallel`` leaves the tensor-parallel layout checks to run: ``cross_checks``)."""
        p, m = self.parallelism, self.model
        tp = p.tensor_model_parallel_size
        if p.sequence_parallel and tp > 1 and m.seq_length % tp:
            raise ValueError(f"parallelism.sequence_parallel: tensor_model_parallel_size {tp} must divide "
                             f"model.seq_length {m.seq_length} (Megatron splits the sequence over the TP ranks)")
        if p.tp_comm_overlap is not False and not (tp > 1 and p.sequence_parallel):
            raise ValueError("parallelism.tp_comm_overlap needs sequence_parallel: true and tensor_model_parallel_size "
                             "> 1 (Megatron-LM --tp-comm-overlap)")
        if p.tp_comm_overlap is not False and p.pipeline_schedule in ("zero_bubble_h1", "zero_bubble_h2",
                                                                      "zero_bubble_v"):
            raise ValueError(f"parallelism.tp_comm_overlap with pipeline_schedule {p.pipeline_schedule} is not "
                             "modelled yet (allowed: tp_comm_overlap false, or another schedule)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_scope(self):
        """Megatron's rules for ``tensor_model_parallel_size`` > 1, and what is not modelled with it."""
        p, m = self.parallelism, self.model
        tp = p.tensor_model_parallel_size
        key = "parallelism.tensor_model_parallel_size"
        if tp == 1:
            return self
        cl = self.hardware.cluster

        def node() -> str | None:
            if cl is None:
                return (f"{key}: {tp} > 1 needs hardware.cluster (e.g. {{preset: dgx-a100, nodes: 1}}); "
                        "without it one GPU is simulated (allowed: 1)")
            world = world_size_of(cl)
            per_node = world // cl.nodes if world is not None else None
            if per_node is not None and (tp > per_node or per_node % tp):
                return (f"{key}: {tp} must divide the {per_node} GPUs per node of hardware.cluster {cl.preset!r} "
                        f"(TP ranks are consecutive inside a node; allowed: a divisor of {per_node})")
            return None

        def split(name: str, size):  # the rule that tp divides the model size ``size()`` named ``name``
            def rule() -> str | None:
                v = size()  # None: the rule does not apply
                return f"{key}: {tp} must divide model.{name} ({v}; Megatron splits it over the TP ranks)" \
                    if v is not None and v % tp else None
            return rule

        def precision() -> str | None:  # PyTorch 2-D FSDP + TP (DeviceMesh), FSDP sharded over dp x cp
            fsdp_2d = self.fsdp is not None and p.data_context_parallel_size > 1
            if cl is not None and self.training.precision == "amp_fp32_params" and not fsdp_2d:
                return (f"{key}: {tp} > 1 needs training.precision bf16 or fp16 (Megatron-LM; amp_fp32_params is "
                        "torch.autocast, allowed with tp 1 or with fsdp over data_parallel_size > 1)")
            return None

        def offload() -> str | None:
            z = self.zero_optimization
            if cl is not None and (z.offload_optimizer.device != "none" or z.offload_param.device != "none"):
                return (f"{key}: {tp} > 1 with zero_optimization offload is not modelled yet (allowed: offload "
                        "device none, or tp 1)")
            return None

        refuse_each(node, split("num_attention_heads", lambda: m.num_attention_heads),
                    split("ffn_hidden_size", lambda: m.ffn_hidden_size or 4 * m.hidden_size),
                    split("num_query_groups", lambda: m.query_groups if m.group_query_attention else None),  # else heads
                    precision, offload)
        return self

    def _zero_bubble_v_rules(self) -> tuple:
        """ZB-V's inputs, the reference's rules (sail-sg/zero-bubble-pipeline-parallelism
        ``megatron/core/zbpp_utils.py`` ``validate_arguments``: pipeline size > 1, the virtual size set to 2 and
        not given otherwise, untied embeddings; the even layers per stage are checked with the split), as rules
        for ``errors.refuse_each`` (each returns its problem or None)."""
        p = self.parallelism
        v = p.virtual_pipeline_model_parallel_size
        return (
            lambda: (f"parallelism.virtual_pipeline_model_parallel_size: {v} with pipeline_schedule "
                     "zero_bubble_v, which places exactly 2 model chunks per rank in a V (allowed: omit it, "
                     "derived 2, or 2)") if v not in (1, 2) else None,
            lambda: ("parallelism.pipeline_schedule: zero_bubble_v needs pipeline_model_parallel_size > 1 "
                     "(allowed with one stage: 1f1b, gpipe, zero_bubble_h1, zero_bubble_h2)")
            if p.pipeline_model_parallel_size == 1 else None,
            lambda: ("parallelism.pipeline_schedule: zero_bubble_v needs "
                     "model.untie_embeddings_and_output_weights: true (the reference implementation asserts "
                     "untied embeddings; allowed: another schedule with tied embeddings)")
            if not self.model.untie_embeddings_and_output_weights else None,
        )

    @model_validator(mode="after")
    def _pipeline_parallel_scope(self):
        """Megatron's rules for pipeline parallelism, and what is not modelled with it: every rule a setting breaks
        is told (``errors.refuse_each``), the layout rules first, then, with pp > 1, the rest."""
        p, m = self.parallelism, self.model
        pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
        key = "parallelism.pipeline_model_parallel_size"
        zbv = p.schedule == "zero_bubble_v"
        if zbv:
            v = 2
        chunks = pp * v
        split = p.pipeline_layers_per_stage

        def layers() -> str | None:  # the layers' split over the pp x v model chunks
            if split is not None:
                if pp == 1:
                    return ("parallelism.pipeline_layers_per_stage needs pipeline_model_parallel_size > 1 (allowed: "
                            "omit it with one stage)")
                if len(split) != chunks or sum(split) != m.num_layers:
                    return (f"parallelism.pipeline_layers_per_stage: {split} must be {chunks} numbers (pp {pp} x "
                            f"virtual {v}) summing to model.num_layers {m.num_layers} (got {len(split)} summing "
                            f"to {sum(split)})")
                return None
            if m.num_layers % chunks and zbv:
                return (f"parallelism.pipeline_schedule: zero_bubble_v needs an even number of layers per "
                        f"pipeline stage: 2 x pp {pp} = {chunks} must divide model.num_layers {m.num_layers} "
                        "(each stage is split into its 2 chunks evenly; or give "
                        f"parallelism.pipeline_layers_per_stage with {chunks} numbers)")
            if m.num_layers % chunks:
                return (f"{key}: pp {pp} x virtual {v} = {chunks} must divide model.num_layers {m.num_layers} "
                        "(or give parallelism.pipeline_layers_per_stage)")
            return None

        layout = (
            *(self._zero_bubble_v_rules() if zbv else ()),
            lambda: (f"parallelism.virtual_pipeline_model_parallel_size: {v} > 1 needs pipeline_schedule "
                     f"interleaved_1f1b (got {p.schedule}; allowed: 1 with gpipe/1f1b)")
            if not zbv and v > 1 and p.schedule != "interleaved_1f1b" else None,
            lambda: ("parallelism.pipeline_schedule: interleaved_1f1b needs "
                     "virtual_pipeline_model_parallel_size > 1 (allowed: gpipe, 1f1b with 1)")
            if p.pipeline_schedule == "interleaved_1f1b" and v == 1 and pp > 1 else None,
            lambda: (f"parallelism.virtual_pipeline_model_parallel_size: {v} > 1 needs "
                     "pipeline_model_parallel_size > 1 (allowed: 1)") if not zbv and v > 1 and pp == 1 else None,
            layers,
        )
        if pp == 1:
            refuse_each(*layout)
            return self
        cl = self.hardware.cluster
        tp = p.tensor_model_parallel_size

        def world() -> str | None:
            if cl is None:
                return (f"{key}: {pp} > 1 needs hardware.cluster (e.g. {{preset: dgx-a100, nodes: 1}}); "
                        "without it one GPU is simulated (allowed: 1)")
            w = world_size_of(cl)
            return (f"{key}: tp {tp} x pp {pp} = {tp * pp} must divide the world size {w} of "
                    f"hardware.cluster (allowed: pp dividing {w // tp})") if w is not None and w % (tp * pp) else None

        def interleaved_batches() -> str | None:
            dp = p.data_parallel_size or 1
            gbs = self.training.global_batch_size or self.training.micro_batch_size * dp
            mbs = gbs // (self.training.micro_batch_size * dp)
            return (f"parallelism.pipeline_schedule: interleaved_1f1b needs the micro-batches per step "
                    f"(global_batch_size / (micro_batch_size x data_parallel_size) = {mbs}) to be a multiple "
                    f"of pipeline_model_parallel_size {pp} (Megatron-LM)") \
                if p.schedule == "interleaved_1f1b" and mbs % pp else None

        def bf16_optimizer() -> str | None:  # DeepSpeed's pipeline engine: no interleaving, no split backward
            if not deepspeed_bf16_optimizer(self):
                return None
            why = stage0_wrapper_gaps(self)
            return (f"zero_optimization.stage: 0 with bf16 and {key} {pp} > 1 is DeepSpeed's "
                    f"BF16_Optimizer, which is not modelled with {', '.join(why)} (allowed: 1f1b or "
                    "gpipe, dense, no LoRA or fp8; or zero_optimization.stage 1)") if why else None

        z = self.zero_optimization
        refuse_each(
            *layout, world,
            lambda: (f"{key}: {pp} > 1 needs training.precision bf16 or fp16 (Megatron-LM; amp_fp32_params "
                     "is torch.autocast, allowed with pp 1 or with fsdp over data_parallel_size > 1)")
            if self.training.precision == "amp_fp32_params" and not (
                self.fsdp is not None and p.data_context_parallel_size > 1) else None,
            interleaved_batches,
            lambda: (f"zero_optimization.stage: {z.stage} with pipeline parallelism is not modelled (DeepSpeed's "
                     "pipeline engine supports ZeRO stage 0 or 1; allowed: 0, 1)") if z.stage >= 2 else None,
            lambda: (f"{key}: {pp} > 1 with zero_optimization offload is not modelled yet (allowed: offload "
                     "device none, or pp 1)")
            if z.offload_optimizer.device != "none" or z.offload_param.device != "none" else None,
            bf16_optimizer,
            lambda: (f"dataloader: a DataLoader with {key} {pp} > 1 is not modelled yet (allowed: no "
                     "dataloader section, or pp 1)") if self.dataloader is not None else None,
        )
        return self

    @model_validator(mode="after")
    def _master_weights_scope(self):
        """DeepSpeed's low-precision master weights / optimizer states: its rules and what is modelled
        (``sections.half_precision.check_master_weights``)."""
        if (why := check_master_weights(self)) is not None:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _fp16_optimizer_scope(self):
        """DeepSpeed's FP16_Optimizer (``deepspeed_fp16_optimizer``): what it is not modelled with, in one line."""
        if deepspeed_fp16_optimizer(self) and (why := stage0_wrapper_gaps(self)):
            raise ValueError(f"zero_optimization.stage: 0 with training.precision {self.training.precision} is "
                             f"DeepSpeed's FP16_Optimizer, which is not modelled with {', '.join(why)} (allowed: "
                             "1f1b or gpipe, dense, no LoRA, fp8 or context parallelism; or zero_optimization.stage "
                             "1)")
        return self

    @model_validator(mode="after")
    def _rank_override_scope(self):
        """Each override selects ranks that exist, once; what is not modelled with it."""
        p = self.parallelism
        pp, dp = p.pipeline_model_parallel_size, p.data_parallel_size or 1
        seen = set()
        for i, o in enumerate(self.rank_overrides):
            key = f"rank_overrides[{i}]"
            if self.hardware.cluster is None:
                raise ValueError(f"{key}: needs hardware.cluster (one GPU has no other ranks; set slowdown or dvfs of "
                                 "the scenario itself)")
            sel = ("pp_rank", o.pp_rank) if o.pp_rank is not None else ("dp_rank", o.dp_rank)
            top = pp if sel[0] == "pp_rank" else dp
            if sel[1] >= top:
                raise ValueError(f"{key}.{sel[0]}: {sel[1]} is outside the {top} {'pipeline stages' if sel[0] == 'pp_rank' else 'data-parallel replicas'} (allowed: 0..{top - 1})")
            if sel in seen:
                raise ValueError(f"{key}.{sel[0]}: {sel[1]} is overridden twice (allowed: one override per rank set)")
            seen.add(sel)
            if sel[0] == "dp_rank":
                if self.run.rank_folding == "symmetric":
                    raise ValueError(f"{key}.dp_rank: a replica override breaks run.rank_folding symmetric (every "
                                     "data-parallel replica identical) (allowed: pp_rank overrides, or "
                                     "run.rank_folding classes or none)")
                if dp == 1:
                    raise ValueError(f"{key}.dp_rank: needs data_parallel_size > 1")
        n_dp = sum(1 for o in self.rank_overrides if o.dp_rank is not None)
        if n_dp and n_dp >= dp:
            raise ValueError("rank_overrides: every data-parallel replica is overridden; override the scenario "
                             "instead (allowed: fewer dp_rank overrides than replicas)")
        for i, o in enumerate(self.rank_overrides):
            if o.gpu is not None:
                self._override_gpu_scope(f"rank_overrides[{i}].gpu", o.gpu)
            if o.gpu is not None and o.dp_rank is not None and any(
                    q.pp_rank is not None and q.gpu is not None for q in self.rank_overrides):
                raise ValueError(f"rank_overrides[{i}].gpu: a replica's and a stage's gpu would both apply to one "
                                 "rank (allowed: gpu on stage overrides or on replica overrides, not both)")
            if o.dvfs is not None and o.dp_rank is not None and any(
                    q.pp_rank is not None and q.dvfs is not None for q in self.rank_overrides):
                raise ValueError(f"rank_overrides[{i}].dvfs: a replica's and a stage's dvfs would both apply to one "
                                 "rank (allowed: dvfs on stage overrides or on replica overrides, not both)")
        classes = dp if self.run.rank_folding == "none" else 1 + n_dp
        if pp * classes > MAX_SIMULATED_RANKS:
            raise ValueError(f"run.rank_folding: {pp} stages x {classes} data-parallel classes = {pp * classes:,} "
                             f"simulated ranks; at most {MAX_SIMULATED_RANKS:,} (allowed: rank_folding classes)")
        return self

    def _override_gpu_scope(self, key: str, name: str) -> None:
        """A rank override's GPU preset exists and has the rates the scenario's precision needs."""
        from hardware_models import presets
        from hardware_models.presets import PresetError

        try:
            gpu = presets.get("gpus", name)
        except PresetError as exc:
            raise ValueError(f"{key}: {exc}") from None
        t = self.training
        need = "fp8" if t.fp8 is not None else t.precision if t.precision in ("tf32", "fp32", "bf16") else None
        if need is not None and need not in gpu.peak_flops_per_s:
            raise ValueError(f"{key}: {name} has no {need} rate, which training.{'fp8' if need == 'fp8' else 'precision'}"
                             f" needs (allowed: a GPU preset with one)")
        if self.fsdp is not None and "bf16" in self.fsdp.dtypes and "bf16" not in gpu.peak_flops_per_s:
            raise ValueError(f"{key}: {name} has no bf16 rate, which fsdp.mixed_precision "
                             f"{self.fsdp.mixed_precision} needs (allowed: a GPU preset with one, or FULL)")

    @model_validator(mode="after")
    def _expert_parallel_scope(self):
        """Megatron's rules for ``num_experts`` and ``expert_model_parallel_size``, and what is not modelled: every
        rule a setting breaks is told (``errors.refuse_each``)."""
        p, m = self.parallelism, self.model
        ep, E = p.expert_model_parallel_size, m.num_experts
        key = "parallelism.expert_model_parallel_size"
        if E is None:
            et = p.expert_tensor_parallel_size
            refuse_each(
                lambda: f"{key}: {ep} > 1 needs model.num_experts (a mixture-of-experts model)" if ep > 1 else None,
                lambda: (f"parallelism.expert_tensor_parallel_size: {et} needs model.num_experts (a "
                         "mixture-of-experts model)") if et is not None and et != p.tensor_model_parallel_size
                else None)
            return self
        dp, tp = p.data_parallel_size or 1, p.tensor_model_parallel_size
        et = p.expert_tensor_parallel_size or tp
        ekey = "parallelism.expert_tensor_parallel_size"
        fe = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
        fs = m.moe_shared_expert_intermediate_size
        sharded = (ep > 1 or et != tp) and dp > 1 and (self.zero_optimization.stage == 3 or self.fsdp is not None)
        what = "zero_optimization.stage: 3" if self.fsdp is None else "fsdp"
        refuse_each(
            lambda: f"{key}: {ep} must divide model.num_experts ({E})" if E % ep else None,
            lambda: (f"{ekey}: {et} above tensor_model_parallel_size {tp} is not modelled (allowed: a divisor "
                     f"of {tp})") if et > tp else None,
            lambda: (f"{ekey}: {et} must divide tensor_model_parallel_size {tp} (modelled: the expert-tensor-"
                     "parallel ranks inside the tensor-parallel group)") if et <= tp and tp % et else None,
            lambda: f"{ekey}: {et} must divide the expert width {fe} (model.moe_ffn_hidden_size)" if fe % et else None,
            lambda: (f"{key}: {ep} x {ekey.split('.')[1]} {et} must divide tensor_model_parallel_size x "
                     f"data_parallel_size {tp} x {dp} (Megatron's expert grid etp-ep-edp spans the tp x dp "
                     "ranks of a pipeline stage"
                     + ("; set hardware.cluster)" if self.hardware.cluster is None else ")"))
            if (tp * dp) % (ep * et) else None,
            lambda: (f"parallelism.sequence_parallel: model.num_experts with tensor_model_parallel_size {tp} "
                     "needs sequence_parallel true (Megatron-LM: \"When using MoE and tensor parallelism, "
                     "sequence parallelism must be used\")") if tp > 1 and not p.sequence_parallel else None,
            lambda: (f"model.moe_shared_expert_intermediate_size: {fs} is not divisible by "
                     f"tensor_model_parallel_size {tp} (the shared expert is split as the dense MLP)")
            if fs and fs % tp else None,
            lambda: "model.moe_shared_expert_gate needs model.moe_shared_expert_intermediate_size"
            if m.moe_shared_expert_gate and not fs else None,
            lambda: ("model.num_experts needs training.precision bf16 or fp16 (Megatron-LM; amp_fp32_params "
                     "is not modelled with experts)") if self.training.precision == "amp_fp32_params" else None,
            lambda: ("model.num_experts with model.add_bias_linear true is not modelled (Megatron's grouped "
                     "experts have no biases; allowed: add_bias_linear false)") if m.add_bias_linear else None,
            lambda: (f"{what} with {key} {ep} / expert_tensor_parallel_size {et} (expert parameters sharded "
                     "over the expert-data-parallel group) is not modelled yet (allowed: ZeRO stage 0-2, "
                     "ddp.use_distributed_optimizer)") if sharded else None,
        )
        return self

    @model_validator(mode="after")
    def _lora_scope(self):
        check_lora_scenario(self)
        return self

    @model_validator(mode="after")
    def _torchtitan_ac_scope(self):
        torchtitan_ac.check_scenario(self)
        return self

    @model_validator(mode="after")
    def _repeat_kv_scope(self):
        """``model.repeat_kv`` in force (given, or torchtitan's default with ``fsdp.version 2``) with grouped K/V:
        flash attention with rope and separate q / k / v projections only (``simulator/graph/builders/
        qkv_layout.py``)."""
        m, fsdp2 = self.model, self.fsdp is not None and self.fsdp.version == 2
        on = m.repeat_kv if m.repeat_kv is not None else fsdp2
        if not on or m.query_groups >= m.num_attention_heads:
            return self
        why = "" if m.repeat_kv is not None else " (torchtitan's default with fsdp.version 2)"
        if m.attention_kernel != "flash" or m.position_embedding_type != "rope":
            raise ValueError(f"model.repeat_kv{why} is modelled with attention_backend flash and "
                             "position_embedding_type rope only (allowed: model.repeat_kv false)")
        lo = self.training.lora
        if not fsdp2 and not (lo is not None and lora_hf_names(tuple(lo.target_modules))):
            raise ValueError("model.repeat_kv is modelled for separate q / k / v projections only (torchtitan: "
                             "fsdp.version 2; Hugging Face: training.lora with q_proj / k_proj / v_proj names); "
                             "Megatron's fused QKV takes grouped K/V as they are (allowed: repeat_kv false)")
        return self

    @model_validator(mode="after")
    def _vit_scope(self):
        vit_section.scenario_scope(self)  # what is not modelled with architecture vit
        return self

    @model_validator(mode="after")
    def _fp8_scope(self):
        if self.training.fp8 is not None and self.fsdp is not None:  # before the precision rule, which FSDP refuses
            raise ValueError(f"training.fp8: {self.training.fp8} with fsdp is not modelled (torchtitan / torchao "
                             "float8 training over FSDP, its dynamic scaling and float8 all-gathers; allowed: fp8 "
                             "with Megatron-LM bf16 training: no fsdp section, training.precision bf16)")
        if self.training.fp8 is not None and self.training.precision != "bf16":
            raise ValueError(f"training.fp8: {self.training.fp8} needs training.precision bf16 (Megatron-LM trains "
                             f"fp8 over bf16; got {self.training.precision})")
        t = self.training
        if t.fp8_param_gather and t.fp8 is None:
            raise ValueError("training.fp8_param_gather needs training.fp8 (Megatron-LM: fp8_param must be used "
                             "together with fp8 mode; allowed: set training.fp8, or omit fp8_param_gather)")
        if t.fp8_param_gather and not self.ddp.use_distributed_optimizer:
            raise ValueError("training.fp8_param_gather needs ddp.use_distributed_optimizer: true (Megatron-LM: "
                             "--fp8-param-gather only supported with the distributed optimizer)")
        if t.fp8_param_gather and self.model.num_experts:
            raise ValueError("training.fp8_param_gather with model.num_experts is not modelled yet (fp8 expert "
                             "weights; allowed: a dense model)")
        if self.training.fp8 is not None and self.zero_optimization.stage == 3:
            raise ValueError("training.fp8 with zero_optimization.stage 3 is not modelled yet (allowed: stage 0-2)")
        p = self.parallelism
        if self.model.kernels == "hf_eager" and (p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1):
            raise ValueError("model.kernels: hf_eager with tensor or context parallelism is not modelled: Hugging Face "
                             "GPT-2's eager modules have no Megatron TP/CP split (allowed: tensor_model_parallel_size "
                             "1 and context_parallel_size 1, or kernels fused)")
        return self

    @model_validator(mode="after")
    def _full_precision_scope(self):
        """What ``training.precision`` fp32 / tf32 needs, and what is not modelled with it."""
        prec = self.training.precision
        if prec not in ("fp32", "tf32"):
            return self
        if self.model.attention_kernel != "unfused":
            raise ValueError(f"training.precision: {prec} needs model.attention_backend: unfused (flash attention has "
                             "fp16 / bf16 kernels only; allowed: unfused)")
        z = self.zero_optimization
        if (self.model.num_experts or z.stage == 3 or self.ddp.use_distributed_optimizer
                or z.offload_optimizer.device != "none" or z.offload_param.device != "none"):
            raise ValueError(f"training.precision: {prec} with experts, ZeRO-3, the distributed optimizer or "
                             "offload is not modelled yet (allowed: DDP, ZeRO-1/2 or FSDP2 data parallelism, TP, PP)")
        return self

    @model_validator(mode="after")
    def _fsdp_precision_scope(self):
        """``training.precision`` against what ``fsdp`` computes in (``sections.fsdp.precision_problem``: FSDP2
        gathering fp32 runs no autocast). After ``_torchtitan_ac_scope``, whose refusals name their own key."""
        if self.fsdp is not None and (why := fsdp_precision_problem(self.fsdp, self.training.precision)):
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _context_parallel_scope(self):
        """Megatron's rules for ``context_parallel_size`` > 1, and what is not modelled with it: every rule a
        setting breaks is told (``errors.refuse_each``)."""
        p, m = self.parallelism, self.model
        cp = p.context_parallel_size
        key = "parallelism.context_parallel_size"
        if cp == 1:
            return self
        cl, z = self.hardware.cluster, self.zero_optimization
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size

        def world() -> str | None:
            if cl is None:
                return f"{key}: {cp} > 1 needs hardware.cluster (e.g. {{preset: dgx-h100, nodes: 1}})"
            w = world_size_of(cl)
            return (f"{key}: tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} must divide the world size {w} "
                    "of hardware.cluster") if w is not None and w % (tp * pp * cp) else None

        refuse_each(
            world,
            lambda: (f"{key}: 2 x {cp} must divide model.seq_length {m.seq_length} (Megatron splits each "
                     "sequence into 2 cp chunks for causal load balance)") if m.seq_length % (2 * cp) else None,
            lambda: (f"parallelism.cp_comm_type: a2a needs cp {cp} to divide the attention heads per TP rank "
                     f"({m.num_attention_heads // tp})")
            if p.cp_comm_type == "a2a" and (m.num_attention_heads // tp) % cp else None,
            lambda: (f"{key}: {cp} > 1 needs training.precision bf16 or fp16 (Megatron-LM; amp_fp32_params: "
                     "with fsdp only, PyTorch context parallelism)")
            if self.training.precision == "amp_fp32_params" and self.fsdp is None else None,
            lambda: (f"{key}: {cp} > 1 with model.attention_backend {m.attention_backend} is not modelled "
                     "(allowed: attention_backend flash with context parallelism)")
            if m.attention_kernel != "flash" else None,
            lambda: (f"{key}: {cp} > 1 with experts is not modelled yet (allowed: dense models; DDP, ZeRO, "
                     "FSDP or the distributed optimizer over dp x cp)") if m.num_experts else None,
            lambda: f"{key}: {cp} > 1 with offload or a DataLoader is not modelled yet"
            if (z.offload_optimizer.device != "none" or z.offload_param.device != "none"
                or self.dataloader is not None) else None,
            lambda: (f"{key}: {cp} > 1 with data-parallel rank classes (run.rank_folding none or a dp_rank "
                     "override) is not modelled yet (allowed: rank_folding classes, pp_rank overrides)")
            if self.run.rank_folding == "none" or any(o.dp_rank is not None for o in self.rank_overrides) else None,
        )
        return self

    @model_validator(mode="after")
    def _batch_consistency(self):
        gbs = self.training.global_batch_size
        per = self.training.micro_batch_size * (self.parallelism.data_parallel_size or 1)
        if gbs is not None and gbs % per:
            raise ValueError(
                f"training.global_batch_size: {gbs} must be a multiple of micro_batch_size x data_parallel_size ({per})"
            )
        if gbs is not None and gbs // per > MAX_GRADIENT_ACCUMULATION:
            raise ValueError(
                f"training.global_batch_size: {gbs} asks for {gbs // per:,} micro-batches per step (micro_batch_size x "
                f"data_parallel_size = {per}); at most {MAX_GRADIENT_ACCUMULATION:,} are simulated"
            )
        passes = self.model.num_layers * (gbs // per if gbs else 1) * self.run.steps
        if passes > MAX_LAYER_PASSES:
            raise ValueError(
                f"num_layers x micro-batches per step x run.steps = {passes:,} layer passes; at most "
                f"{MAX_LAYER_PASSES:,} are simulated in one run (lower run.steps)"
            )
        return self
