"""A DeepSpeed key accepted without effect on the step (``foreign_keys.NO_STEP_EFFECT_KEYS``) is dropped at load;
its warning must survive every dump and re-validation (``with_overrides``, ``largest_fitting``, sweep points): each
row warns as a fresh ``simulate run`` of its point does. Before, the dump had lost the key, so the round trip had
lost the warning (``ScenarioConfig._no_step_effect``)."""

from __future__ import annotations

import subprocess
import sys

import yaml

from simulator.config.loader import load_scenario
from simulator.config.schema import ScenarioConfig
from simulator.studies import sweep
from simulator.studies.whatif import largest_fitting, with_overrides
from tests.conftest import ROOT

LINE = ("zero_optimization.stage3_gather_16bit_weights_on_model_save true: accepted, no effect on the training step "
        "(acts when the model is saved; DeepSpeed's key)")


def _scenario(tmp_path):
    data = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml").read_text())
    data["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    data["model"]["num_layers"] = 2
    data["run"] = {"steps": 3, "warmup_steps": 1}
    path = tmp_path / "g16.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_warning_survives_dumps_overrides_fits_and_sweeps(tmp_path):
    path = _scenario(tmp_path)
    out = subprocess.run([sys.executable, "-m", "simulator", "run", str(path)], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    printed = [ln.split(None, 1)[1] for ln in out.stdout.splitlines() if ln.startswith("warning ")]
    assert printed.count(LINE) == 1, printed
    cfg = load_scenario(path)
    assert cfg.no_step_effect_notes == (LINE,)
    dumped = cfg.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    assert dumped["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ScenarioConfig.model_validate(dumped).no_step_effect_notes == (LINE,)
    assert ScenarioConfig.model_validate_json(cfg.model_dump_json()).no_step_effect_notes == (LINE,)
    assert with_overrides(cfg, **{"training.micro_batch_size": 2}).no_step_effect_notes == (LINE,)
    fit = largest_fitting(cfg, "training.micro_batch_size", [1, 2])
    assert [LINE in ws for ws in fit["warnings"]] == [True, True]
    rows = sweep.run_sweep(path, {"training.micro_batch_size": [1, 2]}, progress=False, log=lambda m: None)
    assert [ws.count(LINE) for ws in rows["warnings"]] == [1, 1]  # the row joins its lines with "; "


def test_a_scenario_without_such_keys_dumps_none():
    cfg = load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")
    assert cfg.no_step_effect_notes == ()
    assert "stage3_gather_16bit_weights_on_model_save" not in cfg.model_dump()["zero_optimization"]
