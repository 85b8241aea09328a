"""``simulate collective CLUSTER``: price NCCL collectives on a cluster preset (nccl-tests style).

Wire it into the ``simulate`` parser with ``add_parser(subparsers)``; ``run(args)`` returns the exit
status (0 priced, 2 bad input: one line on stderr).
"""

from __future__ import annotations

import json
import sys


def add_parser(subparsers):
    """Register the ``collective`` verb on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("collective", help="price an NCCL collective on a cluster preset")
    p.add_argument("cluster", help="cluster preset name (hardware_models/presets/clusters)")
    p.add_argument("--op", default="all_reduce",
                   help="all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, reduce, send_recv "
                   "(default all_reduce)")
    p.add_argument("--ranks", type=int, default=None, help="group size (default: one node's GPUs)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: all GPUs of a node)")
    p.add_argument("--bytes", default="1MiB,64MiB,1GiB", help="comma-separated sizes (default 1MiB,64MiB,1GiB)")
    p.add_argument("--network", default=None, help="network preset (default: the cluster's)")
    p.add_argument("--profile", default=None, help="collective profile preset (default: the cluster's)")
    p.add_argument("--algo", default=None, help="NCCL_ALGO: Ring, Tree, NVLS, NVLSTree")
    p.add_argument("--proto", default=None, help="NCCL_PROTO: LL, LL128, Simple")
    p.add_argument("--nvls-enable", type=int, choices=(0, 1), default=1, help="NCCL_NVLS_ENABLE (default 1)")
    p.add_argument("--nchannels", type=int, default=None, help="NCCL channel count (caps the bus bandwidth)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a cluster field (network.KEY for the network), e.g. nvlink_bytes_per_s='300 GB/s'")
    p.add_argument("--json", action="store_true", help="print a JSON list of results")
    p.set_defaults(fn=run)
    return p


def _overrides(items: list[str]) -> tuple[dict, dict]:
    from hardware_models.collectives import CollectiveError

    cl, net = {}, {}
    for it in items:
        if "=" not in it:
            raise CollectiveError(f"--set {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        try:
            val = json.loads(v)
        except ValueError:
            val = v
        (net if k.startswith("network.") else cl)[k.removeprefix("network.")] = val
    return cl, net


def price(args) -> list:
    """Results of ``args`` (list of ``CollectiveResult``). Raises: PresetError, UnitError."""
    from hardware_models.collectives import (CollectiveError, CollectiveModel, NcclConfig,
                                             load_collective_profile, standard_group)
    from hardware_models.topology import MAX_NODES, build_topology, load_cluster, load_network, max_nodes_text
    from hardware_models.units import parse_quantity

    cl_over, net_over = _overrides(args.set)
    spec = load_cluster(args.cluster, cl_over)
    g = spec.gpus_per_node
    ranks = args.ranks if args.ranks is not None else g
    if ranks < 2:
        raise CollectiveError(f"--ranks must be >= 2 (a collective over one rank moves nothing), got {ranks}")
    rpn = args.ranks_per_node if args.ranks_per_node is not None else min(ranks, g)
    if rpn < 1 or rpn > g:
        raise CollectiveError(f"--ranks-per-node must be in 1..{g} for {args.cluster}, got {rpn}")
    if ranks < 1 or ranks % rpn:
        raise CollectiveError(f"--ranks {ranks} must be a positive multiple of --ranks-per-node {rpn}")
    nodes = ranks // rpn
    if nodes > MAX_NODES:  # the bound build_topology enforces, said in the flags the user gave
        raise CollectiveError(f"--ranks {ranks} ({nodes:,} nodes of {rpn} rank{'s' * (rpn > 1)}) is above "
                              f"{max_nodes_text(spec)}")
    if nodes == 1 and (net_over or args.network):  # no scale-out network on one node: still check what was typed
        if args.network or spec.network:
            load_network(args.network or spec.network, net_over or None)
        print(f"note: one node ({ranks} ranks) crosses no network: the network settings have no effect",
              file=sys.stderr)
    topo = build_topology(spec, nodes=nodes, network=args.network, network_overrides=net_over or None)
    model = CollectiveModel(topo, load_collective_profile(args.profile or spec.collective_profile))
    group = standard_group(topo, ranks, rpn)
    if args.op == "send_recv":
        if ranks != 2:
            raise CollectiveError(f"--ranks {ranks}: send_recv is point to point between 2 ranks (allowed: --ranks 2; "
                                  "--ranks-per-node 1 puts the pair on two nodes)")
    nccl = NcclConfig(algo=args.algo, proto=args.proto, nvls_enable=bool(args.nvls_enable), nchannels=args.nchannels)
    sizes = []
    for tok in str(args.bytes).split(","):
        try:
            t = tok.strip()
            sizes.append(int(t) if t.isdigit() else int(parse_quantity(t, "bytes")))  # a plain count is bytes
        except Exception:
            raise CollectiveError(f"--bytes: {tok.strip()!r} is not a size (e.g. 8, 1MiB, 64MiB, 1GiB)") from None
    return [model.price(args.op, group, s, nccl) for s in sizes]


def format_table(results) -> str:
    """nccl-tests-like table (us, GB/s)."""
    lines = [f"{'bytes':>12}  {'op':>14}  {'ranks':>5}  {'algo':>8}  {'proto':>6}  {'time us':>10}  "
             f"{'algbw GB/s':>10}  {'busbw GB/s':>10}"]
    for r in results:
        lines.append(f"{r.nbytes:>12d}  {r.op:>14}  {r.ranks:>5d}  {r.algorithm:>8}  {r.protocol:>6}  "
                     f"{r.time_s * 1e6:>10.1f}  {r.algbw_bytes_per_s / 1e9:>10.1f}  {r.busbw_bytes_per_s / 1e9:>10.1f}")
    if results:
        lines.append(f"host dispatch per eager call: {results[0].host_dispatch_s * 1e6:.1f} us (not in time)")
    return "\n".join(lines)


def run(args) -> int:
    """Run the verb. Returns the exit status."""
    from hardware_models.presets import PresetError
    from hardware_models.units import UnitError

    try:
        results = price(args)
    except (PresetError, UnitError, ValueError) as exc:
        from simulator.cli import error_exit
        from simulator.config.errors import error_text

        return error_exit(error_text(exc), args.json)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(format_table(results))
    return 0
