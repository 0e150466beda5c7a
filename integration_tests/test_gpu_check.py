"""tools/gpu_check.sh stays runnable: its --cpu mode (small shapes on this CPU) runs the
gpu-marked tests (they skip here) and every part of tools/gpu_bench.py end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.cost(104)
def test_gpu_check_runs_on_the_cpu_and_reports_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    log = (out / "gpu_check.log").read_text()
    assert run.returncode == 0, log[-4000:]
    # The log is whole: its last line is written (tee waited for) before the script exits.
    assert log.rstrip().splitlines()[-1].startswith("gpu_check: done in "), log[-500:]
    assert "gpu_check: pytest -m gpu packages/laminar-rollout/tests" in log
    assert "gpu_check: pytest -m gpu packages/laminar-trainer/tests" in log
    report = json.loads((out / "gpu_bench.json").read_text())
    assert report["small"] is True and report["failed"] == {}
    parts = report["parts"]
    assert set(parts) == {"engine", "trainer", "publish", "relay", "e2e"}
    assert all(v > 0 for v in parts["engine"]["tokens_per_s_by_batch"].values())
    tail = parts["engine"]["long_tail"]
    assert tail["p99"] / tail["p50"] > 5 and tail["continuous"] > 0 and tail["static"] > 0
    assert parts["trainer"]["step_s"] > 0 and parts["trainer"]["tokens_per_s"] > 0
    assert parts["publish"]["bytes"] > 0 and parts["publish"]["stall_s"] > 0
    for chain in ("1 ", "2 ", "4 "):
        assert any(line.strip().startswith(chain) for line in
                   parts["relay"]["output"].splitlines()), parts["relay"]["output"]
    e2e = parts["e2e"]
    assert e2e["steps"] == 3 and 0 <= e2e["eval_before"] <= 1 and 0 <= e2e["eval_after"] <= 1
    assert (out / "e2e.log").stat().st_size > 0 and (out / "relay.log").stat().st_size > 0
    # Everything printed went to the files that come back from the GPU machine.
    assert "gpu_bench: all parts passed" in (out / "gpu_bench.txt").read_text()
