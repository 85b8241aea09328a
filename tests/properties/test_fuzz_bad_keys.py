"""Fuzz: 2-3 keys of a bundled scenario set to bad values at once (wrong types, out of range, unknown choices and
preset names, misspelt keys). Through ``simulate run FILE`` (a subprocess): exit 2, no traceback, and exactly one
``error:`` line per bad key, naming it, and no other line (every other setting is valid: a check that reads a bad
value is skipped, never run on a default). More examples: ``FUZZ_BAD_KEYS=200``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT

SCENARIOS = ["cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml", "cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml",
             "h200/gpt_184m_b8.yaml"]
_BASE = {s: yaml.safe_load((ROOT / "scenarios" / s).read_text()) for s in SCENARIOS}
#: key path -> a value its field refuses by itself
BAD = {"training.micro_batch_size": -8, "model.num_layers": "many", "model.seq_length": -1,
       "training.precision": "bf17", "run.steps": 0, "zero_optimization.stage": 9, "model.hidden_size": "wide",
       "model.vocab_size": 0, "model.num_attention_heads": 0, "run.warmup_steps": -1,
       "parallelism.tensor_model_parallel_size": 0, "parallelism.pipeline_model_parallel_size": "two",
       "parallelism.sequence_parallel": "maybe", "training.optimizer": "adamz", "ddp.bucket_cap_mb": -1,
       "hardware.gpu": "h100-sxm-80g", "hardware.host": "dgx-h100-hots", "hardware.pcie": "pcie-gen5-x1",
       "hardware.cluster.preset": "dgx-h10", "hardware.cluster.nodes": 0, "hardware.cluster.network": "ib-nd",
       "hardware.profile": "h100-sxm", "model.attention_backend": "fastest", "training.global_batch_size": -4,
       # DeepSpeed's top-level keys (foreign_keys.deepspeed_key_problems): named as written, with the others
       "gradient_clipping": -1.0, "prescale_gradients": True}
RENAME = "zz"  # a misspelt key: KEY + "zz" (one "unknown key" line; the key meant, if required, is not "missing")


def _applicable(scenario: str, key: str) -> bool:
    """Whether ``key``'s section exists in ``scenario`` (a cluster key needs a cluster)."""
    node = _BASE[scenario]
    for k in key.split(".")[:-1]:
        node = node.get(k) if isinstance(node, dict) else None
    return isinstance(node, dict)


@st.composite
def mutated(draw):
    scenario = draw(st.sampled_from(SCENARIOS))
    keys = draw(st.lists(st.sampled_from([k for k in BAD if _applicable(scenario, k)]), min_size=2, max_size=3,
                         unique_by=lambda k: k.split(".")[-1]))
    data = yaml.safe_load(yaml.safe_dump(_BASE[scenario]))
    named = []
    for key in keys:
        *parents, leaf = key.split(".")
        node = data
        for k in parents:
            node = node[k]
        if draw(st.booleans()) and leaf in node and not isinstance(node[leaf], dict):  # misspell a written key
            node[leaf + RENAME] = node.pop(leaf)
            named.append(f"{key}{RENAME}: unknown key")
        else:
            node[leaf] = BAD[key]
            named.append(f"{key}: ")
    return scenario, yaml.safe_dump(data, sort_keys=False), named


EXAMPLES = int(os.environ.get("FUZZ_BAD_KEYS", "12"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_each_bad_key_gets_one_line_naming_it(case):
    scenario, text, named = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.yaml"
        path.write_text(text)
        r = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(path)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("warning:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, (scenario, named, r.stderr)
    assert len(lines) == len(named), (scenario, named, lines)
    for want in named:
        assert sum(ln.startswith(f"error: {path}: {want}") for ln in lines) == 1, (scenario, want, lines)
