"""Reward functions in the shapes other frameworks document, loaded by spec in
test_rewards.py (``reward_styles:NAME``). Written after TRL's GRPOTrainer guide
("Using a custom reward function": batched ``completions`` plus dataset columns by
name) and verl's custom reward function contract (``compute_score(data_source,
solution_str, ground_truth, extra_info)``, e.g. its GSM8K scorer's ``#### N``)."""

import re


def reward_len(completions, **kwargs):
    """TRL's guide's first example: prefer completions near 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward(completions, **kwargs):
    """TRL, conversational: completions are lists of messages."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


def accuracy_reward(prompts, completions, solution, **kwargs):
    """TRL with a dataset column (``solution``) and the prompts."""
    assert len(prompts) == len(completions) == len(solution)
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


def trl_none(completions, **kwargs):
    return [None for _ in completions]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function: the number after the last ``####``."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == str(ground_truth) else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl: a dict result with ``score`` and extra fields."""
    return {"score": float(solution_str.strip() == ground_truth), "acc": True,
            "source": data_source, "split": (extra_info or {}).get("split")}


def two_args(completion, metadata):
    return 1.0
