"""Write notebooks/04_dvfs_energy.ipynb (code cells only, no outputs)."""

from pathlib import Path

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# DVFS: the energy-time trade-off of locked clocks\n\n"
        "Run the measured gpt_184m batch-8 step on an H200 at several locked SM clocks (`nvidia-smi -lgc`) "
        "and plot GPU energy per step against step time. Points on the Pareto frontier are neither slower "
        "nor hungrier than any other. The power model is `hardware_models/presets/power/h200-sxm-141gb.yaml` "
        "(fitted by `scripts/fit_h200_power.py` on the batch-16 run; the V-f curve is an assumption)."
    ),
    nbf.v4.new_code_cell(
        "from pathlib import Path\n"
        "import warnings\n"
        "import pandas as pd\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "from simulator import load_scenario, run_scenario\n"
        "ROOT = Path.cwd() if (Path.cwd() / 'scenarios').exists() else Path.cwd().parent\n"
        "SCENARIO = ROOT / 'scenarios/h200/gpt_184m_b8.yaml'"
    ),
    nbf.v4.new_code_cell(
        "clocks = [1980, 1800, 1605, 1410, 1200, 1005, 810, 600, 405]  # all supported H200 clocks\n"
        "rows = []\n"
        "for mhz in clocks:\n"
        "    cfg = load_scenario(SCENARIO, overrides=['dvfs.kind=locked_clock', f'dvfs.locked_clocks_mhz={mhz}',\n"
        "                                             'run.steps=3'])\n"
        "    s = run_scenario(cfg).summary\n"
        "    rows.append({'clock_mhz': mhz, 'step_ms': s['step_time_s'] * 1e3, 'energy_j': s['energy_j_per_step'],\n"
        "                 'avg_power_w': s['avg_power_w'], 'mj_per_token': s['energy_per_token_j'] * 1e3})\n"
        "df = pd.DataFrame(rows)\n"
        "df['pareto'] = [not any((o.step_ms <= r.step_ms and o.energy_j <= r.energy_j) and\n"
        "                        (o.step_ms < r.step_ms or o.energy_j < r.energy_j) for o in df.itertuples())\n"
        "                for r in df.itertuples()]\n"
        "df"
    ),
    nbf.v4.new_code_cell(
        "fig, ax = plt.subplots(figsize=(6, 4))\n"
        "ax.plot(df.step_ms, df.energy_j, 'o-', color='0.6', label='locked clock')\n"
        "front = df[df.pareto]\n"
        "ax.plot(front.step_ms, front.energy_j, 'o', color='C3', label='Pareto-optimal')\n"
        "for r in df.itertuples():\n"
        "    ax.annotate(f'{r.clock_mhz}', (r.step_ms, r.energy_j), textcoords='offset points', xytext=(4, 4), fontsize=8)\n"
        "ax.set_xlabel('step time (ms)')\n"
        "ax.set_ylabel('GPU energy per step (J)')\n"
        "ax.set_title('gpt_184m b8 on H200: locked SM clock (MHz)')\n"
        "ax.legend()\n"
        "fig.tight_layout()"
    ),
    nbf.v4.new_markdown_cell(
        "Clock and power over time are counters of the result (and tracks in the Perfetto trace written by "
        "`write_outputs`). Here: a 400 W power cap, which the firmware controller reaches by stepping the clock down."
    ),
    nbf.v4.new_code_cell(
        "r = run_scenario(load_scenario(SCENARIO, overrides=['dvfs.kind=power_cap', 'dvfs.power_limit_w=400', 'run.steps=6']))\n"
        "c = r.counters[r.counters.scope == 'gpu0']\n"
        "fig, (a1, a2) = plt.subplots(2, 1, figsize=(6, 4), sharex=True)\n"
        "for ax, metric in ((a1, 'power_w'), (a2, 'sm_clock_mhz')):\n"
        "    d = c[c.metric == metric]\n"
        "    ax.step(d.t_s * 1e3, d.value, where='post')\n"
        "    ax.set_ylabel(metric)\n"
        "a2.set_xlabel('time (ms)')\n"
        "fig.tight_layout()\n"
        "{k: r.summary[k] for k in ('step_time_s', 'energy_j_per_step', 'avg_power_w', 'avg_sm_clock_mhz', 'clock_switches')}"
    ),
]

nb = nbf.v4.new_notebook()
nb.cells = cells
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
out = Path(__file__).resolve().parents[1] / "notebooks" / "04_dvfs_energy.ipynb"
nbf.write(nb, out)
print(f"wrote {out}")
