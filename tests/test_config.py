"""Config: defaults, YAML and dotted overrides, and every error path giving a
one-line `config error:` message, exit code 2, and no run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hasten.cli import main
from hasten.config import Config, ConfigError, load_config, parse_override, save_config, set_key


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.model.name == "smollm2-135m"
    assert cfg.train.prompts_per_step * cfg.generation.num_generations == 32


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 2.0e-6\n  steps: 7\nalgo:\n  loss: grpo\n")
    cfg = load_config(path, [parse_override("train.lr=1e-6"), parse_override("model.lora=true")])
    assert cfg.train.lr == 1e-6 and cfg.train.steps == 7 and cfg.algo.loss == "grpo" and cfg.model.lora


def test_yaml_exponents_without_a_dot_are_numbers(tmp_path):
    """YAML 1.1 (PyYAML) reads `1e-5` as a string; a float key takes it as the number, other keys don't."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-5\n  weight_decay: 5E-2\nalgo:\n  epsilon_high: 2e-1\n")
    cfg = load_config(path)
    assert cfg.train.lr == 1e-5 and cfg.train.weight_decay == 0.05 and cfg.algo.epsilon_high == 0.2
    path.write_text("train:\n  steps: 1e2\n")  # an int key still wants an int
    with pytest.raises(ConfigError, match="train.steps must be"):
        load_config(path)
    path.write_text("train:\n  lr: 1e-5x\n")
    with pytest.raises(ConfigError, match="train.lr must be"):
        load_config(path)


def test_override_values_are_read_by_field_type():
    texts = ["train.lr=1e-6", "train.steps=5", "rewards.extra=[a.py:f, b.py:g]", "algo.epsilon_high=null",
             "output.progress=off", "model.name=123", "model.lora=true", "task.system_prompt=null"]
    cfg = load_config(overrides=[parse_override(text) for text in texts])
    assert cfg.train.lr == 1e-6 and cfg.train.steps == 5
    assert cfg.rewards.extra == ["a.py:f", "b.py:g"]
    assert cfg.algo.epsilon_high is None and cfg.task.system_prompt is None
    assert cfg.output.progress == "off"  # not YAML's boolean
    assert cfg.model.name == "123" and cfg.model.lora is True
    cfg = load_config(overrides=[("train.lr", 1)])  # an int where a float is expected is fine
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_mixed_type_switches_take_their_numbers_and_booleans_from_the_command_line():
    """`int | str` and `bool | str` keys (a number or auto, true/false or auto): the command line's text is
    the number or boolean it spells, as in a YAML file; a word stays a word and meets the key's check."""
    texts = ["speed.token_budget=1024", "speed.fast_linear=false", "speed.decode_attention=true",
             "train.attention_fp32=false"]
    cfg = load_config(overrides=[parse_override(text) for text in texts])
    assert cfg.speed.token_budget == 1024 and type(cfg.speed.token_budget) is int
    assert cfg.speed.fast_linear is False and cfg.speed.decode_attention is True
    assert cfg.train.attention_fp32 is False
    assert load_config(overrides=[parse_override("speed.token_budget=0")]).speed.token_budget == 0
    assert load_config(overrides=[parse_override("speed.token_budget=auto")]).speed.token_budget == "auto"
    with pytest.raises(ConfigError, match=r"speed.token_budget must be >= 0 \(0 = off\) or auto \(got '1.5'\)"):
        load_config(overrides=[parse_override("speed.token_budget=1.5")])
    with pytest.raises(ConfigError, match="speed.fast_linear must be true, false or auto .got 'maybe'"):
        load_config(overrides=[parse_override("speed.fast_linear=maybe")])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=[("train.steps", 3), ("generation.top_k", 5)])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([("train.lrr", 1.0)], "unknown key 'train.lrr' (allowed in train: steps, prompts_per_step, lr"),
        ([("trian.lr", 1.0)], "unknown key 'trian.lr' (sections:"),
        ([("lr", 1.0)], "unknown key 'lr'"),
        ([("train.lr", "fast")], "train.lr must be float (got 'fast')"),
        ([("train.steps", 2.5)], "train.steps must be int (got 2.5)"),
        ([("model.lora", "yes")], "model.lora must be bool (got 'yes')"),
        ([("train.lr", -1.0)], "train.lr must be > 0 (got -1.0)"),
        ([("algo.loss", "ppo")], "algo.loss must be one of grpo, bnpo, dr_grpo, dapo, gspo, cispo, sapo, luspo, vespo (got 'ppo')"),
        ([("algo.scale_rewards", "std")], "algo.scale_rewards must be one of group, batch, none"),
        ([("generation.num_generations", 1)], "generation.num_generations must be >= 2"),
        ([("generation.top_p", 0.0)], "generation.top_p must be in (0, 1]"),
        ([("rewards.weights", ["a"])], "rewards.weights must be list of float or null (got ['a'])"),
        ([("task.name", "jsonl")], "task.path is required when task.name is jsonl"),
        ([("train.gradient_accumulation_steps", 64)], "train.gradient_accumulation_steps must be <="),
        ([("speed.decode_attention", "yes")], "speed.decode_attention must be true, false or auto"),
        ([("speed.decode_attention", True), ("speed.engine", "hf")],
         "speed.decode_attention=true is the lean engine's decode kernel, not speed.engine=hf's"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    text = str(error.value)
    assert text.startswith("config error: ") and message in text and "\n" not in text


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    flat = tmp_path / "flat.yaml"
    flat.write_text("lr: 1\n")
    with pytest.raises(ConfigError, match="'lr' in .* must be a mapping"):
        load_config(flat)
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"train": {"nope": 1}}))
    with pytest.raises(ConfigError, match="unknown key 'train.nope'"):
        load_config(nested)


def test_a_key_given_twice_in_yaml_is_an_error_naming_it_and_its_line(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 1.0e-5\n  steps: 3\n  lr: 3.0e-5\nmodel:\n  name: tiny\n")
    with pytest.raises(ConfigError, match=r"twice.yaml line 4: key 'lr' is given twice \(first on line 2\)"):
        load_config(twice)
    sections = tmp_path / "sections.yaml"
    sections.write_text("train:\n  lr: 1.0e-5\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"line 3: key 'train' is given twice \(first on line 1\)"):
        load_config(sections)
    once = tmp_path / "once.yaml"
    once.write_text("train:\n  lr: 3.0e-5\n")
    assert load_config(once).train.lr == 3e-5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train.lr=-1"], "config error: train.lr must be > 0"),
        (["--train.lr", "abc"], "config error: train.lr must be float"),
        (["--nonsense.key=1"], "config error: unknown key 'nonsense.key'"),
        (["--algo.loss=ppo"], "config error: algo.loss must be one of"),
        (["--task", "chess"], "config error: task.name must be one of"),
        (["--model", "no-such-model"], "model error: unknown model 'no-such-model'"),
        (["--reward", "missing.py:fn"], "reward error: 'missing.py' does not exist"),
        (["--steps", "-3"], "config error: train.steps must be >= 0"),
        (["--weird"], "config error: unrecognized argument '--weird'"),
    ],
)
def test_cli_errors_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    runs = tmp_path / "runs"
    code = main(["train", "--model", "tiny", f"--output.dir={runs}", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(message.split(":")[0]) and message in err and "\n" not in err
    assert not runs.exists()


def test_weights_must_match_reward_count(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--task", "arithmetic", f"--output.dir={tmp_path}/runs",
                 "--rewards.weights=[1.0]"])
    assert code == 2
    assert "rewards.weights has 1 values for 2 reward functions (format, correct)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("variant, differences", [
    ("b1-int8.yaml", {"generation.precision": "int8"}),
    ("b1-bf16.yaml", {"train.precision": "bf16", "generation.precision": "bf16"}),
    ("b1-moments.yaml", {"train.optimizer_moments": "bf16"}),
])
def test_b1_variant_configs_differ_from_b1_only_in_their_switches(variant, differences):
    # `hasten bench --config configs/b1-*.yaml` compares against B1's own settings: a variant that drifted
    # from configs/b1.yaml in anything but its named switches would measure something else.
    import dataclasses
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    base, other = (dataclasses.asdict(load_config(root / name)) for name in ("b1.yaml", variant))
    assert {f"{section}.{key}": value for section, values in other.items() for key, value in values.items()
            if value != base[section][key]} == differences


# ------------------------------------------------------------- keys that left speed (config_yaml.MOVED)


def test_an_old_speed_name_sets_the_new_key_with_one_line(tmp_path, capsys, monkeypatch):
    """YAML, overrides and profiles take an old name: it sets the new key, and one line per old name per process
    names the new key."""
    from hasten import config_yaml

    monkeypatch.setattr(config_yaml, "_TOLD", set())
    path = tmp_path / "old.yaml"
    path.write_text("speed:\n  precision: bf16\n  dynamic_sampling: true\n  generation_precision: bf16\n")
    cfg = load_config(path, [("speed.precision", "fp16"), ("speed.gate_threshold", 0.7)])
    assert (cfg.train.precision, cfg.algo.dynamic_sampling, cfg.generation.precision) == ("fp16", True, "bf16")
    assert cfg.algo.gate_threshold == 0.7
    lines = capsys.readouterr().err.splitlines()
    assert lines.count("config: speed.precision is now train.precision (the old name still works for now)") == 1
    assert sorted(lines) == sorted(f"config: {old} is now {config_yaml.MOVED[old]} (the old name still works "
                                   "for now)" for old in ("speed.precision", "speed.dynamic_sampling",
                                                          "speed.generation_precision", "speed.gate_threshold"))
    load_config(overrides=[("speed.precision", "bf16")])
    assert capsys.readouterr().err == ""  # once per process


def test_moved_keys_keep_the_count_and_leave_speed():
    from hasten.config_yaml import MOVED

    cfg = Config()
    assert sum(len(dataclasses.fields(getattr(cfg, section.name))) for section in dataclasses.fields(cfg)) == 212
    for old, new in MOVED.items():
        section, name = new.split(".")
        assert not hasattr(cfg.speed, old.split(".")[1]) and hasattr(getattr(cfg, section), name), old
    with pytest.raises(AttributeError, match="speed.precision is not a speed key; it is now train.precision"):
        cfg.speed.precision = "bf16"  # a plain setattr would add an attribute nothing reads
    with pytest.raises(ConfigError, match="unknown key 'speed.precisionn'"):
        set_key(cfg, "speed.precisionn", "bf16")


def test_the_python_api_takes_an_old_speed_name(capsys):
    from hasten.api import GRPOConfig

    pairs = GRPOConfig(output_dir="x", speed={"optimizer_moments": "bf16"}).overrides(8, 0)
    assert ("speed.optimizer_moments", "bf16") in pairs
    cfg = load_config(overrides=pairs)
    assert cfg.train.optimizer_moments == "bf16"


def test_no_shipped_config_uses_an_old_name():
    from hasten.config_yaml import MOVED, read_file

    for path in sorted(Path(__file__).parent.parent.glob("configs/*.yaml")):
        assert not [key for key, _ in read_file(path) if key in MOVED], path
