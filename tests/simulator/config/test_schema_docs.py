"""``schema_markdown`` (scenarios/README.md's reference): a section's intro is its docstring's whole first
paragraph, not a first line cut mid-sentence."""

from __future__ import annotations

from simulator.config.docs import schema_markdown
from simulator.config.sections.nvme import AioConfig


def test_section_intro_is_the_docstrings_first_paragraph():
    md = schema_markdown(AioConfig, "aio")
    intro = md.split("\n")[2]
    assert intro == ("DeepSpeed ``aio`` (libaio settings of the NVMe swapper): each key is priced by "
                     "``hardware_models.aio`` except ``single_submit``, accepted and not priced (module docstring).")
