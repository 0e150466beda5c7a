"""Multi-turn trajectories on a worker: turns through a real engine (simulated tokens or
scripted text), environment steps off the loop, tool results appended as masked spans."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from laminar_common.codec import PromptTask, SamplingSpec, Trajectory
from laminar_common.consume.validation import check_trajectory
from laminar_rollout.conversations import Completed, Conversations, make_conversations
from laminar_rollout.engines import LogNormalLengths, ManualClock, SimulatedEngine
from laminar_rollout.environments import (
    SimulatedToolEnvironment,
    ToolEnvironment,
    TurnLimits,
)
from laminar_rollout.sandbox import CodeSandbox, SandboxLimits
from laminar_rollout.tokenizer import ByteTokenizer
from laminar_rollout.tools import PythonTool

SHORT = LogNormalLengths(median=8, tail_ratio=2, max_length=16)
"""Turns that end on their stop token within the tests' per-turn budgets."""


def _task(tid: str = "p0#0") -> PromptTask:
    return PromptTask(trajectory_id=tid, prompt_id=tid.split("#")[0], group_size=1,
                      sample_index=0, prompt="what is 6*7?",
                      messages=({"role": "user", "content": "what is 6*7?"},),
                      sampling=SamplingSpec(max_tokens=64))


def _run(conv: Conversations, engine, task: PromptTask, timeout_s: float = 20) -> Completed:
    """Drive one trajectory to its end as the worker's loop does."""
    ids, turn_tokens = conv.begin(task)
    from laminar_rollout.engines import GenerationRequest, SamplingParams

    engine.add_request(GenerationRequest(
        request_id=task.trajectory_id, prompt_token_ids=ids,
        params=SamplingParams(max_tokens=turn_tokens, stop_token_ids=(0,))))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step() if engine.has_unfinished() else []:
            done = conv.turn_ended(out)
            if done is not None:
                return done
        turns, finished = conv.poll()
        for _, request in turns:
            engine.add_request(request)
        if finished:
            return finished[0][1]
        time.sleep(0.001)
    raise AssertionError("the conversation did not end in time")


def _as_trajectory(task: PromptTask, done: Completed) -> Trajectory:
    return Trajectory(
        trajectory_id=task.trajectory_id, prompt_id=task.prompt_id, group_size=1,
        sample_index=0, worker_id="w", policy_version=done.policy_version,
        prompt_token_ids=done.prompt_token_ids, response_token_ids=done.response_token_ids,
        behaviour_logprobs=done.behaviour_logprobs, reward=1.0, finish_reason=done.finish_reason,
        observation_spans=done.observation_spans)


def test_simulated_tool_turns_append_masked_observations_and_stay_trainable():
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=5, max_tokens_per_turn=24, max_total_tokens=600)
    conv = Conversations(tok, lambda rec: SimulatedToolEnvironment(
        rec, limits, median_s=0.001, tail_ratio=10, tool_turns=2), limits, workers=2)
    engine = SimulatedEngine(max_batch=4, vocab_size=200, eos_token_id=0, seed=3,
                             clock=ManualClock(), lengths=SHORT)
    task = _task()
    done = _run(conv, engine, task)
    assert done.turns == 3 and len(done.observation_spans) == 2
    assert not conv.busy and conv.waiting() == []
    for i, (start, end) in enumerate(done.observation_spans, 1):
        text = bytes(t - tok.OFFSET for t in done.response_token_ids[start:end]).decode()
        assert text.startswith(f"\n<|im_start|>tool\nresult {i} after ")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert done.response_token_ids[start - 1] == 0  # the model's stop token precedes it
    traj = _as_trajectory(task, done)
    assert len(done.behaviour_logprobs) == traj.generated_tokens
    assert check_trajectory(traj, vocab_size=300) is None
    assert done.policy_version == 0 and done.finish_reason == "stop"


def test_the_total_token_budget_ends_a_conversation_as_length():
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=8, max_tokens_per_turn=16, max_total_tokens=90)
    conv = Conversations(tok, lambda rec: SimulatedToolEnvironment(
        rec, limits, median_s=0.0, tail_ratio=1, tool_turns=6), limits)
    engine = SimulatedEngine(max_batch=2, vocab_size=200, eos_token_id=0, seed=1,
                             clock=ManualClock(), lengths=SHORT)
    done = _run(conv, engine, _task())
    assert done.finish_reason == "length"
    assert len(done.response_token_ids) <= 90
    assert check_trajectory(_as_trajectory(_task(), done), vocab_size=300) is None


class ScriptedEngine(SimulatedEngine):
    """Writes a fixed text per turn (ByteTokenizer ids), then the stop token."""

    def __init__(self, turns: list[str]) -> None:
        super().__init__(max_batch=2, vocab_size=300, eos_token_id=0, clock=ManualClock())
        self.turns = [ByteTokenizer().encode(t)[1:] for t in turns]

    def _emit(self, seq) -> None:
        turn = sum(1 for t in seq.request.resume_token_ids if t == 0)  # stops so far
        script = self.turns[min(turn, len(self.turns) - 1)]
        i = len(seq.token_ids) - len(seq.request.resume_token_ids)
        seq.token_ids.append(script[i] if i < len(script) else 0)
        seq.logprobs.append(-0.5)


def test_a_hermes_tool_call_runs_in_the_sandbox_and_the_answer_comes_back():
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=3, max_tokens_per_turn=200, max_total_tokens=1000)
    pool = ThreadPoolExecutor(2)
    python = PythonTool(CodeSandbox(SandboxLimits(wall_s=5)))
    conv = Conversations(tok, lambda rec: ToolEnvironment(rec, limits, {"python": python}, pool),
                         limits)
    engine = ScriptedEngine([
        '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>',
        "The answer is 42."])
    task = _task()
    done = _run(conv, engine, task)
    pool.shutdown()
    [(start, end)] = done.observation_spans
    observed = bytes(t - tok.OFFSET for t in done.response_token_ids[start:end]).decode()
    assert observed == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert done.text == "The answer is 42." and done.turns == 2
    assert "<tool_call>" in done.completion and done.completion.endswith("The answer is 42.")
    assert len(done.behaviour_logprobs) == len(done.response_token_ids) - (end - start)
    assert check_trajectory(_as_trajectory(task, done), vocab_size=300) is None


def test_make_conversations_builds_the_configured_environment():
    from laminar_common.errors import ConfigError
    from laminar_rollout.config import EnvironmentConfig

    conv = make_conversations(EnvironmentConfig(type="simulated", options={"median_s": 0.0}),
                              ByteTokenizer())
    ids, turn_tokens = conv.begin(_task())
    assert ids[0] == 1 and turn_tokens == 256
    conv.close()
    import pytest

    with pytest.raises(ConfigError, match="unknown tool 'shell'"):
        make_conversations(EnvironmentConfig(tools=("shell",)), ByteTokenizer())


def test_a_conversation_is_pinned_to_its_worker_once_tool_results_are_in_it():
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=4, max_tokens_per_turn=24)
    conv = Conversations(tok, lambda rec: SimulatedToolEnvironment(
        rec, limits, median_s=0.0, tail_ratio=1, tool_turns=1), limits)
    engine = SimulatedEngine(max_batch=2, vocab_size=200, eos_token_id=0, clock=ManualClock(),
                             lengths=SHORT)
    task = _task()
    ids, turn_tokens = conv.begin(task)
    from laminar_rollout.engines import GenerationRequest, SamplingParams

    engine.add_request(GenerationRequest(request_id=task.trajectory_id, prompt_token_ids=ids,
                                         params=SamplingParams(max_tokens=turn_tokens)))
    assert not conv.pinned(task.trajectory_id)  # first turn: may move, as any trajectory
    outs = []
    while not outs:
        outs = engine.step()
    assert conv.turn_ended(outs[0]) is None
    assert conv.busy and conv.waiting() == [task.trajectory_id]
    deadline = time.monotonic() + 10
    turns = []
    while not turns and time.monotonic() < deadline:
        turns, _ = conv.poll()
    [(_, request)] = turns
    assert conv.pinned(task.trajectory_id) and conv.waiting() == []
    assert request.policy_version == 0 and len(request.resume_logprobs) == \
        len(request.resume_token_ids)
    conv.drop(task.trajectory_id)
    assert not conv.busy


def _tiny_model(seed: int):
    """A random-init Qwen2 whose vocabulary holds every ByteTokenizer id."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False)).eval()


def _drive(conv: Conversations, engine, task: PromptTask, request, timeout_s: float = 60,
           stop_after_turn2_tokens: int | None = None, with_kv: bool = False):
    """Run ``request`` (and the next turns) on ``engine``; with ``stop_after_turn2_tokens``,
    return the engine's export of the trajectory once that many tokens of its second turn
    exist, instead of finishing it (``with_kv``: with its attention cache, as the wire
    carries it)."""
    import msgspec

    from laminar_rollout.engines.kv_wire import kv_to_wire

    engine.add_request(request)
    deadline = time.monotonic() + timeout_s
    turn2_start = None
    while time.monotonic() < deadline:
        for out in engine.step() if engine.has_unfinished() else []:
            done = conv.turn_ended(out)
            if done is not None:
                return done
        if stop_after_turn2_tokens is not None and turn2_start is not None:
            [p] = engine.progress() or [None]
            if p is not None and len(p.token_ids) - turn2_start >= stop_after_turn2_tokens:
                [req] = engine.export_with_kv([task.trajectory_id]) if with_kv else \
                    engine.export([task.trajectory_id])
                state = conv.export_state(task.trajectory_id, replayable=True)
                return msgspec.structs.replace(
                    task, prompt_token_ids=tuple(req.prompt_token_ids),
                    resume_token_ids=tuple(req.resume_token_ids),
                    resume_logprobs=tuple(req.resume_logprobs),
                    policy_version=req.policy_version, conversation=state,
                    kv=kv_to_wire(req.kv) if with_kv else None)
        turns, finished = conv.poll()
        for _, nxt in turns:
            turn2_start = len(nxt.resume_token_ids)
            engine.add_request(nxt)
        if finished:
            return finished[0][1]
    raise AssertionError("the conversation did not end in time")


def begin_request(conv: Conversations, task: PromptTask, **params):
    """The first request of ``task`` on a worker, as the worker builds it: a moved
    trajectory's resumed tokens, version and KV cache included; ``params`` are the
    :class:`SamplingParams` beside ``max_tokens``."""
    from laminar_rollout.engines import GenerationRequest, SamplingParams
    from laminar_rollout.engines.kv_wire import kv_from_wire

    ids, max_tokens = conv.begin(task)
    return GenerationRequest(
        request_id=task.trajectory_id, prompt_token_ids=ids,
        resume_token_ids=list(task.resume_token_ids),
        resume_logprobs=list(task.resume_logprobs),
        policy_version=task.policy_version if task.resume_token_ids else None,
        params=SamplingParams(max_tokens=max_tokens, **params),
        kv=kv_from_wire(task.kv) if task.kv is not None else None)


@pytest.mark.parametrize("with_kv", [False, True], ids=["re-prefilled", "kv-moved"])
def test_a_conversation_moved_mid_turn_between_torch_engines_ends_as_if_it_had_not_moved(
        with_kv):
    """Worker A's torch engine runs turn 1 and part of turn 2 (after a tool result); the
    trajectory is exported with its conversation state and worker B's torch engine (same
    weights, same version) finishes it: tokens, log-probs, spans and turns equal a run
    that never moved (seeded sampling), and no tool call ran twice. With its KV cache
    (repack's KV transfer), B continues from the cache, tool results included, and
    prefills nothing."""
    import torch

    from laminar_rollout.engines import TorchEngine

    model = _tiny_model(seed=0)
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=3, max_tokens_per_turn=16, max_total_tokens=400)
    steps = []

    def env(rec):
        e = SimulatedToolEnvironment(rec, limits, median_s=0.0, tail_ratio=1, tool_turns=1)
        original = e.respond

        def counted(text):
            steps.append(rec["id"])
            return original(text)

        e.respond = counted
        return e

    stops = tuple(range(200, 259))  # about 1 token in 5 ends a turn

    def request(conv, task):
        return begin_request(conv, task, stop_token_ids=stops, seed=task.sampling.seed)

    for seed in range(40):  # a seed whose second turn is long enough to be cut midway
        task = PromptTask(trajectory_id=f"p{seed}#0", prompt_id=f"p{seed}", group_size=1,
                          sample_index=0, prompt="x",
                          messages=({"role": "user", "content": "compute"},),
                          sampling=SamplingSpec(stop_token_ids=stops, seed=seed))
        ref_conv = Conversations(tok, env, limits)
        reference = _drive(ref_conv, TorchEngine(model, max_batch=2, eos_token_ids=()), task,
                           request(ref_conv, task))
        spans = reference.observation_spans
        if len(spans) == 1 and reference.turns == 2 and \
                len(reference.response_token_ids) - spans[0][1] >= 4 and \
                reference.finish_reason == "stop":
            break
    else:
        raise AssertionError("no seed gave a second turn of 4+ tokens")
    steps.clear()

    conv_a = Conversations(tok, env, limits)
    moved = _drive(conv_a, TorchEngine(model, max_batch=2, eos_token_ids=()), task,
                   request(conv_a, task), stop_after_turn2_tokens=2, with_kv=with_kv)
    assert isinstance(moved, PromptTask) and moved.conversation is not None
    assert moved.conversation.observation_spans == spans and moved.conversation.turns == 2
    assert not conv_a.busy  # forgotten on A
    conv_b = Conversations(tok, env, limits)
    engine_b = TorchEngine(model, max_batch=2, eos_token_ids=(), seed=123)
    done = _drive(conv_b, engine_b, moved, request(conv_b, moved))
    if with_kv:  # every position but the last resumed one came with the cache
        assert moved.kv.num_tokens == len(moved.prompt_token_ids) + \
            len(moved.resume_token_ids) - 1
        assert engine_b.prefilled_tokens == 0 and engine_b.kv_reused_tokens == \
            moved.kv.num_tokens
    else:
        assert engine_b.kv_reused_tokens == 0 and engine_b.prefilled_tokens == \
            len(moved.prompt_token_ids) + len(moved.resume_token_ids)
    assert done.response_token_ids == reference.response_token_ids
    assert done.observation_spans == reference.observation_spans
    assert torch.allclose(torch.tensor(done.behaviour_logprobs),
                          torch.tensor(reference.behaviour_logprobs), atol=1e-5)
    assert (done.turns, done.text, done.finish_reason) == \
        (reference.turns, reference.text, reference.finish_reason)
    assert steps == [task.trajectory_id, task.trajectory_id]  # one tool call on A, the final on B


def test_with_kv_reuse_a_turn_prefills_only_its_tool_results_and_samples_the_same():
    import torch

    from laminar_rollout.engines import GenerationRequest, SamplingParams, TorchEngine

    model = _tiny_model(seed=1)
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=4, max_tokens_per_turn=12, max_total_tokens=600)
    stops = tuple(range(200, 259))
    runs = {}
    for reuse in (False, True):
        conv = Conversations(tok, lambda rec: SimulatedToolEnvironment(
            rec, limits, median_s=0.0, tail_ratio=1, tool_turns=3), limits, reuse_kv=reuse)
        engine = TorchEngine(model, max_batch=4, eos_token_ids=())
        done = []
        for seed in range(3):
            task = PromptTask(trajectory_id=f"p{seed}#0", prompt_id=f"p{seed}", group_size=1,
                              sample_index=0, prompt="x",
                              messages=({"role": "user", "content": "compute"},),
                              sampling=SamplingSpec(stop_token_ids=stops, seed=seed))
            ids, max_tokens = conv.begin(task)
            done.append(_drive(conv, engine, task, GenerationRequest(
                request_id=task.trajectory_id, prompt_token_ids=ids, keep_kv=reuse,
                params=SamplingParams(max_tokens=max_tokens, stop_token_ids=stops, seed=seed))))
        runs[reuse] = (done, engine.prefilled_tokens, engine.kv_reused_tokens)
    (plain, plain_prefilled, _), (reused, reused_prefilled, kept) = runs[False], runs[True]
    assert sum(len(d.observation_spans) for d in plain) >= 3  # several turns happened
    for a, b in zip(plain, reused):
        assert a.response_token_ids == b.response_token_ids
        assert a.observation_spans == b.observation_spans
        assert torch.allclose(torch.tensor(a.behaviour_logprobs),
                              torch.tensor(b.behaviour_logprobs), atol=1e-5)
    # Each next turn takes its cache (all but the turn's last token) instead of prefilling
    # it; its last token is then fed by the next decode step instead of the prefill.
    next_turns = sum(len(d.observation_spans) for d in reused)
    assert kept > 0 and reused_prefilled + kept + next_turns == plain_prefilled
    assert reused_prefilled < plain_prefilled / 2


@pytest.mark.parametrize("text, says", [
    ('<tool_call>{"name": "python", "arguments": ' + "[" * 3000 + "]" * 3000 + "}</tool_call>",
     "nested"),
    ('<tool_call>{"name": "\\ud800python", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"name": "python", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>",
     "digits"),
])
def test_hostile_tool_call_text_is_a_tool_error_the_model_sees_not_a_crash(text, says):
    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=2, max_tokens_per_turn=12000, max_total_tokens=20000)
    pool = ThreadPoolExecutor(1)
    conv = Conversations(tok, lambda rec: ToolEnvironment(rec, limits, {}, pool), limits)
    done = _run(conv, ScriptedEngine([text, "ok"]), _task())
    pool.shutdown()
    [(start, end)] = done.observation_spans
    observed = bytes(t - tok.OFFSET for t in done.response_token_ids[start:end]).decode()
    assert "error" in observed and says in observed
    assert conv.counters["env_errors"] == 0 and done.turns == 2


def test_a_next_turn_that_cannot_be_built_ends_that_trajectory_counted_by_reason():
    class Exploding(ByteTokenizer):
        def encode_observation(self, *args, **kwargs):
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    tok = Exploding()
    limits = TurnLimits(max_turns=3, max_tokens_per_turn=200, max_total_tokens=1000)
    pool = ThreadPoolExecutor(1)
    conv = Conversations(tok, lambda rec: ToolEnvironment(rec, limits, {}, pool), limits)
    done = _run(conv, ScriptedEngine(['<tool_call>{"name": "x"}</tool_call>', "ok"]), _task())
    pool.shutdown()
    assert done.turns == 1
    assert conv.counters["env_errors"] == 1
    assert conv.env_error_reasons == {"next_turn:UnicodeEncodeError": 1}
