"""The ``simulate`` command: logic-free verbs over the public API.

Every failure a user can cause prints one line on stderr and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_USAGE = 2
#: how long ``sweep --dask-scheduler`` waits for the scheduler before one error line (exit 2)
DASK_CONNECT_TIMEOUT_S = 10


def error_exit(text: str, as_json: bool = False, status: int = EXIT_USAGE) -> int:
    """Report a failure: ``text`` (one or more ``error: ...`` lines, ``errors.error_text``) on stderr, and with
    ``as_json`` (the verb's ``--json``) one JSON object on stdout too, so that a script reading stdout as JSON gets the
    failure as JSON rather than nothing: ``{"error": the problems joined by "; ", "errors": [one per line],
    "exit_status": status}`` (each problem without its ``error: `` prefix).

    Returns:
        ``status`` (2: bad input; 1: the simulation failed).
    """
    print(text, file=sys.stderr)
    if as_json:
        lines = [ln.removeprefix("error: ") for ln in text.split("\n") if ln.strip()]
        print(json.dumps({"error": "; ".join(lines), "errors": lines, "exit_status": status}))
    return status


def _fmt_bytes(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _busy_line(s: dict) -> list[str]:
    """GPU compute-stream busy fraction, flagged with the cause when the GPU is kept waiting.

    Below 85 % busy the idle time is blamed on a straggler when the run names one (``rank_overrides``), on the
    input pipeline (*data-bound*) when the GPU's
    data wait (``phase_s.data_s``: no kernel runs while the training thread is in
    ``next(iterator)``) is at least half of it, on the pipeline bubble (``pipeline_bubble_s``) when that is,
    on communication (*communication-bound*) when the
    exposed communication (``exposed_comm_s``) is, on both when together they are, on NVMe swaps (*NVMe-bound*) when
    the time a ZeRO-Infinity swap is in flight (``nvme_busy_s``) is, on the offloaded optimizer step
    (*CPU-optimizer-bound*) when its host time (``offload_cpu_optimizer_s``) is, otherwise on the host
    (*host-bound*: kernel launches or other host work such as a CPU optimizer). A pipeline run whose stages
    carry ``gpu_busy`` gets ``_pipeline_busy_line`` instead (the figure named by stage, the waits for other
    stages apart from the host's gaps).
    """
    busy = (s.get("utilisation") or {}).get("compute")
    if busy is None:
        return []
    if _stage_busy(s):
        return _pipeline_busy_line(s)
    note = ""
    if busy < 0.85:
        idle_s = (1.0 - busy) * s.get("step_time_s", 0.0)
        data_s = (s.get("phase_s") or {}).get("data_s", 0.0)
        comm_s = s.get("exposed_comm_s", 0.0) or 0.0
        bubble_s = s.get("pipeline_bubble_s", 0.0) or 0.0
        if s.get("straggler"):
            note = f"  (ranks wait for the slowest: {s['straggler']}, see rank classes / stages)"
        elif bubble_s > 0 and bubble_s >= 0.5 * idle_s:
            note = (f"  (pipeline bubble: the stages wait {bubble_s * 1e3:.2f} ms/step for each other; more "
                    "micro-batches or interleaving shrink it)")
        elif data_s > 0 and data_s >= 0.5 * idle_s:
            note = (f"  (data-bound: the GPU waits {data_s * 1e3:.2f} ms/step for input batches;"
                    " see `simulate dataloader-workers`)")
        elif comm_s > 0 and comm_s >= 0.5 * idle_s:
            note = f"  (communication-bound: the GPU waits {comm_s * 1e3:.2f} ms/step for collectives)"
        elif bubble_s + comm_s >= 0.5 * idle_s:  # neither alone, both together: not the host
            note = (f"  (pipeline bubble {bubble_s * 1e3:.2f} ms and exposed communication {comm_s * 1e3:.2f} ms "
                    "per step)")
        elif (nvme_s := s.get("nvme_busy_s", 0.0) or 0.0) >= 0.5 * idle_s:
            note = (f"  (NVMe-bound: ZeRO-Infinity swaps are in flight {nvme_s * 1e3:.2f} ms/step; the node's swaps "
                    f"alone on its drives take {s.get('nvme_bound_s', 0.0) * 1e3:.2f} ms)")
        elif (cpu_s := s.get("offload_cpu_optimizer_s", 0.0) or 0.0) >= 0.5 * idle_s:
            note = f"  (CPU-optimizer-bound: the offloaded optimizer step takes {cpu_s * 1e3:.2f} ms/step on the host)"
        else:
            note = "  (host-bound: the GPU waits for kernel launches or host work)"
    return [f"GPU busy            {busy * 100:.0f} % of the step{note}"]


def _stage_busy(s: dict) -> list[float]:
    """Each pipeline stage's GPU busy share (``pipeline.stages[].gpu_busy``); empty when not a pipeline run."""
    stages = (s.get("pipeline") or {}).get("stages") or ()
    busy = [st.get("gpu_busy") for st in stages]
    return busy if busy and all(b is not None for b in busy) else []


def _stage_name(st: dict) -> str:
    """``stage N``, with the data-parallel class its figures come from when the run splits rank classes
    (``pipeline.stages[].rank_class``: each stage's first class, ``stage 3 / dp ranks (others)``)."""
    return f"stage {st['pp_rank']}" + (f" / {st['rank_class']}" if st.get("rank_class") else "")


def _pipeline_busy_line(s: dict) -> list[str]:
    """The GPU busy line of a pipeline run: the peak-memory stage's share (the top-level ``utilisation``), named,
    with the range and mean over the stages; when a stage is below 85 % busy, the least busy one's idle time
    split into its waits for the other stages (``pipeline_wait_s``: a launched kernel waits for another stage;
    without it, its ``pipeline_bubble_s``), its exposed communication and its host-bound gaps (``host_idle_s``),
    then its ``pipeline_bubble_s`` (no compute, no collective) as the least idle stage's (named: the schedule's
    bubble, the summary's ``pipeline_bubble_s``) plus its ``pipeline_imbalance_s``. Every figure is named by the
    stage it comes from. Blamed on the host only when the waits and the communication are under half of the
    idle time, on the straggler when the run names one."""
    stages = s["pipeline"]["stages"]
    busy = _stage_busy(s)
    top = s.get("peak_memory_pp_rank", 0)
    line = (f"GPU busy            {busy[top] * 100:.0f} % of the step on {_stage_name(stages[top])} (the peak-memory "
            "stage); "
            f"stages {min(busy) * 100:.0f}-{max(busy) * 100:.0f} %, mean {sum(busy) / len(busy) * 100:.0f} %")
    low = min(range(len(busy)), key=lambda r: busy[r])
    if busy[low] >= 0.85:
        return [line]
    st = stages[low]
    idle_s = (1.0 - busy[low]) * st.get("step_time_s", s.get("step_time_s", 0.0))
    # the stage's idle split by the breakdown's rule (``pipeline.stage_idle_split``); without it, its bubble
    wait_s = st.get("pipeline_wait_s", st.get("pipeline_bubble_s", 0.0))
    host_s, comm_s = st.get("host_idle_s"), st.get("exposed_comm_s", 0.0)
    host = f", host-bound gaps {host_s * 1e3:.2f} ms" if host_s is not None else ""
    ref = min(range(len(stages)), key=lambda r: stages[r].get("pipeline_bubble_s", 0.0))  # the least idle stage
    bubble_s, imb_s = st.get("pipeline_bubble_s", 0.0), st.get("pipeline_imbalance_s", 0.0)
    ref_s = stages[ref].get("pipeline_bubble_s", 0.0)
    if s.get("straggler"):
        line += f"  (ranks wait for the slowest: {s['straggler']}, see rank classes / stages)"
    elif wait_s + comm_s >= 0.5 * idle_s:
        split = (f"its {bubble_s * 1e3:.2f} ms without compute or collectives is the schedule's bubble (it is the "
                 "least idle stage)" if ref == low else
                 f"its {bubble_s * 1e3:.2f} ms without compute or collectives = {ref_s * 1e3:.2f} ms of "
                 f"{_stage_name(stages[ref])} (the "
                 f"least idle stage: the schedule's bubble) + imbalance {imb_s * 1e3:.2f} ms")
        line += (f"  (pipeline: {_stage_name(st)} idles {idle_s * 1e3:.2f} ms/step: waiting for the other stages "
                 f"{wait_s * 1e3:.2f} ms, collectives {comm_s * 1e3:.2f} ms{host}; {split}; "
                 + (f"{_stage_name(stages[ref])} gates the step: balance the stages' work" if imb_s > ref_s
                    else "more micro-batches or interleaving shrink the bubble") + ")")
    else:
        line += (f"  (host-bound: {_stage_name(st)} idles {idle_s * 1e3:.2f} ms/step, waiting for kernel launches or host "
                 f"work{host}; for the other stages {wait_s * 1e3:.2f} ms)")
    return [line]


def _offload_line(s: dict) -> str:
    """The parts of an offloaded step: GPU forward + backward, the CPU optimizer, the post-step parameter upload
    (``offload_h2d_s``, first to last byte) unless parameters are fetched instead and none is uploaded, and the
    parameter fetches (``offload_param_fetch_s`` H2D busy, ``exposed_param_fetch_s`` exposed: the time the compute
    stream waits on a fetch, one definition for ZeRO-3 ``offload_param`` and FSDP ``cpu_offload``,
    ``policies.offload_param.fetch_times``), ms per step."""
    parts = [f"GPU fwd+bwd {s['offload_gpu_fwd_bwd_s'] * 1e3:.1f} ms",
             f"CPU optimizer {s['offload_cpu_optimizer_s'] * 1e3:.1f} ms"]
    fetch = "offload_param_fetch_s" in s
    if not fetch or s.get("offload_h2d_s"):
        parts.append(f"parameter upload {s.get('offload_h2d_s', 0.0) * 1e3:.1f} ms")
    if fetch:
        parts.append(f"parameter fetches H2D {s['offload_param_fetch_s'] * 1e3:.1f} ms busy, "
                     f"{s.get('exposed_param_fetch_s', 0.0) * 1e3:.1f} ms exposed")
    return "offload parts       " + ", ".join(parts)


def format_summary(s: dict, name: str) -> str:
    """Human-readable summary of a run."""
    ph = s.get("phase_s", {})
    timed = [  # the step's times; a run stopped out of memory before simulating (``api.run_scenario``) has none
        f"step time           {s['step_time_s'] * 1e3:.2f} ms"
        f"  ({'data wait %.2f / ' % (ph['data_s'] * 1e3) if ph.get('data_s') else ''}forward {ph.get('fwd_s', 0) * 1e3:.2f} / backward {ph.get('bwd_s', 0) * 1e3:.2f}"
        f" / optimizer {ph.get('opt_s', 0) * 1e3:.2f} ms{' of compute per stage on average' if s.get('pipeline') else ''})",
        f"throughput          {s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:.0f} tokens/s",
        f"MFU                 {s['mfu'] * 100:.1f} %",
        *_busy_line(s),
    ] if s.get("step_simulated") is not False else [
        "step time           not simulated (the persistent state alone does not fit)"]
    lines = [
        f"scenario            {name}",
        f"gpu / profile       {s['gpu']} / {s['profile']}",
        *timed,
        f"peak GPU memory     {_fmt_bytes(s.get('peak_device_memory_bytes', s['peak_memory_bytes']))} of "
        f"{_fmt_bytes(s['gpu_memory_capacity_bytes'])}  (tensors {_fmt_bytes(s['peak_memory_bytes'])}; the rest is "
        "CUDA context and allocator reserve)",
    ]
    n, nt = s.get("num_parameters"), s.get("num_trainable_parameters")
    if n and nt is not None and nt != n:  # LoRA: as PEFT's print_trainable_parameters
        lines.append(f"parameters          trainable {nt:,} of {n:,} ({100 * nt / n:.4f} %)")
    cats = s.get("peak_memory_by_category_bytes") or {}
    if cats:
        lines.append("  at peak           " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))
    if s.get("peak_host_pinned_bytes") or s.get("peak_host_pageable_bytes"):
        lines.append(f"peak host memory    {_fmt_bytes(s.get('peak_host_pinned_bytes', 0))} pinned, "
                     f"{_fmt_bytes(s.get('peak_host_pageable_bytes', 0))} pageable")
    if s.get("host_page_fault_s"):
        lines.append(f"host page faults    {s['host_page_fault_s'] * 1e3:.2f} ms/step of host time on first-touch faults "
                     "of fresh host buffers (4 KiB pages; inside the host ops and copies that allocate them)")
    if (s.get("world_size") or 1) > 1:
        groups = ", ".join(f"{g} {t * 1e3:.2f} ms" for g, t in sorted((s.get("comm_s_by_group") or {}).items()))
        strategy = s.get("data_parallel_strategy") or "DDP"
        sharded = {"DeepSpeed ZeRO-1": "optimizer state sharded", "DeepSpeed ZeRO-2": "optimizer state and gradients "
                   "sharded", "DeepSpeed ZeRO-3": "parameters, gradients and optimizer state sharded",
                   "Megatron distributed optimizer": "optimizer state sharded, gradients reduce-scattered",
                   # graph.builders.bf16_optimizer: the fp32 master partition and Adam moments, like ZeRO-1
                   "DeepSpeed BF16_Optimizer": "fp32 master weights and optimizer state sharded, gradients "
                   "all-reduced",
                   # graph.builders.fp16_optimizer: flat fp32 master and Adam moments of every parameter on each rank
                   "DeepSpeed FP16_Optimizer": "fp32 master weights and optimizer state replicated, 16-bit gradients "
                   "all-reduced"}.get(
            strategy, "model states sharded" if strategy.startswith("FSDP") and "NO_SHARD" not in strategy else None)
        pipe = s.get("pipeline")
        cp = s.get("context_parallel_size", 1)
        ranks = (f"data x context parallel ranks ({s.get('data_parallel_size', 1)} x {cp})" if cp > 1
                 else "data-parallel ranks")
        lines.append(f"parallel            {s['world_size']} GPUs, data parallel {s.get('data_parallel_size', 1)}, "
                     f"tensor parallel {s.get('tensor_parallel_size', 1)}"
                     + (f", pipeline parallel {pipe['pipeline_model_parallel_size']} ({pipe['schedule']}, "
                        f"{pipe['micro_batches']} micro-batch{'es' if pipe['micro_batches'] != 1 else ''})"
                        if pipe else "")
                     + (f", context parallel {s['context_parallel_size']}" if s.get("context_parallel_size", 1) > 1
                        else "")
                     + (f", expert parallel {s['expert_parallel_size']} (inside data parallel)"
                        if s.get("expert_parallel_size", 1) > 1 else "")
                     + (f"; {strategy}: {sharded} over the {ranks}" if sharded
                        else f"; {strategy}: gradients all-reduced over the {ranks}" if cp > 1 and strategy != "none"
                        else ""))
        mp = "; mp = Megatron's model-parallel group, tp x pp: the grad-norm all-reduce" if "mp" in (s.get("comm_s_by_group") or {}) else ""
        lines.append(f"communication       {groups or 'none'} per step; exposed {s.get('exposed_comm_s', 0) * 1e3:.2f} ms "
                     "(compute idle while a collective is in flight" + ("; largest stage" if pipe else "") + mp + ")")
        if pipe:
            ref = _stage_name(min(pipe["stages"], key=lambda st: st["pipeline_bubble_s"]))
            lines.append(f"pipeline bubble     {s['pipeline_bubble_s'] * 1e3:.2f} ms/step (the idle time of {ref}, the "
                         "least idle stage; a stage's imbalance is its idle time beyond that)")
        for st in (pipe or {}).get("stages", ()):
            lines.append(f"  stage {st['pp_rank']:<3}         {st['layers']} layers"
                         + (f", {st['rank_class']}" if st.get("rank_class") else "")
                         + (f" (slowdown {st['slowdown']:g})" if st.get("slowdown", 1.0) != 1.0 else "")
                         + f": compute {sum((st.get('phase_compute_s') or {}).values()) * 1e3:.2f} ms"
                         + (f" at {st['compute_clock_mhz']:.0f} MHz" if st.get("compute_clock_mhz") else "")
                         + f", bubble {st['pipeline_bubble_s'] * 1e3:.2f} ms"
                         f" (imbalance {st['pipeline_imbalance_s'] * 1e3:.2f}), exposed comm "
                         f"{st['exposed_comm_s'] * 1e3:.2f} ms, peak memory {_fmt_bytes(st['peak_device_memory_bytes'])}"
                         + (" OUT OF MEMORY" if st.get("oom") else ""))
    for i, rc in enumerate(s.get("rank_classes") or ()):
        head = "rank classes        " if i == 0 else "                    "
        lines.append(f"{head}{rc['label']} ({rc['replicas']} replica(s), slowdown {rc['slowdown']:g}): compute "
                     f"{rc['compute_s'] * 1e3:.2f} ms, waits {rc['wait_s'] * 1e3:.2f} ms/step"
                     + ("  <- straggler" if rc["label"] == s.get("straggler") else ""))
    if "offload_cpu_optimizer_s" in s:
        lines.append(_offload_line(s))
    if s.get("step_latency_s") and abs(s["step_latency_s"] - s["step_time_s"]) > 0.01 * s["step_time_s"]:
        over = (s.get("pipeline") or {}).get("step_overlap_s")
        why = f" by {over * 1e3:.1f} ms: a stage runs step i+1 before another ends step i" if over else ""
        lines.append(f"step latency        {s['step_latency_s'] * 1e3:.1f} ms (steps overlap{why}; step time is the "
                     "period between step ends)")
    if s.get("data_stall_s"):
        lines.append(f"data stall          {s['data_stall_s'] * 1e3:.2f} ms/step in next(iterator)"
                     f"{' (hidden behind GPU work)' if not ph.get('data_s') else ''}")
    if "energy_j_per_step" in s and s.get("step_simulated") is not False:
        every = (f"; {s['energy_j_per_step_all_gpus']:.1f} J/step for all {s['world_size']} GPUs"
                 if "energy_j_per_step_all_gpus" in s else "")
        lines.append(f"energy              {s['energy_j_per_step']:.2f} J/step, {s.get('avg_power_w', 0):.0f} W average"
                     f"{' per GPU (mean of the stages)' if s.get('pipeline') else ''}{every}"
                     + (f"; power cap {s['power_limit_w']:.0f} W per GPU (dvfs)" if s.get("dvfs_policy") == "power_cap"
                        and s.get("power_limit_w") else "") + _power_model_note(s.get("power_model")))
    if s.get("oom"):
        lines.append(f"OUT OF MEMORY       {s['oom']}")
        lines.append("                    (exit status 1)" if s.get("step_simulated") is False else
                     "                    (the step time and throughput above are what the step would take if it "
                     "fit; exit status 1)")
    lines += [f"warning             {w}" for w in s.get("warnings") or []]
    return "\n".join(lines)


def _power_model_note(name: str | None) -> str:
    """What the energy line says of the power model behind it: ``(generic TDP model)`` for the unfitted one
    (``hardware_models.power.generic_power_model``; the warnings say what it assumes), else its name."""
    if not name:
        return ""
    from hardware_models.power import GENERIC_SUFFIX

    return "  (generic TDP model)" if name.endswith(GENERIC_SUFFIX) else f"  (power model: {name})"


def check_out_dir(path: str | None, run_folder: bool = False) -> None:
    """Fail early (before simulating) if ``--out`` cannot be a folder.

    Args:
        path: The ``--out`` value (None: nothing to check).
        run_folder: The folder becomes one run's outputs: it must be new, empty or a previous run
            (``recording.writers``), so that replacing it deletes no user file.

    Raises:
        ScenarioError: the path is an existing file or cannot be created, or (``run_folder``) holds
            files that are not a previous run's.
    """
    from simulator.config.errors import ScenarioError

    if not path:
        return
    p = Path(path)
    if run_folder:
        from simulator.recording.writers import check_replaceable

        check_replaceable(p)
    if p.exists() and not p.is_dir():
        raise ScenarioError(f"--out {path}: is an existing file, expected a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScenarioError(f"--out {path}: cannot create the folder ({exc.strerror})") from None


#: ``oom_notice`` speaks when the memory estimate's low end exceeds the GPU's memory by this factor: far enough
#: over that the simulated run (which may take minutes at such sizes) surely reports out of memory
OOM_NOTICE_FACTOR = 2.0


def oom_notice(cfg) -> str | None:
    """One line announcing an out-of-memory result before a long simulation, or None.

    From ``studies.memory_estimate.estimate_memory`` (analytic, no simulation): when even its low end
    (``low_device_bytes`` less ``TOLERANCE``) exceeds ``OOM_NOTICE_FACTOR`` times the GPU's memory. None where
    the estimate does not cover the scenario (``NotEstimated``: offload, LoRA...).
    """
    from simulator.studies.memory_estimate import TOLERANCE, NotEstimated, estimate_memory

    try:
        est = estimate_memory(cfg)
    except NotEstimated:
        return None
    if est.low_device_bytes / (1.0 + TOLERANCE) <= OOM_NOTICE_FACTOR * est.capacity_bytes:
        return None
    return (f"notice: estimated peak {est.peak_device_bytes / 1e9:.2f} GB of {est.capacity_bytes / 1e9:.2f} GB: "
            "the run will report out of memory")


def cmd_run(args) -> int:
    from simulator import load_scenario, run_scenario, write_outputs

    check_out_dir(args.out, run_folder=True)
    cfg = load_scenario(args.scenario, args.set)
    if (notice := oom_notice(cfg)) is not None:
        print(notice, file=sys.stderr, flush=True)
    result = run_scenario(cfg)
    written = write_outputs(result, args.out, overrides=args.set, scenario=args.scenario) if args.out else []
    if args.json:
        print(json.dumps(result.summary, default=float))
    else:
        print(format_summary(result.summary, cfg.name))
        if args.out:
            print(f"outputs             {args.out}/ ({', '.join(p.name for p in written)}; trace.json opens in "
                  "ui.perfetto.dev or HTA)")
    return 0 if result.ok else 1


def cmd_schema(args) -> int:
    from simulator.config.schema import ScenarioConfig

    if args.markdown:
        from simulator.config.docs import schema_markdown

        print(schema_markdown())
    else:
        print(json.dumps(ScenarioConfig.model_json_schema(), indent=2))
    return 0


def cmd_presets(args) -> int:
    import yaml

    from hardware_models import presets

    if args.name:
        fams = [f for f, names in presets.list_presets().items() if args.name in names]
        fam = args.family or next(iter(fams), None)
        if args.family is None and len(fams) > 1:  # h100-sxm-80gb is a GPU and a profile: say which is shown
            print(f"note: {args.name!r} is a preset of {', '.join(fams)}; showing {fam} (--family for another)",
                  file=sys.stderr)
        if fam is None:
            from hardware_models.units import short_repr

            raise presets.PresetError(f"unknown preset {short_repr(args.name)}; see `simulate presets`")
        print(yaml.safe_dump(presets.raw(fam, args.name), sort_keys=False))
        return 0
    for fam, names in presets.list_presets(args.family).items():
        print(f"{fam}: {', '.join(names) if names else '(none)'}")
    return 0


def cmd_validate(args) -> int:
    from simulator.studies.validation import validation_table

    df = validation_table(args.case or None, progress=not args.json)
    if args.json:
        print(df.to_json(orient="records"))
        return 0
    gaps, within = df.known_gap.notna(), df.within
    reasons = list(dict.fromkeys(df.known_gap[gaps]))
    shown = df.drop(columns="source").assign(
        known_gap=[f"[{reasons.index(r) + 1}]" if g else "" for r, g in zip(df.known_gap, gaps)])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"{int(within.sum())} of {len(df)} within tolerance; {int(gaps.sum())} known gaps; "
          f"{int((~within & ~gaps).sum())} outside tolerance and not a known gap")
    if reasons:
        print("known gaps (sources: --json):")
    for i, r in enumerate(reasons, 1):
        print(f"[{i}] {r}")
    return 0


def cmd_sweep(args) -> int:
    from simulator.studies.sweep import (SweepInterrupted, check_sweep_folder, is_metric_name, parse_factor, run_sweep,
                                         write_sweep_plots)
    from simulator.config.errors import ScenarioError
    from simulator.studies.sweep import grid
    from simulator.studies.sweep_check import check_points

    if args.workers < 1:
        raise ScenarioError(f"--workers must be >= 1, got {args.workers}")
    plots = [m.strip() for m in (args.plot or "").split(",") if m.strip()]
    if args.plot is not None and not plots:
        raise ScenarioError(f"--plot {args.plot!r}: name at least one metric (e.g. step_time_s,tokens_per_s)")
    if plots and not args.out:
        raise ScenarioError("--plot needs --out DIR (the figures go to DIR/sweep_<metric>.png)")
    bad = [m for m in plots if not is_metric_name(m)]
    if bad:
        raise ScenarioError(f"--plot {bad[0]}: not a summary metric; use one such as step_time_s, tokens_per_s, mfu, "
                            "energy_j_per_step, peak_memory_bytes, phase_s.fwd_s, utilisation.compute")
    check_out_dir(args.out)
    if args.out:
        check_sweep_folder(args.out)
    parsed = [parse_factor(f) for f in args.factor]
    keys = [k for k, _ in parsed]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise ScenarioError(f"--factor {dup}: given more than once; list all its values in one --factor "
                            f"({dup}=v1,v2,...)")
    factors = dict(parsed)
    # every point's whole scenario (file, --set, its factor values) before running anything (exit 2)
    check_points(args.scenario, args.set, grid(factors))
    client = dask_client(args.dask_scheduler) if args.dask_scheduler else None
    try:
        df = run_sweep(args.scenario, factors, base_overrides=args.set, workers=args.workers,
                       out_dir=args.out, progress=not args.json, client=client)
    except SweepInterrupted as stop:
        if len(stop.table):
            _print_sweep(stop.table, args.json)
        where = (f"; the table is in {Path(args.out) / 'results.csv'} and the same command resumes"
                 if args.out else "")
        print(f"interrupted: {len(stop.table)} of {stop.total} points finished{where}", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()
    _print_sweep(df, args.json)
    if args.out:
        written = write_sweep_plots(df, list(factors), plots, args.out) if plots else []
        print(f"table: {Path(args.out) / 'results.csv'}"
              + "".join(f", {p}" for p in written), file=sys.stderr)
    failed = int(df["error"].notna().sum()) if "error" in df else 0
    if failed:
        print(f"error: {failed} of {len(df)} points failed (see the error column)", file=sys.stderr)
    return 1 if failed else 0


def dask_client(address: str):
    """A ``dask.distributed.Client`` connected to ``address`` (``--dask-scheduler``).

    Raises:
        ScenarioError: dask.distributed is not installed, or the scheduler cannot be reached within
            ``DASK_CONNECT_TIMEOUT_S``.
    """
    from simulator.config.errors import ScenarioError

    try:
        from dask.distributed import Client
    except ImportError:
        raise ScenarioError("--dask-scheduler needs dask.distributed: pip install -e '.[dask]'") from None
    import logging

    # the client's own log (reconnect attempts with tracebacks when the scheduler goes away) would bury the one
    # error line the sweep prints for it (studies.sweep.SweepFailed); distributed gives some loggers levels of
    # their own, so each is quieted
    for name in ["distributed", *(n for n in logging.root.manager.loggerDict if n.startswith("distributed."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return Client(address, timeout=f"{DASK_CONNECT_TIMEOUT_S}s")
    except (OSError, ValueError, TypeError) as exc:
        raise ScenarioError(f"--dask-scheduler {address}: cannot connect "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _print_sweep(df, as_json: bool) -> None:
    """JSON: every column; text: the inputs and the headline metrics (results.csv has them all)."""
    from simulator.studies.sweep import SUMMARY_COLUMNS, json_records

    if as_json:  # each point's warnings a list, as run --json's
        print(json.dumps(json_records(df)))
        return
    # run_sweep's rows start with the swept keys, then gpu_busy (a sweep whose points all failed has no metrics)
    inputs = list(df.columns[:df.columns.get_loc("gpu_busy")]) if "gpu_busy" in df else \
        [c for c in df.columns if c not in ("error", "folder")]
    shown = inputs + [c for c in ("gpu_busy", *SUMMARY_COLUMNS, "profile") if c in df]
    found = df.attrs.get("warnings") or {}
    table = df[shown].copy()
    if found:  # each point's warnings by number, each distinct one written once below the table
        refs = [[] for _ in range(len(df))]
        for n, rows in enumerate(found.values(), 1):
            for i in rows:
                refs[i].append(str(n))
        table["warnings"] = [",".join(r) or "-" for r in refs]
    if not df["error"].isna().all():
        table["error"] = df["error"]
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for n, (text, rows) in enumerate(found.items(), 1):
        where = "every point" if len(rows) == len(df) else f"{len(rows)} of {len(df)} points: " + "; ".join(
            ", ".join(f"{k.split('.')[-1]}={df.iloc[i][k]}" for k in inputs) for i in rows[:MAX_POINTS_NAMED]) + (
            f"; and {len(rows) - MAX_POINTS_NAMED} more" if len(rows) > MAX_POINTS_NAMED else "")
        print(f"warning [{n}] ({where}): {text}")


#: points a sweep's warning footnote names (the table's warnings column marks all of them)
MAX_POINTS_NAMED = 8


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainsim-des")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _OneLineParser(argparse.ArgumentParser):
    """argparse with the project's error contract: one line on stderr, exit status 2 (no usage block)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (verbs: run, sweep, validate, presets, schema, ...)."""
    ap = _OneLineParser(prog="simulate", description="Discrete-event simulator of ML training systems.")
    ap.add_argument("--version", action="version", version=f"simulate (trainsim-des) {_version()}")
    sub = ap.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("run", help="simulate a scenario YAML")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field (repeatable)")
    p.add_argument("--out", help="write config, summary, spans and a Perfetto trace here")
    p.add_argument("--json", action="store_true", help="print one JSON object: the summary, or on failure "
                   '{"error": ..., "errors": [...], "exit_status": N} (the error lines stay on stderr)')
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("sweep", help="run a scenario over a grid of values (one row per point)")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--factor", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a factor of the grid (repeatable; the points are every combination), e.g. "
                   "training.micro_batch_size=1,2,4")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field on every point (repeatable)")
    p.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    p.add_argument("--dask-scheduler", metavar="ADDRESS", help="run the points on a dask.distributed cluster")
    p.add_argument("--out", help="one output folder per point under here, results.csv/.parquet (one row per "
                   "point); re-running the same command skips the points already done")
    p.add_argument("--plot", metavar="METRIC,...", help="with --out: write DIR/sweep_<metric>.png per metric "
                   "(e.g. step_time_s,tokens_per_s)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON records")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("validate", help="predicted vs measured for the bundled validation cases",
                       description="Run the bundled validation cases and print predicted vs measured. All cases "
                       "take about 6 minutes (one simulation per distinct scenario, one after another, on one "
                       "core; measured 2026-12); name cases to run fewer. A progress bar on stderr counts the "
                       "simulations (not with --json).")
    p.add_argument("case", nargs="*", help="case names or prefixes of them (default: all)")
    p.add_argument("--json", action="store_true", help="print the table as JSON records")
    p.set_defaults(fn=cmd_validate)

    from hardware_models.presets import FAMILIES as PRESET_FAMILIES

    p = sub.add_parser("presets", help="list presets, or show one")
    p.add_argument("name", nargs="?", help="a preset to show (default: list every family's names)")
    p.add_argument("--family", choices=list(PRESET_FAMILIES), help="only this family (a name in several: which one)")
    p.set_defaults(fn=cmd_presets)

    p = sub.add_parser("schema", help="print the scenario JSON schema")
    p.add_argument("--markdown", action="store_true", help="a Markdown reference (scenarios/README.md)")
    p.set_defaults(fn=cmd_schema)

    # verbs contributed by feature modules: add_parser(subparsers) registers them with fn defaults
    import importlib

    for mod in ("simulator.cli_dataloader", "simulator.cli_energy", "simulator.cli_trace", "simulator.cli_collective",
                "simulator.cli_kernel", "simulator.cli_search", "simulator.cli_fit"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        m.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``simulate`` console script; returns the exit status.

    Run as the command (``argv`` None: the console script, ``python -m simulator``), the objects still alive
    when the command is done are frozen (``gc.freeze``) so that the interpreter's exit does not walk them all in a
    last cyclic collection: about 0.2 s of CPU of a ``simulate run`` of 0.6 s (measured on this 2-core machine,
    2026-12-03; its exit still runs atexit handlers and frees every module). Called from Python (``main([...])``,
    the tests) nothing is frozen.
    """
    try:
        return _main(argv)
    finally:
        if argv is None:
            import gc

            gc.freeze()


def _main(argv: list[str] | None) -> int:
    """``main`` without the freeze."""
    from hardware_models.presets import PresetError
    from hardware_models.units import UnitError
    from pydantic import ValidationError

    from hardware_models.safe_yaml import YamlInputError
    from simulator.config.errors import PolicyError, ScenarioError, error_text
    from simulator.engine.errors import SimulationError

    import warnings

    def one_line_warning(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=sys.stderr)

    warnings.showwarning = one_line_warning
    args = build_parser().parse_args(argv)
    as_json = bool(getattr(args, "json", False))  # the verb's --json: the failure as a JSON object on stdout too
    try:
        return int(args.fn(args) or 0)
    except (ScenarioError, PresetError, UnitError, YamlInputError) as exc:
        return error_exit(error_text(exc), as_json)
    except ValidationError as exc:  # a model built from user input outside load_scenario
        from simulator.config.loader import format_validation_error

        where = getattr(args, "scenario", None) or "input"
        return error_exit(error_text(format_validation_error(exc, where, exc.title)), as_json)
    except PolicyError as exc:  # stage-2 validation of a policy's parameters
        where = getattr(args, "scenario", None)
        return error_exit(f"error: {where + ': ' if where else ''}{exc}", as_json)
    except SimulationError as exc:
        return error_exit(f"error: simulation failed: {exc}", as_json, 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
