"""The multi-turn tool loop above the engine: one Rollout per batch, tool-result tokens masked.

TRL 1.16's _tool_call_loop, on hasten's token-id engines:

    turn 0   engine.generate(prompts rendered with the tools' schemas, G)   (the group shares its prefill)
    turn k   for every rollout whose last turn ended (EOS) with <tool_call>s:
               parse -> run every rollout's calls at once, each with its timeout, in a child process
               killed at the timeout or (tool_isolation=thread) on a thread (agent/tools.py, agent/isolation.py)
               -> the template's tool turn as ids (agent/template.py), appended without re-tokenizing
               -> engine.generate(prompt + completion so far, 1) for those rollouts only
    until no rollout calls a tool, generation.max_tool_turns rounds (TRL's max_tool_calling_iterations),
    or the length cap (generation.max_new_tokens counts every completion token, tool results included,
    as TRL's max_completion_length; a tool turn that would pass it is dropped and the rollout ends).

Rollouts that finished wait; the others continue in a smaller batch, so a long
conversation never holds a short one's slot. On the lean engine each
conversation's K/V stays between turns (rollout/continuation.py: only the tool
turn is prefilled, each prompt once per group); other engines (transformers',
speculative, vLLM) re-prefill the conversation through engine.generate. Both
draw the same tokens (tests/test_agent_cache.py); generation.tool_kv_cache=false
forces the second.

The Rollout it returns is an ordinary one whose completion is model turns and
tool turns concatenated, plus `tool_mask` (1 = written by the model, 0 = tool
result): the learner's forward sees every token, the loss only the model's
(train/trainer.py grpo_step), tool tokens carry sampling log-prob 0, and
completion_length counts model tokens only (Rollout.model_lengths), as TRL.
Rewards get TRL's layout: `completions` as the list of messages (assistant
turns with their tool_calls, tool messages), plus `environments` when an
environment_factory is in use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rewards.batch import RewardInputs
from ..rollout import Engine, Rollout, RowRange, SamplingParams
from ..rollout.continuation import ConversationCache
from ..rollout.lean import LeanEngine
from ..rollout.stops import apply_stop_strings
from .environments import Environments
from .forkserver import ForkServer
from .results import result_limit
from .template import ToolTemplate, tool_call_message
from .tools import CALL_PATTERN, Tool, ToolCall, ToolRunner, parse_tool_calls, unique_tools


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 10  # tool-calling rounds after the first turn (generation.max_tool_turns)
    timeout: float = 10.0  # seconds per tool call (generation.tool_timeout)
    stop_strings: tuple[str, ...] = ()  # generation.stop_strings, cut per model turn
    kv_cache: bool = True  # generation.tool_kv_cache: the lean engine keeps each conversation's K/V between turns
    isolation: str = "process"  # generation.tool_isolation: where user tools run (agent/tools.py)


@dataclass
class Conversation:
    """One rollout in flight: its prompt, what has been written so far, and who wrote it."""

    prompt: list[dict]  # the row's messages, with the environment's reset text appended (TRL's `prompts`)
    prompt_ids: list[int]
    tools: dict[str, Tool]
    environment: Any = None
    ids: list[int] = field(default_factory=list)  # completion: model turns and tool turns
    logprobs: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)  # 1 = model token, 0 = tool-result token
    messages: list[dict] = field(default_factory=list)  # TRL's completion layout
    ended: bool = False  # the last model turn ended with EOS / a stop string
    pending: list[ToolCall] = field(default_factory=list)  # the last turn's calls, not yet run
    kept: int = 0  # completion tokens before the latest tool turn (what the model wrote or saw already)

    def add_model_turn(self, ids: list[int], logprobs: list[float], ended: bool, text: str) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.tool_mask += [1] * len(ids)
        self.ended = ended
        calls = parse_tool_calls(text) if ended else []  # a cut-off turn's call is not run (TRL: no EOS)
        # a turn with an unreadable call (not JSON, no name) makes no call: its text is the answer, as TRL's
        # parse_response finds no tool_calls in it and generates no tool turn
        self.pending = [] if any(call.error is not None for call in calls) else calls
        self.messages.append(tool_call_message(CALL_PATTERN.sub("", text).strip(), self.pending))


@dataclass
class AgentBatch:
    rollout: Rollout
    inputs: RewardInputs
    metrics: dict[str, float]


class Agent:
    """Tools (and environments) for a run: `generate(engine, rows, G, sampling, seed)` -> AgentBatch."""

    def __init__(self, tokenizer, template: ToolTemplate, tools: list[Tool], environments: Environments | None,
                 settings: AgentSettings, pad_token_id: int, fork_server: ForkServer | None = None):
        self.tokenizer, self.template, self.settings = tokenizer, template, settings
        self.tools = unique_tools(tools)
        self.environments = environments
        self.pad_token_id = pad_token_id
        self.runner = ToolRunner(settings.timeout, settings.isolation, fork_server)  # closes the server with it

    def generate(self, engine: Engine, rows: list[dict], num_generations: int, sampling: SamplingParams,
                 seed: int, row_range: RowRange | None = None) -> AgentBatch:
        conversations = self._start(rows, num_generations)
        cache = None
        if self.settings.kv_cache and isinstance(engine, LeanEngine):  # the fast path: no re-prefill per turn
            # A later turn decodes every active row for the largest budget left (_continue), so a row that
            # has used most of its own budget may write up to max_new_tokens past it: room for both.
            cache = ConversationCache(engine, max(len(c.prompt_ids) for c in conversations)
                                      + 2 * sampling.max_new_tokens)
        first = self._first_turn(engine, cache, conversations, num_generations, sampling, seed, row_range)
        calls = failures = 0
        for turn in range(1, self.settings.max_turns + 1):
            active = [c for c in conversations if c.pending]
            if not active:
                break
            results = self.runner.run([c.pending for c in active], [c.tools for c in active],
                                      result_limit(sampling.max_new_tokens))
            calls += sum(len(r) for r in results)
            failures += sum(result.failed for r in results for result in r)
            active = self._append_tool_turns(active, results, sampling.max_new_tokens)
            if active:
                self._continue(engine, cache, conversations, active, sampling, seed + 1_000_003 * turn)
        for conversation in conversations:
            conversation.pending = []  # the turn cap left these unanswered: the completion ends with the call
        rollout = self._rollout(first, conversations, num_generations, sampling)
        metrics = {"tools/call_frequency": calls / len(conversations),
                   "tools/failure_frequency": failures / calls if calls else 0.0,
                   "tools/model_turns": sum(len([m for m in c.messages if m["role"] == "assistant"])
                                            for c in conversations) / len(conversations)}
        return AgentBatch(rollout, self._reward_inputs(rows, conversations, rollout, num_generations), metrics)

    # -- turns
    def _start(self, rows: list[dict], num_generations: int) -> list[Conversation]:
        """One conversation per rollout: environment reset (its text appended to the last user message), ids."""
        conversations = []
        instances = self.environments.take(rows, num_generations) if self.environments else None
        for index in range(len(rows) * num_generations):
            row = rows[index // num_generations]
            messages, tools = list(row["prompt"]), dict(self.tools)
            environment = None
            if instances is not None:
                environment, name = instances[index]
                observation = self.environments.reset(environment, name, row)
                if observation:
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
                tools.update(self.environments.bound_tools(environment, name))
            schemas = [tool.schema for tool in tools.values()]
            conversations.append(Conversation(messages, self.template.encode_prompt(messages, schemas), tools,
                                              environment))
        return conversations

    def _first_turn(self, engine: Engine, cache: ConversationCache | None, conversations: list[Conversation],
                    num_generations: int, sampling: SamplingParams, seed: int,
                    row_range: RowRange | None) -> Rollout:
        """Turn 0. A group whose rollouts share one prompt shares its prefill (generate with G); when an
        environment's reset made them differ, every rollout is its own prompt (G = 1, the same draws)."""
        prompts = [c.prompt_ids for c in conversations]
        grouped = all(prompts[i] == prompts[i - i % num_generations] for i in range(len(prompts)))
        prompts, group = (prompts[::num_generations], num_generations) if grouped else (prompts, 1)
        generate = cache.start if cache is not None else engine.generate
        rollout = generate(prompts, group, sampling, seed, row_range)
        self._take_turn(rollout, conversations, [sampling.max_new_tokens] * len(conversations))
        return rollout

    def _append_tool_turns(self, active: list[Conversation], results, budget: int) -> list[Conversation]:
        """Tool results as the template's tool turn; those that would pass the length cap end their rollout."""
        kept = []
        for conversation, turn in zip(active, results):
            conversation.pending = []
            conversation.kept = len(conversation.ids)
            suffix = self.template.tool_turn_ids([(result.name, result.content) for result in turn])
            if len(conversation.ids) + len(suffix) > budget:
                continue  # TRL: dropped, the rollout exits with its completion as it is
            conversation.ids += suffix
            conversation.logprobs += [0.0] * len(suffix)
            conversation.tool_mask += [0] * len(suffix)
            conversation.messages += [{"role": "tool", "name": result.name, "content": result.content}
                                      for result in turn]
            kept.append(conversation)
        return kept

    def _continue(self, engine: Engine, cache: ConversationCache | None, conversations: list[Conversation],
                  active: list[Conversation], sampling: SamplingParams, seed: int) -> None:
        budgets = [sampling.max_new_tokens - len(c.ids) for c in active]
        contexts = [c.prompt_ids + c.ids for c in active]
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budgets))
        if cache is not None:  # only the tool turn (and the last sampled token) is prefilled
            index = {id(c): row for row, c in enumerate(conversations)}
            rollout = cache.extend([index[id(c)] for c in active], contexts,
                                   [len(c.prompt_ids) + c.kept for c in active], turn_sampling, seed)
        else:
            rollout = engine.generate(contexts, 1, turn_sampling, seed)
        self._take_turn(rollout, active, budgets)

    def _take_turn(self, rollout: Rollout, conversations: list[Conversation], budgets: list[int]) -> None:
        """A generated turn into each conversation, cut at its stop string and at its own length budget."""
        rollout = apply_stop_strings(rollout, self.tokenizer, list(self.settings.stop_strings), self.pad_token_id)
        lengths = rollout.completion_lengths.tolist()
        ids, logprobs = rollout.completion_ids.tolist(), rollout.sampling_logprobs.tolist()
        ended = rollout.ended_with_eos.tolist()
        for row, conversation in enumerate(conversations):
            length = min(lengths[row], budgets[row])
            turn_ids = ids[row][:length]
            finished = bool(ended[row]) and length == lengths[row]
            text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
            conversation.add_model_turn(turn_ids, logprobs[row][:length], finished, text)

    # -- outputs
    def _rollout(self, first: Rollout, conversations: list[Conversation], num_generations: int,
                 sampling: SamplingParams) -> Rollout:
        width = max(1, max(len(c.ids) for c in conversations))
        count = len(conversations)
        ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)  # (N, T)
        mask = torch.zeros(count, width, dtype=torch.long)  # (N, T)
        tool_mask = torch.zeros(count, width, dtype=torch.long)  # (N, T)
        logprobs = torch.zeros(count, width)  # (N, T)
        for row, conversation in enumerate(conversations):
            length = len(conversation.ids)
            ids[row, :length] = torch.tensor(conversation.ids, dtype=torch.long)
            mask[row, :length] = 1
            tool_mask[row, :length] = torch.tensor(conversation.tool_mask, dtype=torch.long)
            logprobs[row, :length] = torch.tensor(conversation.logprobs)
        device = first.completion_ids.device
        ended = torch.tensor([c.ended for c in conversations], dtype=torch.bool)
        grouped = first.num_generations == num_generations  # else every rollout carries its own prompt
        return Rollout(first.prompt_ids, first.prompt_mask, ids.to(device), mask.to(device),
                       logprobs.to(device), ended.to(device), num_generations if grouped else 1, sampling,
                       dict(first.stats), tool_mask=tool_mask.to(device))

    def _reward_inputs(self, rows: list[dict], conversations: list[Conversation], rollout: Rollout,
                       num_generations: int) -> RewardInputs:
        sample_rows = [row for row in rows for _ in range(num_generations)]
        completion_ids = [c.ids for c in conversations]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        keys = sorted({key for row in rows for key in row if key != "prompt"})
        columns = {key: [row.get(key) for row in sample_rows] for key in keys}
        if self.environments is not None:
            columns["environments"] = [c.environment for c in conversations]
        return RewardInputs(prompts=[c.prompt for c in conversations],
                            completions=[c.messages for c in conversations], texts=texts, columns=columns,
                            completion_ids=completion_ids)

    def close(self) -> None:
        self.runner.close()
