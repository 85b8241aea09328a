"""``simulate kernel GPU --gemm M,N,K | --attention BH,S,D | --elementwise BYTES``: one kernel's price.

The cost model's time for one kernel on a GPU preset with its default profile (the shipped fitted
one, else the generic one; ``--profile`` picks another preset), and what bounds it. It is how a
user asks "what does this GEMM cost on that GPU", and how the cost model is checked against kernel
measurements.
"""

from __future__ import annotations

import json
import sys

from simulator.graph.dtypes import DTYPE_BYTES
from simulator.studies.kernels import price_kernel


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
    if "warning" in r:
        print(f"warning: {r['warning']}", file=sys.stderr)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['kernel']} on {r['gpu']} ({r['profile']}, {r['dtype']}): {r['time_s'] * 1e6:.2f} us, "
              f"{r['flops'] / 1e9:.3f} GFLOP, {r['bytes'] / 1e6:.3f} MB, efficiency {r['efficiency'] * 100:.1f} % "
              f"of peak, {r['bound']}-bound", file=sys.stdout)
    return 0
