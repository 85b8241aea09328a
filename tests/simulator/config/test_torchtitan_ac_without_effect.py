"""torchtitan's ``activation_checkpoint`` keys that change nothing are named in the run's warnings
(``api.ineffective_setting_warnings``): ``selective_ac_option`` given beside ``mode`` none or full, which torchtitan
does not read (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py
``_apply_ac_to_transformer_block``: ``full`` wraps every block before the option is looked at; ``apply_ac`` is not
called with ``none``), and an int option larger than the model's block count, which checkpoints no block (block
``i`` is checkpointed when ``(i + 1) % n == 0``): the graph is then the one of ``mode: none``."""

from __future__ import annotations

import pytest

from simulator.api import build_graph, ineffective_setting_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

LLAMA = ROOT / "scenarios/h200/llama3_8b_b1.yaml"
BASE = ["fsdp={version: 2}", "model.num_layers=4", "training.micro_batch_size=2", "model.vocab_size=8192",
        "model.seq_length=256"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _lines(ac: str) -> list[str]:
    return [w for w in ineffective_setting_warnings(load_scenario(LLAMA, [*BASE, f"activation_checkpoint={ac}"]))
            if w.startswith("activation_checkpoint.")]


@pytest.mark.parametrize("ac,line", [
    ("{mode: none, selective_ac_option: op}", "activation_checkpoint.selective_ac_option op has no effect with mode "
                                              "none (read only with mode selective); the run is the same without it"),
    ("{mode: full, selective_ac_option: 3}", "activation_checkpoint.selective_ac_option 3 has no effect with mode "
                                             "full (read only with mode selective); the run is the same without it"),
    ("{selective_ac_option: 5}", "activation_checkpoint.selective_ac_option 5 checkpoints none of the model's 4 "
                                 "blocks (block i when (i + 1) % 5 == 0): the run is the same as mode none"),
])
def test_an_option_that_changes_nothing_is_named(ac, line):
    assert _lines(ac) == [line]


@pytest.mark.parametrize("ac", ["{mode: none}", "{mode: full}", "{selective_ac_option: 4}", "{selective_ac_option: op}",
                                "{selective_ac_option: 0}", "{}"])
def test_an_option_in_force_is_not_named(ac):
    assert _lines(ac) == []


def test_the_unread_options_graph_is_the_one_without_it():
    """What the lines say: the option beside mode none, and an option past the last block, build mode none's ops."""
    def names(ac):
        return [(o.name, o.flops) for o in build_graph(load_scenario(LLAMA, [*BASE, f"activation_checkpoint={ac}"])).ops]

    none = names("{mode: none}")
    assert names("{mode: none, selective_ac_option: op}") == none == names("{selective_ac_option: 5}")
    assert names("{selective_ac_option: 4}") != none  # block 3 is checkpointed
