"""``simulate validate`` shows a progress bar on stderr (one tick per distinct simulation, as sweep and search
show theirs), none with ``--json``, and its ``--help`` states how long all cases take."""

import re

import pytest

from simulator.cli import main
from simulator.studies.validation import all_cases


def test_progress_bar_counts_the_distinct_runs(capsys):
    cases = [c for c in all_cases() if c.case_id.startswith("gpt_184m_b8")]
    runs = {r for c in cases for r in c.runs}
    assert len(cases) > len(runs) >= 1  # the cases share their runs: ticks count runs, not cases
    assert main(["validate", "gpt_184m_b8"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"validate: 100%.*\b{len(runs)}/{len(runs)} ", err), err
    assert main(["validate", "gpt_184m_b8", "--json"]) == 0
    assert "validate:" not in capsys.readouterr().err


def test_help_gives_the_expected_duration(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "All cases take about 6 minutes" in " ".join(capsys.readouterr().out.split())
