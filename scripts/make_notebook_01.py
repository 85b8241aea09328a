"""Write notebooks/01_what_if_quickstart.ipynb (code cells only, no outputs)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# What if: batch size and GPU type\n\n"
        "Simulate the measured gpt_184m training step on an H200, then ask what changes with the batch size "
        "and on other GPUs. Uses only the public API; every result is a pandas DataFrame."
    ),
    nbf.v4.new_code_cell(
        "from pathlib import Path\n"
        "import pandas as pd\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "from simulator import load_scenario, run_scenario\n"
        "ROOT = Path.cwd() if (Path.cwd() / 'scenarios').exists() else Path.cwd().parent\n"
        "SCENARIO = ROOT / 'scenarios/h200/gpt_184m_b8.yaml'"
    ),
    nbf.v4.new_code_cell(
        "rows = []\n"
        "for gpu in ['h200-sxm-141gb', 'h100-sxm-80gb', 'a100-sxm4-80gb']:\n"
        "    for b in [2, 4, 8, 16]:\n"
        "        over = [f'hardware.gpu={gpu}', f'training.micro_batch_size={b}', 'run.steps=2']\n"
        "        if gpu != 'h200-sxm-141gb':\n"
        "            over.append('hardware.profile=null')  # generic profile: no measurements for this GPU\n"
        "        s = run_scenario(load_scenario(SCENARIO, over)).summary\n"
        "        rows.append({'gpu': gpu, 'batch': b, 'step_ms': s['step_time_s'] * 1e3,\n"
        "                     'tokens_per_s': s['tokens_per_s'], 'mfu': s['mfu'],\n"
        "                     'peak_GB': s['peak_memory_bytes'] / 1e9})\n"
        "df = pd.DataFrame(rows)\n"
        "df"
    ),
    nbf.v4.new_code_cell(
        "fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))\n"
        "for gpu, d in df.groupby('gpu'):\n"
        "    axes[0].plot(d.batch, d.tokens_per_s / 1e3, marker='o', label=gpu)\n"
        "    axes[1].plot(d.batch, d.peak_GB, marker='o', label=gpu)\n"
        "axes[0].set(xlabel='micro batch', ylabel='k tokens/s', title='Throughput')\n"
        "axes[1].set(xlabel='micro batch', ylabel='GB', title='Peak GPU memory')\n"
        "axes[0].legend(); fig.tight_layout()"
    ),
    nbf.v4.new_code_cell(
        "# Where does the time go? Busy time by kernel class for one step at batch 8 on the H200.\n"
        "r = run_scenario(load_scenario(SCENARIO, ['run.steps=2']))\n"
        "one = r.spans[(r.spans.step == 1) & (r.spans.stream == 'compute')]\n"
        "breakdown = one.groupby('cost_class').duration_s.sum().sort_values() * 1e3\n"
        "assert abs(breakdown.sum() - r.summary['step_time_s'] * 1e3) < r.summary['step_time_s'] * 1e3\n"
        "breakdown.plot.barh(xlabel='ms per step'); breakdown"
    ),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
nbf.write(nb, "notebooks/01_what_if_quickstart.ipynb")
print("wrote notebooks/01_what_if_quickstart.ipynb")
