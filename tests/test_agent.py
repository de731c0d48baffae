"""The tool loop (hasten/agent/) with scripted model turns: parsing, execution, errors, timeouts, masks.

A ScriptedEngine stands in for the model: it answers each context with the
text a script picks for it (looked up by the last user/tool content), so every
path of the loop is driven exactly, on the tiny model's byte tokenizer.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from hasten.agent import Environments, make_tool, parse_tool_calls
from hasten.agent.loop import Agent, AgentSettings
from hasten.agent.template import HERMES_TEMPLATE, ToolTemplate, resolve_template
from hasten.agent.tools import ToolError
from hasten.config import ConfigError
from hasten.models.tiny import tiny_tokenizer
from hasten.rollout import Rollout, SamplingParams

LOGPROB = -0.25  # every scripted token's sampling log-prob


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("boom")


def hang(x: int) -> int:
    """Never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(30)
    return x


def leave(x: int) -> int:
    """Calls sys.exit.

    Args:
        x: Anything.
    """
    raise SystemExit(3)


async def add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: The first term.
        b: The second term.
    """
    await asyncio.sleep(0.01)
    return a + b


async def slow_add(a: int, b: int) -> int:
    """Add two integers, too slowly.

    Args:
        a: The first term.
        b: The second term.
    """
    await asyncio.sleep(30)
    return a + b


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class ScriptedEngine:
    """An Engine whose completions are script(context text) + EOS, each token at log-prob LOGPROB."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, num_generations, sampling, seed, rows=None):
        self.calls.append((len(prompts), num_generations, sampling.max_new_tokens))
        tokenizer = self.tokenizer
        texts = [tokenizer.decode(p) for p in prompts for _ in range(num_generations)]
        outputs = []
        for index, text in enumerate(texts):
            ids = tokenizer(self.script(text, index % num_generations), add_special_tokens=False)["input_ids"]
            ended = len(ids) < sampling.max_new_tokens
            outputs.append((ids + [tokenizer.eos_token_id])[:sampling.max_new_tokens] if ended else
                           ids[:sampling.max_new_tokens])
        width = max(len(p) for p in prompts)
        prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        length = max(len(o) for o in outputs)
        ids = torch.tensor([o + [0] * (length - len(o)) for o in outputs])
        mask = torch.tensor([[1] * len(o) + [0] * (length - len(o)) for o in outputs])
        ended = torch.tensor([bool(o) and o[-1] == tokenizer.eos_token_id for o in outputs])
        return Rollout(prompt_ids, prompt_mask, ids, mask, mask * LOGPROB, ended, num_generations, sampling)

    def weights_changed(self):
        pass


def last_content(text: str) -> str:
    """The last user or tool-response content of a rendered ChatML context."""
    if "<tool_response>" in text:
        return text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
    return text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_agent(tokenizer, tools, max_turns=3, timeout=2.0, environments=None, isolation="process"):
    template = ToolTemplate(tokenizer, HERMES_TEMPLATE)
    return Agent(tokenizer, template, [make_tool(t) for t in tools], environments,
                 AgentSettings(max_turns, timeout, isolation=isolation), tokenizer.pad_token_id or 0)


def rows_for(*questions):
    return [{"prompt": [{"role": "user", "content": q}], "answer": q} for q in questions]


def test_parse_tool_calls_reads_hermes_calls_and_flags_bad_ones():
    text = (call("multiply", '{"a": 3, "b": 4}') + "then" + call("add", '"{\\"a\\": 1, \\"b\\": 2}"')
            + "<tool_call>{not json}</tool_call>" + '<tool_call>{"arguments": {}}</tool_call>'
            + call("multiply", "[1, 2]"))
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("multiply", {"a": 3, "b": 4}, True), ("add", {"a": 1, "b": 2}, True)]
    assert calls[2].error and "JSON" in calls[2].error
    assert calls[3].error and calls[4].error
    assert parse_tool_calls("no call here") == []


def test_tool_without_hints_or_docstring_is_a_one_line_error():
    def bare(a):
        return a

    with pytest.raises(ToolError, match="tool error: bare") as error:
        make_tool(bare)
    assert "\n" not in str(error.value)


def test_template_without_tool_format_is_a_config_error(tokenizer):
    class Plain:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        eos_token = "</s>"

    with pytest.raises(ConfigError, match="generation.tool_template"):
        resolve_template(Plain(), "auto")
    assert resolve_template(tokenizer, "auto").template == HERMES_TEMPLATE  # ChatML: the shipped one


def test_one_tool_round_trip_masks_and_logprobs(tokenizer):
    def script(text, sample):
        content = last_content(text)
        if content == "q":
            return call("multiply", '{"a": 12, "b": 13}')
        return f"<answer>{content}</answer>"

    agent = make_agent(tokenizer, [multiply])
    engine = ScriptedEngine(tokenizer, script)
    batch = agent.generate(engine, rows_for("q"), 2, SamplingParams(max_new_tokens=400), seed=0)
    rollout = batch.rollout
    first = tokenizer(call("multiply", '{"a": 12, "b": 13}'), add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    suffix = agent.template.tool_turn_ids([("multiply", "156")])
    last = tokenizer("<answer>156</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    expected = first + suffix + last
    for row in range(2):
        length = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :length].tolist() == expected
        assert rollout.tool_mask[row, :length].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(last)
        logprobs = rollout.sampling_logprobs[row, :length]
        assert torch.all(logprobs[rollout.tool_mask[row, :length] == 0] == 0)
        assert torch.allclose(logprobs[rollout.tool_mask[row, :length] == 1], torch.tensor(LOGPROB))
    assert rollout.model_lengths.tolist() == [len(first) + len(last)] * 2  # completion_length: model tokens
    assert rollout.ended_with_eos.tolist() == [True, True]
    loss_mask = rollout.loss_mask()
    assert torch.equal(loss_mask, rollout.completion_mask * rollout.tool_mask)
    assert engine.calls == [(1, 2, 400), (2, 1, 400 - len(first) - len(suffix))]  # the group, then 2 rows
    messages = batch.inputs.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 12, "b": 13}}
    assert messages[1]["content"] == "156" and messages[2]["content"] == "<answer>156</answer>"
    assert batch.metrics["tools/call_frequency"] == 1.0 and batch.metrics["tools/failure_frequency"] == 0.0


@pytest.mark.parametrize("tool, arguments, message", [
    ("explode", '{"x": 1}', "RuntimeError: boom"),
    ("nosuch", '{"x": 1}', "unknown tool 'nosuch'"),
    ("multiply", '{"a": 1}', "bad arguments for multiply"),
    ("hang", '{"x": 1}', "hang timed out after 0.5 s"),
    ("slow_add", '{"a": 1, "b": 2}', "slow_add timed out after 0.5 s"),
    ("leave", '{"x": 1}', "SystemExit: 3"),
])
def test_failures_become_error_text_for_the_model(tokenizer, tool, arguments, message):
    seen = []

    def script(text, sample):
        content = last_content(text)
        if content == "q":
            return call(tool, arguments)
        seen.append(content)
        return "done"

    agent = make_agent(tokenizer, [multiply, explode, hang, slow_add, leave], timeout=0.5)
    batch = agent.generate(ScriptedEngine(tokenizer, script), rows_for("q"), 2, SamplingParams(max_new_tokens=400), 0)
    assert len(seen) == 2 and all(message in content for content in seen)
    assert batch.metrics["tools/failure_frequency"] == 1.0
    assert batch.inputs.completions[0][-1]["content"] == "done"


def test_calls_of_different_rollouts_run_at_the_same_time(tokenizer):
    """Thread isolation (the barrier is shared memory); tests/test_agent_tools.py checks process isolation."""
    barrier = threading.Barrier(4, timeout=20)  # passes only if all four rollouts' calls are running at once

    def meet(x: int) -> str:
        """Wait for the other rollouts' calls.

        Args:
            x: Anything.
        """
        barrier.wait()
        return "met"

    def script(text, sample):
        return call("meet", '{"x": 1}') if last_content(text) == "q" else "done"

    batch = make_agent(tokenizer, [meet], timeout=30, isolation="thread").generate(
        ScriptedEngine(tokenizer, script), rows_for("q", "q"), 2, SamplingParams(max_new_tokens=400), 0)
    assert [c[1]["content"] for c in batch.inputs.completions] == ["met"] * 4


def test_prompt_shows_the_tool_schemas(tokenizer):
    prompts = []

    def script(text, sample):
        prompts.append(text)
        return "done"

    make_agent(tokenizer, [multiply, add]).generate(ScriptedEngine(tokenizer, script), rows_for("q"), 2,
                                                    SamplingParams(max_new_tokens=50), 0)
    assert '"name": "multiply"' in prompts[0] and '"name": "add"' in prompts[0] and "<tools>" in prompts[0]


def test_async_tools_and_several_calls_per_turn(tokenizer):
    def script(text, sample):
        content = last_content(text)
        if content == "q":
            return call("add", '{"a": 2, "b": 3}') + call("multiply", '{"a": 2, "b": 3}')
        return "ok"

    agent = make_agent(tokenizer, [add, multiply])
    batch = agent.generate(ScriptedEngine(tokenizer, script), rows_for("q"), 2, SamplingParams(max_new_tokens=400), 0)
    tool_messages = [m for m in batch.inputs.completions[1] if m["role"] == "tool"]
    assert [(m["name"], m["content"]) for m in tool_messages] == [("add", "5"), ("multiply", "6")]
    assert batch.metrics["tools/call_frequency"] == 2.0


def test_turn_cap_and_length_cap_end_the_loop(tokenizer):
    def always_call(text, sample):
        return call("multiply", '{"a": 1, "b": 1}')

    engine = ScriptedEngine(tokenizer, always_call)
    batch = make_agent(tokenizer, [multiply], max_turns=2).generate(
        engine, rows_for("q"), 2, SamplingParams(max_new_tokens=2000), 0)
    assert len(engine.calls) == 3  # turn 0 and 2 tool rounds
    assert [m["role"] for m in batch.inputs.completions[0]].count("assistant") == 3
    # A budget that fits one call but not its tool turn: the rollout ends with its call, unanswered.
    first = len(tokenizer(always_call("", 0), add_special_tokens=False)["input_ids"]) + 1
    engine = ScriptedEngine(tokenizer, always_call)
    batch = make_agent(tokenizer, [multiply]).generate(engine, rows_for("q"), 2, SamplingParams(max_new_tokens=first + 5),
                                                      0)
    assert len(engine.calls) == 1 and batch.rollout.completion_mask.sum(dim=1).tolist() == [first, first]
    assert batch.metrics["tools/call_frequency"] == 1.0  # the calls ran (TRL counts them) but were dropped


def test_rows_that_finish_wait_while_others_continue(tokenizer):
    def script(text, sample):
        content = last_content(text)
        if content == "q" and sample == 0:
            return call("multiply", '{"a": 2, "b": 2}')
        return "final"

    engine = ScriptedEngine(tokenizer, script)
    batch = make_agent(tokenizer, [multiply]).generate(engine, rows_for("q", "r"), 2, SamplingParams(max_new_tokens=300),
                                                      0)
    assert [c[0] for c in engine.calls] == [2, 1]  # two prompts' groups, then only the row that called
    assert batch.rollout.tool_mask[1].sum() == batch.rollout.completion_mask[1].sum()  # no tool tokens
    assert batch.metrics["tools/call_frequency"] == pytest.approx(0.25)


class Guess:
    """A tiny environment: the secret is the row's answer; one tool."""

    made = 0

    def __init__(self):
        Guess.made += 1
        self.secret, self.tries = None, 0

    def reset(self, **row):
        self.secret, self.tries = int(row["secret"]), 0
        return " Guess it."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        self.tries += 1
        return "correct" if number == self.secret else ("higher" if number < self.secret else "lower")

    def get_reward(self) -> float:
        return 1.0 if self.tries else 0.0


def test_environment_reset_tools_and_reward(tokenizer):
    def script(text, sample):
        content = last_content(text)
        if content.endswith("Guess it."):
            return call("guess", '{"number": %d}' % (5 + sample))
        return content

    environments = Environments(Guess)
    agent = make_agent(tokenizer, [], environments=environments)
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "secret": 6}]
    batch = agent.generate(ScriptedEngine(tokenizer, script), rows, 3, SamplingParams(max_new_tokens=400), 0)
    assert batch.inputs.prompts[0][-1]["content"] == "Play. Guess it."  # reset's text, as TRL's prompts
    replies = [c[-1]["content"] for c in batch.inputs.completions]
    assert replies == ["higher", "correct", "lower"]  # one instance per rollout, reset with the row
    instances = batch.inputs.columns["environments"]
    assert len({id(e) for e in instances}) == 3
    reward = environments.reward_functions()[0]
    assert reward.name == "Guess" and reward.fn(environments=instances) == [1.0, 1.0, 1.0]
    made = Guess.made
    agent.generate(ScriptedEngine(tokenizer, script), rows, 3, SamplingParams(max_new_tokens=400), 0)
    assert Guess.made == made  # pooled: reset, not rebuilt


def test_environment_without_reset_is_an_error():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: Anything.
            """
            return x

    with pytest.raises(ToolError, match="NoReset has no reset"):
        Environments(NoReset)


def test_qwen3s_own_template_is_swapped_for_trls_prefix_preserving_training_version():
    """Qwen3's template drops earlier turns' <think> blocks, so a tool turn changes the text before it: as
    TRL 1.16 does, auto renders tool turns with TRL's qwen3 training template (bundled), saying so once."""
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = trl_templates.qwen3_chat_template
    own = ToolTemplate(tokenizer, trl_templates.qwen3_chat_template)
    assert not own.preserves_prefix()
    with pytest.raises(ConfigError, match="prefix-preserving"):
        own.tool_turn_ids([("multiply", "6")])
    said: list[str] = []
    template = resolve_template(tokenizer, "auto", log=said.append)
    assert template.template == trl_templates.qwen3_training_chat_template  # the bundled copy is TRL's file
    assert template.preserves_prefix() and template.tool_turn_ids([("multiply", "6")])
    assert len(said) == 1 and "qwen3_training.jinja" in said[0]
    # a template that preserves prefixes is kept as it is, silently
    tokenizer.chat_template = trl_templates.qwen3_training_chat_template
    assert resolve_template(tokenizer, "auto", log=said.append).template == trl_templates.qwen3_training_chat_template
    assert len(said) == 1


@pytest.mark.parametrize("body", ['{"arguments": {"a": 3}}', '{"name": "multiply", "arguments": {a: 3}}'])
def test_a_turn_with_an_unreadable_call_makes_no_call(body):
    """TRL's test_train_with_malformed_tool_calls: no name, or not JSON, is no tool call (no second turn); a
    readable call in the same shape is one."""
    from hasten.agent.loop import Conversation

    turn = Conversation(prompt=[], prompt_ids=[1], tools={})
    turn.add_model_turn([5, 6], [0.0, 0.0], ended=True, text=f"<tool_call>\n{body}\n</tool_call>")
    assert turn.pending == [] and "tool_calls" not in turn.messages[-1]
    turn.add_model_turn([5, 6], [0.0, 0.0], ended=True,
                        text='<tool_call>\n{"name": "multiply", "arguments": {"a": 3}}\n</tool_call>')
    assert [call.name for call in turn.pending] == ["multiply"] and turn.messages[-1]["tool_calls"]
