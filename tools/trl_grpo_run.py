"""TRL's GRPOTrainer on a Laminar job's settings: the TRL half of tools/bench_vs_trl.py.

Runs in TRL's own environment (tools/trl_env.sh), never in Laminar's: it needs torch,
transformers, trl, datasets, pydantic and pyyaml, and imports from Laminar only
laminar-common's ``data`` subpackage (records, prompt tokenization, EOS ids, rewards)
and, for the demo's ``synthetic`` reward, laminar-examples' tasks, from the source tree
beside this file. bench_vs_trl.py writes the spec (``--spec``):
every setting already resolved from the job file, so nothing here reads a job file or
picks a default of its own. The result (``--out``) holds:

- ``window_s``: first ``on_step_begin`` to last ``on_step_end`` of the optimizer
  updates (``total_steps x mini_batches x epochs`` of them; every ``mini_batches x
  epochs`` updates share one generation batch), the in-training evals included, as
  Laminar's trainer runs its evals inside its step loop;
- ``tokens``: completion tokens generated (EOS included, as Laminar counts a
  trajectory's response tokens), counted in the reward function;
- ``eval_before`` / ``eval_after`` / ``evals``: greedy accuracy on the held-out file's
  first ``limit`` records, decoded with ``model.generate`` and scored by
  ``laminar_common.data.rewards.score`` with the job's eval reward;
- ``generate_s``: time inside GRPOTrainer's generate-and-score (the rest of the
  window is loss, backward, optimizer, evals and checkpoints).

Completions are decoded for the reward as Laminar does (a trailing EOS dropped, other
special tokens kept as text), from the ``completion_ids`` TRL passes to reward
functions; the job's reward function is called through the same ``score`` wrapper.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_COMMON_SRC = Path(__file__).resolve().parents[1] / "packages" / "laminar-common" / "src"
# the ``synthetic`` reward's home (laminar_examples.tasks: stdlib and laminar-common only)
_EXAMPLES_SRC = Path(__file__).resolve().parents[1] / "examples" / "src"
# Laminar-side spellings of the built-in rewards, which import a tier (laminar_rollout).
_REWARD_ALIASES = {"laminar_rollout.rewards:synthetic_task": "synthetic",
                   "laminar_rollout.rewards:exact_answer": "exact"}


def _load_reward(spec: str):
    from laminar_common.data.rewards import load_reward_fn

    return load_reward_fn(_REWARD_ALIASES.get(spec, spec))


def _decode(tokenizer, ids, eos_ids) -> str:
    """Laminar's decode for scoring (laminar_trainer.decoding.decode_completion)."""
    ids = list(ids)
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


class HeldOut:
    """Greedy held-out accuracy with plain ``model.generate`` (batches of 128)."""

    def __init__(self, spec: dict, tokenizer) -> None:
        from laminar_common.data.chat import eos_token_ids, prompt_token_ids
        from laminar_common.data.records import DataConfig, load_records

        ev = spec["eval"]
        records = load_records(ev["prompts"], DataConfig(**ev["data"]))[: ev["limit"]]
        self.records = records
        self.prompt_ids = [prompt_token_ids(tokenizer, r.prompt) for r in records]
        self.eos = list(eos_token_ids(tokenizer, spec["model_dir"]) or (tokenizer.eos_token_id,))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        self.max_new_tokens = ev["max_new_tokens"]
        self.reward = _load_reward(ev["reward"])
        self.tokenizer = tokenizer

    def __call__(self, model) -> float:
        import torch

        from laminar_common.data.rewards import score

        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total = 0.0
        try:
            for start in range(0, len(self.records), 128):
                prompts = self.prompt_ids[start: start + 128]
                width = max(len(p) for p in prompts)
                ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts],
                                   device=device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                    device=device)
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                         max_new_tokens=self.max_new_tokens,
                                         eos_token_id=self.eos, pad_token_id=self.pad,
                                         temperature=None, top_p=None, top_k=None)
                for record, row in zip(self.records[start: start + 128], out[:, width:].tolist()):
                    cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
                    text = _decode(self.tokenizer, row[:cut], self.eos)
                    value, _ = score(self.reward, record.prompt, text, record.metadata)
                    total += value
        finally:
            model.train(was_training)
        return total / len(self.records)


def _dataset(spec: dict):
    from datasets import Dataset

    from laminar_common.data.records import DataConfig, load_records

    records = load_records(spec["prompts"], DataConfig(**spec["data"]))
    # metadata as JSON text: records' metadata dicts need not share one schema.
    return Dataset.from_list([{"prompt": r.prompt, "record_id": r.record_id,
                               "metadata_json": json.dumps(r.metadata)} for r in records])


def run(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from laminar_common.data.chat import eos_token_ids
    from laminar_common.data.rewards import score

    t_start = time.monotonic()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    held_out = HeldOut(spec, tokenizer)
    updates_per_step = spec["mini_batches"] * spec["epochs"]
    total_updates = spec["total_steps"] * updates_per_step

    t0 = time.monotonic()
    eval_before = held_out(model)
    print(f"TRL eval before: {eval_before:.3f} ({time.monotonic() - t0:.1f}s)", flush=True)

    reward_fn = _load_reward(spec["reward"])
    eos = set(eos_token_ids(tokenizer, spec["model_dir"]) or (tokenizer.eos_token_id,))
    counts = {"tokens": 0, "completions": 0, "generations": 0}
    rewards_per_step: list[float] = []

    def job_reward(prompts, completions, completion_ids, metadata_json, **kwargs):
        values = []
        for prompt, ids, meta in zip(prompts, completion_ids, metadata_json):
            value, _ = score(reward_fn, prompt, _decode(tokenizer, ids, eos), json.loads(meta))
            values.append(value)
        counts["tokens"] += sum(len(ids) for ids in completion_ids)
        counts["completions"] += len(completion_ids)
        counts["generations"] += 1
        rewards_per_step.append(sum(values) / len(values))
        return values

    timing = {"begin": None, "end": None, "generate_s": 0.0}
    evals: list[dict] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if timing["begin"] is None:
                timing["begin"] = time.monotonic()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step // updates_per_step
            every = spec["eval"]["every_steps"]
            # Laminar's trainer evaluates inside its step loop after steps every, 2*every,
            # ... and evaluates the last step after the loop (eval_after): the same here.
            if (every and state.global_step % updates_per_step == 0 and step % every == 0
                    and step < spec["total_steps"]):
                t = time.monotonic()
                # "t": seconds from the window's start to the evaluated weights (before
                # this eval; earlier evals count), as Laminar's side counts it.
                evals.append({"step": step, "accuracy": held_out(model),
                              "seconds": time.monotonic() - t, "t": t - timing["begin"]})
                print(f"TRL eval at step {step}: {evals[-1]['accuracy']:.3f}", flush=True)
            timing["end"] = time.monotonic()
            if state.global_step % updates_per_step == 0:
                print(f"TRL step {step}/{spec['total_steps']} reward "
                      f"{rewards_per_step[-1]:.3f}", flush=True)

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.monotonic()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timing["generate_s"] += time.monotonic() - t

    out_dir = Path(spec["output_dir"])
    ckpt = spec["checkpoint"]
    config = GRPOConfig(
        output_dir=str(out_dir),
        seed=spec["seed"],
        data_seed=spec["seed"],
        max_steps=total_updates,
        per_device_train_batch_size=spec["batch_groups"] * spec["group_size"]
        // spec["mini_batches"],
        gradient_accumulation_steps=1,
        steps_per_generation=spec["mini_batches"],
        num_iterations=spec["epochs"],
        num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        shuffle_dataset=False,
        learning_rate=spec["lr"],
        max_grad_norm=spec["grad_clip"],
        bf16=spec["bf16"],
        gradient_checkpointing=False,
        report_to="none",
        disable_tqdm=True,
        logging_steps=updates_per_step,
        save_strategy="steps" if ckpt["every_steps"] else "no",
        save_steps=(ckpt["every_steps"] or 1) * updates_per_step,
        save_total_limit=ckpt["keep"],
        dataloader_num_workers=0,
        **spec["trl"],
    )
    # Laminar's own AdamW and LR schedule: the bench passes the LR of every trainer step
    # (laminar_trainer.step.make_optimizer); TRL steps the scheduler once per update.
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"],
                                  weight_decay=spec["weight_decay"])
    lrs = spec["lr_per_step"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lrs[min(u // updates_per_step, len(lrs) - 1)] / spec["lr"])
    trainer = TimedGRPOTrainer(model=model, reward_funcs=job_reward, args=config,
                               train_dataset=_dataset(spec), processing_class=tokenizer,
                               callbacks=[Timing()], optimizers=(optimizer, scheduler))
    trainer.train()
    window_s = timing["end"] - timing["begin"]

    t0 = time.monotonic()
    eval_after = held_out(trainer.model)
    print(f"TRL eval after: {eval_after:.3f} ({time.monotonic() - t0:.1f}s)", flush=True)
    import importlib.metadata as md

    return {
        "seed": spec["seed"], "steps": spec["total_steps"], "updates": trainer.state.global_step,
        "window_s": window_s, "tokens": counts["tokens"],
        "tokens_per_s": counts["tokens"] / window_s, "completions": counts["completions"],
        "generations": counts["generations"], "generate_s": timing["generate_s"],
        "eval_before": eval_before, "eval_after": eval_after, "evals": evals,
        "eval_s": sum(e["seconds"] for e in evals),
        "reward_first": rewards_per_step[0], "reward_last": rewards_per_step[-1],
        "rewards": rewards_per_step, "torch_threads": torch.get_num_threads(),
        "wall_s": time.monotonic() - t_start,
        "versions": {name: md.version(name) for name in
                     ("trl", "transformers", "torch", "accelerate", "datasets")},
        "trl_config": {k: getattr(config, k) for k in (
            "per_device_train_batch_size", "steps_per_generation", "num_iterations",
            "generation_batch_size", "num_generations", "max_completion_length", "loss_type",
            "scale_rewards", "epsilon", "epsilon_high", "beta", "importance_sampling_level",
            "mask_truncated_completions", "entropy_coef", "bf16", "max_grad_norm",
            "shuffle_dataset", "max_steps", "temperature", "top_p", "top_k")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run TRL's GRPOTrainer on settings resolved by tools/bench_vs_trl.py "
                    "(run it with TRL's environment's python; see tools/trl_env.sh).")
    parser.add_argument("--spec", required=True, help="the JSON spec bench_vs_trl.py wrote")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(_COMMON_SRC), str(_EXAMPLES_SRC)]
    result = run(json.loads(Path(args.spec).read_text()))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
