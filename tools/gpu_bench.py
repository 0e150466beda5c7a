"""The GPU benchmark of tools/gpu_check.sh: Laminar's figures at a real model shape.

At ``--shape qwen2.5-0.5b`` (the default on a GPU) it builds a random-init model with
Qwen2.5-0.5B's config in bf16 (about 0.5 B parameters, 0.99 GB of bf16 weights; no
download), and measures, each part side by side with its baseline in the same run:

1. torch-engine decode tokens/s at batch 1 / 32 / 128, and continuous vs static
   batching on a long-tail length mix (p99 ~ 10x the median; lengths forced with
   EOS off, so both sides generate the same tokens);
2. one GRPO training step (``train_step``: bf16 mixed precision, fp32 master
   weights, micro-batches): step time, tokens/s, peak GPU memory;
3. the publish stall: the device-to-host bf16 snapshot the trainer pays per
   version, and the host memory it takes;
4. relay broadcast of a version of that size through chains of 1 / 2 / 4 relays
   (``tools/bench_relay.py``; ratio to the raw ZeroMQ data plane of the same run);
5. a short (20-step) end-to-end laminar-mode run (``laminar up examples/demo.yaml``) with the
   trainer and one torch-engine worker sharing the GPU: held-out accuracy before
   and after.

``--cpu`` runs every part at small shapes on the CPU (so the script cannot rot; its
figures say nothing about a GPU). Everything printed also goes to ``--out``
(``gpu_bench.json`` and the relay/end-to-end logs). Exit status 1 when a part failed
(the others still run; the failure is printed and in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Inside the ~8 minutes gpu_check.sh has on the GPU machine: a hang is a failed part,
# recorded, not a whole run killed from outside.
RELAY_TIMEOUT_S = 150
E2E_TIMEOUT_S = 240

SHAPES = {
    # Qwen2.5-0.5B's config.json (hidden, layers, heads, KV heads, MLP, vocab, tied).
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=True),
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="small shapes on the CPU (a check)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape (default: qwen2.5-0.5b on a GPU, tiny with --cpu)")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_bench",
                   help="where the JSON and logs go (default: $OUT, else runs/gpu_bench)")
    p.add_argument("--parts", default="engine,trainer,publish,relay,e2e",
                   help="comma list of parts to run")
    p.add_argument("--e2e-steps", type=int, default=None,
                   help="steps of the end-to-end run (default 20 on a GPU, 3 with --cpu)")
    return p.parse_args(argv)


class Report:
    """Prints a line and keeps it (and figures) for the JSON."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"parts": {}, "failed": {}}
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_bench.json").write_text(json.dumps(self.data, indent=2))
        (self.out / "gpu_bench.txt").write_text("\n".join(self.lines) + "\n")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def build_model_dir(shape: str, dtype, where: Path) -> Path:
    """A random-init model of ``shape`` saved with save_pretrained (+ a tokenizer)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from laminar_examples.demo_model import build_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], initializer_range=0.02)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(where)
    build_tokenizer().save_pretrained(where)
    return where


# -- 1. engine ------------------------------------------------------------------------


def part_engine(rep: Report, model_dir: Path, device, dtype, small: bool) -> None:
    import numpy as np

    from laminar_rollout.engines import GenerationRequest, SamplingParams, make_engine

    shape = SHAPES[rep.data["shape"]]  # the model built for this run
    vocab = shape["vocab_size"]
    prompt_len, decode = (16, 16) if small else (64, 128)
    rng = np.random.default_rng(0)

    def requests(n: int, lengths: list[int], tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", [int(x) for x in rng.integers(4, vocab, prompt_len)],
                                  SamplingParams(temperature=1.0, max_tokens=int(lengths[i]),
                                                 seed=i))
                for i in range(n)]

    def engine(max_batch: int):
        return make_engine("torch", model=str(model_dir), max_batch=max_batch,
                           context_length=min(4096, shape["max_position_embeddings"]),
                           device=str(device), dtype=dtype, eos_token_ids=(), seed=0)

    rows = {}
    rep.say(f"[engine] torch engine, {dtype}, prompt {prompt_len} tokens, {decode} new "
            "tokens per request, temperature 1.0")
    warm = engine(8)
    warm.run_until_done(requests(2, [4, 4], "w"))
    del warm
    for batch in (1, 32, 128):
        eng = engine(batch)  # outside the timed region
        reqs = requests(batch, [decode] * batch, f"b{batch}-")
        _sync(device)
        t0 = time.perf_counter()
        outs = eng.run_until_done(reqs)
        _sync(device)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        rows[batch] = tokens / dt
        rep.say(f"[engine] batch {batch:4d}: {tokens / dt:10.1f} tokens/s "
                f"({tokens} tokens in {dt:.2f} s)")
        del eng
    # Long tail: log-normal lengths, p99 = 10x the median.
    n, slots, median = (32, 8, 8) if small else (256, 64, 64)
    sigma = math.log(10.0) / 2.3263
    lengths = [int(min(max(1, round(median * math.exp(sigma * z))), 10 * median * 3))
               for z in rng.standard_normal(n)]
    p50, p99 = float(np.percentile(lengths, 50)), float(np.percentile(lengths, 99))
    tail = requests(n, lengths, "t")
    results = {}
    for mode in ("static", "continuous"):
        eng = engine(slots)  # built (and its cache allocated) outside the timed region
        _sync(device)
        t0 = time.perf_counter()
        tokens = 0
        if mode == "continuous":
            tokens = sum(len(o.token_ids) for o in eng.run_until_done(tail))
        else:  # each wave waits for its longest member before the next starts
            for i in range(0, n, slots):
                tokens += sum(len(o.token_ids) for o in eng.run_until_done(tail[i:i + slots]))
        _sync(device)
        results[mode] = tokens / (time.perf_counter() - t0)
        del eng
    ratio = results["continuous"] / results["static"]
    rep.say(f"[engine] long tail ({n} requests, {slots} slots, lengths p50 {p50:.0f} p99 "
            f"{p99:.0f}, p99/p50 {p99 / p50:.1f}): continuous {results['continuous']:.1f} "
            f"tokens/s, static {results['static']:.1f} tokens/s, ratio {ratio:.2f}x")
    rep.data["parts"]["engine"] = {"tokens_per_s_by_batch": rows, "long_tail": {
        **results, "ratio": ratio, "p50": p50, "p99": p99, "requests": n, "slots": slots}}


# -- 2. trainer step ------------------------------------------------------------------


def _groups(n_groups: int, size: int, prompt_len: int, max_resp: int, vocab: int, seed: int):
    import torch

    from laminar_common.codec import Trajectory
    from laminar_trainer.buffer import Group

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(n_groups):
        prompt = tuple(int(x) for x in torch.randint(4, vocab, (prompt_len,), generator=gen))
        trajs = {}
        for i in range(size):
            n = int(torch.randint(max_resp // 8, max_resp + 1, (1,), generator=gen))
            resp = tuple(int(x) for x in torch.randint(4, vocab, (n,), generator=gen))
            trajs[i] = Trajectory(
                trajectory_id=f"s{seed}g{g}#{i}", prompt_id=f"s{seed}g{g}", group_size=size,
                sample_index=i, worker_id="bench", policy_version=0, prompt_token_ids=prompt,
                response_token_ids=resp,
                behaviour_logprobs=tuple(-2.0 for _ in range(n)),
                reward=float((g + i) % 2), finish_reason="stop")
        out.append(Group(f"s{seed}g{g}", size, trajs))
    return out


def part_trainer(rep: Report, model_dir: Path, device, small: bool) -> object:
    import torch

    from laminar_trainer.config import TrainerConfig
    from laminar_trainer.policy import build_training
    from laminar_trainer.step import train_step

    vocab = SHAPES[rep.data["shape"]]["vocab_size"]  # the model built for this run
    groups, size, prompt_len, max_resp = (2, 4, 16, 32) if small else (16, 8, 128, 512)
    cfg = TrainerConfig(model_dir=str(model_dir), device=device.type,
                        dtype="float32" if small else "bfloat16", batch_groups=groups,
                        activation_checkpointing=not small,
                        optim={"lr": 1e-6, "micro_batch_groups": 1 if small else 2})
    training = build_training(cfg, None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, tokens = [], 0
    for s in range(3):
        batch = _groups(groups, size, prompt_len, max_resp, vocab, s)
        _sync(device)
        t0 = time.perf_counter()
        train_step(training.model, training.optimizer, training.scheduler, batch, cfg)
        _sync(device)
        if s:  # the first step warms up (allocator, kernels)
            times.append(time.perf_counter() - t0)
            tokens += sum(len(t.prompt_token_ids) + len(t.response_token_ids)
                          for g in batch for t in g.trajectories())
    step_s = sum(times) / len(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    params = sum(p.numel() for p in training.model.parameters())
    rep.say(f"[trainer] {params / 1e6:.1f} M parameters, {cfg.dtype} "
            f"(fp32 master weights), {groups} groups x {size} samples, responses up to "
            f"{max_resp} tokens, activation checkpointing {cfg.activation_checkpointing}")
    rep.say(f"[trainer] step {step_s:.3f} s, {tokens / sum(times):.0f} tokens/s"
            + (f", peak GPU memory {peak:.1f} GiB" if peak is not None else ""))
    rep.data["parts"]["trainer"] = {"step_s": step_s, "tokens_per_s": tokens / sum(times),
                                    "parameters": params, "peak_gpu_gib": peak}
    return training


# -- 3. publish stall -----------------------------------------------------------------


def part_publish(rep: Report, training, device) -> int:
    import torch

    from laminar_trainer.publisher import snapshot_model

    snapshot_model(training.model, 0, 0, dtype=torch.bfloat16)  # warm (pinned pages etc.)
    rss0, _ = _rss_mib()
    _sync(device)
    t0 = time.perf_counter()
    snap = snapshot_model(training.model, 1, 1, dtype=torch.bfloat16)
    _sync(device)
    stall = time.perf_counter() - t0
    rss1, hwm = _rss_mib()
    # The raw copy it is measured against: one flat device-to-host copy of the same bytes.
    flat = torch.empty(snap.nbytes // 2, dtype=torch.bfloat16, device=device)
    _sync(device)
    t0 = time.perf_counter()
    flat.to("cpu", copy=True)
    _sync(device)
    raw = time.perf_counter() - t0
    rep.say(f"[publish] bf16 snapshot of {snap.nbytes / 2**20:.0f} MiB: stall {stall:.3f} s "
            f"(one flat device-to-host copy of the same bytes: {raw:.3f} s, "
            f"{stall / raw:.2f}x); host memory +{rss1 - rss0:.0f} MiB (RSS peak {hwm:.0f} MiB)")
    rep.data["parts"]["publish"] = {"bytes": snap.nbytes, "stall_s": stall, "raw_copy_s": raw,
                                    "host_mib_added": rss1 - rss0, "rss_peak_mib": hwm}
    return snap.nbytes


# -- 4. relay chain -------------------------------------------------------------------


def part_relay(rep: Report, nbytes: int, out: Path) -> None:
    size_mb = max(16, round(nbytes / 2**20))
    cmd = [sys.executable, str(ROOT / "tools" / "bench_relay.py"), "--size-mb", str(size_mb),
           "--relays", "1,2,4", "--repeat", "2"]
    rep.say(f"[relay] {' '.join(cmd[1:])}")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RELAY_TIMEOUT_S)
    (out / "relay.log").write_text(run.stdout + run.stderr)
    for line in run.stdout.splitlines():
        rep.say(f"[relay] {line}")
    if run.returncode:
        raise RuntimeError(f"bench_relay exited {run.returncode}: {run.stderr[-1500:]}")
    rep.data["parts"]["relay"] = {"size_mb": size_mb, "output": run.stdout}


# -- 5. end to end --------------------------------------------------------------------


def part_e2e(rep: Report, device, steps: int, out: Path) -> None:
    run_dir = out / "e2e"
    dev = "cuda" if device.type == "cuda" else "cpu"
    cmd = ["laminar", "up", str(ROOT / "examples" / "demo.yaml"),
           "--set", f"run_dir={run_dir}",
           "--set", f"tiers.trainer.config.device={dev}",
           "--set", f"tiers.worker.config.engine.device={dev}",
           "--set", f"tiers.trainer.config.total_steps={steps}",
           "--set", f"tiers.trainer.config.eval.every_steps={max(steps, 1)}"]
    rep.say(f"[e2e] {' '.join(cmd)}")
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    wall = time.perf_counter() - t0
    (out / "e2e.log").write_text(run.stdout + run.stderr)
    if run.returncode:
        raise RuntimeError(f"laminar up exited {run.returncode}: {run.stderr[-2000:]}")
    text = run.stdout + run.stderr
    held = re.findall(r"held-out[^\n]*", text)
    for line in held[-3:]:
        rep.say(f"[e2e] {line.strip()}")
    summary = sorted(run_dir.rglob("summary.json"))
    data = json.loads(summary[-1].read_text()) if summary else {}
    before, after = data.get("eval_before"), data.get("eval_after")
    rep.say(f"[e2e] {steps} steps in {wall:.1f} s wall (setup included); held-out accuracy "
            f"{before} -> {after}")
    if before is None or after is None:
        raise RuntimeError(f"no held-out accuracy in {summary[-1] if summary else run_dir}")
    rep.data["parts"]["e2e"] = {"steps": steps, "wall_s": wall, "eval_before": before,
                                "eval_after": after}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    small = args.cpu
    if not small and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --cpu for the small CPU check)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if small else "cuda:0")
    shape = args.shape or ("tiny" if small else "qwen2.5-0.5b")
    dtype = torch.float32 if small else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    rep.data.update(shape=shape, device=str(device), small=small,
                    when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    torch=torch.__version__, python=platform.python_version(),
                    gpu=torch.cuda.get_device_name(0) if not small else None,
                    cpus=os.cpu_count())
    rep.say(f"gpu_bench: {shape} on {rep.data['gpu'] or 'CPU'} ({os.cpu_count()} CPUs), "
            f"torch {torch.__version__}, {rep.data['when']}"
            + (" -- CPU CHECK, small shapes: not GPU figures" if small else ""))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    steps = args.e2e_steps if args.e2e_steps is not None else (3 if small else 20)
    nbytes = 0
    training = None
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        model_dir = build_model_dir(shape, dtype, Path(tmp) / "model")
        for part in parts:
            t0 = time.perf_counter()
            try:
                if part == "engine":
                    part_engine(rep, model_dir, device, dtype, small)
                elif part == "trainer":
                    training = part_trainer(rep, model_dir, device, small)
                elif part == "publish":
                    if training is None:
                        training = part_trainer(rep, model_dir, device, small)
                    nbytes = part_publish(rep, training, device)
                elif part == "relay":
                    if not nbytes:  # no publish part: the saved weights' size
                        nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
                    part_relay(rep, nbytes, out)
                elif part == "e2e":
                    training = None  # free the bench model's memory for the stack
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    part_e2e(rep, device, steps, out)
                else:
                    raise ValueError(f"unknown part {part!r}")
            except Exception as exc:  # noqa: BLE001 - every part runs; failures are reported
                rep.data["failed"][part] = f"{type(exc).__name__}: {exc}"
                rep.say(f"[{part}] FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            rep.say(f"[{part}] took {time.perf_counter() - t0:.1f} s")
            rep.save()
    rep.say("gpu_bench: " + ("all parts passed" if not rep.data["failed"]
                             else f"FAILED parts: {', '.join(rep.data['failed'])}"))
    rep.save()
    return 1 if rep.data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
