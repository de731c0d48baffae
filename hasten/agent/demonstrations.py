"""A finished tool conversation as the token ids the tool loop would have produced: SFT's side of the template.

A model that never calls a tool gives GRPO nothing to reinforce, so an
agentic run may start from SFT on correct conversations (a task's
`demonstrate`, rft/demonstrations.py). That SFT must teach exactly the tokens
GRPO later samples and scores, so a conversation is encoded the way
agent/loop.py builds a rollout, piece by piece:

    prompt      template.encode_prompt(messages, tool schemas)   (ends with the generation prompt)
    assistant   its text as the template renders it after the generation prompt, up to the
                end-of-turn text, tokenized, + the EOS id the model stops with      target 1
    tool turn   template.tool_turn_ids(results) (consecutive tool messages together)  target 0
    ...         until the last assistant turn

so the loss sees the model's turns only and the tool results are context
(GRPO's tool_mask). An assistant turn's text is what rendering the
conversation with it adds to rendering it without it, so any template that
ToolTemplate accepts (hermes, the model's own, a .jinja file) works.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .template import ToolTemplate


@dataclass(frozen=True)
class EncodedConversation:
    prompt_ids: list[int]
    completion_ids: list[int]  # assistant turns and tool turns, in order
    target_mask: tuple[int, ...]  # per completion token: 1 = written by the model, 0 = tool result


def encode_conversation(template: ToolTemplate, prompt: list[dict], completion: list[dict],
                        schemas: list[dict], eos_token_id: int) -> EncodedConversation:
    """prompt messages + completion messages (assistant/tool turns, ending with an assistant turn) -> ids."""
    if not completion or completion[-1].get("role") != "assistant":
        raise ValueError("a demonstration's completion must end with an assistant turn")
    history = list(prompt)
    ids: list[int] = []
    mask: list[int] = []
    index = 0
    while index < len(completion):
        message = completion[index]
        if message.get("role") == "assistant":
            turn = template.text_ids(assistant_text(template, history, message, schemas)) + [eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            history.append(message)
            index += 1
            continue
        results = []
        while index < len(completion) and completion[index].get("role") == "tool":
            results.append((completion[index].get("name", "tool"), str(completion[index]["content"])))
            history.append(completion[index])
            index += 1
        if not results:
            raise ValueError(f"a demonstration's completion holds a {message.get('role')!r} message; "
                             "only assistant and tool turns belong there")
        turn = template.tool_turn_ids(results)
        ids += turn
        mask += [0] * len(turn)
    return EncodedConversation(template.encode_prompt(prompt, schemas), ids, tuple(mask))


def assistant_text(template: ToolTemplate, history: list[dict], message: dict, schemas: list[dict]) -> str:
    """What the model writes for `message` after `history`: the text the template adds, up to end of turn."""
    before = template.render(history, schemas, add_generation_prompt=True)
    after = template.render(history + [message], schemas, add_generation_prompt=False)
    end = template.eos_text
    if not after.startswith(before) or not end or end not in after[len(before):]:
        raise ConfigError("config error: the tool template does not render an assistant turn as the text after "
                          "its generation prompt, ended by the tokenizer's EOS; it cannot be used for SFT "
                          "demonstrations (generation.tool_template)")
    written = after[len(before):]
    return written[:written.index(end)]
