"""Tests for laminar_examples.demo_model, warmstart and accuracy: tokenizer, tiny model,
decoding, warm start."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from laminar_examples.accuracy import evaluate_accuracy
from laminar_examples.demo_model import (
    BOS_ID,
    DEFAULT_MODEL_SIZES,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    build_tiny_model,
    build_tokenizer,
)
from laminar_examples.tasks import (
    TASK_ALPHABET,
    make_task_records,
    plausible_mistake,
    score_completion,
)
from laminar_examples.warmstart import _with_mistakes, train_supervised, warm_start
from laminar_trainer.decoding import decode_completion, generate_completions
from laminar_trainer.logprobs import compute_token_logprobs, encode_prompts, pack_sequences

DEMO_IDS = {"eos_id": EOS_ID, "pad_id": PAD_ID}

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# The warm start the module fixture makes (and the determinism test makes again).
WARM = dict(steps=8, seed=3, model_sizes=SMALL, batch_size=16, target_accuracy=None, n_eval=16)


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("warm")
    return warm_start(out, "sort", **WARM)


def test_tokenizer_is_character_level_with_fixed_special_ids(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
    )
    assert tokenizer.unk_token_id == UNK_ID
    assert len(tokenizer) == 4 + len(TASK_ALPHABET)
    ids = tokenizer(TASK_ALPHABET)["input_ids"]
    assert ids == [BOS_ID, *range(4, 4 + len(TASK_ALPHABET))]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TASK_ALPHABET
    assert tokenizer("sort Q=")["input_ids"][-2] == UNK_ID


def test_prompt_then_answer_tokenizes_as_the_concatenation(tokenizer):
    prompt, answer = "sort 3 1=", "13"
    joined = tokenizer(prompt + answer)["input_ids"]
    separate = (
        tokenizer(prompt)["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
    )
    assert joined == separate


def test_decode_completion_keeps_stray_special_tokens(tokenizer):
    digits = tokenizer("12", add_special_tokens=False)["input_ids"]
    assert decode_completion(tokenizer, [*digits, EOS_ID]) == "12"
    assert decode_completion(tokenizer, [digits[0], PAD_ID, digits[1]]) == "1<pad>2"


def test_tiny_model_is_seeded(tokenizer):
    a = build_tiny_model(len(tokenizer), seed=1, **SMALL)
    b = build_tiny_model(len(tokenizer), seed=1, **SMALL)
    c = build_tiny_model(len(tokenizer), seed=2, **SMALL)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)
    assert a.config.eos_token_id == EOS_ID and a.config.pad_token_id == PAD_ID
    with pytest.raises(ValueError, match="not divisible"):
        build_tiny_model(10, hidden_size=30, num_heads=4)


def test_pack_sequences_right_pads_and_marks_completions():
    input_ids, attention, completion = pack_sequences([[1, 5], [1]], [[7, 2], [8, 9, 2]], pad_id=0)
    assert input_ids.tolist() == [[1, 5, 7, 2], [1, 8, 9, 2]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert completion.tolist() == [[False, False, True, True], [False, True, True, True]]
    input_ids, attention, completion = pack_sequences([[1, 5, 6], [1]], [[2], [8]], pad_id=0)
    assert input_ids.tolist() == [[1, 5, 6, 2], [1, 8, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack_sequences([[1], [1]], [[2]])


def test_sampled_logprobs_match_the_training_forward(tokenizer):
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    prompts = encode_prompts(tokenizer, ["sort 12=", "sort 98765=", "add 1+2="])
    sampled = generate_completions(
        model, prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(0),
        **DEMO_IDS)
    input_ids, attention, mask = pack_sequences(prompts, sampled.token_ids)
    logprobs = compute_token_logprobs(model, input_ids, attention)
    for row, expected in enumerate(sampled.logprobs):
        assert torch.allclose(logprobs[row][mask[row]], torch.tensor(expected), atol=1e-5)


def test_greedy_decoding_ignores_left_padding_and_stops_at_eos(tokenizer):
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    prompts = encode_prompts(tokenizer, ["sort 12=", "sort 9876543210="])
    alone = generate_completions(model, prompts[:1], 5, **DEMO_IDS)
    batched = generate_completions(model, prompts, 5, **DEMO_IDS)
    assert batched.token_ids[0] == alone.token_ids[0]
    for ids, finished in zip(batched.token_ids, batched.finished):
        assert finished == (EOS_ID in ids)
        assert EOS_ID not in ids[:-1]
        assert len(ids) <= 5
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_completions(model, prompts, 0, **DEMO_IDS)


def test_decoding_takes_the_stop_and_pad_ids_from_the_model_when_not_given(tokenizer):
    """The trainer's decoding knows no model: without eos_id / pad_id it reads the model's
    config, which for the demo's model names EOS_ID and PAD_ID."""
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    prompts = encode_prompts(tokenizer, ["sort 12=", "sort 9876543210=", "add 1+2="])
    for temperature in (0.0, 1.0):
        runs = [generate_completions(model, prompts, 8, temperature=temperature,
                                     generator=torch.Generator().manual_seed(1), **ids)
                for ids in ({}, DEMO_IDS)]
        assert runs[0] == runs[1]
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    with pytest.raises(ValueError, match="needs eos_id"):
        generate_completions(model, prompts, 2)
    assert generate_completions(model, prompts, 2, eos_id=EOS_ID).token_ids is not None


def test_supervised_training_fits_a_small_set(tokenizer):
    torch.manual_seed(0)
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    records = make_task_records("sort", 8, seed=0, max_len=3)
    losses = train_supervised(model, tokenizer, records, 40, batch_size=8, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    assert evaluate_accuracy(model, tokenizer, records) >= 0.5


def test_evaluate_accuracy_matches_manual_scoring(tokenizer):
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    records = make_task_records("sort", 5, seed=0)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in records])
    completions = generate_completions(model, prompts, 12, **DEMO_IDS)
    expected = sum(
        score_completion(r, decode_completion(tokenizer, ids))
        for r, ids in zip(records, completions.token_ids)
    ) / len(records)
    assert evaluate_accuracy(model, tokenizer, records, 12, batch_size=2) == expected
    with pytest.raises(ValueError, match="at least one record"):
        evaluate_accuracy(model, tokenizer, [])


def test_warm_start_saves_a_directory_that_loads_offline(warm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    summary = json.loads((warm.out_dir / "warm_start.json").read_text())
    assert summary["steps"] == 8 and summary["eval_accuracy"] == warm.accuracy
    assert 0.0 <= warm.accuracy <= 1.0
    model = AutoModelForCausalLM.from_pretrained(warm.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(warm.out_dir)
    assert tokenizer("sort 21=")["input_ids"] == warm.tokenizer("sort 21=")["input_ids"]
    assert tokenizer.eos_token_id == EOS_ID
    ids = torch.tensor([tokenizer("sort 21=12")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, warm.model(ids).logits, atol=1e-6)


def test_warm_start_is_deterministic(warm, tmp_path):
    again = warm_start(tmp_path, "sort", **WARM)
    for a, b in zip(warm.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    assert again.accuracy == warm.accuracy


def test_supervised_training_stops_when_asked(tokenizer):
    model = build_tiny_model(len(tokenizer), seed=0, **SMALL)
    records = make_task_records("sort", 8, seed=0, max_len=3)
    calls = []

    def should_stop(step):
        calls.append(step)
        return step >= 6

    losses = train_supervised(
        model, tokenizer, records, 100, batch_size=4, should_stop=should_stop, check_every=3
    )
    assert calls == [3, 6]
    assert len(losses) == 6
    assert model.training


def test_warm_start_with_an_unreached_target_runs_every_step(tmp_path, caplog):
    result = warm_start(
        tmp_path,
        "sort",
        steps=4,
        seed=0,
        model_sizes=SMALL,
        batch_size=8,
        target_accuracy=1.0,
        check_every=2,
        n_dev=8,
        n_eval=8,
    )
    summary = json.loads((tmp_path / "warm_start.json").read_text())
    assert result.steps == 4 and summary["steps"] == 4 and summary["max_steps"] == 4
    assert [step for step, _ in summary["dev_history"]] == [2, 4]
    assert result.dev_accuracy == summary["dev_history"][-1][1] < 1.0
    assert "below the target" in caplog.text


def test_warm_start_rejects_unknown_size_fields(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model size field\(s\) \['layers'\]"):
        warm_start(tmp_path, steps=0, model_sizes={"layers": 2})
    with pytest.raises(ValueError, match="target_accuracy must be in"):
        warm_start(tmp_path, steps=0, target_accuracy=0.0)


def test_noisy_demonstrations_answer_with_the_plausible_mistake():
    records = make_task_records("sort", 2000, seed=0)
    noisy = _with_mistakes(records, 0.6, seed=0)
    assert [r["prompt"] for r in noisy] == [r["prompt"] for r in records]
    changed = [n for n, r in zip(noisy, records) if n["answer"] != r["answer"]]
    mistaken = [n for n in noisy if n["answer"] == plausible_mistake(n)]
    assert all(n["answer"] == plausible_mistake(n) for n in changed)
    # ~60% draw the mistake; already sorted lists look the same either way.
    assert 0.55 < len(mistaken) / len(records) < 0.7
    assert records[0]["answer"] == make_task_records("sort", 1, seed=0)[0]["answer"]
    assert _with_mistakes(records, 0.6, seed=0) == noisy


def test_warm_start_records_its_demo_error_rate_and_refuses_bad_ones(tmp_path):
    warm_start(tmp_path, "sort", steps=2, seed=0, model_sizes=SMALL, batch_size=8,
               n_eval=4, demo_error_rate=0.6)
    summary = json.loads((tmp_path / "warm_start.json").read_text())
    assert summary["demo_error_rate"] == 0.6 and summary["steps"] == 2
    with pytest.raises(ValueError, match=r"demo_error_rate must be in \[0, 1\), got 1.0"):
        warm_start(tmp_path / "x", steps=1, demo_error_rate=1.0)
    assert not (tmp_path / "x").exists()


def test_repeat_records_fit_the_demo_model_with_their_eos(tokenizer):
    # examples/longtail.yaml's sampling.max_tokens relies on this: no right answer is cut.
    records = make_task_records("repeat", 4000, seed=1) + make_task_records(
        "repeat", 1000, seed=2, split="eval")
    for r in records[:50]:
        assert len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) == len(
            r["answer"])
    longest = max(len(tokenizer(r["prompt"])["input_ids"]) + len(r["answer"]) + 1
                  for r in records)
    assert longest <= DEFAULT_MODEL_SIZES["max_position_embeddings"]


def test_noisy_repeat_demonstrations_stop_one_unit_early(tmp_path):
    records = make_task_records("repeat", 1000, seed=0)
    noisy = _with_mistakes(records, 0.6, seed=0)
    mistaken = [n for n, r in zip(noisy, records) if n["answer"] != r["answer"]]
    assert 0.55 < len(mistaken) / len(records) < 0.65  # the mistake is never right
    assert all(n["answer"] == plausible_mistake(n) for n in mistaken)
    result = warm_start(tmp_path, "repeat", steps=2, seed=0, model_sizes=SMALL, batch_size=8,
                        n_eval=4, demo_error_rate=0.6)
    assert json.loads((tmp_path / "warm_start.json").read_text())["task"] == "repeat"
    assert 0.0 <= result.accuracy <= 1.0
