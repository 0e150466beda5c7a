"""docs/configuration.md is what tools/config_reference.py writes from the config classes
(every tier installed here): a field added, renamed or redocumented shows up there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_configuration_reference_is_up_to_date():
    run = subprocess.run([sys.executable, str(REPO / "tools" / "config_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout
    text = (REPO / "docs" / "configuration.md").read_text()
    # every tier's table, nested paths, the engines' variants, the job file's tiers
    for needle in ("## `laminar-trainer run` (TrainerConfig)", "| `optim.lr` |",
                   "### `engine` as VllmEngineConfig", "| `tiers.<name>.restart_args` |",
                   "| `on_data_exhausted` |", "## `laminar-relay serve` (RelayConfig)"):
        assert needle in text, needle
