"""A ds_config written for the Hugging Face Trainer, pasted: its ``"auto"`` placeholders are refused saying what they
are (filled by the Trainer from its TrainingArguments at launch) and to write the value, and its ``scheduler``
section is refused naming why it has no key here (a learning-rate schedule changes no step's time). Before: "Input
should be a valid boolean (got 'auto')" alone, and ``scheduler: unknown key`` with no hint."""

from __future__ import annotations

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.foreign_keys import HF_AUTO_NOTE
from simulator.config.loader import scenario_from_dict
from tests.simulator.config.test_pasted_framework_names import BASE, _merge

#: transformers docs, "DeepSpeed" (main_classes/deepspeed): the ZeRO-2 example config with its "auto" values
HF_ZERO2_AUTO = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
    "gradient_clipping": "auto",
}


def _refused(extra: dict) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_merge(BASE, extra), "ds.yaml")
    return str(e.value).splitlines()


@pytest.mark.parametrize("extra,head", [
    ({"fp16": {"enabled": "auto"}}, "ds.yaml: fp16.enabled: Input should be a valid boolean (got 'auto')"),
    ({"bf16": {"enabled": "auto"}}, "ds.yaml: bf16.enabled: Input should be a valid boolean (got 'auto')"),
    ({"gradient_clipping": "auto"}, "ds.yaml: gradient_clipping: Input should be a valid number (got 'auto')"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
     "ds.yaml: zero_optimization.reduce_bucket_size"),
])
def test_auto_values_name_the_hf_trainer_placeholder(extra, head):
    (line,) = _refused(extra)
    assert line.startswith(head) and line.endswith(f"; {HF_AUTO_NOTE}"), line


def test_auto_on_a_deepspeed_top_level_key_gets_its_hint_and_the_auto_note():
    (line,) = _refused({"gradient_accumulation_steps": "auto"})
    assert "DeepSpeed's gradient_accumulation_steps is implied here" in line and line.endswith(f"; {HF_AUTO_NOTE}")
    (line,) = _refused({"train_micro_batch_size_per_gpu": "auto"})
    assert "is training.micro_batch_size here" in line and line.endswith(f"; {HF_AUTO_NOTE}")


def test_whole_hf_config_gives_one_line_per_auto_value():
    lines = _refused(HF_ZERO2_AUTO)
    assert len(lines) == 4 and all(ln.endswith(HF_AUTO_NOTE) for ln in lines), lines


def test_other_bad_values_get_no_auto_note():
    (line,) = _refused({"fp16": {"enabled": "yes please"}})
    assert "Hugging Face" not in line


def test_scheduler_section_is_refused_saying_it_changes_no_step():
    (line,) = _refused({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}}})
    assert line.startswith("ds.yaml: scheduler: unknown key (allowed: ")
    assert "DeepSpeed's scheduler section" in line and "changes no step's work or time" in line
    assert line.endswith("remove it")
