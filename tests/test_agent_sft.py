"""The agentic warm start (sft.source=task): the calculator task's demonstrations are correct tool
conversations from training questions only, encoded to exactly the tokens the tool loop builds (tool
results masked out of the loss), and `hasten sft` then `hasten train` runs end to end on the tiny model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from hasten.agent import make_tool
from hasten.agent.builtin_tools import calculator
from hasten.agent.demonstrations import encode_conversation
from hasten.agent.loop import Agent, AgentSettings
from hasten.agent.template import HERMES_TEMPLATE, ToolTemplate
from hasten.agent.tools import parse_tool_calls
from hasten.cli import main as cli_main
from hasten.config import ConfigError, TaskConfig, load_config
from hasten.rft.batches import Example, pack_examples, packed_nll_sum, pad_examples, padded_nll_sum
from hasten.rft.demonstrations import demonstration_examples, demonstration_rows, demonstrations
from hasten.rft.prompts import question_of
from hasten.rft.profiles import load_rft_config
from hasten.rollout import SamplingParams
from hasten.tasks import make_task
from hasten.train.evaluate import evaluate
from test_agent import ScriptedEngine

FACTORS = re.compile(r"What is (\d+) x (\d+)\?")


def calculator_task(num_train=12, num_eval=6):
    return make_task(TaskConfig(name="calculator", num_train=num_train, num_eval=num_eval))


def test_calculator_demonstrations_are_correct_tool_conversations():
    task = calculator_task()
    rows = demonstrations(task)
    assert len(rows) == len(task.train_rows)
    for row, train_row in zip(rows, task.train_rows):
        assert row["prompt"] == train_row["prompt"]  # GRPO's prompt, worked example and all
        a, b = map(int, FACTORS.match(train_row["question"]).groups())
        call, result, answer = row["completion"]
        assert call["role"] == "assistant" and call["tool_calls"] == [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}]
        assert result == {"role": "tool", "name": "calculator", "content": str(a * b)}  # the tool's real result
        assert answer["role"] == "assistant" and answer["content"].endswith(f"<answer>{a * b}</answer>")
        assert task.check(answer["content"], train_row).correct
        assert train_row["answer"] == a * b


def test_demonstrations_never_use_held_out_questions():
    task = calculator_task()
    held_out = {question_of(row) for row in task.eval_rows}
    assert not held_out & {question_of({"prompt": row["prompt"]}) for row in demonstrations(task)}
    # a training row that repeats a held-out question (generate_split allows repeats in small spaces) is left out
    task.train_rows = [task.eval_rows[0], *task.train_rows, task.eval_rows[3]]
    kept = demonstration_rows(task)
    assert kept == task.train_rows[1:-1]
    assert demonstration_rows(task, 5) == task.train_rows[1:6]


def test_a_task_without_demonstrations_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="sft.source=task needs a task with demonstrations"):
        demonstrations(make_task(TaskConfig(name="arithmetic", num_train=2, num_eval=2)))
    code = cli_main(["sft", "--model", "tiny", "--task", "arithmetic", "--sft.source=task",
                     f"--output.dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "sft.source=task" in err[0]
    assert not (tmp_path / "runs").exists()


def test_encoded_demonstration_is_the_tool_loops_rollout(tokenizer):
    """Drive the real tool loop with a model that writes the demonstration's text: same ids, same mask."""
    task = calculator_task(num_train=2, num_eval=2)
    row = task.train_rows[0]
    demo = task.demonstrate(row)
    a, b = map(int, FACTORS.match(row["question"]).groups())
    call_text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'

    def script(text, sample):  # right after a tool result: answer; otherwise call
        return demo[-1]["content"] if text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n") \
            else call_text

    template = ToolTemplate(tokenizer, HERMES_TEMPLATE)
    tool = make_tool(calculator)
    agent = Agent(tokenizer, template, [tool], None, AgentSettings(max_turns=2), tokenizer.pad_token_id or 0)
    batch = agent.generate(ScriptedEngine(tokenizer, script), [row], 1, SamplingParams(max_new_tokens=2000), seed=0)
    rollout = batch.rollout
    length = int(rollout.completion_mask[0].sum())
    encoded = encode_conversation(template, row["prompt"], demo, [tool.schema], tokenizer.eos_token_id)
    assert encoded.prompt_ids == rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    assert encoded.completion_ids == rollout.completion_ids[0, :length].tolist()
    assert list(encoded.target_mask) == rollout.tool_mask[0, :length].tolist()
    assert 0 in encoded.target_mask  # the tool turn is there, and masked
    assert task.check(batch.inputs.texts[0], row).correct
    first_turn = encoded.completion_ids[:encoded.target_mask.index(0)]
    calls = parse_tool_calls(tokenizer.decode(first_turn, skip_special_tokens=True))
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": f"{a} * {b}"})]


def test_tool_result_tokens_are_context_not_targets(model):
    """Masked completion tokens are neither packed targets nor padded labels; packed == padded with masks."""
    plain = Example([5, 6, 7], [9, 10, 11, 12, 13, 14])
    masked = Example([5, 6, 7], [9, 10, 11, 12, 13, 14], (1, 1, 0, 0, 1, 1))
    packed = pack_examples([masked, plain], 64)
    padded = pad_examples([masked, plain], pad_token_id=0)
    assert masked.num_targets == 4 and packed.num_targets == padded.num_targets == 10
    assert padded.labels[0, 3:9].tolist() == [9, 10, -100, -100, 13, 14]
    assert packed.targets.tolist()[:4] == [9, 10, 13, 14]
    with torch.no_grad():
        logps = model(input_ids=torch.tensor([[5, 6, 7, 9, 10, 11, 12, 13]])).logits.log_softmax(-1)[0]  # (8, V)
        by_hand = -(logps[2, 9] + logps[3, 10] + logps[6, 13] + logps[7, 14])  # 11 and 12 are context only
        alone = packed_nll_sum(model, pack_examples([masked], 64))
        assert math.isclose(float(alone), float(by_hand), rel_tol=1e-5)
        assert math.isclose(float(packed_nll_sum(model, packed)), float(padded_nll_sum(model, padded)), rel_tol=1e-5)
    with pytest.raises(ValueError, match="target_mask"):
        Example([1], [2, 3], (1,))


def test_sft_on_demonstrations_then_grpo_from_its_checkpoint(tmp_path, capsys, tokenizer):
    """The two-stage recipe of docs/agentic.md on the tiny model: a full SFT on tool conversations, its
    held-out eval through the tool loop, then a GRPO step that loads the SFT checkpoint."""
    common = ["--task.num_train=8", "--task.num_eval=2", f"--output.dir={tmp_path / 'runs'}", "--output.progress=off"]
    code = cli_main(["sft", "--model", "tiny", "--task", "calculator", "--sft.source=task", "--model.lora=false",
                     "--sft.max_examples=4", "--sft.epochs=1", "--sft.batch_size=2", "--sft.lr=1e-3",
                     "--eval.num_examples=2", "--eval.max_new_tokens=8", "--output.name=sft", "--json", *common])
    assert code == 0, capsys.readouterr().err[-2000:]
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = load_rft_config("sft", None, [("task.name", "calculator"), ("task.num_train", 8), ("task.num_eval", 2),
                                        ("sft.source", "task"), ("sft.max_examples", 4)])
    examples = demonstration_examples(cfg, make_task(cfg.task), tokenizer)
    assert report["examples"] == 4 and report["optimizer_steps"] == 2
    targets = sum(example.num_targets for example in examples)
    assert report["target_tokens"] == targets < sum(len(example.completion_ids) for example in examples)
    assert report["eval"]["num_examples"] == 2 and "tools/call_rate" in report["eval"]  # the tool loop evaluated
    written = [json.loads(line) for line in (tmp_path / "runs" / "sft" / "demonstrations.jsonl").open()]
    assert written == json.loads(json.dumps(demonstrations(make_task(cfg.task), 4)))  # what was trained on
    checkpoint = tmp_path / "runs" / "sft" / "checkpoint"
    assert (checkpoint / "config.json").is_file()  # a full model: GRPO loads it natively
    code = cli_main(["train", "--model", str(checkpoint), "--task", "calculator", "--steps", "1",
                     "--train.prompts_per_step=1", "--generation.num_generations=2",
                     "--generation.max_new_tokens=8", "--eval.num_examples=0", "--output.name=grpo", *common])
    assert code == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((tmp_path / "runs" / "grpo" / "summary.json").read_text())
    assert summary["status"] == "finished"


@pytest.mark.parametrize("stage_one", ["agent-sft.yaml", "agent-warm.yaml"])
def test_the_two_stage_configs_agree_on_task_and_template(stage_one):
    """configs/agent-sft.yaml and agent-warm.yaml train on the prompts configs/agent-demo.yaml samples, never
    on its eval rows."""
    root = Path(__file__).parent.parent / "configs"
    sft = load_rft_config("sft", root / stage_one, [])
    grpo = load_config(root / "agent-demo.yaml")
    assert sft.sft.source == "task" and not sft.model.lora and sft.model.name == grpo.model.name
    assert sft.task == grpo.task
    assert sft.generation.tool_template == grpo.generation.tool_template
    assert sft.generation.max_tool_turns == grpo.generation.max_tool_turns
    sft_task, grpo_task = make_task(sft.task), make_task(grpo.task)
    held_out = {question_of(row) for row in grpo_task.eval_rows[:grpo.eval.num_examples]}
    trained = demonstrations(sft_task, sft.sft.max_examples)
    assert len(trained) == sft.sft.max_examples
    assert not held_out & {question_of({"prompt": row["prompt"]}) for row in trained}
    assert {json.dumps(row["prompt"]) for row in trained} <= {json.dumps(row["prompt"]) for row in grpo_task.train_rows}


def test_held_out_eval_reports_the_tool_call_rate(tokenizer):
    """With tools, evaluate() counts the completions that called a tool and the calls per completion."""
    task = calculator_task(num_train=2, num_eval=3)
    first = task.eval_rows[0]
    a, b = map(int, FACTORS.match(first["question"]).groups())
    call_text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'

    def script(text, sample):
        if text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"):
            return f"<answer>{a * b}</answer>"
        return call_text if text.endswith(first["question"] + "<|im_end|>\n<|im_start|>assistant\n") \
            else "<answer>7</answer>"  # no call, a wrong answer

    agent = Agent(tokenizer, ToolTemplate(tokenizer, HERMES_TEMPLATE), [make_tool(calculator)], None,
                  AgentSettings(max_turns=2), tokenizer.pad_token_id or 0)
    metrics, _ = evaluate(task, ScriptedEngine(tokenizer, script), tokenizer, [], 3, 2000, 2, agent=agent)
    assert metrics["tools/call_rate"] == pytest.approx(1 / 3)
    assert metrics["tools/call_frequency"] == pytest.approx(1 / 3)
    assert metrics["accuracy"] == pytest.approx(1 / 3)
