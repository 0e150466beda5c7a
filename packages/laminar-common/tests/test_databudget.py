"""``laminar up`` refuses a job whose prompts run out before its last step."""

import json

import pytest

from laminar_common.errors import ConfigError
from laminar_common.launch.databudget import check_data_budget

MANAGER = ("laminar-rollout", "manage")
TRAINER = ("laminar-trainer", "run")


def _prompts(tmp_path, n):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "1"}) + "\n"
                            for i in range(n)))
    return str(path)


def test_prompts_that_run_out_before_the_last_step_are_refused_with_the_fix(tmp_path):
    tiers = {"manager": (MANAGER, {"prompts": _prompts(tmp_path, 600)}),
             "trainer": (TRAINER, {"total_steps": 30, "batch_groups": 32})}
    with pytest.raises(ConfigError) as info:
        check_data_budget(tiers)
    text = str(info.value)
    assert "the prompts run out at step 18 of 30" in text
    assert "total_steps 30 x batch_groups 32 = 960 groups" in text
    assert "600 prompts" in text and "epochs 1 = 600" in text
    assert "tiers.manager.config.epochs to 2 or more" in text
    assert "tiers.trainer.config.total_steps to 18 or fewer" in text


def test_enough_epochs_pass_and_a_tight_fit_with_dynamic_sampling_is_warned(tmp_path):
    prompts = _prompts(tmp_path, 600)
    assert check_data_budget({"m": (MANAGER, {"prompts": prompts, "epochs": 2}),
                              "t": (TRAINER, {"total_steps": 30, "batch_groups": 32})}) == []
    warned = check_data_budget({
        "m": (MANAGER, {"prompts": prompts, "epochs": 2}),
        "t": (TRAINER, {"total_steps": 30, "batch_groups": 32,
                        "buffer": {"dynamic_sampling": True}})})
    assert len(warned) == 1 and "consumes some groups untrained" in warned[0]
    with pytest.raises(ConfigError, match="max_prompts"):
        check_data_budget({"m": (MANAGER, {"prompts": prompts, "epochs": 5, "max_prompts": 100}),
                           "t": (TRAINER, {"total_steps": 30, "batch_groups": 32})})


def test_jobs_it_cannot_judge_are_not_checked(tmp_path):
    # no prompt file yet, no manager, or a command that is not Laminar's
    missing = str(tmp_path / "nope.jsonl")
    assert check_data_budget({"m": (MANAGER, {"prompts": missing}),
                              "t": (TRAINER, {"total_steps": 99})}) == []
    assert check_data_budget({"t": (TRAINER, {"total_steps": 99})}) == []
    assert check_data_budget({"m": (("python", "mine.py"), {"prompts": _prompts(tmp_path, 1)}),
                              "t": (TRAINER, {"total_steps": 99})}) == []
