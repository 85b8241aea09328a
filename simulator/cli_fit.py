"""``simulate fit SCENARIO (--largest | --smallest) KEY=V1,V2,...``: the largest (or smallest) value of one key
that fits in memory, e.g. the largest micro-batch or the smallest number of nodes (``studies.whatif``)."""

from __future__ import annotations

import json


def add_parser(subparsers):
    """Register ``fit``."""
    p = subparsers.add_parser("fit", help="the largest micro-batch (or any key) that fits, or the smallest world")
    p.add_argument("scenario", help="scenario YAML")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--largest", metavar="KEY=V1,V2,...", help="e.g. training.micro_batch_size=1,2,4,8,16")
    g.add_argument("--smallest", metavar="KEY=V1,V2,...", help="e.g. hardware.cluster.nodes=1,2,4,8")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field on every point "
                   "(repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_fit)


def cmd_fit(args) -> int:
    from simulator.config.errors import ScenarioError
    from simulator.config.loader import load_scenario
    from simulator.studies.search import check_values
    from simulator.studies.sweep import parse_factor
    from simulator.studies.whatif import fitting_values

    which = "largest" if args.largest else "smallest"
    try:
        key, values = parse_factor(args.largest or args.smallest)
    except ScenarioError as exc:
        raise ScenarioError(str(exc).replace("--factor", f"--{which}", 1)) from None
    load_scenario(args.scenario, args.set)  # the base scenario must load (its errors are the user's first fix)
    check_values(args.scenario, {key: values}, args.set, flag=f"--{which}")  # a value refused alone: before any runs
    df = fitting_values(args.scenario, key, values, args.set)
    errors = set(df.error.dropna())
    if len(errors) == 1 and df.error.notna().all():  # every value refused for one reason: a bad key or value
        why = errors.pop()  # a policy's refusal (PolicyError) does not name the file, the schema's does
        raise ScenarioError(why if why.startswith(f"{args.scenario}: ") else f"{args.scenario}: {why}")
    answer = df.attrs[which]
    if args.json:
        rows = [{k: (None if v != v else v) for k, v in r.items()} for r in df.to_dict("records")]
        print(json.dumps({"key": key, which: answer, "points": rows, "warnings": list(df.attrs["warnings"])},
                         default=str))
    else:
        print(f"{key:<32} fits  peak GPU memory / capacity      step time")  # of the tightest rank class
        for r in df.itertuples():
            dev = r.peak_device_memory_bytes
            mem = (f"{dev / 1e9:8.2f} / {r.gpu_memory_capacity_bytes / 1e9:.2f} GB" if dev == dev and dev is not None
                   else f"{'-':>8}")
            step = f"{r.step_time_s * 1e3:.1f} ms" if r.step_time_s == r.step_time_s and r.step_time_s else "-"
            why = f"  ({r.error})" if isinstance(r.error, str) else ""
            if isinstance(r.memory_binding_class, str):  # rank_overrides: GPUs of different memory
                mem = f"{mem} [{r.memory_binding_class}]"
            print(f"{str(r.value):<32} {'yes' if r.fits else 'no ':<4}  {mem:<30} {step}{why}")
        for text, where in df.attrs["warnings"].items():  # each once, as `simulate run` prints them
            who = "every value" if len(where) == len(df) else f"{key} " + ", ".join(str(df.value[i]) for i in where)
            print(f"warning ({who}): {text}")
        print(f"{which} that fits: {answer if answer is not None else 'none of the values'}")
    return 0 if answer is not None else 1
