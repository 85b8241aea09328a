"""Offload settings, named as in DeepSpeed's config (``zero_optimization``, ``activation_checkpointing``).

YAML::

    zero_optimization:
      stage: 2                       # DeepSpeed ZeRO stage 0-3 (offload needs >= 1; offload_param needs 3)
      overlap_comm: true             # gradient D2H copies overlap backward (DeepSpeed overlap_comm)
      reduce_bucket_size: null       # elements per gradient copy bucket; null = one copy per parameter
      offload_optimizer:
        device: cpu                  # none | cpu | nvme (ZeRO-Infinity, stage 3: simulator/policies/offload_nvme.py)
        nvme_path: /local_nvme       # device nvme: where DeepSpeed's swap files go (needed, not priced)
        buffer_count: 4              # device nvme: pinned swap buffers of one sub-group's fp32 state each
        pipeline_read: false         # device nvme: read the next sub-group's state during this one's step
        pipeline_write: false        # device nvme: write this sub-group's state during the next one's step
        fast_init: false             # device nvme: initialisation only (no step effect)
        pin_memory: true             # host buffers page-locked (pinned PCIe rates) or pageable
        mode: overlap                # serial | overlap | delayed_param_update (see below)
        cpu_adam_impl: torch_foreach # torch_foreach | torch_single | torch_fused | deepspeed_cpu_adam | deepspeed_cpu_adam_2020
                                     # (device nvme: deepspeed_cpu_adam, its default there)
      offload_param:
        device: none                 # none | cpu | nvme: ZeRO-Infinity parameter offload (stage 3)
        pin_memory: true
        prefetch_depth: 1            # layers fetched ahead of use (0 = fetch on demand)
        nvme_path: /local_nvme       # device nvme (needed, not priced)
        buffer_count: 5              # device nvme: pinned swap buffers of buffer_size elements
        buffer_size: 100000000
        max_in_cpu: 1000000000       # device nvme: accepted (DeepSpeed's default); not priced
      sub_group_size: 1000000000     # optimizer nvme: the CPU step and its swaps in groups of this many elements
    activation_checkpointing:
      cpu_checkpointing: false       # checkpointed block inputs go to host memory (needs recompute full)
      host_buffers: fresh            # fresh | prefaulted | reused: first-touch page faults of those host buffers

``offload_optimizer.mode`` (simulator name; DeepSpeed has no single key for it):

* ``serial``: gradients are copied to the host after backward, then the CPU Adam step, then the
  parameter upload; nothing overlaps (DeepSpeed with ``overlap_comm: false``).
* ``overlap``: each gradient (or bucket) is copied as soon as backward produces it, on a copy
  stream, overlapping the rest of backward (DeepSpeed ``overlap_comm: true``).
* ``delayed_param_update``: DPU of the ZeRO-Offload paper (Ren et al., USENIX ATC'21, section
  4.2; DeepSpeed's ``delayed_param_update`` in its CPU-Adam code path): the CPU step of step i
  runs on a worker thread while the GPU runs step i+1 with parameters one step stale.

When ``mode`` is omitted it follows ``overlap_comm`` (``overlap`` if true, else ``serial``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from simulator.config.limits import MAX_NUM_LAYERS, MAX_REDUCE_BUCKET_SIZE, MODEL_CONFIG, integral_count, no_bool

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: Adam's swapped states per sub-group: fp32 parameter, exp_avg, exp_avg_sq and the gradient (DeepSpeed's
#: ``ADAM_OPTIMIZER_STATE_BUFFER_COUNT``, microsoft/DeepSpeed@b1cb0dfc deepspeed/runtime/zero/offload_config.py)
ADAM_SWAP_BUFFERS = 4
#: DeepSpeed's default sub_group_size (deepspeed/runtime/zero/config.py); another value needs device nvme here
SUB_GROUP_SIZE_DEFAULT = 1_000_000_000
OFFLOAD_MODES = ("serial", "overlap", "delayed_param_update")
CPU_ADAM_IMPLS = ("torch_foreach", "torch_single", "deepspeed_cpu_adam")


class _Model(BaseModel):
    model_config = MODEL_CONFIG


def _check_device(v):
    if v is None:
        return "none"
    if isinstance(v, str) and v.lower() not in OFFLOAD_DEVICES:
        raise ValueError(f"unknown offload device {v!r}; allowed: {', '.join(OFFLOAD_DEVICES)}")
    return v.lower() if isinstance(v, str) else v


class OffloadOptimizerConfig(_Model):
    """ZeRO-Offload: fp32 master weights and Adam state on the host, the Adam step on the CPU."""

    device: Literal["none", "cpu", "nvme"] = Field(default="none", description="none | cpu | nvme (DeepSpeed "
                                                   "offload_optimizer.device; nvme: ZeRO-Infinity, stage 3).")
    pin_memory: bool = Field(default=False, description="Host buffers page-locked (DeepSpeed offload_optimizer.pin_memory).")
    nvme_path: str | None = Field(default=None, max_length=4096, description="device nvme: folder of the swap files "
                                  "(needed, as DeepSpeed needs it; not priced: the drives are hardware.nvme).")
    buffer_count: int = Field(default=4, ge=1, le=1024, description="device nvme: pinned swap buffers, each of one "
                              "sub-group's fp32 elements (DeepSpeed default 4: Adam's 4 states).")
    pipeline_read: bool = Field(default=False, description="device nvme: read the next sub-group's state while this "
                                "one steps (DeepSpeed's PipelinedOptimizerSwapper).")
    pipeline_write: bool = Field(default=False, description="device nvme: write a sub-group's state while the next "
                                 "one steps.")
    fast_init: bool = Field(default=False, description="device nvme: initialisation only; no step effect.")
    mode: Literal["serial", "overlap", "delayed_param_update"] | None = Field(
        default=None, description="serial | overlap | delayed_param_update (default: from overlap_comm)."
    )
    cpu_adam_impl: Literal["torch_foreach", "torch_single", "torch_fused", "deepspeed_cpu_adam",
                           "deepspeed_cpu_adam_2020"] = Field(
        default="torch_foreach",
        description="torch.optim.AdamW(foreach=True) | foreach=False | fused=True | DeepSpeedCPUAdam (fused, vectorised) | "
        "DeepSpeedCPUAdam as released with ZeRO-Offload (DeepSpeed 0.3, 2020: the fp16 parameters are converted in a "
        "second pass and copied to the GPU tile by tile inside the step; with its stage2.py gradient path: fp32 gradient copies "
        "the training thread waits for, the unscale on the CPU; modes serial and overlap, one GPU).",
    )

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v):
        return _check_device(v)

    @model_validator(mode="before")
    @classmethod
    def _nvme_adam(cls, data):
        """Device nvme without ``cpu_adam_impl``: DeepSpeedCPUAdam, what DeepSpeed's NVMe swapper steps with (so a
        pasted DeepSpeed ``offload_optimizer`` block, which has no such key, runs as DeepSpeed does)."""
        if (isinstance(data, dict) and isinstance(data.get("device"), str) and data["device"].lower() == "nvme"
                and "cpu_adam_impl" not in data):
            data = {**data, "cpu_adam_impl": "deepspeed_cpu_adam"}
        return data


class OffloadParamConfig(_Model):
    """ZeRO-Infinity parameter offload to host memory, fetched layer by layer ahead of use."""

    device: Literal["none", "cpu", "nvme"] = Field(default="none", description="none | cpu | nvme (DeepSpeed "
                                                   "offload_param.device).")
    pin_memory: bool = Field(default=False, description="Host copy of the parameters page-locked.")
    prefetch_depth: int = Field(default=1, le=MAX_NUM_LAYERS, description="Layers fetched ahead of use (>= 0; 0 = on demand).")
    nvme_path: str | None = Field(default=None, max_length=4096, description="device nvme: folder of the swap files "
                                  "(needed; not priced).")
    buffer_count: int = Field(default=5, ge=1, le=1_000_000, description="device nvme: pinned swap buffers "
                              "(DeepSpeed default 5).")
    buffer_size: int = Field(default=100_000_000, gt=0, le=MAX_REDUCE_BUCKET_SIZE, description="device nvme: "
                             "elements per swap buffer, model dtype (DeepSpeed default 1e8; every parameter "
                             "partition must be smaller).")
    max_in_cpu: int = Field(default=1_000_000_000, ge=0, le=MAX_REDUCE_BUCKET_SIZE, description="device nvme: "
                            "accepted, not priced (DeepSpeed default 1e9).")
    _counts = field_validator("buffer_size", "max_in_cpu", mode="before")(integral_count)

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v):
        return _check_device(v)

    @field_validator("prefetch_depth")
    @classmethod
    def _depth(cls, v: int) -> int:
        if v < 0:
            raise ValueError("prefetch_depth must be >= 0 (layers fetched ahead of use)")
        return v


class ZeroOptimizationConfig(_Model):
    """DeepSpeed ``zero_optimization`` (the parts this simulator models)."""

    stage: Literal[0, 1, 2, 3] = Field(default=0, description="ZeRO stage 0-3.")
    _no_bool = field_validator("stage", mode="before")(no_bool)
    overlap_comm: bool | None = Field(default=None, description="Overlap gradient copies (offload) or "
                                      "reductions (data parallel) with backward; default: true for stage 3, else "
                                      "false (DeepSpeed's default).")
    reduce_bucket_size: int | None = Field(
        default=None, gt=0, le=MAX_REDUCE_BUCKET_SIZE,
        description="Elements per gradient bucket: offload copies (null = one copy per parameter); "
        "data-parallel reduce-scatter with stage 1/2 (null = DeepSpeed's default 5e8)."
    )
    contiguous_gradients: bool = Field(
        default=True, description="Stage 1/2: gradients copied into DeepSpeed's IPG buffers of reduce_bucket_size "
        "elements (model dtype; two with overlap_comm) as they are produced (DeepSpeed's default true); false: no "
        "buffers, each gradient its own tensor.")
    allgather_bucket_size: int = Field(
        default=500_000_000, gt=0, le=MAX_REDUCE_BUCKET_SIZE, description="DeepSpeed's elements per parameter all-gather after "
        "the step with data-parallel stage 1/2 (default 5e8): accepted, no effect: current DeepSpeed gathers the "
        "updated partition in one all_gather_into_tensor (deepspeed/runtime/utils.py all_gather_dp_groups); its "
        "chunked fallback (torch.distributed without all_gather_into_tensor) is not modelled.")
    stage3_prefetch_bucket_size: int = Field(
        default=50_000_000, gt=0, le=MAX_REDUCE_BUCKET_SIZE, description="Stage 3 with data parallelism: parameter "
        "elements gathered ahead of use (DeepSpeed default 5e7; block granularity).")
    stage3_param_persistence_threshold: int = Field(
        default=100_000, ge=0, le=MAX_REDUCE_BUCKET_SIZE, description="Stage 3: parameters of at most this many "
        "elements are not partitioned (DeepSpeed default 1e5).")
    stage3_max_live_parameters: int = Field(
        default=1_000_000_000, gt=0, le=MAX_REDUCE_BUCKET_SIZE, description="Stage 3: most parameter elements "
        "gathered at once (DeepSpeed default 1e9).")
    stage3_max_reuse_distance: int = Field(
        default=1_000_000_000, ge=0, le=MAX_REDUCE_BUCKET_SIZE, description="Stage 3: a block's parameters are not "
        "released after its forward when the parameters used before its backward (the later blocks' forward and "
        "backward and the LM head's) number fewer elements than this, so its backward gathers nothing (DeepSpeed "
        "default 1e9; block granularity: simulator/graph/builders/sharding.py zero3_kept_after_forward); 0: every "
        "block gathered again. Not modelled with offload_param (every block fetched again; the run's warnings say so).")
    sub_group_size: int = Field(
        default=SUB_GROUP_SIZE_DEFAULT, gt=0, le=MAX_REDUCE_BUCKET_SIZE, description="With offload_optimizer nvme: the CPU "
        "step and its swaps run in groups of this many elements of the rank's partition (DeepSpeed default 1e9); "
        "allowed only there.")
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()
    _counts = field_validator("sub_group_size", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                              "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                              mode="before")(integral_count)

    def ipg_buffers(self, pipeline_stages: int = 1) -> int:
        """DeepSpeed ZeRO-1/2 IPG gradient buffers of ``reduce_bucket_size`` elements allocated by each backward
        (microsoft/DeepSpeed@cde57d2 ``deepspeed/runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer.backward``:
        one with ``contiguous_gradients``, a second with ``overlap_comm`` in force, ``overlap_in``); 0 for other
        stages, without ``contiguous_gradients``, or with optimizer offload (whose gradient path is modelled by
        ``simulator/policies/offload_optimizer.py`` without them). ``pipeline_stages``: the pipeline-parallel size."""
        if self.stage not in (1, 2) or not self.contiguous_gradients or self.offload_optimizer.device != "none":
            return 0
        return 2 if self.overlap_in(pipeline_stages) else 1

    @property
    def overlap(self) -> bool:
        """``overlap_comm`` as configured (DeepSpeed: true for stage 3 when not given, else false); with a pipeline
        the value in force is ``overlap_in``'s."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def overlap_in(self, pipeline_stages: int) -> bool:
        """``overlap_comm`` in force with ``pipeline_stages`` pipeline-parallel ranks: DeepSpeed's engine turns it off
        for a ``PipelineModule`` ("Pipeline parallelism does not support overlapped communication, will be
        disabled."; deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``_configure_zero_optimizer``,
        stages 1-2), else ``overlap``."""
        return self.overlap and pipeline_stages == 1

    @model_validator(mode="after")
    def _consistent(self):
        oo, op = self.offload_optimizer, self.offload_param
        if oo.device == "cpu" and self.stage == 0:
            raise ValueError("offload_optimizer.device: cpu needs zero_optimization.stage >= 1 (as in DeepSpeed)")
        if "nvme" in (oo.device, op.device):
            self._nvme_scope()
        if op.device != "none" and self.stage != 3:
            raise ValueError(f"offload_param.device: {op.device} needs zero_optimization.stage 3, got stage {self.stage}")
        if op.device != "none" and oo.device == "none":
            raise ValueError(f"offload_param.device: {op.device} needs offload_optimizer.device: cpu or nvme as well")
        if self.sub_group_size != SUB_GROUP_SIZE_DEFAULT and oo.device != "nvme":
            raise ValueError("sub_group_size is modelled with offload_optimizer.device: nvme only "
                             "(its swaps run per sub-group); elsewhere it does not change the step here: remove it (allowed: the default "
                             "1e9)")
        if oo.mode == "serial" and self.overlap_comm:
            raise ValueError("offload_optimizer.mode: serial contradicts overlap_comm: true")
        if oo.device == "cpu" and oo.mode in ("overlap", "delayed_param_update") and self.overlap_comm is False:
            # DeepSpeed without overlap_comm copies each bucket's gradients to the host on the compute stream, in
            # line with backward (stage_1_and_2.py reduce_ipg_grads: ``elif self.cpu_offload: stream =
            # current_stream()``, its copy_grad_stream disabled): no copy overlaps backward, which mode serial
            # models (the copies after backward); modes overlap and DPU copy on a side stream as backward goes
            raise ValueError(f"offload_optimizer.mode: {oo.mode} contradicts overlap_comm: false (without overlap_comm "
                             "DeepSpeed's gradient copies do not overlap backward; allowed: mode serial, or "
                             "overlap_comm true)")
        return self

    def _nvme_scope(self) -> None:
        """What ZeRO-Infinity NVMe offload needs (one line each, as ``ValueError``)."""
        oo, op = self.offload_optimizer, self.offload_param
        for key, part in (("offload_optimizer", oo), ("offload_param", op)):
            if part.device == "nvme" and not part.nvme_path:
                raise ValueError(f"{key}.device: nvme needs {key}.nvme_path (the folder of the swap "
                                 "files, e.g. /local_nvme; DeepSpeed needs it too)")
        if self.stage != 3:
            raise ValueError(f"offload_optimizer.device: nvme needs zero_optimization.stage 3, got stage {self.stage} "
                             "(DeepSpeed swaps to NVMe in ZeRO-3 only; allowed: stage 3, or device cpu)"
                             if oo.device == "nvme" else
                             f"offload_param.device: nvme needs zero_optimization.stage 3, got stage {self.stage}")
        if oo.device == "nvme":
            if oo.cpu_adam_impl != "deepspeed_cpu_adam":
                raise ValueError(f"offload_optimizer.cpu_adam_impl: {oo.cpu_adam_impl} with device nvme: DeepSpeed "
                                 "steps a swapped sub-group with DeepSpeedCPUAdam (allowed: deepspeed_cpu_adam)")
            if oo.mode not in (None, "overlap") or self.overlap_comm is False:
                raise ValueError("offload_optimizer.mode / overlap_comm with device nvme: the ZeRO-3 gradient path "
                                 "overlaps backward (allowed: mode overlap or omitted, overlap_comm true or omitted)")
            need = ADAM_SWAP_BUFFERS * (1 + oo.pipeline_read + oo.pipeline_write)
            if oo.buffer_count < need:
                raise ValueError(f"offload_optimizer.buffer_count: {oo.buffer_count} is too few for "
                                 f"{'pipelined ' if need > ADAM_SWAP_BUFFERS else ''}swapping: {need} needed "
                                 f"({ADAM_SWAP_BUFFERS} per sub-group in flight; DeepSpeed's swapper runs out of swap "
                                 f"buffers otherwise; allowed: >= {need})")

    @property
    def offload_mode(self) -> str:
        """The effective optimizer-offload mode."""
        return self.offload_optimizer.mode or ("overlap" if self.overlap_comm else "serial")


class ActivationCheckpointingConfig(_Model):
    """DeepSpeed ``activation_checkpointing`` (only ``cpu_checkpointing`` is modelled)."""

    cpu_checkpointing: bool = Field(
        default=False, description="Move checkpointed block inputs to host memory (needs recompute_granularity: full) "
        "as DeepSpeed does: a blocking Tensor.to() into pageable memory before each block's forward and back before "
        "its recompute, in line with the compute (simulator/policies/recompute.py)."
    )
    host_buffers: Literal["fresh", "prefaulted", "reused"] = Field(
        default="fresh", description="How the host buffers that receive the checkpoints are allocated each "
        "iteration: fresh (DeepSpeed 0.3: torch new_empty, the blocking D2H copy faults in every 4 KiB page "
        "of buffers totalling 32 MiB or more, which glibc maps afresh), prefaulted (later DeepSpeed: one zero "
        "written per page on the host before the copy, overlapping the GPU's queued work), reused (already "
        "resident: no faults) (simulator/policies/recompute.py)."
    )
