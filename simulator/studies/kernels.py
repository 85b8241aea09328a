"""One kernel's price on a GPU preset (``simulate kernel``): the cost model alone, outside a graph."""

from __future__ import annotations

from simulator.graph.dtypes import DTYPE_BYTES


def price_kernel(gpu_name: str, op_kind: str, dims: list[int], dtype: str = "bf16",
                 profile_name: str | None = None) -> dict:
    """Price one kernel. Returns ``time_s``, ``flops``, ``bytes``, ``efficiency`` (achieved FLOP/s
    over the dtype's peak for GEMM/attention, achieved bytes/s over the HBM peak otherwise),
    ``bound`` (``compute``, ``memory`` or ``fixed``), ``gpu``, ``profile``.

    Raises:
        PresetError: unknown GPU or profile preset.
        ScenarioError: the GPU has no peak for ``dtype`` (fp8 on an A100, bf16 on a V100).
    """
    from hardware_models import presets
    from simulator.config.loader import default_profile_for
    from simulator.cost.roofline import RooflineCostModel
    from simulator.graph.ops import CostClass, Op, OpKind

    gpu = presets.get("gpus", gpu_name)
    if dtype not in gpu.peak_flops_per_s:
        from simulator.config.errors import ScenarioError

        raise ScenarioError(f"--dtype {dtype}: {gpu.name} has no {dtype} rate (allowed: "
                            f"{', '.join(sorted(gpu.peak_flops_per_s))})")
    prof = (presets.get("profiles", profile_name) if profile_name
            else default_profile_for(gpu, gpu_name, presets.get("links", "pcie-gen5-x16")))
    b = DTYPE_BYTES[dtype]
    if op_kind == "gemm":
        m, n, k = dims
        cc, shape, flops = CostClass.GEMM, (m, n, k), 2.0 * m * n * k
        reads, writes = b * (m * k + k * n), b * m * n
    elif op_kind == "attention":
        bh, s, d = dims
        cc, shape, flops = CostClass.ATTENTION_FWD, (bh, s, s, d), 4.0 * bh * s * s * d / 2  # causal
        reads, writes = b * 3 * bh * s * d, b * bh * s * d
    else:
        cc, shape, flops = CostClass.ELEMENTWISE, (), 0.0
        reads = writes = dims[0] / 2
    op = Op(0, op_kind, OpKind.COMPUTE, "compute", cost_class=cc, flops=flops, bytes_read=float(reads),
            bytes_written=float(writes), shape=shape, dtype=dtype)
    model = RooflineCostModel(gpu, prof)
    compute, memory, fixed = model.split_s(op)
    t = model.duration_s(op)
    bound = "fixed" if fixed >= max(compute, memory) else ("compute" if compute >= memory else "memory")
    if flops:
        eff = flops / t / gpu.peak(dtype)
    else:
        eff = (reads + writes) / t / gpu.hbm_bandwidth_bytes_per_s
    out = {"gpu": gpu.name, "profile": prof.name, "kernel": op_kind, "dtype": dtype, "time_s": t,
            "flops": flops, "bytes": float(reads + writes), "efficiency": eff, "bound": bound}
    if prof.gpu != gpu_name:  # a profile measured on another GPU: its efficiencies need not carry over
        out["warning"] = (f"profile {prof.name!r} belongs to GPU preset {prof.gpu!r}, not {gpu_name!r}: its measured "
                          "efficiencies are applied to this GPU's peaks")
    return out
