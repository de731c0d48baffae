"""The lean engine's conversation cache (rollout/continuation.py) draws what re-prefilling draws.

Turn 0 against LeanEngine.generate, a later turn against generate on the whole conversation (with the
whole last turn kept, and cut short as a stop string cuts it), and the tool loop end to end with the
cache on and off: the same tokens, log-probs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from conftest import head_dim_64_model

from hasten.kernels import decode_attention
from hasten.agent import make_tool
from hasten.agent.loop import Agent, AgentSettings
from hasten.agent.template import HERMES_TEMPLATE, ToolTemplate
from hasten.models.tiny import tiny_model, tiny_tokenizer
from hasten.rollout import SamplingParams
from hasten.rollout.continuation import ConversationCache
from hasten.rollout.lean import LeanEngine

SAMPLING = SamplingParams(max_new_tokens=24, temperature=0.8)


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer)).eval()
    return LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]), tokenizer


def same(actual, expected):
    assert torch.equal(actual.completion_ids, expected.completion_ids)
    assert torch.equal(actual.completion_mask, expected.completion_mask)
    assert torch.equal(actual.ended_with_eos, expected.ended_with_eos)
    mask = expected.completion_mask.bool()
    assert (actual.sampling_logprobs - expected.sampling_logprobs)[mask].abs().max() < 1e-4


def test_first_turn_equals_generate(engine):
    lean, tokenizer = engine
    prompts = [tokenizer("a longer first prompt", add_special_tokens=False)["input_ids"],
               tokenizer("short", add_special_tokens=False)["input_ids"]]
    cache = ConversationCache(lean, 64)
    first = cache.start(prompts, 3, SAMPLING, seed=7)
    same(first, lean.generate(prompts, 3, SAMPLING, seed=7))
    held = [len(prompts[row // 3]) + int(first.completion_mask[row].sum()) - 1 for row in range(6)]
    assert cache.lengths.tolist() == held  # the prompt and every sampled token but the last (never fed)


@pytest.mark.parametrize("cut", [None, 3])
def test_later_turn_equals_generate_on_the_whole_conversation(engine, cut):
    lean, tokenizer = engine
    prompts = [tokenizer("question one", add_special_tokens=False)["input_ids"],
               tokenizer("q2", add_special_tokens=False)["input_ids"]]
    cache = ConversationCache(lean, 256)
    first = cache.start(prompts, 2, SAMPLING, seed=3)
    tool = tokenizer("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    rows = [0, 3]  # the first prompt's first rollout, the second's second
    contexts, kept = [], []
    for row in rows:
        length = int(first.completion_mask[row].sum()) if cut is None else cut
        written = prompts[row // 2] + first.completion_ids[row, :length].tolist()
        contexts.append(written + tool)
        kept.append(len(written))
    later = cache.extend(rows, contexts, kept, SAMPLING, seed=11)
    same(later, lean.generate(contexts, 1, SAMPLING, seed=11))
    # A third turn for one of them: only its new tokens are fed.
    third = [contexts[1] + later.completion_ids[1, :int(later.completion_mask[1].sum())].tolist() + tool]
    kept_third = [len(third[0]) - len(tool)]
    same(cache.extend([3], third, kept_third, SAMPLING, seed=13), lean.generate(third, 1, SAMPLING, seed=13))


@pytest.mark.skipif(decode_attention.unavailable_reason() is not None, reason="no fused decode attention here")
def test_turns_with_the_fused_decode_attention_equal_plain_generate(monkeypatch):
    """speed.decode_attention in the conversation cache: rows of different own lengths (a later turn for
    some rows only), each answered by the kernel, draw what plain re-prefilling draws without it."""
    tokenizer = tiny_tokenizer()
    model = head_dim_64_model(len(tokenizer))
    plain = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    fused = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], decode_attention=True)
    answered = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a: answered.append(attend(*a)) or answered[-1])
    prompts = [tokenizer("question one is longer", add_special_tokens=False)["input_ids"],
               tokenizer("q2", add_special_tokens=False)["input_ids"]]
    cache = ConversationCache(fused, 256)
    first = cache.start(prompts, 3, SAMPLING, seed=5)
    same(first, plain.generate(prompts, 3, SAMPLING, seed=5))
    tool = tokenizer("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    rows, contexts, kept = [1, 2, 4], [], []
    for row in rows:
        written = prompts[row // 3] + first.completion_ids[row, :int(first.completion_mask[row].sum())].tolist()
        contexts.append(written + tool)
        kept.append(len(written))
    same(cache.extend(rows, contexts, kept, SAMPLING, seed=9), plain.generate(contexts, 1, SAMPLING, seed=9))
    assert answered and all(out is not None for out in answered)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class ForceFirstTurn:
    """A forward hook on lm_head: the first len(script) logits calls emit script's tokens (turn 0 is a tool
    call); after that the model samples freely."""

    def __init__(self, script):
        self.script, self.calls = script, 0

    def __call__(self, module, inputs, logits):
        if self.calls >= len(self.script):
            return logits
        forced = torch.full_like(logits, -1e9)
        forced[..., self.script[self.calls]] = 0.0
        self.calls += 1
        return forced


def forced_batches(lean, tokenizer, tool, script, rows, sampling, max_turns, before_each=lambda: None,
                   isolation="process"):
    """The agent's batch with the conversation cache and without, the first turn forced to `script`."""
    batches = []
    for kv_cache in (True, False):
        before_each()
        agent = Agent(tokenizer, ToolTemplate(tokenizer, HERMES_TEMPLATE), [make_tool(tool)], None,
                      AgentSettings(max_turns=max_turns, kv_cache=kv_cache, isolation=isolation),
                      tokenizer.pad_token_id)
        hook = lean.base.lm_head.register_forward_hook(ForceFirstTurn(script))
        try:
            batches.append(agent.generate(lean, rows, 2, sampling, seed=5))
        finally:
            hook.remove()
            agent.close()
    return batches


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tool_loop_with_cache_equals_re_prefill(engine, temperature):
    lean, tokenizer = engine
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    script = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = [{"prompt": [{"role": "user", "content": f"What is {n} x 7?"}]} for n in (6, 16)]
    sampling = SamplingParams(max_new_tokens=200, temperature=temperature)  # call ~77 + tool turn ~52 + a turn
    batches = forced_batches(lean, tokenizer, multiply, script, rows, sampling, max_turns=2)
    cached, plain = (batch.rollout for batch in batches)
    assert batches[0].metrics["tools/model_turns"] == 2.0  # the forced call ran and every rollout went on
    same(cached, plain)
    assert torch.equal(cached.tool_mask, plain.tool_mask)


def test_rows_whose_tool_results_differ_in_length_fit_the_cache(engine):
    """A later turn decodes every row for the largest budget left; a row whose long tool result used most of
    its own budget must still fit (the cache once held only the longest prompt + max_new_tokens)."""
    lean, tokenizer = engine
    answers = iter(["x" * 40, "7"])  # the group's two rollouts get tool results of different lengths

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        return next(answers, "7")

    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
    script = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = [{"prompt": [{"role": "user", "content": "Look k up."}]}]
    sampling = SamplingParams(max_new_tokens=200, temperature=0.0)

    def reset():
        nonlocal answers
        answers = iter(["x" * 40, "7"])

    # thread isolation: the tool's answers come from one iterator in this process (TRL's contract); in a child
    # per call (process isolation) every call would start the iterator afresh
    batches = forced_batches(lean, tokenizer, lookup, script, rows, sampling, max_turns=1, before_each=reset,
                             isolation="thread")
    for batch in batches:  # (which rollout gets the long result depends on the tool threads' order)
        tool_tokens = sorted(int(((1 - batch.rollout.tool_mask[row]) * batch.rollout.completion_mask[row]).sum())
                             for row in range(2))
        assert tool_tokens[0] < tool_tokens[1]  # both tool turns appended, of different lengths
        assert batch.metrics["tools/model_turns"] == 2.0  # and every rollout went on after its tool turn


@pytest.mark.parametrize("fused", [False, True])
def test_rows_that_finish_leave_the_batch(fused):
    """Rows that end their turn early leave the running batch (the later steps feed fewer rows, nothing is
    copied), on turn 0 and on a later turn for some rows, and the rest draw what re-prefilling draws. Many
    end tokens make the rows end at different steps."""
    if fused and decode_attention.unavailable_reason() is not None:
        pytest.skip("no fused decode attention here")
    tokenizer = tiny_tokenizer()
    model = head_dim_64_model(len(tokenizer))
    ends = list(range(3, len(tokenizer), 9))  # one token in nine ends a row
    plain = LeanEngine(model, tokenizer.pad_token_id, ends)
    lean = LeanEngine(model, tokenizer.pad_token_id, ends, decode_attention=fused)
    fed = []
    layers = lean._layers
    lean._layers = lambda hidden, *rest: fed.append(hidden.shape[0]) or layers(hidden, *rest)
    prompts = [tokenizer("question one is longer", add_special_tokens=False)["input_ids"],
               tokenizer("q2", add_special_tokens=False)["input_ids"]]
    cache = ConversationCache(lean, 256)
    first = cache.start(prompts, 4, SAMPLING, seed=2)
    same(first, plain.generate(prompts, 4, SAMPLING, seed=2))
    lengths = first.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps
    decode_steps = fed[1:]  # fed[0] is the prompts' prefill
    assert decode_steps[0] == int((lengths > 1).sum())  # a row whose first token ends it is never fed
    assert decode_steps[-1] < decode_steps[0] and decode_steps == sorted(decode_steps, reverse=True)
    assert sum(decode_steps) == int((lengths - 1).sum())  # each row is fed until its last sampled token
    tool = tokenizer("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    rows, contexts, kept = [0, 3, 5, 6], [], []
    for row in rows:
        written = prompts[row // 4] + first.completion_ids[row, :int(first.completion_mask[row].sum())].tolist()
        contexts.append(written + tool)
        kept.append(len(written))
    fed.clear()
    later = cache.extend(rows, contexts, kept, SAMPLING, seed=4)
    same(later, plain.generate(contexts, 1, SAMPLING, seed=4))
    assert sum(fed[1:]) == int((later.completion_mask.sum(1) - 1).sum())
