"""Generate a recorded trajectory again, from its seed and its weight version.

``laminar replay RUN_DIR --trajectory ID`` finds the trajectory in the trainer's step
records (``laminar_common.data.provenance``), takes the weights of its policy version from the
trainer's checkpoints (the checkpoint whose version it is; version 0 is the job's
initial model), casts them to the dtype the trainer published (what the workers
loaded), loads them into a torch engine and samples the prompt again with the
trajectory's own seed and sampling parameters. A seeded row draws each token from a
generator seeded by ``(seed, position)`` alone (``engines._sampling``), so the tokens
come out the same whatever batch the worker sampled it in; log-probs agree to float
rounding (the worker computed them in a batch).

Limits, said by the errors: the job must sample with a seed (the manager's
``sampling.seed``); single-turn trajectories only (a multi-turn one needs its
environment's tool results); a checkpoint must hold the version; the engine's dtype is
``--dtype`` (the rollout's, default float32). vLLM's seeded sampling is not
reproduced here (see docs/provenance.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from laminar_common.codec import Trajectory
from laminar_common.data.provenance import find_records, find_trajectory
from laminar_common.errors import LaminarError

__all__ = ["Regenerated", "regenerate", "main"]


@dataclass
class Regenerated:
    trajectory: Trajectory
    token_ids: list[int]
    logprobs: list[float]
    weights: str
    """Where the version's weights came from."""

    @property
    def same_tokens(self) -> bool:
        return tuple(self.token_ids) == self.trajectory.response_token_ids

    @property
    def logprob_diff(self) -> float:
        pairs = zip(self.logprobs, self.trajectory.behaviour_logprobs)
        return max((abs(a - b) for a, b in pairs), default=0.0)

    def describe(self) -> str:
        t = self.trajectory
        head = (f"trajectory {t.trajectory_id} (v{t.policy_version}, seed {t.sampling.seed}, "
                f"weights from {self.weights}): ")
        if self.same_tokens:
            return (head + f"the same {len(self.token_ids)} tokens; log-probs within "
                    f"{self.logprob_diff:.2e} of the recorded ones")
        first = next((i for i, (a, b) in enumerate(zip(self.token_ids, t.response_token_ids))
                      if a != b), min(len(self.token_ids), len(t.response_token_ids)))
        return (head + f"tokens differ from position {first} ({len(self.token_ids)} generated, "
                f"{len(t.response_token_ids)} recorded): another engine dtype, device or "
                "library version, or weights that are not the ones the worker loaded")


def _weights_of(version: int, ckpt_dir: Path, cfg: dict) -> tuple[str, Path]:
    """The weights published as ``version``: the checkpoint of the step that published
    it (its trainer state names the version, and the step is one that publishes), or,
    for version 0, the job's initial model."""
    import json

    every, total = int(cfg.get("publish_every", 1)), int(cfg.get("total_steps", 0))
    for path in sorted(p for p in ckpt_dir.glob("step-*")
                       if p.is_dir() and not p.name.endswith(".tmp")):
        state = path / "trainer_state" / "trainer.json"
        if not state.is_file():
            continue
        saved = json.loads(state.read_text())
        if saved.get("version") != version or not (
                saved.get("step", -1) % every == 0 or saved.get("step") == total):
            continue
        if not (path / "model" / "config.json").is_file():
            raise LaminarError(f"checkpoint {path} holds version {version} but no model "
                               "directory (a sharded checkpoint: laminar-trainer export it "
                               "first)")
        return f"checkpoint {path.name}", path / "model"
    model_dir = Path(cfg["model_dir"])
    if version == 0 and (model_dir / "config.json").is_file():
        return f"the initial model {model_dir}", model_dir
    raise LaminarError(f"no checkpoint in {ckpt_dir} holds the weights published as version "
                       f"{version} (keep more checkpoints, checkpoint.keep; a resumed run "
                       "publishes its checkpoint's weights as a new version no checkpoint "
                       "names)" + ("" if version else f"; the initial model {model_dir} is "
                                   "not there"))


def regenerate(run_dir: str | Path, trajectory_id: str, dtype: str = "float32") -> Regenerated:
    """Generate ``trajectory_id`` again (see the module docstring).

    Raises:
        LaminarError: it cannot be regenerated (says why).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .engines import GenerationRequest, SamplingParams, TorchEngine

    records_dir, ckpt_dir = find_records(run_dir)
    record, traj = find_trajectory(records_dir, trajectory_id)
    s = traj.sampling
    if traj.simulated:
        raise LaminarError(f"trajectory {trajectory_id} came from a simulated engine")
    if s.seed is None:
        raise LaminarError(f"trajectory {trajectory_id} was sampled without a seed: set "
                           "sampling.seed on the manager to make a job's trajectories "
                           "regenerable")
    if traj.observation_spans:
        raise LaminarError(f"trajectory {trajectory_id} is multi-turn: its tool results came "
                           "from its environment; only single-turn ones are regenerated")
    cfg = record.config
    where, source = _weights_of(traj.policy_version, ckpt_dir, cfg)
    published = getattr(torch, cfg.get("publish_dtype", "float32"))
    engine = TorchEngine(cfg["model_dir"], max_batch=1, dtype=getattr(torch, dtype),
                         weight_version=0)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    # What a worker loaded: the master weights cast to the dtype the trainer published.
    engine.load_weights(traj.policy_version, (
        (name, t.to(published) if t.is_floating_point() else t)
        for name, t in model.state_dict().items()))
    del model
    engine.add_request(GenerationRequest(
        request_id=trajectory_id, prompt_token_ids=list(traj.prompt_token_ids),
        params=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_tokens=s.max_tokens, stop_token_ids=tuple(s.stop_token_ids),
                              seed=s.seed)))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    out = next(o for o in outputs if o.request_id == trajectory_id)
    return Regenerated(traj, list(out.token_ids), list(out.logprobs), where)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="laminar replay --trajectory",
                                description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--trajectory", required=True, help="the trajectory id")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the rollout engine's dtype (engine.dtype)")
    args = p.parse_args(argv)
    try:
        result = regenerate(args.run_dir, args.trajectory, args.dtype)
    except LaminarError as exc:
        print(f"laminar replay: {exc}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0 if result.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
