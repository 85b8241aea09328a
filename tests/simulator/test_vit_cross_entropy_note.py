"""``training.cross_entropy`` on a ViT (no LM head) changes nothing: the run says so."""

from simulator.api import ineffective_setting_warnings
from simulator.config.loader import load_scenario

VIT = "scenarios/h200/vit_b16_b64.yaml"


def test_vit_cross_entropy_flagged():
    cfg = load_scenario(VIT, ["training.cross_entropy=megatron"])
    assert any(w.startswith("training.cross_entropy megatron has no effect on a ViT")
               for w in ineffective_setting_warnings(cfg))


def test_vit_without_it_not_flagged():
    assert not any("cross_entropy" in w for w in ineffective_setting_warnings(load_scenario(VIT)))
