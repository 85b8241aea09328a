#!/usr/bin/env python3
"""Pipeline schedules side by side on one bundled scenario: 1F1B, ZB-H1, ZB-H2 and ZB-V.

Runs ``scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml`` (GPT 16 x 2048, PP4 x DP2 on one DGX H100, 16
micro-batches) with ``parallelism.pipeline_schedule`` set to each schedule, prints a table (step time, the
schedule's bubble = the least idle stage's idle compute time, each stage's idle time and peak memory) and
writes a figure: each stage's compute over the measured step (forward, input-gradient backward, weight-gradient
kernels) per schedule, then step time and peak memory per stage.

Usage: ``python scripts/plot_pipeline_schedules.py [OUT.png]`` (default ``docs/pipeline_schedules.png``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"
SCHEDULES = (("1f1b", "1F1B"), ("zero_bubble_h1", "ZB-H1"), ("zero_bubble_h2", "ZB-H2"), ("zero_bubble_v", "ZB-V"))
#: the weight-gradient kernels (what the zero-bubble schedules move into their W passes)
W_KERNELS = (".wgrad", ".grad_accum", ".bias_grad", ".dgamma", ".dgamma_dbeta")


def run_all() -> list[tuple[str, dict, object]]:
    """``[(label, summary, spans of the last step)]`` per schedule."""
    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario

    out = []
    for sched, label in SCHEDULES:
        res = run_scenario(load_scenario(SCENARIO, [f"parallelism.pipeline_schedule={sched}"]))
        spans = res.spans
        out.append((label, res.summary, spans[spans.step == spans.step.max()]))
    return out


def table(runs) -> str:
    """The figures as a Markdown table (ms, GB)."""
    rows = ["| schedule | step (ms) | bubble (ms) | idle per stage (ms) | peak memory per stage (GB) |",
            "|---|---|---|---|---|"]
    for label, s, _ in runs:
        st = s["pipeline"]["stages"]
        idle = ", ".join(f"{1e3 * x['pipeline_bubble_s']:.1f}" for x in st)
        mem = ", ".join(f"{x['peak_memory_bytes'] / 1e9:.2f}" for x in st)
        rows.append(f"| {label} | {1e3 * s['step_time_s']:.1f} | {1e3 * s['pipeline_bubble_s']:.1f} | {idle} | {mem} |")
    return "\n".join(rows)


def figure(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    fig = plt.figure(figsize=(11, 2.1 * n + 3.2))
    gs = fig.add_gridspec(n + 1, 2, height_ratios=[1] * n + [1.6])
    colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "other": "#999999"}
    t_max = max(sp.end_s.max() - sp.start_s.min() for _, _, sp in runs)
    for i, (label, s, sp) in enumerate(runs):
        ax = fig.add_subplot(gs[i, :])
        comp = sp[sp.stream == "compute"]
        t0 = sp.start_s.min()
        for (rank, kind), part in comp.assign(kind=comp.apply(_kind, axis=1)).groupby(["pp_rank", "kind"]):
            ax.broken_barh(list(zip(1e3 * (part.start_s - t0), 1e3 * part.duration_s)), (rank - 0.4, 0.8),
                           color=colours[kind], linewidth=0)
        ax.set_xlim(0, 1e3 * t_max)
        ax.set_ylim(3.6, -0.6)
        ax.set_yticks(range(4), [f"stage {r}" for r in range(4)])
        ax.set_title(f"{label}: step {1e3 * s['step_time_s']:.1f} ms, bubble {1e3 * s['pipeline_bubble_s']:.1f} ms",
                     fontsize=10, loc="left")
        if i == n - 1:
            ax.set_xlabel("time in the step (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in ("F", "B", "W", "other")]
    fig.axes[0].legend(handles, ["forward", "backward (input grads)", "weight-grad kernels", "optimizer, other"],
                       ncol=4, fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 1.45))
    ax = fig.add_subplot(gs[n, 0])
    labels = [r[0] for r in runs]
    steps = [1e3 * r[1]["step_time_s"] for r in runs]
    bub = [1e3 * r[1]["pipeline_bubble_s"] for r in runs]
    ax.bar(labels, steps, color="#8172B3", label="step")
    ax.bar(labels, bub, color="#C44E52", label="bubble (least idle stage)")
    for x, y in enumerate(steps):
        ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("step time and bubble", fontsize=10, loc="left")
    ax = fig.add_subplot(gs[n, 1])
    width = 0.8 / n
    for i, (label, s, _) in enumerate(runs):
        mem = [x["peak_memory_bytes"] / 1e9 for x in s["pipeline"]["stages"]]
        ax.bar([r + (i - (n - 1) / 2) * width for r in range(len(mem))], mem, width, label=label)
    ax.set_xticks(range(4), [f"stage {r}" for r in range(4)])
    ax.set_ylabel("GB")
    ax.legend(fontsize=8)
    ax.set_title("peak allocated memory per stage", fontsize=10, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _kind(row) -> str:
    if row.phase == "fwd":
        return "F"
    if row.phase == "bwd":
        return "W" if row["name"].endswith(W_KERNELS) else "B"
    return "other"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/pipeline_schedules.png"
    runs = run_all()
    print(table(runs))
    figure(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
