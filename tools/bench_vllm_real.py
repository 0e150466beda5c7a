"""A real-size run on this CPU: a Qwen2.5-0.5B-shaped model through the whole stack.

Small models hide what a real size costs. This tool builds a random-init model of
Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads / 2 KV heads, intermediate
4864, vocabulary 151,936, tied embeddings: ~494M parameters; saved in bf16, as
Qwen ships it) with the demo's character tokenizer, its vocabulary filled up with
word tokens so that every sampled id decodes (nothing here measures learning),
writes a job file
and runs it with ``laminar up``: a relay, the manager, one worker on the chosen
engine (vLLM by default) and the trainer (fp32 master weights, AdamW), for a few
real GRPO steps on the sort task's prompts, scored by a reward that varies with the
sampled text (a random-init model never sorts: the task's reward would give no
advantage, no update and empty deltas). It prints, from the tiers' own logs and metrics:

- the trainer's peak resident memory (VmHWM) and its step time;
- the publish stall per version (device-to-host snapshot + hand-off to the master
  relay) and the background send to the relay (the ~1 GB bf16 version);
- the worker's time per version to fetch it and load it in place into the engine
  (vLLM: inside its layerwise reload), and the engine's own load time;
- the bytes the relay stored per version: full versions and, with ``--delta-every K``,
  bit-exact sparse deltas at the job's learning rate (the worker's fetch of a delta
  also reads its base when it has none of its own).

On this 24 GiB machine the whole stack at this size is at the edge of memory (the
trainer's fp32 weights, gradients and AdamW moments alone are ~8 GB): 3 steps fit; a
4-step run had its trainer OOM-killed by the kernel.

Nothing is simulated: the engine, the training step and the relay are the real
ones. One run takes several minutes on 2 cores (most of it the trainer's steps).

    python tools/bench_vllm_real.py --steps 3 --delta-every 2 --out real.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


_REWARD = '''"""The real-size run's reward: the share of the completion's distinct words with an even
id (varies from sample to sample)."""


import re


def score(prompt, completion, metadata):
    words = re.findall(r"<w(\\d+)>", completion)
    return len({w for w in words if w[-1] in "02468"}) / max(len(words), 1)
'''


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="trainer steps (versions)")
    p.add_argument("--engine", choices=("vllm", "torch"), default="vllm")
    p.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"],
                   help="fewer layers for a quick trial (24: the real shape)")
    p.add_argument("--delta-every", type=int, default=0,
                   help="publish_delta_full_every (0: every version in full)")
    p.add_argument("--lr", type=float, default=1e-5, help="the job's learning rate")
    p.add_argument("--engine-dtype", default="float32",
                   help="the engine's dtype (float32: a CPU without AVX512-BF16 runs bf16 "
                        "slowly; bfloat16 on GPUs)")
    p.add_argument("--work-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--timeout-s", type=float, default=3000)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def build_model(out: Path, layers: int) -> int:
    """Save the random-init Qwen2.5-0.5B-shaped model (bf16) and the demo tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from laminar_examples.demo_model import BOS_ID, EOS_ID, PAD_ID

    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers},
                         max_position_embeddings=256, bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    word_tokenizer(config.vocab_size).save_pretrained(out)
    return n


def word_tokenizer(vocab_size: int):
    """The demo's character tokenizer (its prompts encode as in the demo) with the rest of
    the vocabulary as ``<w4>`` ... words, so that every id the random model samples
    decodes to text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from laminar_examples.demo_model import SPECIAL_TOKENS, TASK_ALPHABET

    words = [*SPECIAL_TOKENS, *TASK_ALPHABET]
    words += [f"<w{i}>" for i in range(len(words), vocab_size)]
    backend = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[],
                                   unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                   bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def job_file(work: Path, args: argparse.Namespace) -> dict:
    engine = ({"type": "vllm", "model_dir": "{run_dir}/model", "enforce_eager": True,
               "kv_cache_tokens": 16384, "dtype": args.engine_dtype}
              if args.engine == "vllm" else
              {"type": "torch", "model_dir": "{run_dir}/model", "dtype": args.engine_dtype})
    return {
        "job": "real-size", "run_dir": str(work / "run"),
        "etcd": {"embedded": True, "ttl_s": 30},
        "setup": [["laminar-examples", "prompts", "--task", "sort", "--n", "400", "--split", "train",
                   "--seed", "1", "--out", "{run_dir}/train.jsonl"]],
        "tiers": {
            "relay": {"command": ["laminar-relay", "serve"],
                      "config": {"member_id": "relay-0", "bind_host": "127.0.0.1",
                                 "advertise_host": "127.0.0.1",
                                 # a few ~1.3 GB versions: the host's memory is the limit
                                 "store": {"max_bytes": 3 << 30}}},
            "manager": {"command": ["laminar-rollout", "manage"], "ready": "manager",
                        "config": {"prompts": "{run_dir}/train.jsonl", "group_size": 4,
                                   "batch_groups": 2, "max_staleness": 1, "mode": "laminar",
                                   "sampling": {"max_tokens": 8, "temperature": 1.0},
                                   "state_dir": "{run_dir}/manager",
                                   # one engine step of this size on a CPU can take
                                   # seconds: the manager must not take the worker for dead
                                   "worker_timeout_s": 600}},
            "worker": {"command": ["laminar-rollout", "serve"], "id_field": "worker_id",
                       "config": {"engine": engine, "weight_load_timeout_s": 1800,
                                  "reward": "realsize_reward:score"}},
            "trainer": {"command": ["laminar-trainer", "run"],
                        "config": {"trainer_id": "trainer", "model_dir": "{run_dir}/model",
                                   "batch_groups": 2, "total_steps": args.steps,
                                   "wait_timeout_s": 3000,
                                   "publish_delta_full_every": args.delta_every,
                                   "optim": {"lr": args.lr, "warmup_steps": 0},
                                   "run_dir": "{run_dir}/trainer"}},
        },
        "wait_for": "trainer", "timeout_s": int(args.timeout_s),
    }


class PeakMemory:
    """Polls /proc for the tiers' processes; keeps each one's VmHWM (peak RSS, MiB)."""

    def __init__(self, patterns: dict[str, str]) -> None:
        self.patterns = patterns
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for pid in (d for d in os.listdir("/proc") if d.isdigit()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue  # the process ended between listing and reading
                for name, pattern in self.patterns.items():
                    if pattern in cmd:
                        m = re.search(r"VmHWM:\s+(\d+) kB", status)
                        if m:
                            self.peak[name] = max(self.peak.get(name, 0.0), int(m[1]) / 1024)


def _floats(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-real-"))
    (work / "run").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_params = build_model(work / "run" / "model", args.layers)
    build_s = time.perf_counter() - t0
    print(f"model: random-init Qwen2.5-0.5B shape ({args.layers} layers), "
          f"{n_params / 1e6:.1f}M parameters, saved in bf16 in {build_s:.1f}s; "
          f"engine {args.engine}; {args.steps} real GRPO steps; work dir {work}")
    import yaml

    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job_file(work, args), sort_keys=False))
    # A random-init model never sorts, so the task's reward would be 0 everywhere: no
    # advantage, no update, empty deltas. This reward varies with the text sampled.
    (work / "realsize_reward.py").write_text(_REWARD)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        PYTHONPATH=os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH")) if p))
    with PeakMemory({"trainer": "laminar_trainer.cli run",
                     "worker": "laminar_rollout.cli serve",
                     "relay": "laminar_relay.cli serve"}) as mem:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "laminar_common.launch.cli", "up",
                               str(path)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s + 120)
        wall = time.perf_counter() - t0
    (work / "up.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"laminar up exited {proc.returncode}; see {work / 'up.log'}:\n"
              + (proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
        return 1
    run = work / "run"
    rows = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    steps = [r for r in rows if "step_s" in r]
    trainer_log = (run / "logs" / "trainer.log").read_text()
    worker_log = next((run / "logs").glob("worker*.log")).read_text()
    published = re.findall(r"published weights v(\d+) \(([0-9.]+) MB\) in ([0-9.]+)s",
                           trainer_log)
    loads = re.findall(r"loaded weights v(\d+) in ([0-9.]+)s \((\d+) bytes fetched(, rebuilt "
                       r"from deltas)?\)", worker_log)
    engine_loads = _floats(r"into vLLM in ([0-9.]+)s", worker_log)
    figures = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "tools/bench_vllm_real.py", *(argv or sys.argv[1:])]),
        "engine": args.engine, "layers": args.layers, "parameters": n_params,
        "laminar_up_wall_s": round(wall, 1),
        "peak_rss_mib": {k: round(v) for k, v in mem.peak.items()},
        "step_s": [round(r["step_s"], 2) for r in steps],
        "stall_s": [round(r["stall_s"], 3) for r in steps],
        "published": [{"version": int(v), "mb": float(mb), "send_s": float(s)}
                      for v, mb, s in published],
        "worker_loads": [{"version": int(v), "s": float(s), "bytes": int(b),
                          "delta": bool(d)} for v, s, b, d in loads],
        "engine_load_s": engine_loads,
    }
    print(f"laminar up: {wall:.0f}s wall; peak RSS (MiB): {figures['peak_rss_mib']}")
    print(f"trainer step: {figures['step_s']} s; publish stall: {figures['stall_s']} s")
    for p in figures["published"]:
        print(f"  published v{p['version']}: {p['mb']:.0f} MB sent to the master relay in "
              f"{p['send_s']:.2f}s (background)")
    for w in figures["worker_loads"]:
        kind = "delta" if w["delta"] else "full"
        print(f"  worker v{w['version']}: fetched {w['bytes'] / 1e6:.1f} MB ({kind}) and "
              f"loaded in {w['s']:.2f}s")
    if engine_loads:
        print(f"vLLM in-place load per version: {[round(x, 2) for x in engine_loads]} s "
              f"(median {statistics.median(engine_loads):.2f}s)")
    relay_log = (run / "logs" / "relay.log").read_text()
    stored = {int(v): int(n) for v, n in
              re.findall(r"stored version (\d+) \((\d+) bytes\) from trainer", relay_log)}
    full = max(stored.values(), default=0)
    figures["relay_stored_bytes"] = stored
    for v, n in sorted(stored.items()):
        kind = "full" if n == full else "delta"
        print(f"  relay stored v{v}: {n / 1e6:.0f} MB ({kind}, {n / full:.0%} of the full)")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
