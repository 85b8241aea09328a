"""``simulate kernel GPU --gemm M,N,K | --attention BH,S,D | --elementwise BYTES``: one kernel's price.

The cost model's time for one kernel on a GPU preset with its default profile (the shipped fitted
one, else the generic one; ``--profile`` picks another preset), and what bounds it. It is how a
user asks "what does this GEMM cost on that GPU", and how the cost model is checked against kernel
measurements.
"""

from __future__ import annotations

import json
import sys

#: Bytes per element of the operand dtypes.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def add_parser(subparsers):
    """Register ``kernel``."""
    p = subparsers.add_parser("kernel", help="the cost model's price of one kernel on a GPU preset")
    p.add_argument("gpu", help="GPU preset name (simulate presets --family gpus)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--gemm", metavar="M,N,K", help="a GEMM [M,K] x [K,N]")
    what.add_argument("--attention", metavar="BH,S,D", help="causal flash attention forward: batch x heads, seq, head dim")
    what.add_argument("--elementwise", metavar="BYTES", help="a memory-bound kernel moving BYTES (read + written)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="operand dtype (default bf16)")
    p.add_argument("--profile", help="efficiency profile preset (default: the GPU's shipped one, else generic)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_kernel)


def _ints(text: str, n: int, flag: str) -> list[int]:
    from simulator.config.errors import ScenarioError

    parts = text.split(",")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        vals = []
    if len(vals) != n or any(v < 1 or v > 10**7 for v in vals):
        raise ScenarioError(f"{flag} {text!r}: expected {n} comma-separated integers in 1..10,000,000")
    return vals


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
    return {"gpu": gpu.name, "profile": prof.name, "kernel": op_kind, "dtype": dtype, "time_s": t,
            "flops": flops, "bytes": float(reads + writes), "efficiency": eff, "bound": bound}


def cmd_kernel(args) -> int:
    if args.gemm:
        kind, dims = "gemm", _ints(args.gemm, 3, "--gemm")
    elif args.attention:
        kind, dims = "attention", _ints(args.attention, 3, "--attention")
    else:
        from hardware_models.units import UnitError, parse_quantity
        from simulator.config.errors import ScenarioError

        try:
            nbytes = parse_quantity(args.elementwise if not args.elementwise.isdigit() else int(args.elementwise),
                                    "bytes")
        except UnitError as exc:
            raise ScenarioError(f"--elementwise {args.elementwise!r}: {exc}") from None
        if not 1 <= nbytes <= 1e15:
            raise ScenarioError(f"--elementwise {args.elementwise!r}: expected 1 B .. 1 PB")
        kind, dims = "elementwise", [int(nbytes)]
    r = price_kernel(args.gpu, kind, dims, args.dtype, args.profile)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['kernel']} on {r['gpu']} ({r['profile']}, {r['dtype']}): {r['time_s'] * 1e6:.2f} us, "
              f"{r['flops'] / 1e9:.3f} GFLOP, {r['bytes'] / 1e6:.3f} MB, efficiency {r['efficiency'] * 100:.1f} % "
              f"of peak, {r['bound']}-bound", file=sys.stdout)
    return 0
