"""Prompt -> ids through a real BPE tokenizer with a ChatML template."""

from __future__ import annotations

import json

import pytest

from laminar_common.data.chat import eos_token_ids, prompt_token_ids, render_chat
from laminar_common.errors import ConfigError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is 3 + 4? #### 7", "user assistant system"] * 20, trainer)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def test_messages_render_with_the_template_and_a_generation_prompt(tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3 + 4?"}]
    text = render_chat(tokenizer, msgs)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n3 + 4?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = prompt_token_ids(tokenizer, msgs)
    # The special tokens appear exactly once each where the template put them (not
    # split into characters, and no second BOS/EOS added by encoding).
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 3 and tokenizer.decode(ids) == text
    tail = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(tail):] == tail


def test_text_prompts_are_encoded_as_is(tokenizer):
    assert prompt_token_ids(tokenizer, "3 + 4?") == tokenizer("3 + 4?")["input_ids"]


def test_chat_prompts_need_a_template(tokenizer):
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ConfigError, match="no chat_template"):
        prompt_token_ids(bare, [{"role": "user", "content": "hi"}])


def test_eos_ids_merge_the_tokenizer_and_generation_config(tokenizer, tmp_path):
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.eos_token_id
    assert eos_token_ids(tokenizer, tmp_path) == (im_end,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, end]}))
    assert eos_token_ids(tokenizer, tmp_path) == (im_end, end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    assert eos_token_ids(tokenizer, tmp_path) == (im_end, end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="eos_token_id"):
        eos_token_ids(tokenizer, tmp_path)


def test_observation_text_continues_a_turn_that_ended_on_its_stop_token(tokenizer):
    from laminar_common.data.chat import observation_text

    history = [{"role": "user", "content": "3 + 4?"},
               {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    obs = [{"role": "tool", "content": "7"}]
    text = observation_text(tokenizer, history, obs, "<|im_end|>")
    # After the model's <|im_end|>: the template's newline, the tool turn, the next header.
    assert text == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    whole = render_chat(tokenizer, history, add_generation_prompt=False)
    assert whole[:whole.rfind("<|im_end|>") + len("<|im_end|>")] + text == \
        render_chat(tokenizer, [*history, *obs])
    with pytest.raises(ConfigError, match="never writes the stop token"):
        observation_text(tokenizer, history, obs, "<|endoftext|>")
