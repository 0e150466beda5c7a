"""Laminar vs TRL's GRPOTrainer on one job, side by side in one invocation.

Runs the job file (default ``examples/demo.yaml``) twice over, one after the other,
never at once:

1. Laminar: ``laminar up JOB`` with ``run_dir`` in a fresh work dir (the job's own
   setup builds the warm-started model and the prompt files there). Read from the
   trainer's ``metrics.jsonl``: the window from the first step's start (its wait for
   data included) to the last step's end, trajectory tokens consumed in it, and the
   held-out accuracy before/after from ``summary.json``; the whole ``laminar up`` wall
   time separately, and its setup's share.
2. TRL: ``tools/trl_grpo_run.py`` in TRL's own environment (``tools/trl_env.sh``; TRL
   is in no Laminar package's dependencies), once per seed (``--seeds N``), on the
   same model directory and prompt files, with every setting the job file gives
   mapped onto ``GRPOConfig``: group size -> ``num_generations``, ``optim.mini_batches``
   -> ``steps_per_generation`` (one generation batch, several updates, the clip
   anchored at the weights that generated it), ``optim.epochs`` -> ``num_iterations``,
   Laminar's own AdamW and LR schedule (``laminar_trainer.step.make_optimizer``,
   stepped once per trainer step) passed in as the optimizer and a scheduler.
   Held-out accuracy with the same file, records, greedy budget and reward function.

Printed: the absolute figures of both, the ratios Laminar/TRL (tokens/s, window and
wall time), every setting matched and every difference left (on/off-policy, loss
details, process layout). ``--out FILE`` writes all of it as JSON.

    tools/trl_env.sh                       # once: builds <repo>/.tox/trl-bench
    python tools/bench_vs_trl.py --job examples/demo.yaml --seeds 1 --out bench.json

Every figure is measured here and then; both sides share the CPU with nothing of
the other's (they run in turn), but not necessarily with nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_SCRIPT = ROOT / "tools" / "trl_grpo_run.py"
DEFAULT_TRL_PYTHON = ROOT / ".tox" / "trl-bench" / "bin" / "python"
# Laminar's aggregation -> TRL's loss_type (both normalise over the whole mini-batch).
_TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
                  "seq-mean-token-sum-norm": "dr_grpo"}
_TRL_SCALE_REWARDS = {"grpo": "group", "gspo": "group", "dr_grpo": "none"}
_SETUP_DONE = re.compile(r"setup done in ([0-9.]+)s")


@dataclass(frozen=True)
class JobSettings:
    """What one job file sets for the RL run, resolved through Laminar's own configs."""

    job_file: str
    run_dir: str
    model_dir: str
    prompts: str
    data: dict
    group_size: int
    batch_groups: int
    mode: str
    max_staleness: int
    sampling: dict
    workers: int
    engine: dict
    reward: str
    total_steps: int
    optim: dict
    loss: dict
    eval: dict
    checkpoint: dict
    buffer: dict
    dtype: str
    publish_dtype: str
    trainer_threads: int
    seed: int
    trainer_run_dir: str
    manager_state_dir: str


def _tier(job, command: tuple[str, ...], what: str):
    for spec in job.tiers.values():
        if tuple(spec.command[:2]) == command:
            return spec
    raise SystemExit(f"{job.job}: no {what} tier (command {list(command)}) in the job file")


def read_job_settings(path: str, overrides: list[str]) -> JobSettings:
    """Resolve a ``laminar up`` job file (with ``--set`` overrides) into the settings
    both sides run with; defaults are the configs' own."""
    from laminar_common.data.records import DataConfig
    from laminar_common.launch.jobfile import fill_placeholders, load_job
    from laminar_common.launch.layout import apply_layout, usable_cores
    from laminar_rollout.config import (
        ManagerConfig,
        TorchEngineConfig,
        VllmEngineConfig,
        WorkerConfig,
    )
    from laminar_trainer.config import (
        BufferConfig,
        CheckpointConfig,
        EvalConfig,
        LossConfig,
        OptimConfig,
        TrainerConfig,
    )

    job = load_job(path, overrides)
    job, _, _ = apply_layout(job, usable_cores())  # what laminar up will run here
    path = str(Path(path).resolve())
    run_dir = fill_placeholders(job.run_dir, {"job": job.job})
    subs = {"run_dir": run_dir, "job": job.job, "name": "worker"}

    def config(spec) -> dict:
        return fill_placeholders(dict(spec.config), subs)

    manager = ManagerConfig(**config(_tier(job, ("laminar-rollout", "manage"), "manager")))
    worker_spec = _tier(job, ("laminar-rollout", "serve"), "rollout worker")
    worker = config(worker_spec)
    trainer = config(_tier(job, ("laminar-trainer", "run"), "trainer"))
    engine = worker.get("engine", {})
    engine_configs = {"torch": TorchEngineConfig, "vllm": VllmEngineConfig}
    if engine.get("type") not in engine_configs:
        raise SystemExit(f"{path}: the workers' engine is {engine.get('type')!r}; this bench "
                         "compares a torch- or vLLM-engine job (TRL generates with "
                         "model.generate)")
    engine = {name: engine.get(name, field.default)
              for name, field in engine_configs[engine["type"]].model_fields.items()}
    if trainer.get("model_dir") != engine["model_dir"]:
        raise SystemExit(f"{path}: trainer.model_dir and the workers' engine.model_dir differ")

    def trainer_field(name: str):
        return trainer.get(name, TrainerConfig.model_fields[name].default)

    ev = EvalConfig(**trainer.get("eval", {}))
    if ev.prompts is None:
        raise SystemExit(f"{path}: the trainer has no eval.prompts (held-out accuracy)")
    return JobSettings(
        job_file=path, run_dir=run_dir, model_dir=engine["model_dir"],
        prompts=manager.prompts, data=manager.data.model_dump(), group_size=manager.group_size,
        batch_groups=trainer_field("batch_groups"), mode=manager.mode,
        max_staleness=manager.max_staleness, sampling=manager.sampling.model_dump(),
        workers=worker_spec.replicas, engine=engine,
        reward=worker.get("reward", WorkerConfig.model_fields["reward"].default),
        total_steps=trainer_field("total_steps"),
        optim=OptimConfig(**trainer.get("optim", {})).model_dump(),
        loss=LossConfig(**trainer.get("loss", {})).model_dump(),
        eval={**ev.model_dump(), "data": DataConfig.model_validate(ev.data).model_dump()},
        checkpoint=CheckpointConfig(**trainer.get("checkpoint", {})).model_dump(),
        buffer=BufferConfig(**trainer.get("buffer", {})).model_dump(),
        dtype=trainer_field("dtype"), publish_dtype=trainer_field("publish_dtype"),
        trainer_threads=trainer_field("threads"), seed=trainer_field("seed"),
        trainer_run_dir=trainer_field("run_dir"), manager_state_dir=manager.state_dir or "")


def laminar_lr_per_step(s: JobSettings) -> list[float]:
    """The LR of each trainer step, from the trainer's own optimizer and schedule."""
    import torch

    from laminar_trainer.config import OptimConfig
    from laminar_trainer.step import make_optimizer

    optimizer, scheduler = make_optimizer(torch.nn.Linear(1, 1), OptimConfig(**s.optim),
                                          s.total_steps)
    lrs = []
    for _ in range(s.total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def trl_loss_settings(s: JobSettings) -> dict:
    """GRPOConfig's loss fields for the job's ``loss`` (SystemExit: no TRL equivalent)."""
    loss = s.loss
    if loss["algorithm"] not in _TRL_SCALE_REWARDS:
        raise SystemExit(f"loss.algorithm {loss['algorithm']!r} has no GRPOTrainer equivalent")
    if loss["aggregation"] not in _TRL_LOSS_TYPE:
        raise SystemExit(f"loss.aggregation {loss['aggregation']!r} has no TRL loss_type")
    return {"loss_type": _TRL_LOSS_TYPE[loss["aggregation"]],
            "scale_rewards": _TRL_SCALE_REWARDS[loss["algorithm"]],
            "importance_sampling_level": "sequence" if loss["algorithm"] == "gspo" else "token",
            "epsilon": loss["clip_low"], "epsilon_high": loss["clip_high"],
            "beta": loss["kl_coef"], "use_bias_correction_kl": False,
            "entropy_coef": loss["entropy_coef"],
            "mask_truncated_completions": loss["overlong_filter"]}


def trl_spec(s: JobSettings, seed: int, output_dir: Path, threads: int) -> dict:
    """Everything tools/trl_grpo_run.py needs, resolved here (it reads no job file)."""
    ckpt = s.checkpoint
    return {
        "model_dir": s.model_dir, "prompts": s.prompts, "data": s.data, "reward": s.reward,
        "group_size": s.group_size, "batch_groups": s.batch_groups,
        "mini_batches": s.optim["mini_batches"], "epochs": s.optim["epochs"],
        "total_steps": s.total_steps, "max_tokens": s.sampling["max_tokens"],
        "temperature": s.sampling["temperature"], "top_p": s.sampling["top_p"],
        "top_k": s.sampling["top_k"], "lr": s.optim["lr"],
        "lr_per_step": laminar_lr_per_step(s), "weight_decay": s.optim["weight_decay"],
        "grad_clip": s.optim["grad_clip"], "bf16": s.dtype == "bfloat16",
        "eval": {k: s.eval[k] for k in ("prompts", "data", "limit", "max_new_tokens",
                                        "reward", "every_steps")},
        "checkpoint": {"every_steps": ckpt["every_steps"] if ckpt["dir"] else 0,
                       "keep": ckpt["keep"]},
        "seed": seed, "threads": threads or None, "output_dir": str(output_dir),
        "trl": trl_loss_settings(s),
    }


def run_laminar(s: JobSettings, overrides: list[str], log_path: Path,
                steps: int | None = None) -> dict:
    """``laminar up`` the job; its figures from the trainer's metrics and summary.

    ``steps`` above the job's ``total_steps`` N lets the trainer go on to that many steps
    (the LR schedule's first N steps are the same: it must be constant after warm-up):
    the N-step window, its tokens and its held-out accuracy (the in-loop eval at step N)
    come from the first N steps; the evals of the later steps only extend the run's
    accuracy-over-time (``evals``, ``eval_final``)."""
    from laminar_common.launch.report import load_metrics

    steps = steps or s.total_steps
    argv = [sys.executable, "-m", "laminar_common.launch.cli", "up", s.job_file]
    if steps != s.total_steps:
        overrides = [*overrides, f"tiers.trainer.config.total_steps={steps}"]
    for item in overrides:
        argv += ["--set", item]
    print(f"Laminar: {' '.join(argv[3:])} (log {log_path})", flush=True)
    setup_s = 0.0
    t0 = time.monotonic()
    with log_path.open("w") as log, subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if (m := _SETUP_DONE.search(line)) is not None:
                setup_s += float(m.group(1))
            if line.startswith(("[laminar up] setup done", "EVAL", "held-out")):
                print("  " + line.rstrip(), flush=True)
    wall_s = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"laminar up exited {proc.returncode}; see {log_path}")
    trainer_dir = Path(s.trainer_run_dir)
    rows, summary = load_metrics(trainer_dir)
    all_rows = [r for r in rows if r["step"] <= steps][-steps:]
    rows = all_rows[:s.total_steps]
    eval_after = summary["eval_after"]
    if steps != s.total_steps:
        eval_after = rows[-1].get("eval_accuracy")
        if eval_after is None:
            raise SystemExit(f"{log_path}: no held-out eval at step {s.total_steps} of the "
                             f"{steps}-step run (eval.every_steps must divide total_steps)")
    first = rows[0]
    start = first["time"] - first["wait_s"] - first["step_s"] - first.get("stall_s", 0.0)
    window_s = rows[-1]["time"] - start
    tokens = sum(r["tokens"] for r in rows)
    return {
        "steps": len(rows), "window_s": window_s, "tokens": tokens,
        "tokens_per_s": tokens / window_s, "wall_s": wall_s, "setup_s": setup_s,
        "eval_before": summary["eval_before"], "eval_after": eval_after,
        # "t": from the window's start to the evaluated weights (the row is stamped before
        # the step's eval; earlier evals count, as on TRL's side).
        "evals": [{"step": r["step"], "accuracy": r["eval_accuracy"], "t": r["time"] - start}
                  for r in all_rows if r.get("eval_accuracy") is not None],
        "steps_run": len(all_rows), "eval_final": summary["eval_after"],
        "window_all_s": all_rows[-1]["time"] - start,
        "reward_first": first["reward_mean"], "reward_last": rows[-1]["reward_mean"],
        "rewards": [r["reward_mean"] for r in rows], "staleness_hist": summary["staleness_hist"],
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "summary_tokens_per_s": summary["tokens_per_s"], "trainer_run_dir": str(trainer_dir),
        "train_compute_s": sum(r["step_s"] for r in rows),
    }


def run_trl(trl_python: Path, spec: dict, work: Path) -> dict:
    """One TRL run in TRL's environment (a subprocess: its own interpreter)."""
    seed = spec["seed"]
    spec_path, out_path = work / f"trl-seed{seed}.spec.json", work / f"trl-seed{seed}.json"
    log_path = work / f"trl-seed{seed}.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    # TRL's interpreter must not see Laminar's venv or path.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    argv = [str(trl_python), str(TRL_SCRIPT), "--spec", str(spec_path), "--out", str(out_path)]
    print(f"TRL seed {seed}: {TRL_SCRIPT.name} (log {log_path})", flush=True)
    t0 = time.monotonic()
    with log_path.open("w") as log, subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("TRL eval"):
                print("  " + line.rstrip(), flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run (seed {seed}) exited {proc.returncode}; see {log_path}")
    result = json.loads(out_path.read_text())
    result["process_wall_s"] = time.monotonic() - t0
    return result


def time_to(run: dict, target: float) -> float | None:
    """Seconds into ``run``'s window until its held-out accuracy first reached ``target``:
    the evals inside the window, then the final weights at the end of the run (its last
    step: the window's end, or later where a Laminar run went on past it); None if never
    (the accuracy before training counts at 0 s)."""
    return next((p["t"] for p in accuracy_over_time(run) if p["accuracy"] >= target - 1e-9),
                None)


def accuracy_over_time(run: dict) -> list[dict]:
    """The run's held-out accuracies in time order: before training (step 0, 0 s), the
    in-loop evals, and the final weights at the run's last step."""
    points = [{"step": 0, "accuracy": run["eval_before"], "t": 0.0}]
    points += [e for e in run.get("evals", []) if "t" in e]
    points.append({"step": run.get("steps_run", run.get("steps")),
                   "accuracy": run.get("eval_final", run["eval_after"]),
                   "t": run.get("window_all_s", run["window_s"])})
    return sorted(points, key=lambda p: p["t"])


def accuracy_at(run: dict, seconds: float) -> float:
    """The accuracy of the run's last eval at or before ``seconds`` into its window."""
    return [p for p in accuracy_over_time(run) if p["t"] <= seconds + 1e-9][-1]["accuracy"]


def reuse_setup(first_run_dir: Path, run_dir: Path, s: JobSettings) -> None:
    """Copy the first Laminar run's set-up outputs (model, prompt files) into ``run_dir``
    so the job's set-up finds them and leaves them: every run starts from the same model.
    The launcher's and the tiers' own state (trainer, checkpoints, manager, logs, etcd)
    is not copied."""
    skip = {Path(p).resolve() for p in (s.trainer_run_dir, s.checkpoint["dir"] or "",
                                        s.manager_state_dir) if p}
    own = {"logs", "configs", "etcd", "launch.json", "launch.lock"}

    def ignore(directory: str, names: list[str]) -> list[str]:
        here = Path(directory)
        return [n for n in names if (here == first_run_dir and n in own)
                or (run_dir / (here / n).relative_to(first_run_dir)).resolve() in skip]

    shutil.copytree(first_run_dir, run_dir, ignore=ignore, dirs_exist_ok=True)


def compare_settings(s: JobSettings, lam: dict, trls: list[dict]) -> tuple[list[str], list[str]]:
    """Every setting matched, and every difference left, in words."""
    import transformers

    trl0 = trls[0]
    m, e = s.optim["mini_batches"], s.optim["epochs"]
    n = s.batch_groups * s.group_size
    samp, loss, ev = s.sampling, s.loss, s.eval
    cfg = trl0["trl_config"]
    matched = [
        f"model: the same save_pretrained directory ({s.model_dir}), loaded in fp32 on both "
        "sides",
        f"train prompts: the same file ({s.prompts})",
        f"step: {s.batch_groups} prompts x {s.group_size} samples = {n} completions, "
        f"{s.total_steps} steps (TRL: generation_batch_size {cfg['generation_batch_size']}, "
        f"num_generations {cfg['num_generations']})",
        f"sampling: max_tokens {samp['max_tokens']}, temperature {samp['temperature']}, "
        f"top_p {samp['top_p']}, top_k {samp['top_k']} (TRL max_completion_length, "
        "temperature, top_p, top_k); log-probs at the sampling temperature on both sides",
        f"reward: the job's {s.reward} through laminar_common.data.rewards.score, on the "
        "completion decoded alike (a trailing EOS dropped, other special tokens kept)",
        f"advantages: {loss['algorithm']} "
        + ("(r - group mean) / (group std, Bessel) (TRL scale_rewards=group)"
           if _TRL_SCALE_REWARDS[loss["algorithm"]] == "group" else
           "r - group mean (TRL scale_rewards=none)")
        + "; zero for a group of equal rewards",
        f"objective: PPO clip [1 - {loss['clip_low']}, 1 + {loss['clip_high']}] "
        f"per {'sequence' if loss['algorithm'] == 'gspo' else 'token'}, {loss['aggregation']}"
        f" over each mini-batch (TRL loss_type={cfg['loss_type']}, epsilon "
        f"{cfg['epsilon']}, epsilon_high {cfg['epsilon_high']})",
        ("KL: off" if not loss["kl_coef"] else
         f"KL: k3 to the initial policy, coef {loss['kl_coef']:g}")
        + f" (TRL beta {cfg['beta']}); entropy bonus {loss['entropy_coef']}; truncated "
        f"completions {'masked' if loss['overlong_filter'] else 'kept'} in the loss",
        f"updates: {m} mini-batch(es) x {e} epoch(s) = {m * e} optimizer update(s) a step of "
        f"{n // m} completions each; the clip anchored at the weights of the step's start "
        f"(TRL steps_per_generation {m}, num_iterations {e}, per_device_train_batch_size "
        f"{cfg['per_device_train_batch_size']}: old log-probs computed once per generation)",
        f"optimizer: torch.optim.AdamW (default betas, eps), weight decay "
        f"{s.optim['weight_decay']}, grad-norm clip {s.optim['grad_clip']}",
        f"LR: Laminar's make_optimizer schedule (peak {s.optim['lr']}, {s.optim['warmup_steps']}"
        f" warm-up steps, {s.optim['schedule']}) stepped once per trainer step, given to TRL as"
        f" a LambdaLR over its {m * e} updates a step",
        f"precision: {s.dtype} training (TRL bf16={cfg['bf16']})",
        f"held-out: the first {ev['limit']} records of {ev['prompts']}, greedy, "
        f"{ev['max_new_tokens']} new tokens, reward {ev['reward']}, before and after training"
        + (f"; also after every {ev['every_steps']} steps inside the timed window on both "
           "sides" if ev["every_steps"] else ""),
        "timed window: the first step's start (its data: generation / pipeline fill) to the "
        "last step's end; tokens = completion tokens, EOS included",
    ]
    if s.checkpoint["dir"]:
        matched.append(f"checkpoints every {s.checkpoint['every_steps']} steps, "
                       f"{s.checkpoint['keep']} kept (TRL save_steps "
                       f"{s.checkpoint['every_steps'] * m * e}, save_total_limit "
                       f"{s.checkpoint['keep']}; each side's own format)")
    hist = ", ".join(f"{k}: {v}" for k, v in lam["staleness_hist"].items())
    differences = [
        f"on/off-policy: Laminar runs mode {s.mode} (max_staleness {s.max_staleness}; "
        f"trajectories by staleness {{{hist}}}), corrected by {loss['correction']} PPO"
        + (f" (importance weight min(pi_prox / mu, {loss['tis_cap']}); pi_prox "
           + ("recomputed by a forward at the step's start"
              if loss["proximal"] == "recompute" else
              "interpolated log-linearly between mu and pi by version, no forward "
              "(loss.proximal loglinear)") + ")"
           if loss["correction"] == "decoupled" else "")
        + "; TRL is synchronous and on-policy: each generation batch is sampled by the "
        "current weights, then trained on, with no behaviour-policy correction",
        f"behaviour weights: Laminar's engines ({s.engine['dtype']}) sample with weights "
        f"published in {s.publish_dtype}; TRL samples with its {s.dtype} training weights",
        f"process layout: Laminar runs etcd, a relay, the manager, {s.workers} rollout "
        f"worker(s) ({s.engine['type']} engine"
        + (f", {s.engine['threads']} thread(s) each" if "threads" in s.engine else "")
        + ", continuous batching,"
        f" max_batch {s.engine['max_batch']}) and the trainer ({s.trainer_threads} thread(s))"
        " as separate processes, generation overlapping training; TRL runs one process "
        f"({trl0['torch_threads']} torch threads) that alternates model.generate on the whole"
        f" generation batch ({n} rows, padded, static) and training",
        "weights: Laminar publishes every step through the relay to the workers; TRL "
        "generates with the weights it trains",
        "rewards: Laminar scores on reward threads in the workers, off the decode loop; TRL "
        "scores in its one process after generation",
        f"step batch: Laminar's step takes the first {s.batch_groups} complete groups to "
        f"arrive (completion order, prompts dispatched in "
        f"{'shuffled' if s.data['shuffle'] else 'file'} order); TRL's takes the next "
        f"{s.batch_groups} prompts of the file (shuffle_dataset=False)",
        (f"mini-batches: Laminar streams them (optim.stream): each of the step's "
         f"{m} updates starts once its {s.batch_groups // m} groups are complete, in "
         "arrival order (short answers first), so generating the step's long answers "
         "overlaps training on its short ones; TRL generates the whole batch, then "
         "shuffles its completions before splitting"
         if s.optim.get("stream") else
         "mini-batches: Laminar shuffles the step's groups (optim.shuffle) and splits them, "
         "whole groups each; TRL shuffles the step's completions before splitting"
         if s.optim.get("shuffle", True) else
         "mini-batches: Laminar splits the step's groups in arrival order (optim.shuffle "
         "off), whole groups each; TRL shuffles the step's completions before splitting")
        if m > 1 else
        "mini-batches: one update a step on both sides",
        "advantage epsilon: Laminar divides by std + 1e-6, TRL by std + 1e-4",
        "in-training evals: Laminar's trainer evaluates while the workers keep generating "
        "(up to the staleness bound); TRL's evals stop everything" if ev["every_steps"] else
        "in-training evals: none",
        f"seeds: sampling RNG streams differ (Laminar engine seed {s.engine['seed']} per "
        f"worker, trainer seed {s.seed}; TRL seed(s) {[t['seed'] for t in trls]})",
        f"wall time: Laminar's covers the job's setup ({lam['setup_s']:.1f}s: warm start, "
        "prompt files), etcd and every process's start; TRL's covers its imports, model "
        "load, the evals and training, not the setup (it reuses Laminar's model and files)",
    ]
    if trl0["versions"]["transformers"] != transformers.__version__:
        differences.append(f"transformers {transformers.__version__} (Laminar) vs "
                           f"{trl0['versions']['transformers']} (TRL)")
    if loss["overlong_buffer"]:
        differences.append(f"soft overlong punishment (buffer {loss['overlong_buffer']}): "
                           "Laminar only")
    if s.buffer["dynamic_sampling"]:
        differences.append("dynamic sampling (equal-reward groups dropped): Laminar only")
    if s.optim.get("micro_batch_tokens"):
        differences.append(f"micro-batches: Laminar runs each mini-batch in forward/backward "
                           f"passes of about {s.optim['micro_batch_tokens']} padded tokens, "
                           "trajectories sorted by length (the same gradient, less padding); TRL "
                           "pads each mini-batch to its longest completion")
    if loss["aggregation"] == "seq-mean-token-sum-norm" and loss["norm_tokens"] not in (
            None, samp["max_tokens"]):
        differences.append(f"Dr. GRPO constant: Laminar {loss['norm_tokens']}, TRL "
                           f"max_completion_length {samp['max_tokens']}")
    if loss["kl_coef"]:
        differences.append("KL: TRL's k3 per token with use_bias_correction_kl=False, "
                           "Laminar's k3 aggregated like the policy loss")
    return matched, differences


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def report(s: JobSettings, lams: list[dict], trls: list[dict], matched: list[str],
           differences: list[str], variant: str = "") -> dict:
    trl = {key: _mean([t[key] for t in trls]) for key in (
        "window_s", "tokens", "tokens_per_s", "eval_before", "eval_after", "process_wall_s",
        "generate_s", "reward_first", "reward_last")}
    lam = {key: _mean([r[key] for r in lams]) for key in (
        "window_s", "tokens", "tokens_per_s", "eval_before", "eval_after", "wall_s", "setup_s",
        "reward_first", "reward_last", "train_compute_s", "trainer_idle_fraction")}
    lam_wall_no_setup = lam["wall_s"] - lam["setup_s"]
    # Laminar runs that went on past the N steps (--laminar-steps): their wall time
    # covers the later steps too, so it is not set against TRL's.
    went_on = max(r.get("steps_run", s.total_steps) for r in lams)
    ratios = {"tokens_per_s": lam["tokens_per_s"] / trl["tokens_per_s"],
              "window_s": lam["window_s"] / trl["window_s"],
              "wall_s_without_setup": (lam_wall_no_setup / trl["process_wall_s"]
                                       if went_on == s.total_steps else None)}
    seeds = f" (mean of {len(trls)} seeds)" if len(trls) > 1 else ""
    runs = f" (mean of {len(lams)} runs)" if len(lams) > 1 else ""
    print(f"\n{Path(s.job_file).name}{f' (variant {variant})' if variant else ''}: "
          f"{s.total_steps} steps of {s.batch_groups} x "
          f"{s.group_size}, {s.optim['mini_batches']} update(s) a step; "
          f"Laminar{runs}, TRL {trls[0]['versions']['trl']}{seeds}")
    print(f"{'':34}{'Laminar':>12}{'TRL':>12}{'Laminar/TRL':>13}")

    def line(label: str, a: float, b: float, fmt: str, ratio: float | None = None) -> None:
        tail = f"{ratio:>12.2f}x" if ratio is not None else ""
        print(f"{label:34}{format(a, fmt):>12}{format(b, fmt):>12}{tail}")

    line(f"{s.total_steps}-step window (s)", lam["window_s"], trl["window_s"], ".1f",
         ratios["window_s"])
    line("tokens in the window", lam["tokens"], trl["tokens"], ".0f")
    line("tokens/s", lam["tokens_per_s"], trl["tokens_per_s"], ".1f", ratios["tokens_per_s"])
    if went_on == s.total_steps:
        line("wall without setup (s)", lam_wall_no_setup, trl["process_wall_s"], ".1f",
             ratios["wall_s_without_setup"])
        print(f"{'job wall, setup included (s)':34}{lam['wall_s']:>12.1f}{'':>12}"
              f"   (setup {lam['setup_s']:.1f}s)")
    else:
        print(f"(Laminar went on to {went_on} steps for accuracy over time: its whole wall "
              f"time, {lam['wall_s']:.1f}s with setup {lam['setup_s']:.1f}s, covers them; the "
              f"rows here are its first {s.total_steps} steps)")
    line("held-out accuracy before", lam["eval_before"], trl["eval_before"], ".3f")
    line("held-out accuracy after", lam["eval_after"], trl["eval_after"], ".3f")
    line("gain (points)", 100 * (lam["eval_after"] - lam["eval_before"]),
         100 * (trl["eval_after"] - trl["eval_before"]), "+.1f")
    line("train reward, first step", lam["reward_first"], trl["reward_first"], ".3f")
    line("train reward, last step", lam["reward_last"], trl["reward_last"], ".3f")
    print(f"TRL time generating and scoring: {trl['generate_s']:.1f}s of its window, training "
          f"the rest ({trl['window_s'] - trl['generate_s']:.1f}s); Laminar trainer steps "
          f"{lam['train_compute_s']:.1f}s of its window (beside generation), idle "
          f"{100 * lam['trainer_idle_fraction']:.0f}% of its run")
    for i, r in enumerate(lams if len(lams) > 1 else []):
        print(f"  Laminar run {i + 1}: window {r['window_s']:.1f}s, {r['tokens_per_s']:.1f} "
              f"tokens/s, held-out {r['eval_before']:.3f} -> {r['eval_after']:.3f}")
    if len(trls) > 1:
        for t in trls:
            print(f"  TRL seed {t['seed']}: window {t['window_s']:.1f}s, "
                  f"{t['tokens_per_s']:.1f} tokens/s, held-out {t['eval_before']:.3f} -> "
                  f"{t['eval_after']:.3f}")
    target = trl["eval_after"]

    def reached(runs: list[dict]) -> str:
        return ", ".join("not reached" if (t := time_to(r, target)) is None else f"{t:.1f}s"
                         for r in runs)
    to_target = {"target": target, "laminar": [time_to(r, target) for r in lams],
                 "trl": [time_to(t, target) for t in trls]}
    print(f"time to TRL's final held-out accuracy ({target:.3f}{', the seeds mean' if seeds else ''}"
          f"; evals every {s.eval['every_steps'] or '-'} steps and the final weights"
          + (f"; Laminar over {went_on} steps" if went_on > s.total_steps else "")
          + f"): Laminar {reached(lams)}; TRL {reached(trls)}")
    print("held-out accuracy over time (step: accuracy at seconds into the window):")
    for name, r in [*((f"Laminar run {i + 1}", r) for i, r in enumerate(lams)),
                    *((f"TRL seed {t['seed']}", t) for t in trls)]:
        print(f"  {name}: " + ", ".join(
            f"{p['step']}: {p['accuracy']:.3f} at {p['t']:.1f}s"
            for p in accuracy_over_time(r)))
    at_trl = [accuracy_at(r, trl["window_s"]) for r in lams]
    print(f"Laminar's held-out accuracy at TRL's mean window ({trl['window_s']:.1f}s; its last "
          f"eval by then): {', '.join(f'{a:.3f}' for a in at_trl)} (mean "
          f"{_mean(at_trl):.3f}; TRL's final {target:.3f})")
    print("\nMatched:")
    for item in matched:
        print(f"  - {item}")
    print("Differences left:")
    for item in differences:
        print(f"  - {item}")
    return {"job": asdict(s), "laminar_runs": lams, "laminar_mean": lam, "trl_runs": trls,
            "trl_mean": trl, "ratios_laminar_over_trl": ratios, "time_to_trl_final": to_target,
            "laminar_accuracy_at_trl_window": at_trl,
            "matched": matched, "differences": differences}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=str(ROOT / "examples" / "demo.yaml"),
                   help="laminar up job file (torch or vLLM engine, eval.prompts set)")
    p.add_argument("--seeds", type=int, default=1, help="TRL runs, seeds 0..N-1")
    p.add_argument("--laminar-runs", type=int, default=1,
                   help="Laminar runs of the job (the later ones reuse the first's set-up)")
    p.add_argument("--laminar-steps", type=int, default=0, metavar="M",
                   help="let each Laminar run go on to M steps (> the job's total_steps N; "
                        "LR schedule constant after warm-up) for its accuracy over time and "
                        "time to TRL's final accuracy; the N-step figures come from its first "
                        "N steps (0: stop at N, like TRL)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                   help="job-file override for both sides (repeatable), e.g. "
                        "tiers.trainer.config.total_steps=5")
    p.add_argument("--laminar-variant", dest="variants", action="append", default=[],
                   metavar="NAME:A.B=C",
                   help="also run Laminar with this override (repeat a NAME for several), "
                        "--laminar-runs times, each reported against the same TRL seeds, "
                        "e.g. s0:tiers.manager.config.max_staleness=0")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", str(DEFAULT_TRL_PYTHON)),
                   help="TRL's environment's interpreter (tools/trl_env.sh builds it)")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="torch threads of the TRL process (0: torch's default)")
    p.add_argument("--work-dir", default=None,
                   help="where both runs write (default: a new temp dir, kept)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.laminar_runs < 1:
        p.error("--seeds and --laminar-runs must be >= 1")
    trl_python = Path(args.trl_python)
    if not trl_python.is_file():
        p.error(f"no TRL environment at {trl_python}: run tools/trl_env.sh first")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_vs_trl-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, f"run_dir={work / 'laminar'}"]
    settings = read_job_settings(args.job, overrides)
    trl_loss_settings(settings)  # fail before the runs on a loss TRL cannot express
    steps = args.laminar_steps or settings.total_steps
    if steps < settings.total_steps:
        p.error(f"--laminar-steps {steps} is below the job's total_steps "
                f"{settings.total_steps}")
    if steps > settings.total_steps:
        every = settings.eval["every_steps"]
        if not every or settings.total_steps % every:
            p.error(f"--laminar-steps needs a held-out eval at step {settings.total_steps}: "
                    f"set eval.every_steps to a divisor of it (now {every})")
        if settings.optim["schedule"] != "constant":
            p.error("--laminar-steps needs optim.schedule constant (a "
                    f"{settings.optim['schedule']} schedule would differ over the first "
                    f"{settings.total_steps} steps)")
    print(f"work dir: {work}", flush=True)

    variants: dict[str, list[str]] = {}
    for item in args.variants:
        name, sep, override = item.partition(":")
        if not sep or not name or name == "job" or "=" not in override:
            p.error(f"--laminar-variant {item!r}: expected NAME:A.B=C (NAME not 'job')")
        variants.setdefault(name, []).append(override)
    for extra in variants.values():
        read_job_settings(args.job, [*args.overrides, *extra])  # refused before any run

    lams = [run_laminar(settings, overrides, work / "laminar-up.log", steps)]
    first_run_dir = Path(settings.run_dir).resolve()
    variant_runs: dict[str, tuple[JobSettings, list[dict]]] = {}
    for name, extra in {"job": [], **variants}.items():
        for i in range(2 if name == "job" else 1, args.laminar_runs + 1):
            tag = f"{i}" if name == "job" else f"{name}-{i}"
            run_overrides = [*args.overrides, *extra, f"run_dir={work / f'laminar-{tag}'}"]
            run_settings = read_job_settings(args.job, run_overrides)
            reuse_setup(first_run_dir, Path(run_settings.run_dir).resolve(), run_settings)
            run = run_laminar(run_settings, run_overrides, work / f"laminar-up-{tag}.log", steps)
            if name == "job":
                lams.append(run)
            else:
                variant_runs.setdefault(name, (run_settings, []))[1].append(run)
    trls = []
    for seed in range(args.seeds):
        spec = trl_spec(settings, seed, work / f"trl-seed{seed}", args.trl_threads)
        trls.append(run_trl(trl_python, spec, work))
    matched, differences = compare_settings(settings, lams[0], trls)
    result = report(settings, lams, trls, matched, differences)
    for name, (run_settings, runs) in variant_runs.items():
        matched, differences = compare_settings(run_settings, runs[0], trls)
        result.setdefault("variants", {})[name] = {
            "overrides": variants[name],
            **report(run_settings, runs, trls, matched, differences,
                     variant=f"{name}: {', '.join(variants[name])}")}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
