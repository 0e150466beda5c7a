"""Issue 16 acceptance: ``examples/tools.yaml`` end to end, multi-turn RL with a real sandbox.

The job file as shipped but for its run dir and 12 RL steps instead of 30 (the suite's
time; the held-out gain was +79 points after 20 steps and the train reward 0.74 at step
11). A 300-step warm start instead of 600 taught no tool call at all, so it is kept. The warm start,
then ``laminar up`` with a relay, the manager, a torch-engine worker whose
trajectories call the ``python`` tool (bubblewrap sandbox) and the trainer, which
trains on the model's turns only. Asserted: tool calls are made and the sandbox's
results come back into the conversation (the trainer's sample log), every prompt
is trained exactly once, and held-out greedy accuracy with the tool rises by at
least 40 points over the warm start.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import consumed_ids, laminar_up, run_to_end

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
MIN_GAIN = 0.40


def _tooluse():
    spec = importlib.util.spec_from_file_location("tooluse", REPO / "examples" / "tools"
                                                  / "tooluse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.cost(233)
def test_tools_job_learns_to_call_the_python_tool(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "tools.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    job["setup"][0][1] = str(REPO / "examples" / "tools" / "tooluse.py")
    trainer = job["tiers"]["trainer"]["config"]
    trainer["total_steps"] = STEPS
    # One thread (tox's): the suite runs two tests at a time on 2 cores, and two threads
    # here starved the Ray tests beside it (their actors started minutes late in CI).
    run_to_end(laminar_up(tmp_path, job), 1200)
    run = tmp_path / "run"
    consumed = consumed_ids(run / "trainer")
    batch = trainer["batch_groups"] * job["tiers"]["manager"]["config"]["group_size"]
    assert len(consumed) == len(set(consumed)) == STEPS * batch

    # Tool calls were made and the sandbox's answers came back into the conversation.
    samples = [json.loads(x) for x in (run / "trainer" / "samples.jsonl").read_text()
               .splitlines()]
    calls = 0
    for s in samples:
        m = re.search(r'"print\((\d+)\*(\d+)\)"\}\}</tool_call>\ntool\n(-?\d+)\n', s["completion"])
        if m:
            a, b, result = map(int, m.groups())
            assert result == a * b, s["completion"]
            calls += 1
    assert calls >= 1, [s["completion"] for s in samples]

    tooluse = _tooluse()
    before = tooluse.evaluate_tool_use(run / "model", run / "eval.jsonl", limit=128)
    after = tooluse.evaluate_tool_use(run / "trainer" / "final", run / "eval.jsonl", limit=128)
    print(f"held-out greedy accuracy with the tool {before['accuracy']:.3f} -> "
          f"{after['accuracy']:.3f}; tool calls {before['tool_call_rate']:.2f} -> "
          f"{after['tool_call_rate']:.2f}")
    assert before["finished"] == after["finished"] == 128
    assert after["accuracy"] - before["accuracy"] >= MIN_GAIN, (before, after)
    assert after["tool_call_rate"] > before["tool_call_rate"]
