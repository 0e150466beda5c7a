"""Tier config checks before a launch: run in parallel, failures named, set-up gaps deferred."""

from __future__ import annotations

import sys
import threading

import pytest

from laminar_common.errors import ConfigError, LaminarError
from laminar_common.launch.preflight import (
    TierCheck,
    default_check_args,
    is_deferred,
    raise_for,
    run_checks,
    setup_paths,
)


def _check(tier: str, code: str, replica: str | None = None) -> TierCheck:
    return TierCheck(tier, replica or tier, f"runs/j/configs/{replica or tier}.yaml",
                     (sys.executable, "-c", code), f"fake-{tier} --print-config")


def test_laminar_tiers_have_their_check_flag_and_other_commands_none():
    assert default_check_args(["laminar-trainer", "run"]) == ("--print-config",)
    assert default_check_args(["laminar-rollout", "manage", "--x"]) == ("--print-config",)
    assert default_check_args(["laminar-relay", "serve"]) == ("--check",)
    assert default_check_args(["laminar-examples", "warmstart"]) == ()
    assert default_check_args(["laminar-trainer", "export"]) == ()
    assert default_check_args(["python", "my_trainer.py"]) == ()


def test_failures_come_back_in_check_order_with_code_and_text():
    checks = [
        _check("relay", "pass"),
        _check("worker", "import sys; print('  engine.typo: unknown field', file=sys.stderr);"
                         " sys.exit(2)", "worker-0"),
        _check("trainer", "raise SystemExit('model_dir: missing')"),
    ]
    failures = run_checks(checks, timeout_s=60, parallel=2)
    assert [(f.check.replica, f.code) for f in failures] == [("worker-0", 2), ("trainer", 1)]
    assert "engine.typo: unknown field" in failures[0].text
    with pytest.raises(ConfigError) as err:
        raise_for(failures, "job.yaml")
    text = str(err.value)
    assert text.startswith("2 tier config check(s) failed (nothing was started):")
    assert ("tier worker (worker-0): config runs/j/configs/worker-0.yaml "
            "(tiers.worker.config in job.yaml) rejected by `fake-worker --print-config` "
            "(exit 2):\n      engine.typo: unknown field") in text
    assert "tier trainer (trainer)" in text and "    model_dir: missing" in text
    raise_for([], "job.yaml")  # nothing failed: no error


def test_a_check_past_its_deadline_is_killed_and_fails():
    (failure,) = run_checks([_check("slow", "import time; time.sleep(60)")], timeout_s=0.5)
    assert failure.code is None and failure.text.startswith("no answer within 0.5s")


def test_a_stop_kills_the_checks_and_raises():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(LaminarError, match="interrupted while checking"):
        run_checks([_check("slow", "import time; time.sleep(60)")], timeout_s=60, stop=stop)


def test_a_command_that_cannot_run_is_named():
    check = TierCheck("t", "t", "c.yaml", ("/nonexistent/tier-binary", "--check"))
    with pytest.raises(LaminarError, match="tier t: cannot run '/nonexistent/tier-binary'"):
        run_checks([check])


def test_setup_paths_are_the_path_arguments_but_not_the_run_dir():
    setup = [["laminar-examples", "warmstart", "--out", "runs/demo/model", "--steps", "150"],
             ["laminar-examples", "prompts", "--out=runs/demo/train.jsonl"],
             ["laminar", "keys", "--out", "runs/demo/"], ["tool", "-x", "runs"]]
    assert setup_paths(setup, "runs/demo") == ["runs/demo/model", "runs/demo/train.jsonl"]


@pytest.mark.parametrize("text, deferred", [
    # Every problem names a path a set-up step writes: checked again after the set-up.
    ("laminar-trainer run: invalid TrainerConfig (file 'runs/demo/configs/trainer.yaml'):\n"
     "  model_dir: Value error, 'runs/demo/model' does not exist (got 'runs/demo/model')\n",
     True),
    ("laminar-rollout manage: prompts file 'runs/demo/train.jsonl' does not exist", True),
    # A typo, or a path no set-up step names, fails before the set-up.
    ("laminar-trainer run: invalid TrainerConfig (file 'x.yaml'):\n"
     "  model_dir: Value error, 'runs/demo/model' does not exist\n"
     "  optim.lrr: unknown field; did you mean 'lr'?\n", False),
    ("laminar-trainer run: invalid TrainerConfig (file 'x.yaml'):\n"
     "  model_dir: Value error, '/data/other' does not exist\n", False),
    ("laminar-trainer run: invalid TrainerConfig (file 'runs/demo/model.yaml'):\n", False),
    ("Traceback (most recent call last):\n  File \"runs/demo/model/x.py\"\nNameError: x", False),
])
def test_only_failures_about_set_up_products_are_deferred(text, deferred):
    assert is_deferred(text, ["runs/demo/model", "runs/demo/train.jsonl"]) is deferred
    assert is_deferred(text, []) is False


def test_a_passing_checks_warnings_reach_the_console_once_each():
    from laminar_common.config import PREFLIGHT_WARNING_PREFIX

    line = f"import sys; print({PREFLIGHT_WARNING_PREFIX + 'no seccomp'!r}, file=sys.stderr)"
    said: list[str] = []
    failures = run_checks([_check("worker", line, "worker-0"), _check("worker", line, "worker-1"),
                           _check("relay", "print('not a warning')")],
                          timeout_s=60, parallel=2, warn=said.append)
    assert failures == []
    assert len(said) == 1 and said[0].endswith(": no seccomp") and said[0].startswith("worker-")
