"""The tool-use example's task, warm start and held-out evaluation (``examples/tools.yaml``).

The task: "What is 347 * 86?" — a product a small model cannot compute in its head,
but can get exactly by calling the ``python`` tool (Hermes format) and copying the
result into its answer (``#### 29842``, scored by the ``gsm8k`` reward).

``warmstart`` writes the train and held-out prompt files and a warm-started chat
model (Qwen2-shaped, byte-level BPE, ChatML, built in code and saved with
``save_pretrained``): supervised on multi-turn demonstrations — call the tool,
read its result, answer — with the loss on the model's own turns only (the tool
result is context, as in RL). A ``--demo-error-rate`` share of the demonstrations
answers at once with a wrong guess instead, so the greedy policy mostly guesses
while sampling still often calls the tool: the gap RL has to close.

``evaluate`` runs held-out prompts through the rollout tier's own multi-turn path
(``Conversations`` + the torch engine + the real sandbox), greedily, and prints the
accuracy and the share of answers that called the tool.

    python examples/tools/tooluse.py warmstart --out runs/tools/model --data runs/tools
    python examples/tools/tooluse.py evaluate --model runs/tools/model --data runs/tools
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

TOOL_CALL = '<tool_call>{{"name": "python", "arguments": {{"code": "print({a}*{b})"}}}}</tool_call>'


def make_problems(n: int, seed: int, split: str) -> list[dict]:
    """``n`` distinct products; train and eval never share an (a, b) pair."""
    rng = random.Random(f"tool-mul/{split}/{seed}")
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if (a, b) in seen or (((a * 7 + b) % 5 == 0) != (split == "eval")):
            continue
        seen.add((a, b))
        out.append({"id": f"mul-{split}-{len(out)}", "a": a, "b": b,
                    "prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
                    "answer": str(a * b)})
    return out


def _wrong_guess(rng: random.Random, a: int, b: int) -> int:
    """A plausible guess: the right magnitude, wrong digits."""
    guess = a * b
    while guess == a * b:
        guess = a * b + rng.choice([-1, 1]) * rng.randint(1, 9) * 10 ** rng.randint(0, 2)
    return guess


def write_data(data_dir: Path, n_train: int, n_eval: int, seed: int) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("eval", n_eval)):
        with open(data_dir / f"{split}.jsonl", "w") as fh:
            for p in make_problems(n, seed, split):
                fh.write(json.dumps({k: p[k] for k in ("id", "prompt", "answer")}) + "\n")


def warmstart(args: argparse.Namespace) -> int:
    import torch

    from laminar_common.data.chat import observation_text, prompt_token_ids
    from laminar_examples.chat_model import build_chat_model, build_chat_tokenizer, save_chat_model
    from laminar_examples.warmstart import supervised_update

    out = Path(args.out)
    write_data(Path(args.data), args.train, args.eval, args.seed)
    if (out / "warm_start.json").is_file() and not args.force:
        print(f"warm start: {out} already holds a model")
        return 0
    started = time.perf_counter()
    rng = random.Random(f"tool-demos/{args.seed}")
    problems = make_problems(args.steps * args.batch, args.seed + 1000, "train")
    demos = []  # (messages, [(text, trained)]...)
    for p in problems:
        a, b = p["a"], p["b"]
        if rng.random() < args.demo_error_rate:
            demos.append((p["prompt"], [(f"#### {_wrong_guess(rng, a, b)}", None)]))
        else:
            demos.append((p["prompt"], [(TOOL_CALL.format(a=a, b=b), str(a * b)),
                                        (f"#### {a * b}", None)]))
    corpus = [f"<|im_start|>user\n{m[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
              + "".join(f"{t}<|im_end|>\n<|im_start|>tool\n{o}<|im_end|>\n" for t, o in turns
                        if o is not None) + turns[-1][0] for m, turns in demos[:4000]]
    tok = build_chat_tokenizer(corpus, args.vocab)
    tok.model_max_length = args.context
    eos = int(tok.eos_token_id)

    def encode(messages, turns):
        """Prompt ids, then every turn (trained) and tool result (context), with a mask."""
        ids = prompt_token_ids(tok, messages)
        mask = [False] * len(ids)
        history = list(messages)
        for text, result in turns:
            turn = [*tok(text, add_special_tokens=False)["input_ids"], eos]
            ids += turn
            mask += [True] * len(turn)
            history.append({"role": "assistant", "content": text})
            if result is not None:
                obs = [{"role": "tool", "name": "python", "content": result}]
                more = tok(observation_text(tok, history, obs, "<|im_end|>"),
                           add_special_tokens=False)["input_ids"]
                ids += more
                mask += [False] * len(more)
                history += obs
        return ids, mask

    encoded = [encode(m, turns) for m, turns in demos]
    longest = max(len(ids) for ids, _ in encoded)
    if longest > args.context:
        raise SystemExit(f"a demonstration is {longest} tokens; --context {args.context}")
    model = build_chat_model(len(tok), seed=args.seed, hidden_size=args.hidden,
                             num_layers=args.layers, num_heads=4, num_kv_heads=2,
                             intermediate_size=3 * args.hidden,
                             max_position_embeddings=args.context)
    torch.manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warm = 20
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else
        0.1 + 0.9 * max(0.0, 1 - (s - warm) / max(1, args.steps - warm)))
    model.train()
    loss = float("nan")
    for step in range(args.steps):
        chunk = encoded[step * args.batch:(step + 1) * args.batch]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), int(tok.pad_token_id), dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        target = torch.zeros((len(chunk), width), dtype=torch.bool)
        for row, (ids, mask) in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
            target[row, :len(ids)] = torch.tensor(mask)
        loss = supervised_update(model, optimizer, scheduler, input_ids, attention, target)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"warm start step {step}: loss {loss:.3f}", flush=True)
    model.eval()
    save_chat_model(out, model, tok)
    summary = {"task": "tool-mul", "steps": args.steps, "batch": args.batch,
               "demo_error_rate": args.demo_error_rate, "final_loss": loss,
               "parameters": sum(p.numel() for p in model.parameters()),
               "vocab_size": len(tok), "seconds": time.perf_counter() - started}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("warm start: " + json.dumps(summary))
    return 0


def evaluate_tool_use(model_dir: str | Path, eval_file: str | Path, limit: int = 128,
                      max_turns: int = 3, temperature: float = 0.0) -> dict:
    """Held-out accuracy (greedy by default) through the rollout tier's multi-turn path,
    and the share of trajectories that called the tool."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoModelForCausalLM

    from laminar_common.codec import PromptTask, SamplingSpec
    from laminar_common.data.rewards import load_reward_fn
    from laminar_rollout.conversations import Conversations
    from laminar_rollout.engines import GenerationRequest, SamplingParams, TorchEngine
    from laminar_rollout.environments import ToolEnvironment, TurnLimits
    from laminar_rollout.sandbox import CodeSandbox, SandboxLimits
    from laminar_rollout.tokenizer import HfTokenizer
    from laminar_rollout.tools import PythonTool

    torch.set_num_threads(1)
    records = [json.loads(x) for x in Path(eval_file).read_text().splitlines()][:limit]
    tok = HfTokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    engine = TorchEngine(model, max_batch=64, eos_token_ids=tok.eos_token_ids)
    limits = TurnLimits(max_turns=max_turns, max_tokens_per_turn=48, max_total_tokens=160)
    pool = ThreadPoolExecutor(4)
    python = PythonTool(CodeSandbox(SandboxLimits(wall_s=5)))
    conv = Conversations(tok, lambda rec: ToolEnvironment(rec, limits, {"python": python}, pool),
                         limits)
    score = load_reward_fn("gsm8k")
    tasks, results = {}, {}
    for r in records:
        task = PromptTask(trajectory_id=r["id"], prompt_id=r["id"], group_size=1,
                          sample_index=0, prompt="", messages=tuple(r["prompt"]),
                          metadata={"answer": r["answer"]},
                          sampling=SamplingSpec(temperature=temperature, seed=len(tasks)))
        ids, max_tokens = conv.begin(task)
        engine.add_request(GenerationRequest(
            request_id=task.trajectory_id, prompt_token_ids=ids,
            params=SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                  stop_token_ids=tok.eos_token_ids, seed=len(tasks))))
        tasks[task.trajectory_id] = task
    deadline = time.monotonic() + 600
    while len(results) < len(records) and time.monotonic() < deadline:
        for out in engine.step() if engine.has_unfinished() else []:
            done = conv.turn_ended(out)
            if done is not None:
                results[out.request_id] = done
        turns, finished = conv.poll()
        for _, request in turns:
            engine.add_request(request)
        for task, done in finished:
            results[task.trajectory_id] = done
        if not engine.has_unfinished() and not turns:
            time.sleep(0.005)
    pool.shutdown()
    correct = sum(score(tasks[t].messages, d.text, tasks[t].metadata) > 0
                  for t, d in results.items())
    called = sum(bool(d.observation_spans) for d in results.values())
    return {"accuracy": correct / len(records), "tool_call_rate": called / len(records),
            "n": len(records), "finished": len(results)}


def evaluate(args: argparse.Namespace) -> int:
    result = evaluate_tool_use(args.model, Path(args.data) / "eval.jsonl", args.limit,
                               temperature=args.temperature)
    print("held-out: " + json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmstart", help="write prompt files and a warm-started chat model")
    w.add_argument("--out", required=True, help="model directory (save_pretrained)")
    w.add_argument("--data", required=True, help="where train.jsonl and eval.jsonl go")
    w.add_argument("--steps", type=int, default=300)
    w.add_argument("--batch", type=int, default=64)
    w.add_argument("--lr", type=float, default=3e-3)
    w.add_argument("--demo-error-rate", type=float, default=0.6)
    w.add_argument("--train", type=int, default=4000, help="train prompts written")
    w.add_argument("--eval", type=int, default=256, help="held-out prompts written")
    w.add_argument("--vocab", type=int, default=400)
    w.add_argument("--hidden", type=int, default=128)
    w.add_argument("--layers", type=int, default=4)
    w.add_argument("--context", type=int, default=160)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--force", action="store_true", help="rebuild an existing model")
    e = sub.add_parser("evaluate", help="held-out greedy accuracy with the tool")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--limit", type=int, default=128)
    e.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = p.parse_args(argv)
    return warmstart(args) if args.cmd == "warmstart" else evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
