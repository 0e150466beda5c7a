"""Issue 13 acceptance: the second example job, as an RL engineer from verl/TRL runs it.

``examples/math.yaml`` unchanged but for its run dir and step count, through
``laminar up``: a verl-format parquet (chat-message prompts, nested
``reward_model.ground_truth``, no id column) read as is, a Qwen2-shaped chat model
with a BPE tokenizer and a ChatML template (warm-started by the job's set-up), two
torch workers rendering prompts with that template and scoring with the ``math``
reward (math-verify), and the trainer evaluating the held-out parquet with the same
reward. Held-out greedy accuracy must rise over the warm start. Then: the final model
was saved, and the worker's prompt ids for a record are the trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import laminar_up, run_to_end

REPO = Path(__file__).resolve().parents[1]
MIN_GAIN = 0.10
STEPS = 12  # the suite's time: +33.6 points after 20 steps, train reward 0.54 at step 11


@pytest.mark.cost(138)
def test_math_job_runs_a_verl_parquet_unchanged_and_raises_held_out_accuracy(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "math.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    trainer = job["tiers"]["trainer"]["config"]
    trainer["total_steps"] = STEPS
    trainer["checkpoint"]["every_steps"] = STEPS
    trainer["eval"]["every_steps"] = 0
    run_to_end(laminar_up(tmp_path, job, name="math.yaml"), 1200)
    run = tmp_path / "run"
    summary = json.loads((run / "trainer" / "summary.json").read_text())
    assert summary["simulated_step"] is False and summary["steps"] == STEPS
    before, after = summary["eval_before"], summary["eval_after"]
    assert after - before >= MIN_GAIN, (before, after)
    # The dataset really was the verl layout: chat prompts, nested ground truth, no ids.
    import pyarrow.parquet as pq

    table = pq.read_table(run / "train.parquet")
    assert "id" not in table.column_names
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["role"] == "user" and "ground_truth" in row["reward_model"]
    # Rewards were computed (math-verify), not errors: the trained reward is not all 0.
    rows = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = [r for r in rows if "reward_mean" in r]
    assert steps and max(r["reward_mean"] for r in steps) > 0.2
    # The final model is always saved as a clean HF directory, without optimizer state.
    final = Path(summary["final_model"])
    assert (final / "config.json").is_file() and (final / "tokenizer_config.json").is_file()
    assert not any("optim" in p.name for p in final.iterdir())


def test_the_worker_and_the_trainer_build_the_same_prompt_ids(tmp_path):
    """One record of the job's parquet, through the rollout's tokenizer wrapper and the
    trainer's held-out loader: identical ids (the chat template applied once, alike)."""
    from transformers import AutoTokenizer

    from laminar_common.data.chat import prompt_token_ids
    from laminar_common.data.records import DataConfig, load_records
    from laminar_examples.chat_model import build_chat_model, build_chat_tokenizer, save_chat_model
    from laminar_examples.math_tasks import write_math_prompts
    from laminar_rollout.tokenizer import HfTokenizer
    from laminar_trainer.config import EvalConfig
    from laminar_trainer.evaluation import load_eval_records

    data = tmp_path / "eval.parquet"
    write_math_prompts(data, 8, "eval", 2)
    keys = DataConfig(prompt_key="prompt", answer_key="reward_model.ground_truth",
                      system_prompt="Answer briefly.")
    tok = build_chat_tokenizer(["Tom has 3 apples. #### 3", "user assistant system"] * 10)
    save_chat_model(tmp_path / "model", build_chat_model(len(tok), num_layers=1), tok)
    worker_side = HfTokenizer(str(tmp_path / "model"))
    record = load_records(data, keys)[0]
    ids = worker_side.encode_prompt(record.prompt)
    evals = load_eval_records(EvalConfig(prompts=str(data), data=keys, limit=1))
    trainer_side = prompt_token_ids(AutoTokenizer.from_pretrained(tmp_path / "model"),
                                    evals[0]["prompt"])
    assert ids == trainer_side
    text = worker_side._tok.decode(ids)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert worker_side.eos_token_ids == (2, 0)
