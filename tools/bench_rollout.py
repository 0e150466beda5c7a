"""Benchmark the generation engines on this CPU (torch; vLLM with ``--engines torch,vllm``):
throughput by batch size and the continuous-batching gain over static batching on a
long-tail length mix.

Both parts run the real engines (``TorchEngine``; ``VllmEngine`` on vLLM's CPU build,
the same model loaded from a saved directory, fp32, eager) on a tiny random-init Qwen2
model built from a config (no download); the model size is printed. vLLM's CPU
attention needs a head size of at least 32 (``--hidden`` >= 128). Part 1 also runs Hugging
Face ``generate`` (sampling at temperature 1, the same model, batch, prompt and
token count, ``min_new_tokens`` = ``max_new_tokens``) side by side: the engine
computes every sampled token's log-prob as well, ``generate`` does not. Response lengths are
forced through ``max_tokens`` with EOS disabled, so every run generates the
same number of tokens and the comparison is reproducible. Static batching here
means: requests are cut into batches of ``--max-batch`` in arrival order, and a
batch must finish its longest member before the next batch starts.
Continuous batching feeds all requests to one engine whose freed slots are
refilled at once. Both are measured side by side in one run; the machine is
shared and noisy, so compare the ratios, not absolute figures across runs.

The step-count ratio is the gain where a decode step costs the same at any
batch size (GPU decode is memory-bound); on a CPU a step's cost grows with the
batch, so the wall-clock ratio is lower.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from statistics import NormalDist


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32,128",
                   help="throughput batch sizes (comma list)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per request, part 1")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt length, both parts")
    p.add_argument("--requests", type=int, default=128, help="requests in the long-tail mix")
    p.add_argument("--max-batch", type=int, default=8, help="slots / static batch size, part 2")
    p.add_argument("--median", type=float, default=24.0, help="median response length")
    p.add_argument("--tail-ratio", type=float, default=10.0, help="p99 / median of lengths")
    p.add_argument("--max-len", type=int, default=400, help="response length cap")
    p.add_argument("--engines", default="torch",
                   help="comma list of engines: torch, vllm (vllm needs vLLM installed)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (4 heads)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: shared 2-core box)")
    p.add_argument("--repeats", type=int, default=2, help="best of N for each measurement")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from laminar_rollout.engines import (
        GenerationRequest,
        LogNormalLengths,
        SamplingParams,
        TorchEngine,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    context = args.prompt_len + max(args.decode_tokens, args.max_len) + 1
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
    )
    model = Qwen2ForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: random-init Qwen2, hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, {n_params / 1e3:.1f}K parameters, float32, CPU, "
        f"{args.threads} torch thread(s)"
    )
    prompt = [1] * args.prompt_len

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"torch", "vllm"}
    if unknown or not engines:
        print(f"--engines: unknown {sorted(unknown)}; choose from torch, vllm", file=sys.stderr)
        return 2
    vllm_engines: dict[int, object] = {}
    model_dir = None
    if "vllm" in engines:
        import tempfile

        if args.hidden // 4 < 32:
            print(f"--hidden {args.hidden}: vLLM's CPU attention needs a head size >= 32 "
                  "(--hidden >= 128)", file=sys.stderr)
            return 2
        model_dir = tempfile.mkdtemp(prefix="bench-rollout-")
        model.save_pretrained(model_dir)

    def make(kind: str, max_batch: int):
        if kind == "torch":
            return TorchEngine(model, max_batch=max_batch, eos_token_ids=(), seed=args.seed)
        if max_batch not in vllm_engines:  # one vLLM engine per slot count, reused
            from laminar_rollout.engines import make_engine

            vllm_engines[max_batch] = make_engine(
                "vllm", model=model_dir, max_batch=max_batch, context_length=context,
                dtype="float32", eos_token_ids=(), seed=args.seed, enforce_eager=True,
                kv_cache_tokens=max_batch * context,
                engine_kwargs={"skip_tokenizer_init": True})
        return vllm_engines[max_batch]

    def run(requests: list, max_batch: int, kind: str = "torch") -> tuple[float, int, int]:
        engine = make(kind, max_batch)
        for r in requests:
            engine.add_request(r)
        steps = tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(len(o.token_ids) for o in engine.step())
            steps += 1
        return time.perf_counter() - start, steps, tokens

    def best(fn):
        results = [fn() for _ in range(args.repeats)]
        return min(results, key=lambda r: r[0])

    batches = [int(x) for x in args.batch_sizes.split(",")]
    for kind in engines:
        run([GenerationRequest("warmup", prompt, SamplingParams(max_tokens=8))],
            max(batches) if kind == "vllm" else 1, kind)

    def hf_generate(b: int) -> tuple[float, int, int]:
        ids = torch.tensor([prompt] * b)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=args.decode_tokens,
                                 min_new_tokens=args.decode_tokens, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                                 pad_token_id=0)
        secs = time.perf_counter() - start
        return secs, args.decode_tokens, (out.shape[1] - len(prompt)) * b

    hf_generate(1)  # warm-up

    print("\n[1] throughput, every request decodes the same length; HF generate side by side"
          f" (engines: {', '.join(engines)}; vLLM runs with max_num_seqs {max(batches)})")
    print(f"{'batch':>6} {'engine':>7} {'tokens':>8} {'seconds':>8} {'tokens/s':>10} "
          f"{'vs batch 1':>10} {'HF tok/s':>10} {'engine/HF':>10}")
    base: dict[str, float] = {}
    uid = 0
    for b in batches:
        hf_secs, _, hf_tokens = best(lambda b=b: hf_generate(b))
        hf_rate = hf_tokens / hf_secs
        for kind in engines:
            def once(b=b, kind=kind):
                nonlocal uid
                uid += 1
                reqs = [GenerationRequest(f"t{uid}-{i}", prompt,
                                          SamplingParams(max_tokens=args.decode_tokens))
                        for i in range(b)]
                return run(reqs, max(batches) if kind == "vllm" else b, kind)

            secs, _, tokens = best(once)
            assert hf_tokens == tokens, (hf_tokens, tokens)
            rate = tokens / secs
            base.setdefault(kind, rate)
            print(f"{b:>6} {kind:>7} {tokens:>8} {secs:>8.3f} {rate:>10.0f} "
                  f"{rate / base[kind]:>9.2f}x {hf_rate:>10.0f} {rate / hf_rate:>9.2f}x")

    # stratified draw: the n quantiles of the log-normal, shuffled, so a short mix has
    # the configured tail exactly instead of a noisy p99
    sigma = LogNormalLengths(args.median, args.tail_ratio, args.max_len).sigma
    quantiles = [NormalDist().inv_cdf((i + 0.5) / args.requests) for i in range(args.requests)]
    lengths = [
        min(args.max_len, max(1, round(args.median * math.exp(sigma * z)))) for z in quantiles
    ]
    np.random.default_rng(args.seed).shuffle(lengths)
    p50, p99 = np.percentile(lengths, [50, 99])
    mb = args.max_batch
    print(
        f"\n[2] long-tail mix: {len(lengths)} requests, stratified log-normal lengths: "
        f"median {p50:.0f}, p99 {p99:.0f} "
        f"(p99/median {p99 / p50:.1f}), max {max(lengths)}, {sum(lengths)} tokens; "
        f"{mb} slots"
    )
    print(f"{'engine':>7} {'mode':>12} {'seconds':>8} {'steps':>6} {'tokens/s':>10}")
    for kind in engines:
        def mix() -> list:
            nonlocal uid
            uid += 1
            return [GenerationRequest(f"l{uid}-{i}", prompt, SamplingParams(max_tokens=n))
                    for i, n in enumerate(lengths)]

        def static(kind=kind) -> tuple[float, int, int]:
            reqs = mix()
            total = (0.0, 0, 0)
            for k in range(0, len(reqs), mb):
                secs, steps, tokens = run(reqs[k : k + mb], mb, kind)
                total = (total[0] + secs, total[1] + steps, total[2] + tokens)
            return total

        s_secs, s_steps, s_tokens = best(static)
        c_secs, c_steps, c_tokens = best(lambda kind=kind: run(mix(), mb, kind))
        assert s_tokens == c_tokens == sum(lengths), (s_tokens, c_tokens, sum(lengths))
        print(f"{kind:>7} {'static':>12} {s_secs:>8.3f} {s_steps:>6} {s_tokens / s_secs:>10.0f}")
        print(f"{kind:>7} {'continuous':>12} {c_secs:>8.3f} {c_steps:>6} "
              f"{c_tokens / c_secs:>10.0f}")
        print(
            f"{kind}: continuous/static {s_secs / c_secs:.2f}x tokens/s (wall clock, this CPU), "
            f"{s_steps / c_steps:.2f}x fewer decode steps (the gain at flat step cost)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
