"""B7 (bench/b7.py, bench/agentic.py): agentic GRPO against TRL's tools=, its structure and its one tool setup.

`--quick` on the tiny model (2 steps of 2 prompts x 4 rollouts, 8 held-out questions): what is checked is
that B7 runs B5's procedure on the calculator task with the tool loop, reports minutes and s/step rows,
and that both sides rendered the same first prompt with the same template and tool schemas, append the
same tool turn, read a call the same way and stop after the same number of tool turns. The tiny model's
random weights never call a tool, so the records' probes (one tool result, one call) stand in for
calls. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hasten.bench import main
from hasten.bench.b5 import DEMO_CONFIG

trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL side: needs `trl` (hasten[bench])")
PROBE_CALL = [["calculator", {"expression": "2 * 3"}]]


def run(capsys, *argv: str) -> tuple[str, dict]:
    code = main(["--quick", "--workloads", "B7", *argv])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])


def records(directory: Path) -> dict[str, dict]:
    """Each run's AgentRecord, by run directory name."""
    return {path.parent.name: json.loads(path.read_text())["agent"] for path in sorted(directory.glob("*/run.json"))}


def check_hasten_record(record: dict) -> None:
    """What hasten's tool loop used: the Hermes template, the calculator's schema, the task's turn cap."""
    from hasten.agent import HERMES_TEMPLATE
    from hasten.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    assert record["template"] == HERMES_TEMPLATE
    assert [schema["function"]["name"] for schema in record["tools"]] == ["calculator"]
    assert record["max_tool_turns"] == 2  # the calculator task's default
    prompt = tokenizer.decode(record["first_prompt_ids"])
    assert "<tools>" in prompt and '"name": "calculator"' in prompt  # the schema, in the system turn
    assert "<tool_response>" in prompt  # the worked example's tool turn
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(record["tool_turn_ids"]) == (
        "\n<|im_start|>user\n<tool_response>\n1998\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert record["parsed_calls"] == PROBE_CALL


def check_rows(payload: dict, labels: list[str], seeds: int) -> dict[str, dict]:
    b7 = payload["workloads"]["B7"]
    rows = {row["name"]: row for row in b7["rows"]}
    assert list(rows) == labels + [f"{label} s/step" for label in labels]
    for label in labels:
        minutes, timed = rows[label], rows[f"{label} s/step"]
        assert minutes["unit"] == "min" and timed["unit"] == "s/step"
        assert len(minutes["seconds"]) == len(timed["seconds"]) == seeds and minutes["steps"] == 2
        assert 0 <= minutes["final_accuracy"] <= 1 and timed["final_accuracy"] == minutes["final_accuracy"]
        assert minutes["tool_calls"] == 0.0  # random weights: no rollout calls, and both sides count that
    settings = b7["settings"]["b7"]
    assert 0 <= settings["base_accuracy"] <= 1 and Path(settings["plot"]).is_file()
    assert settings["setup"]["template"] == "hermes" and settings["setup"]["tools"] == ["calculator"]
    assert settings["setup"]["max_tool_turns"] == 2 and settings["setup"]["prompt_tokens"] > 0
    return rows


def test_quick_b7_hasten_side_runs_the_tool_task(capsys, tmp_path):
    table, payload = run(capsys, "--peers", "none", "--b7-dir", str(tmp_path / "b7"), "--seeds", "0,1",
                         "--report", str(tmp_path / "page"))
    check_rows(payload, ["hasten"], seeds=2)
    b7 = payload["workloads"]["B7"]
    assert b7["settings"]["hasten"]["task"]["name"] == "calculator"
    assert b7["settings"]["hasten"]["model"]["name"] == "tiny"
    assert b7["settings"]["b7"]["setup"]["same_setup"] is None  # nothing to compare with
    assert b7["settings"]["b7"]["target"]["met"] is None
    found = records(tmp_path / "b7")
    assert set(found) == {"hasten-seed0", "hasten-seed1"}
    for record in found.values():
        check_hasten_record(record)
    assert found["hasten-seed0"]["first_prompt_ids"] != found["hasten-seed1"]["first_prompt_ids"]  # seeded streams
    assert "B7       hasten s/step" in table
    assert (tmp_path / "page" / "b7-accuracy.png").is_file()  # --report copies the plot


@trl
def test_quick_b7_against_trl_uses_one_tool_setup(capsys, tmp_path):
    _, payload = run(capsys, "--peers", "trl", "--b7-dir", str(tmp_path / "b7"))
    rows = check_rows(payload, ["hasten", "trl"], seeds=1)
    assert rows["trl"]["baseline"] == "hasten" and rows["trl s/step"]["baseline"] == "hasten s/step"
    b7 = payload["workloads"]["B7"]
    assert "trl s/step/hasten s/step" in b7["ratios"]  # minutes pair with minutes only (both inf here: no ratio)
    assert set(b7["ratios"]) <= {"trl/hasten", "trl s/step/hasten s/step"}
    trl_settings = b7["settings"]["trl"]
    assert trl_settings["max_tool_calling_iterations"] == 2 and trl_settings["max_completion_length"] == 8
    # the tiny model's estimate fits anywhere: TRL's CPU best, checkpointing off, and the note says why
    assert trl_settings["gradient_checkpointing"] is False
    assert any(note.startswith("TRL ran with gradient checkpointing off: its step's memory estimate")
               for note in b7["notes"])
    found = records(tmp_path / "b7")
    hasten, peer = found["hasten-seed0"], found["trl-seed0"]
    check_hasten_record(hasten)
    for field in hasten:  # field by field, so a failure names what differs
        assert peer[field] == hasten[field], field
    assert b7["settings"]["b7"]["setup"]["same_setup"] is True
    assert set(b7["settings"]["b7"]["target"]) == {"goal", "ratio", "final_accuracy_at_least_trl", "met"}


def test_differences_name_each_field_that_differs():
    from hasten.bench.agentic import AgentRecord, differences

    one = AgentRecord("t", [{"function": {"name": "calculator"}}], 2, [1, 2], [3], PROBE_CALL).to_dict()
    assert differences(one, dict(one)) == []
    assert differences(one, {**one, "template": "u", "max_tool_turns": 3}) == ["template", "max_tool_turns"]
    assert differences(one, {**one, "parsed_calls": [["calculator", {"expression": "2*3"}]]}) == ["parsed_calls"]


@pytest.mark.parametrize("argv, message", [
    (["--b7-model", "no-such-model"], "--b7-model"),
    (["--b7-config", str(DEMO_CONFIG)], "has no tools"),
    (["--b7-config", "missing.yaml"], "--b7-config"),
    (["--b7-minutes", "0"], "--b7-minutes"),
])
def test_bad_b7_arguments_are_one_line_errors(capsys, tmp_path, argv, message):
    directory = tmp_path / "b7"
    code = main(["--quick", "--workloads", "B7", "--peers", "none", "--b7-dir", str(directory), *argv])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in error[-1]
    assert not directory.exists()  # refused before anything trained or wrote


def test_trl_checkpointing_is_chosen_once_from_the_memory_estimate_or_forced():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hasten.bench.b7 import AGENT_CONFIG, TrlCheckpointing
    from hasten.config import load_config

    cfg = load_config(AGENT_CONFIG, [])
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # SmolLM2-135M
    prompts = []
    agent = SimpleNamespace(template=SimpleNamespace(encode_prompt=lambda messages, tools: prompts.append(1) or
                                                     [0] * 500), tools={})
    scorer = SimpleNamespace(session=SimpleNamespace(task=SimpleNamespace(train_rows=[{"prompt": []}]), agent=agent,
                                                     policy=SimpleNamespace(model=SimpleNamespace(config=config))))
    small = TrlCheckpointing(None, budget_gib=8.0)
    assert small.choose(cfg, scorer) is True and small.estimate_gib > 8.0  # 32 x ~660 tokens, every layer kept
    assert small.choose(cfg, scorer) is True and len(prompts) == 1  # chosen once, for every seed
    assert "on: its step's memory estimate without it is" in small.note()
    large = TrlCheckpointing(None, budget_gib=small.estimate_gib + 1)
    assert large.choose(cfg, scorer) is False and "off:" in large.note()
    forced = TrlCheckpointing(False, budget_gib=1.0)
    assert forced.choose(cfg, scorer) is False and forced.estimate_gib is None
    assert forced.note() == "TRL ran with gradient checkpointing off (--trl-checkpointing off)"
