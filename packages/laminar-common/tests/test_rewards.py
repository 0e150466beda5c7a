import importlib.util
import sys
import threading

import pytest

from laminar_common.data.rewards import (
    BUILTIN_REWARDS,
    exact_reward,
    gsm8k_reward,
    load_reward_fn,
    math_reward,
    score,
)
from laminar_common.errors import ConfigError

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify not installed (pip install 'laminar-common[math]')")

GSM8K_ANSWER = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"


@needs_math_verify
@pytest.mark.parametrize("gold,completion", [
    ("0.5", "so the answer is $\\frac{1}{2}$"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    (GSM8K_ANSWER, "48 + 24 = 72, so \\boxed{72}"),
    (GSM8K_ANSWER, "She sold 72 clips.\n#### 72"),
    ("(x+1)^2", "expanding: \\boxed{x^2 + 2x + 1}"),
    ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}"),
    ("1,234", "\\boxed{1234}"),
])
def test_math_reward_accepts_equivalent_answers(gold, completion):
    assert math_reward("q", completion, {"answer": gold}) == 1.0


@needs_math_verify
@pytest.mark.parametrize("gold,completion", [
    ("0.5", "\\boxed{\\frac{1}{3}}"),
    (GSM8K_ANSWER, "\\boxed{71}"),
    (GSM8K_ANSWER, "The answer is 24, no wait\n#### 73"),
    ("(x+1)^2", "\\boxed{x^2+1}"),
    ("72", "I do not know"),
    ("72", ""),
])
def test_math_reward_rejects_wrong_answers(gold, completion):
    assert math_reward("q", completion, {"answer": gold}) == 0.0


def test_math_reward_without_ground_truth_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"metadata\['answer'\]"):
        math_reward("q", "\\boxed{1}", {"task": "x"})
    reward, err = score(math_reward, "q", "\\boxed{1}", {})
    assert reward == 0.0 and "answer" in err


@needs_math_verify
def test_math_reward_runs_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm (main thread only); ours are off.
    results = []
    thread = threading.Thread(target=lambda: results.append(
        score(math_reward, "q", "\\boxed{\\frac{2}{4}}", {"answer": "0.5"})))
    thread.start()
    thread.join(timeout=60)
    assert results == [(1.0, None)]


def test_missing_math_verify_is_a_config_error_naming_the_extra(monkeypatch):
    from laminar_common.data import rewards

    rewards._math_verify.cache_clear()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now raises ImportError
    try:
        with pytest.raises(ConfigError, match=r"laminar-common\[math\]") as info:
            load_reward_fn("math")
        assert "'math'" in str(info.value)
    finally:
        rewards._math_verify.cache_clear()


@pytest.mark.parametrize("gold,completion,want", [
    (GSM8K_ANSWER, "so 72 clips\n#### 72", 1.0),
    ("#### 1,234", "total: 1,000 + 234\n#### 1,234", 1.0),
    ("1234", "#### $1,234.", 1.0),
    ("72", "the answer is 72.0", 1.0),  # no ####: the last number
    ("-3", "it drops to $-3$", 1.0),
    ("24", "48-24", 1.0),  # a minus between numbers is not a sign
    (GSM8K_ANSWER, "72 is tempting\n#### 71", 0.0),
    (GSM8K_ANSWER, "72\n#### no number here", 0.0),
    ("72", "no digits", 0.0),
])
def test_gsm8k_reward_extracts_the_final_number(gold, completion, want):
    assert gsm8k_reward("q", completion, {"answer": gold}) == want


def test_gsm8k_reward_needs_a_numeric_ground_truth():
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("q", "#### 1", {"answer": "#### seventy"})
    with pytest.raises(ValueError, match="answer"):
        gsm8k_reward("q", "#### 1", {})


def test_exact_reward_reads_the_gsm8k_ground_truth():
    assert exact_reward("q", "\\boxed{72}", {"answer": GSM8K_ANSWER}) == 1.0
    assert exact_reward("q", "so \\boxed{1/2}", {"answer": "0.5"}) == 1.0
    assert exact_reward("q", "\\boxed{7}", {"answer": "8"}) == 0.0


@needs_math_verify
def test_builtins_resolve_by_name():
    assert set(BUILTIN_REWARDS) == {"math", "gsm8k", "exact", "synthetic"}
    assert load_reward_fn("math") is math_reward
    assert load_reward_fn("gsm8k") is gsm8k_reward
    assert load_reward_fn("exact") is exact_reward
    assert load_reward_fn("laminar_common.data.rewards:gsm8k_reward") is gsm8k_reward
    # the demo's reward lives with its tasks, in laminar-examples (examples/tests load it)
    assert BUILTIN_REWARDS["synthetic"] == "laminar_examples.tasks:synthetic_reward"


def test_the_synthetic_builtin_without_laminar_examples_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "laminar_examples"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "laminar_examples", None)  # as if not installed
    for spec in ("synthetic", "laminar_examples.tasks:synthetic_reward"):
        with pytest.raises(ConfigError, match="pip install laminar-examples") as info:
            load_reward_fn(spec)
        assert repr(spec) in str(info.value)
        assert "laminar-examples package, which is not installed" in str(info.value)
        assert "another built-in (exact, gsm8k, math" in str(info.value)


@pytest.mark.parametrize("spec,match", [
    ("nocolon", "expected a built-in"),
    (":f", "expected a built-in"),
    ("no.such.module:f", "cannot import"),
    ("laminar_common.data.rewards:missing", "no callable 'missing'"),
    ("laminar_common.data.rewards:BUILTIN_REWARDS", "no callable"),
])
def test_bad_specs_are_config_errors_naming_the_spec(spec, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_reward_fn(spec)
    assert repr(spec) in str(info.value)


def test_reward_receives_prompt_completion_and_nested_metadata():
    seen = []

    def judge(prompt, completion, metadata):
        seen.append((prompt, completion, metadata))
        return float(metadata["rubric"]["points"][completion])

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    metadata = {"answer": "hello", "rubric": {"points": {"hello": 2, "bye": 0}}}
    assert score(judge, messages, "hello", metadata) == (2.0, None)
    assert seen == [(messages, "hello", metadata)]


def test_score_turns_failures_into_errors():
    def broken(prompt, completion, metadata):
        raise KeyError("oops")

    reward, err = score(broken, "p", "c", {})
    assert reward == 0.0 and err.startswith("KeyError")
    for bad in (float("nan"), float("inf")):
        reward, err = score(lambda p, c, m, bad=bad: bad, "p", "c", {})
        assert reward == 0.0 and "returned" in err
    reward, err = score(lambda p, c, m: "not a number", "p", "c", {})
    assert reward == 0.0 and "ValueError" in err


@pytest.fixture
def styles(monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    yield
    sys.modules.pop("reward_styles", None)


def test_trl_batched_rewards_are_called_one_sample_at_a_time(styles):
    fn = load_reward_fn("reward_styles:reward_len")
    assert fn.style == "trl"
    assert fn("sort 321=", "x" * 15, {"answer": "123"}) == -5.0
    fmt = load_reward_fn("reward_styles:format_reward")
    chat = [{"role": "user", "content": "2+2?"}]
    assert fmt(chat, "<think>4</think><answer>4</answer>", {}) == 1.0
    assert fmt(chat, "4", {}) == 0.0
    acc = load_reward_fn("reward_styles:accuracy_reward")
    assert acc("q", " 72 ", {"solution": "72", "answer": "72"}) == 1.0
    assert score(acc, "q", "71", {"solution": "72"}) == (0.0, None)
    # A column the function names and the record lacks: an error on that record, counted.
    value, error = score(acc, "q", "72", {"answer": "72"})
    assert value == 0.0 and "solution" in error
    value, error = score(load_reward_fn("reward_styles:trl_none"), "q", "72", {})
    assert value == 0.0 and "[None]" in error


def test_verl_compute_score_gets_the_ground_truth_as_the_file_holds_it(styles):
    fn = load_reward_fn("reward_styles:compute_score")
    assert fn.style == "verl"
    verl_row = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72",
                                                               "style": "rule"},
                "extra_info": {"split": "train"}}
    assert fn("q", "so 48+24=72\n#### 72", verl_row) == 1.0
    assert fn("q", "#### 71", verl_row) == 0.0
    assert fn("q", "#### 5", {"answer": "5"}) == 1.0  # no reward_model: the answer key's
    value, error = score(fn, "q", "#### 5", {})
    assert value == 0.0 and "no reward_model.ground_truth" in error
    d = load_reward_fn("reward_styles:compute_score_dict")
    assert d("q", "72", verl_row) == 1.0 and d("q", "7", verl_row) == 0.0


def test_a_reward_that_fits_no_known_signature_is_refused_at_load(styles):
    with pytest.raises(ConfigError, match=r"reward 'reward_styles:two_args': cannot be called "
                                          r"as any reward Laminar knows .*TRL's.*verl's"):
        load_reward_fn("reward_styles:two_args")
