"""PyTorch FullyShardedDataParallel settings (``fsdp:``), named as in ``torch.distributed.fsdp`` and
llm-foundry's ``fsdp_config``.

YAML::

    fsdp:
      sharding_strategy: FULL_SHARD    # FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
      backward_prefetch: BACKWARD_PRE  # BACKWARD_PRE | BACKWARD_POST | null
      forward_prefetch: false
      limit_all_gathers: true
      reshard_after_forward: null      # default: true for FULL_SHARD / HYBRID_SHARD, false otherwise
      cpu_offload: false               # true: CPUOffload(offload_params=True); or {offload_params: true,
                                       #   cpu_adam_impl: torch_single | torch_foreach | torch_fused}
      mixed_precision: DEFAULT         # DEFAULT | PURE | FULL, or {param_dtype: bf16, reduce_dtype: fp32}
      version: 1                       # 1: FullyShardedDataParallel (FlatParameter); 2: fully_shard (FSDP2)
      offload_policy: null             # version 2: {kind: cpu, pin_memory: true} = CPUOffloadPolicy(pin_memory=True)

``version: 2`` is FSDP2 (``torch.distributed.fsdp.fully_shard``, torchtitan's): per-parameter dim-0 sharding, the
all-gather copy-in / copy-out and reduce-scatter copy-in kernels (``simulator/graph/builders/fsdp2.py``). It takes
no ``sharding_strategy``, ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers`` or ``cpu_offload``
(FSDP1's; refused in one line; its CPU offload is ``offload_policy``, ``fully_shard(offload_policy=CPUOffloadPolicy(
pin_memory=...))``, also written ``CPUOffloadPolicy``, ``CPUOffloadPolicy(pin_memory=False)`` or torchtitan's
``training.enable_cpu_offload: true``; ``simulator/policies/offload_fsdp.py``): the mesh (``parallelism.data_parallel_shard_degree`` /
``data_parallel_replicate_degree``, torchtitan's names) makes it FSDP or HSDP, ``reshard_after_forward`` true
(default) / false / an int (reshard to groups of that many consecutive shard ranks) says what it keeps after
forward, and ``mixed_precision`` is its ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.

One FSDP unit per transformer block (``transformer_auto_wrap_policy``) plus the root (embeddings,
final norm, LM head). FSDP shards the fp32 parameters, the optimizer updates the fp32 shard, and
``mixed_precision`` sets the dtype of the gathered parameters (``param_dtype``) and of the gradient
reduction (``reduce_dtype``). Version 1 runs the model under ``torch.autocast`` (``training.precision:
amp_fp32_params``, llm-foundry ``precision: amp_bf16``), so its GEMMs are bf16 whatever it gathers.
Version 2 runs as torchtitan does, without autocast: the gathered dtype is the compute dtype, bf16
under ``amp_fp32_params`` (bf16 activations, residual stream and norms, no casts before the GEMMs:
``TransformerSpec.fsdp2_bf16_params``), fp32 (torchtitan's ``mixed_precision_param = "float32"``) under
``training.precision: fp32`` (fp32 GEMMs) or ``tf32`` (``allow_tf32``); the other pairings are
refused in one line (``precision_problem``). ``mixed_precision`` strings are
composer's ``get_mixed_precision`` (llm-foundry): ``DEFAULT`` = param bf16, reduce fp32; ``PURE`` =
both bf16; ``FULL`` = both fp32. Defaults are PyTorch's (``backward_prefetch=BACKWARD_PRE``,
``forward_prefetch=False``, ``limit_all_gathers=True``: ``FullyShardedDataParallel.__init__``,
torch 2.x) with llm-foundry's ``mixed_precision: DEFAULT``. See
``simulator/graph/builders/sharding.py`` for the schedule.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from simulator.config.limits import MODEL_CONFIG

#: ``fsdp.version`` by API name
FSDP_API_VERSIONS = {"FullyShardedDataParallel": 1, "fully_shard": 2}
#: FSDP1's ``cpu_offload`` under version 2: FSDP2's counterpart, ``fully_shard(offload_policy=CPUOffloadPolicy(
#: pin_memory=True))`` (pytorch/pytorch@05f814fe torch/distributed/fsdp/_fully_shard/_fsdp_api.py ``CPUOffloadPolicy``)
FSDP2_OFFLOAD_NOTE = ("its counterpart is fsdp.offload_policy: {kind: cpu, pin_memory: true} (fully_shard's "
                      "offload_policy=CPUOffloadPolicy(pin_memory=True))")
#: FSDP1 keys that ``fully_shard`` has no counterpart for, and what FSDP2 does instead (pytorch/pytorch
#: torch/distributed/fsdp/_fully_shard/_fully_shard.py ``fully_shard(module, mesh, reshard_after_forward,
#: shard_placement_fn, mp_policy, offload_policy, ignored_params)``; _fsdp_param_group.py: implicit forward prefetch
#: through the all-gather streams, explicit backward prefetch of the previous unit)
FSDP1_ONLY_KEYS = {
    "sharding_strategy": "its mesh makes it FSDP or HSDP (parallelism.data_parallel_shard_degree / "
                         "data_parallel_replicate_degree) and reshard_after_forward false is SHARD_GRAD_OP",
    "backward_prefetch": "it prefetches the previous unit in backward itself",
    "forward_prefetch": "its forward prefetch is the all-gather streams' own",
    "limit_all_gathers": "it limits all-gathers by stream order, not a CPU rate limiter",
    "cpu_offload": FSDP2_OFFLOAD_NOTE,
}
#: composer ``get_mixed_precision`` presets: name -> (param_dtype, reduce_dtype)
MIXED_PRECISION_PRESETS = {"DEFAULT": ("bf16", "fp32"), "PURE": ("bf16", "bf16"), "FULL": ("fp32", "fp32")}


class _Model(BaseModel):
    model_config = MODEL_CONFIG


class FsdpMixedPrecision(_Model):
    """``torch.distributed.fsdp.MixedPrecision`` (the parts modelled)."""

    param_dtype: Literal["bf16", "fp32"] = Field(default="bf16", description="Dtype of the gathered parameters. "
                                                 "version 1 (under autocast): the GEMMs run bf16 either way; version "
                                                 "2 (no autocast): the compute dtype, fp32 with training.precision "
                                                 "fp32 or tf32.")
    reduce_dtype: Literal["bf16", "fp32"] = Field(default="fp32", description="Dtype of the gradient reduce-scatter.")


#: torch AdamW implementations on CPU tensors (``hardware_models.host_kernels.IMPLEMENTATIONS``)
FSDP_CPU_ADAM_IMPLS = ("torch_single", "torch_foreach", "torch_fused")
#: ``training.optimizer.impl`` -> the implementation ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)`` runs on CPU
#: parameters (fused CPU AdamW: torch >= 2.4)
OPTIMIZER_IMPL_ON_CPU = {"foreach": "torch_foreach", "fused": "torch_fused", "single": "torch_single"}


class FsdpCpuOffload(_Model):
    """``torch.distributed.fsdp.CPUOffload`` and the torch AdamW that then steps the CPU parameters."""

    offload_params: bool = Field(default=True, description="Parameters (fp32 flat shards) and gradients in host "
                                 "memory, AdamW on the CPU (false: no offload, as CPUOffload(offload_params=False)).")
    cpu_adam_impl: Literal["torch_single", "torch_foreach", "torch_fused"] | None = Field(
        default=None, description="torch AdamW on the CPU shards: torch_single (the for-loop torch picks for CPU "
        "tensors when neither foreach nor fused is given), torch_foreach, torch_fused; default: from "
        "training.optimizer.impl (foreach -> torch_foreach, fused -> torch_fused, single -> torch_single).")


#: ``fsdp.offload_policy`` written as PyTorch's constructor: ``CPUOffloadPolicy``, ``CPUOffloadPolicy()``,
#: ``CPUOffloadPolicy(pin_memory=False)``; ``OffloadPolicy`` / ``OffloadPolicy()`` is the no-offload default
_CPU_POLICY = re.compile(r"^CPUOffloadPolicy(\(\s*(pin_memory\s*=\s*(True|False|true|false))?\s*\))?$")
_NO_POLICY = ("OffloadPolicy", "OffloadPolicy()", "none")


class FsdpOffloadPolicy(_Model):
    """FSDP2's ``CPUOffloadPolicy`` (pytorch/pytorch@05f814fe torch/distributed/fsdp/_fully_shard/_fsdp_api.py):
    sharded parameters, gradients and optimizer states on the CPU, the optimizer step on the CPU."""

    kind: Literal["cpu"] = Field(default="cpu", description="cpu: CPUOffloadPolicy (the only offload fully_shard "
                                 "has; OffloadPolicy, no offload, is offload_policy: null).")
    pin_memory: bool = Field(default=True, description="CPUOffloadPolicy.pin_memory: the sharded parameters (and "
                             "the gradients copied down) in page-locked memory, copied asynchronously; false: "
                             "pageable, each copy at the pageable rate with the training thread waiting on it.")


class FsdpConfig(_Model):
    """PyTorch FSDP (exclusive with ``zero_optimization.stage`` > 0 and ``ddp.use_distributed_optimizer``)."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = Field(
        default="FULL_SHARD", description="FULL_SHARD (params, grads, optimizer state sharded; params gathered in "
        "forward and again in backward), SHARD_GRAD_OP (params stay gathered from forward to backward), "
        "HYBRID_SHARD (FULL_SHARD inside a node, gradients all-reduced across nodes), NO_SHARD (DDP: whole fp32 "
        "parameters, a param_dtype copy cast per unit, gradients all-reduced in reduce_dtype).")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] | None = Field(
        default="BACKWARD_PRE", description="When the next unit's all-gather is issued in backward (null: on demand).")
    forward_prefetch: bool = Field(default=False, description="Issue the next unit's all-gather at the start of "
                                   "the current unit's forward.")
    limit_all_gathers: bool = Field(default=True, description="Rate limiter: at most two all-gathers in flight "
                                    "(false: the host issues them as fast as it runs ahead).")
    reshard_after_forward: bool | int | None = Field(
        default=None, description="Free the gathered parameters after forward (default: true for FULL_SHARD and "
        "HYBRID_SHARD; version 2: true). version 2 also takes an int: reshard to groups of that many consecutive "
        "shard ranks (a factor of the shard group size; 1 is false, the shard size true), all-gathered over them "
        "in backward.")
    cpu_offload: bool | FsdpCpuOffload = Field(default=False, description="CPUOffload(offload_params=True): fp32 "
                                               "parameter and gradient shards in host memory, each unit's shard "
                                               "copied H2D before its all-gather, the reduced gradient shard D2H, "
                                               "AdamW on the CPU; true or {offload_params, cpu_adam_impl}.")
    mixed_precision: Literal["DEFAULT", "PURE", "FULL"] | FsdpMixedPrecision = Field(
        default="DEFAULT", description="DEFAULT | PURE | FULL (composer/llm-foundry) or {param_dtype, reduce_dtype} "
        "(version 2: MixedPrecisionPolicy's).")
    offload_policy: FsdpOffloadPolicy | None = Field(
        default=None, description="version 2 (fully_shard's offload_policy): {kind: cpu, pin_memory: bool} = "
        "CPUOffloadPolicy(pin_memory=...), also written CPUOffloadPolicy or CPUOffloadPolicy(pin_memory=False); "
        "torchtitan's training.enable_cpu_offload: true is CPUOffloadPolicy(). The fp32 sharded parameters live on "
        "the host, each unit's shard is copied H2D before its all-gather, the reduced fp32 gradient shard D2H, and "
        "AdamW (training.optimizer.impl) steps on the CPU; null: no offload (OffloadPolicy).")
    version: Literal[1, 2] = Field(
        default=1, description="1: FullyShardedDataParallel (one FlatParameter per unit, padded to the shard size); "
        "2: FSDP2 fully_shard (torchtitan's; also written fully_shard): per-parameter dim-0 shards, each padded, "
        "with its copy-in / copy-out kernels; takes no FSDP1-only key.")

    @field_validator("version", mode="before")
    @classmethod
    def _version_value(cls, v):
        if isinstance(v, str) and v in FSDP_API_VERSIONS:
            return FSDP_API_VERSIONS[v]
        if isinstance(v, bool) or v not in (1, 2):
            raise ValueError(f"{v!r} (allowed: 1 (FullyShardedDataParallel), 2 (fully_shard), or those API names)")
        return v

    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _reshard_value(cls, v):
        if v is None or isinstance(v, bool) or (isinstance(v, int) and v >= 1):
            return v
        raise ValueError(f"{v!r} (allowed: true, false, or with version 2 an int >= 1: the group size to reshard to)")

    @model_validator(mode="after")
    def _version_keys(self):
        """FSDP1-only keys under ``version: 2`` and an int ``reshard_after_forward`` under 1: one line each."""
        if self.version == 2:
            given = [k for k in FSDP1_ONLY_KEYS if k in self.model_fields_set]
            if given:
                has = "takes no such key" if given[0] == "cpu_offload" else "has none"
                raise ValueError(f"fsdp.{given[0]} is FSDP1's (FullyShardedDataParallel); fsdp.version 2 "
                                 f"(fully_shard) {has}: {FSDP1_ONLY_KEYS[given[0]]} (allowed: omit it, or "
                                 "version 1)")
        elif self.offload_policy is not None:
            raise ValueError("fsdp.offload_policy is FSDP2's (fully_shard's CPUOffloadPolicy); fsdp.version 1 "
                             "(FullyShardedDataParallel) offloads with fsdp.cpu_offload (allowed: version 2, or "
                             "cpu_offload: true)")
        elif isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"fsdp.reshard_after_forward: {self.reshard_after_forward} (an int: reshard to a smaller "
                             "group) is FSDP2's (allowed with version 1: true, false; or version 2)")
        return self

    @field_validator("cpu_offload", mode="before")
    @classmethod
    def _offload_value(cls, v):
        if isinstance(v, dict):
            impl = v.get("cpu_adam_impl")
            if impl is not None and impl not in FSDP_CPU_ADAM_IMPLS:  # one line instead of pydantic's union report
                raise ValueError(f"cpu_adam_impl {impl!r} (allowed: {', '.join(FSDP_CPU_ADAM_IMPLS)}: torch AdamW on "
                                 "the CPU shards)")
        elif not isinstance(v, bool):
            raise ValueError(f"{v!r} (allowed: true, false or {{offload_params: bool, cpu_adam_impl: ...}})")
        return v

    @field_validator("offload_policy", mode="before")
    @classmethod
    def _offload_policy_value(cls, v):
        if isinstance(v, dict) and isinstance(v.get("preset"), str):  # ``--set fsdp.offload_policy.pin_memory=...``
            base = cls._offload_policy_value(v["preset"])  # over a string form: the overrides' {preset: name}
            rest = {k: x for k, x in v.items() if k != "preset"}
            if base is None and rest:
                raise ValueError(f"{v['preset']} (no offload) takes no {', '.join(rest)} (allowed: CPUOffloadPolicy, "
                                 "or {kind: cpu, pin_memory: ...})")
            return {**base, **rest} if base is not None else None
        if isinstance(v, str):
            if v.strip() in _NO_POLICY:
                return None
            m = _CPU_POLICY.match(v.strip())
            if m:
                return {"kind": "cpu", "pin_memory": (m.group(3) or "True").lower() == "true"}
        if v is None or isinstance(v, dict):
            return v
        raise ValueError(f"{v!r} (allowed: {{kind: cpu, pin_memory: true | false}}, CPUOffloadPolicy, "
                         "CPUOffloadPolicy(pin_memory=False), or null / OffloadPolicy: no offload)")

    @property
    def offload_params(self) -> bool:
        """Sharded states on the host with the CPU AdamW: FSDP1 ``CPUOffload(offload_params=True)`` or FSDP2
        ``offload_policy`` ``CPUOffloadPolicy``."""
        c = self.cpu_offload
        return (c if isinstance(c, bool) else c.offload_params) or self.offload_policy is not None

    @property
    def offload_key(self) -> str:
        """The key that asked for the offload, for messages: ``fsdp.offload_policy`` (FSDP2) or
        ``fsdp.cpu_offload`` (FSDP1)."""
        return "fsdp.offload_policy" if self.offload_policy is not None else "fsdp.cpu_offload"

    @property
    def offload_pinned(self) -> bool:
        """Whether the offloaded parameter and gradient shards are page-locked: FSDP1 always pins them
        (``FlatParamHandle``), FSDP2 as ``CPUOffloadPolicy.pin_memory`` says."""
        return self.offload_policy.pin_memory if self.offload_policy is not None else True

    def cpu_adam_impl(self, optimizer_impl: str) -> str:
        """The host implementation of the CPU AdamW (``cpu_adam_impl``, else from ``training.optimizer.impl``)."""
        c = self.cpu_offload
        if not isinstance(c, bool) and c.cpu_adam_impl is not None:
            return c.cpu_adam_impl
        return OPTIMIZER_IMPL_ON_CPU[optimizer_impl]

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _mixed_precision_value(cls, v):
        if isinstance(v, str) and v.upper() in MIXED_PRECISION_PRESETS:
            return v.upper()
        if not isinstance(v, dict):  # one line instead of pydantic's union report
            raise ValueError(f"{v!r} (allowed: {', '.join(MIXED_PRECISION_PRESETS)}, or {{param_dtype: bf16 | fp32, "
                             "reduce_dtype: bf16 | fp32})")
        return v

    @field_validator("sharding_strategy", "backward_prefetch", mode="before")
    @classmethod
    def _upper(cls, v):
        return v.upper() if isinstance(v, str) else v

    @property
    def dtypes(self) -> tuple[str, str]:
        """``(param_dtype, reduce_dtype)``."""
        mp = self.mixed_precision
        return MIXED_PRECISION_PRESETS[mp] if isinstance(mp, str) else (mp.param_dtype, mp.reduce_dtype)

    @property
    def mixed_precision_label(self) -> str:
        """``mixed_precision`` as written, with its ``param_dtype``, for messages: ``FULL (param_dtype fp32)``,
        ``param_dtype fp32``."""
        mp = self.mixed_precision
        return f"{mp} (param_dtype {self.dtypes[0]})" if isinstance(mp, str) else f"param_dtype {self.dtypes[0]}"

    @property
    def reshards(self) -> bool:
        """Whether block parameters are gathered again for backward (an int ``reshard_after_forward`` > 1: yes,
        over its smaller group)."""
        r = self.reshard_after_forward
        if r is not None:
            return bool(r) if isinstance(r, bool) else r > 1
        return self.version == 2 or self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")


def fsdp_mesh(f: FsdpConfig, dp: int, cp: int, node_ranks: int, shard_degree: int | None,
              replicate_degree: int | None) -> tuple[int, int]:
    """``(shard_size, replicate_size)`` of FSDP's 2-D mesh in ranks of the gradient-reduce group (dp x cp), the
    shard group being consecutive ranks of that group and the replicas strided by it.

    Args:
        f: The ``fsdp`` section.
        dp: ``parallelism.data_parallel_size``.
        cp: ``parallelism.context_parallel_size`` (torchtitan shards over ``dp_shard x cp``: its ``dp_shard_cp``).
        node_ranks: Ranks of the reduce group on one node (FSDP1 HYBRID_SHARD's default shard group, PyTorch
            ``_init_intra_and_inter_node_groups``).
        shard_degree: ``parallelism.data_parallel_shard_degree`` (-1: the rest), or None.
        replicate_degree: ``parallelism.data_parallel_replicate_degree``, or None.

    A mesh given explicitly (either degree) is torchtitan's ``init_device_mesh(("dp_replicate", "dp_shard"))``;
    else FSDP1 HYBRID_SHARD shards inside a node and replicates across nodes, every other strategy (and
    version 2) shards over all of dp x cp. The degrees were checked against dp by the schema.
    """
    if shard_degree is None and replicate_degree is None:
        if f.version == 1 and f.sharding_strategy == "HYBRID_SHARD":
            shard = min(node_ranks, dp * cp)
            return shard, dp * cp // shard
        return dp * cp, 1
    rep = replicate_degree or 1
    shard = dp // rep if shard_degree in (None, -1) else shard_degree
    return shard * cp, rep


#: ``training.precision`` values that compute in fp32 without autocast (``graph.builders.transformer.FULL_PRECISIONS``)
_NO_AUTOCAST = ("fp32", "tf32")


def precision_problem(f: FsdpConfig, precision: str) -> str | None:
    """Why ``training.precision`` and ``fsdp`` together are not modelled, in one line naming the key, or None.

    The compute dtype is what the framework runs. FSDP1 is llm-foundry's: Composer's ``precision: amp_bf16`` puts
    the fp32 model under ``torch.autocast`` whatever ``mixed_precision`` gathers (``amp_fp32_params``; FULL gathers
    fp32 and autocast casts each weight to bf16 for its GEMM). FSDP2 is torchtitan's, which enters no autocast when
    FSDP is on: ``Trainer.forward_backward_step`` runs the model under ``maybe_enable_amp``, which returns
    ``contextlib.nullcontext()`` when ``parallel_dims.fsdp_enabled`` ("Mixed precision training is handled by
    fully_shard"; with a pipeline it is not entered at all), and ``apply_fsdp`` gathers in
    ``MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param])`` (pytorch/torchtitan@000204a4
    torchtitan/train.py, torchtitan/distributed/utils.py ``maybe_enable_amp``; @81c12433
    torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``). So under FSDP2 the gathered dtype is the compute
    dtype: bf16 is ``amp_fp32_params`` (bf16 GEMMs on the gathered bf16 weights), fp32 is ``fp32`` (GEMMs at the
    fp32 rate: ``torch.backends.cuda.matmul.allow_tf32`` is False by default since PyTorch 1.12, PyTorch docs "CUDA
    semantics", TensorFloat-32 section, and torchtitan's trainer does not set it) or ``tf32`` (``allow_tf32 =
    True``). The other pairings are refused rather than priced at a dtype the run does not compute in.
    """
    if precision in _NO_AUTOCAST:
        if f.version == 1:
            return (f"training.precision: {precision} with fsdp.version 1 (FullyShardedDataParallel) is not modelled "
                    "(allowed: training.precision amp_fp32_params, or fsdp.version 2 with mixed_precision FULL)")
        if f.dtypes[0] != "fp32":
            return (f"training.precision: {precision} with fsdp.mixed_precision {f.mixed_precision_label}: "
                    "fully_shard gathers bf16 parameters, so the model computes in bf16, not fp32 (allowed: "
                    "fsdp.mixed_precision FULL or {param_dtype: fp32, reduce_dtype: ...}, or training.precision "
                    "amp_fp32_params for bf16 compute)")
    elif precision == "amp_fp32_params" and f.version == 2 and f.dtypes[0] == "fp32":
        return (f"fsdp.mixed_precision: {f.mixed_precision_label} with fsdp.version 2 under training.precision "
                "amp_fp32_params (torch.autocast) is not modelled: torchtitan runs fully_shard without autocast "
                "(maybe_enable_amp), so fp32 gathered parameters compute in fp32 (allowed: training.precision fp32, or "
                "tf32 for torch.backends.cuda.matmul.allow_tf32 = True; or param_dtype bf16 for bf16 compute)")
    return None
