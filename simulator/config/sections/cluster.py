"""Cluster, data-parallel (PyTorch DDP, Megatron-LM DDP and distributed optimizer) and NCCL settings.

YAML::

    hardware:
      gpu: h100-sxm-80gb
      cluster:
        preset: dgx-h100           # hardware_models/presets/clusters
        nodes: 1                   # world size = nodes x the preset's gpus_per_node
        network: ib-ndr-rail       # default: the cluster preset's network
        collective_profile: null   # default: the cluster preset's collective profile
        overrides: {}              # cluster preset fields (nvlink_bytes_per_s: "300 GB/s")
        network_overrides: {}      # network preset fields (nic_bytes_per_s: "10 GB/s")
    parallelism:
      data_parallel_size: 8        # default: world size / (tp x pp)
    ddp:
      bucket_cap_mb: 25            # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
      first_bucket_mb: 1           # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB
      overlap_grad_reduce: true    # Megatron-LM --overlap-grad-reduce: buckets reduced during backward
      gradient_as_bucket_view: false
      use_distributed_optimizer: false  # Megatron-LM --use-distributed-optimizer
      overlap_param_gather: false  # Megatron-LM --overlap-param-gather
      bucket_size: null            # Megatron-LM --ddp-bucket-size (elements)
    nccl: {algo: null, proto: null, nvls_enable: true, nchannels: null,   # NCCL_ALGO / NCCL_PROTO ...
           interference: true}     # compute/communication interference (false: each side priced alone)

Sources: PyTorch ``torch/nn/parallel/distributed.py`` (``bucket_cap_mb`` default 25, MiB;
``_DEFAULT_FIRST_BUCKET_BYTES = int(1024 * 1024)`` in ``torch/distributed/constants.py``) and the
DDP notes (https://pytorch.org/docs/stable/notes/ddp.html: buckets are all-reduced as soon as all
their gradients are ready, overlapping backward; under ``no_sync()`` only the last micro-batch
reduces); Megatron-LM ``--overlap-grad-reduce``; NCCL environment variables (NCCL docs, "Environment
Variables": ``NCCL_ALGO``, ``NCCL_PROTO``, ``NCCL_NVLS_ENABLE``, ``NCCL_MIN/MAX_NCHANNELS``).
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hardware_models.topology import MAX_NODES
from simulator.config.errors import ScenarioWarning


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterConfig(_Model):
    """A cluster of identical nodes (``hardware_models/presets/clusters``) joined by a network."""

    preset: str = Field(description="Cluster node preset: dgx-h100, dgx-h200, dgx-a100, h100-pcie-8gpu, "
                                    "4x-a100-pcie-nvlink, 4x-a100-pcie.")
    nodes: PositiveInt = Field(default=1, le=MAX_NODES,
                               description=f"Nodes; world size = nodes x the preset's gpus_per_node (at most {MAX_NODES:,}).")
    network: str | None = Field(default=None, description="Network preset (ib-ndr-rail, ib-hdr, roce-400g); "
                                                          "default: the cluster preset's. Used when nodes > 1.")
    collective_profile: str | None = Field(default=None, description="Collective profile preset "
                                           "(presets/collectives); default: the cluster preset's.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Cluster preset field -> value.")
    network_overrides: dict[str, Any] = Field(default_factory=dict, description="Network preset field -> value "
                                              "(nic_bytes_per_s: \"10 GB/s\" throttles every NIC rail).")

    @model_validator(mode="after")
    def _network_needs_nodes(self):
        if self.nodes == 1 and (self.network is not None or self.network_overrides):
            warnings.warn("hardware.cluster.network: one node has no scale-out network, so the network and its "
                          "overrides have no effect (set hardware.cluster.nodes > 1)", ScenarioWarning, stacklevel=2)
        return self


class DdpConfig(_Model):
    """PyTorch DistributedDataParallel gradient bucketing (used when data_parallel_size > 1, ZeRO stage 0)."""

    bucket_cap_mb: float = Field(default=25.0, gt=0, description="Bucket size cap, MiB (PyTorch DDP default 25).")
    first_bucket_mb: float = Field(default=1.0, gt=0, description="First bucket cap, MiB (PyTorch "
                                   "_DEFAULT_FIRST_BUCKET_BYTES = 1 MiB).")
    overlap_grad_reduce: bool = Field(default=True, description="Reduce each bucket as soon as backward completes "
                                      "it (PyTorch DDP; Megatron-LM --overlap-grad-reduce); false: all buckets "
                                      "after backward.")
    gradient_as_bucket_view: bool = Field(default=False, description="PyTorch DDP gradient_as_bucket_view: "
                                          "false keeps a separate bucket buffer (one more fp32 copy of the "
                                          "gradients on the GPU).")
    use_distributed_optimizer: bool = Field(default=False, description="Megatron-LM --use-distributed-optimizer: "
                                            "fp32 main grads reduce-scattered per bucket, optimizer state and fp32 "
                                            "master weights 1/dp, bf16 params all-gathered after the step "
                                            "(training.precision bf16 or fp16).")
    overlap_param_gather: bool = Field(default=False, description="Megatron-LM --overlap-param-gather (with "
                                       "use_distributed_optimizer): the parameter all-gathers overlap the next "
                                       "forward, each block waiting for its bucket.")
    accumulate_allreduce_grads_in_fp32: bool | None = Field(
        default=None, description="Megatron-LM --accumulate-allreduce-grads-in-fp32 (default off; Megatron forces "
        "it on with --bf16): with training.precision fp16 off keeps the contiguous grad buffer in fp16 (its "
        "accumulation and data-parallel all-reduce / reduce-scatter 2 B per parameter, then a cast into fp32 main "
        "grads before the step), on makes it fp32 (4 B). Only with Megatron's optimizer (precision bf16 / fp16, no "
        "zero_optimization stage, no fsdp); false with bf16 is refused unless ddp.grad_reduce_in_bf16.")
    grad_reduce_in_bf16: bool = Field(default=False, description="Megatron-LM --grad-reduce-in-bf16 (DDP config "
                                      "grad_reduce_in_fp32: false): with training.precision bf16 the contiguous grad "
                                      "buffer, its accumulation and its data-parallel all-reduce / reduce-scatter are "
                                      "bf16 (2 B per parameter), cast into fp32 main grads before the step. Only with "
                                      "Megatron's optimizer (no zero_optimization stage, fsdp or training.lora); "
                                      "ignored, with a warning, outside bf16 (as Megatron-LM does).")
    bucket_size: int | None = Field(default=None, gt=0, le=10**12, description="Megatron-LM --ddp-bucket-size, "
                                    "elements, with use_distributed_optimizer (default: max(4e7, 1e6 x dp) with "
                                    "overlap_grad_reduce, else one bucket).")


class NcclSectionConfig(_Model):
    """NCCL overrides (``NCCL_ALGO``, ``NCCL_PROTO``, ``NCCL_NVLS_ENABLE``, channels); null = NCCL's tuner."""

    algo: str | None = Field(default=None, description="NCCL_ALGO: Ring, Tree, NVLS, NVLSTree.")
    proto: str | None = Field(default=None, description="NCCL_PROTO: LL, LL128, Simple.")
    nvls_enable: bool = Field(default=True, description="NCCL_NVLS_ENABLE.")
    nchannels: PositiveInt | None = Field(default=None, description="NCCL channel count (caps the bus bandwidth; "
                                          "also the SMs a collective holds from compute).")
    interference: bool = Field(default=True, description="Model compute/communication interference: collectives "
                               "hold SMs (one per channel) and HBM bandwidth from the kernels beside them and run "
                               "slower while compute overlaps them (factors in the collective profile); false "
                               "prices each side alone, for comparison.")
