"""The trainer's console: the step line, why a starved trainer waits, the all-failed check."""

import json

import pytest

from laminar_common.codec import Trajectory
from laminar_common.errors import LaminarError
from laminar_trainer.console import check_rewards, clock, step_line, why_waiting


def test_the_step_line_has_progress_eval_and_what_went_wrong():
    metrics = {"tokens_per_s": 1234.4, "reward_errors": 3, "trajectories": 256,
               "uniform_group_fraction": 1.0}
    line = step_line(11, 12, 30, 0.4123, metrics, elapsed_s=44.0, steps_done=11,
                     eval_last={"eval_accuracy": 0.637}, eval_step=10, reward_errors_so_far=7)
    assert line == ("STEP 11 v12 reward=0.412 | 11/30 | 0:44 elapsed, ETA 1:16 | 1234 tok/s | "
                    "eval 0.637 (step 10) | REWARD ERRORS 3/256 (7 so far) | every group "
                    "scored the same: nothing learned")
    # resumed at 9: the ETA counts this process's 2 steps, not the 11
    assert "ETA 1:29:00" in step_line(11, 12, 100, 0.0, {"tokens_per_s": 1}, 120, 2, {}, 0, 0)
    assert clock(3725) == "1:02:05" and clock(-1) == "0:00"


@pytest.mark.parametrize("status,want", [
    (None, "no manager has reported a status"),
    (b"not json", "does not parse"),
    ({"prompts_exhausted": True, "cursor": {"epoch": 1}, "ledger": {"done": 3}, "workers": {}},
     "the manager's prompts are exhausted (cursor {'epoch': 1}, ledger {'done': 3})"),
    ({"holding_for_resume": True, "workers": {"w": {}}}, "holds new work until resumed"),
    ({"workers": {}, "ledger": {}}, "no rollout worker is connected"),
    ({"workers": {"w0": {}, "w1": {}}, "ledger": {"pending": 4}, "trainer_rejections": 2},
     "2 worker(s) generating, manager ledger {'pending': 4}, 2 trajectories rejected"),
])
def test_a_starved_trainer_says_why_it_waits(status, want):
    raw = status if status is None or isinstance(status, bytes) else json.dumps(status).encode()
    text = why_waiting(3, raw)
    assert text.startswith("3 complete group(s) held; ") and want in text, text


def _traj(i, error):
    return Trajectory(trajectory_id=f"p#{i}", prompt_id="p", group_size=2, sample_index=i,
                      worker_id="w", policy_version=0, prompt_token_ids=(1,),
                      response_token_ids=(2,), behaviour_logprobs=(-1.0,), reward=0.0,
                      finish_reason="stop", reward_error=error)


def test_every_reward_failed_stops_with_the_first_error():
    check_rewards(1, [_traj(0, "ValueError: x"), _traj(1, None)])  # one worked: goes on
    check_rewards(1, [])
    with pytest.raises(LaminarError, match=r"step 1: every reward of the step failed \(2 of 2"
                                           r"\), e.g. p#0 from w: ValueError: x"):
        check_rewards(1, [_traj(0, "ValueError: x"), _traj(1, "ValueError: y")])


def test_nothing_more_coming_only_when_exhausted_and_nothing_is_left_out():
    from laminar_trainer.console import nothing_more_coming

    def status(**kw):
        return json.dumps(kw).encode()

    done9 = status(prompts_exhausted=True, ledger={"pending": 0, "dispatched": 0, "done": 9})
    assert nothing_more_coming(done9, held=9)
    assert not nothing_more_coming(done9, held=8)  # one is still on its way (a re-send)
    assert not nothing_more_coming(status(prompts_exhausted=True, ledger={"dispatched": 2}), 9)
    assert not nothing_more_coming(status(prompts_exhausted=False, ledger={}), 9)
    assert not nothing_more_coming(None, 9) and not nothing_more_coming(b"{not json", 9)
