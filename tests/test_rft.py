"""RFT: datagen keeps only correct samples in the documented format; the SFT loss counts
completion tokens only; packed == padded (loss and gradients); profiles resolve to their
documented settings and learn the same thing; malformed record files fail in one line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hasten.cli import main as cli_main
from hasten.config import Config, ConfigError, Raw, TaskConfig
from hasten.rft.batches import Example, first_fit, pack_examples, packed_nll_sum, pad_examples, padded_nll_sum
from hasten.rft.data import RFTDataError, RFTRecord, load_records, trim_to_answer, write_records
from hasten.rft.datagen import run_datagen
from hasten.rft.profiles import PROFILES, load_rft_config
from hasten.rft.prompts import PromptFormat
from hasten.rft.sft import CompiledOrEager, resolve_precision, train_examples
from hasten.rollout import Rollout
from hasten.tasks import make_task


class ScriptedEngine:
    """An Engine that 'samples' given texts: script[question] = the oversample completions."""

    def __init__(self, tokenizer, task, script: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.by_prompt = {row["question"]: script[row["question"]] for row in task.train_rows}

    def generate(self, prompts, num_generations, sampling, seed):
        texts = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            question = next(q for q in self.by_prompt if q in text)
            assert len(self.by_prompt[question]) == num_generations
            texts += self.by_prompt[question]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
               for t in texts]
        width = max(len(i) for i in ids)
        completion = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, sample in enumerate(ids):
            completion[row, :len(sample)] = torch.tensor(sample)
            mask[row, :len(sample)] = 1
        return Rollout(torch.zeros(len(prompts), 1, dtype=torch.long), torch.ones(len(prompts), 1, dtype=torch.long),
                       completion, mask, torch.zeros(completion.shape), torch.ones(len(ids), dtype=torch.bool),
                       num_generations)


def datagen_config(tmp_path, keep: str) -> Config:
    return load_rft_config("datagen", None, [("task.num_train", 3), ("task.num_eval", 2), ("rft.oversample", 4),
                                              ("rft.keep", keep), ("rft.prompts_per_batch", 2),
                                              ("rft.data", str(tmp_path / "out" / "rft.json"))])


@pytest.mark.parametrize("keep", ["one", "all"])
def test_datagen_keeps_only_correct_samples_in_the_documented_format(tmp_path, tokenizer, keep):
    cfg = datagen_config(tmp_path, keep)
    task = make_task(cfg.task)
    first, second, third = task.train_rows
    right = lambda row, extra="": f"So it is {row['answer']:g}.\n<answer>{row['answer']:g}</answer>{extra}"
    script = {
        # 2 correct (one with trailing text to trim), 1 duplicate of the first, 1 wrong
        first["question"]: [right(first, " Hope that helps!"), f"<answer>{first['answer'] * 10:g}</answer>",
                            right(first), f"Maybe {first['answer']:g}.\n<answer>{first['answer']:g}</answer>"],
        second["question"]: ["<answer>-1</answer>", "no tags at all", f"{second['answer']:g}", "<answer></answer>"],
        third["question"]: ["<answer>oops</answer>", "x", "y", right(third)],
    }
    report = run_datagen(cfg, log=lambda _: None, engine=ScriptedEngine(tokenizer, task, script), tokenizer=tokenizer)
    assert (report.questions, report.solved, report.samples) == (3, 2, 12)
    assert report.correct_samples == 4 and math.isclose(report.solved_fraction, 2 / 3)
    data = json.loads((tmp_path / "out" / "rft.json").read_text())
    assert all(isinstance(item, list) and len(item) == 3 for item in data)
    expected = [[first["question"], first["answer"], right(first)]]
    if keep == "all":  # distinct correct reasonings: the trimmed duplicate counts once
        expected.append([first["question"], first["answer"], f"Maybe {first['answer']:g}.\n<answer>{first['answer']:g}</answer>"])
    expected.append([third["question"], third["answer"], right(third)])
    assert data == expected
    assert report.records == len(expected)
    assert [r.to_json() for r in load_records(cfg.rft.data)] == expected
    assert not list((tmp_path / "out").glob(".*tmp*"))  # nothing half-written left behind


def test_datagen_keeping_no_record_is_one_line_exit_2_and_writes_nothing(tmp_path, tokenizer, capsys, monkeypatch):
    from hasten.rft import cli as rft_cli

    cfg = datagen_config(tmp_path, "one")
    task = make_task(cfg.task)
    script = {row["question"]: ["<answer>-1</answer>"] * 4 for row in task.train_rows}
    monkeypatch.setattr("hasten.rft.datagen.load_generator",
                        lambda cfg, log: (type("P", (), {"tokenizer": tokenizer}), ScriptedEngine(tokenizer, task, script)))
    code = rft_cli.main(["rft", "datagen", "--task.num_train=3", "--task.num_eval=2", "--oversample=4",
                         "--rft.prompts_per_batch=2", f"--data={tmp_path / 'out' / 'rft.json'}"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error.startswith("rft error: no sample was correct (3 questions x 4 samples)"), error
    assert not (tmp_path / "out" / "rft.json").exists()


def test_trim_to_answer():
    assert trim_to_answer("a <answer>3</answer> b") == "a <answer>3</answer>"
    assert trim_to_answer("a <answer>3") is None
    assert trim_to_answer("a </answer>") is None


@pytest.mark.parametrize("content, message", [
    ('[["q", 1, "<answer>1</answer>"], ["q2", 2]]', "record 2: expected [question, answer, reasoning]"),
    ('[["q", 1, "<answer>1</answer>"], ["", 2, "<answer>2</answer>"]]', "record 2: question must be"),
    ('[["q", 1, "<answer>1</answer>"], ["q", 1, "<answer>1</answer>"], ["q", [1], "<answer>1</answer>"]]',
     "record 3: answer must be"),
    ('[["q", 1, "it is 1"]]', "record 1: reasoning must be a string ending with <answer>...</answer>"),
    ('[["q", 1, "<answer>1</answer>"],\n  ["q", 2 "x"]]', "is not valid JSON (line 2 column"),
    ('{"q": 1}', "must hold a JSON list"),
    ('[]', "holds no records"),
])
def test_malformed_records_fail_with_one_line_naming_the_record(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(RFTDataError, match="rft data error: .*" + message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(".", r"\.")):
        load_records(path)
    code = cli_main(["sft", "--model", "tiny", "--data", str(path), f"--output.dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message.split(" (")[0] in err[0]
    assert not (tmp_path / "runs").exists()  # nothing written


def examples_for_loss() -> list[Example]:
    gen = torch.Generator().manual_seed(0)
    lengths = [(5, 3), (9, 1), (3, 6), (7, 4), (4, 2)]
    return [Example(torch.randint(3, 200, (p,), generator=gen).tolist(),
                    torch.randint(3, 200, (c,), generator=gen).tolist()) for p, c in lengths]


def test_sft_loss_ignores_prompt_tokens_by_hand(model):
    # With a zero output layer every next-token distribution is uniform over V, so the
    # loss of one target is exactly log V: the sum must be (completion tokens) x log V.
    flat = copy.deepcopy(model)
    flat.lm_head.weight = torch.nn.Parameter(torch.zeros_like(flat.lm_head.weight))
    vocab = flat.config.vocab_size
    example = Example(prompt_ids=[5, 6, 7, 8], completion_ids=[9, 10])
    packed = pack_examples([example], 64)
    padded = pad_examples([example], pad_token_id=0)
    assert packed.num_targets == padded.num_targets == 2
    with torch.no_grad():
        assert math.isclose(float(packed_nll_sum(flat, packed)), 2 * math.log(vocab), rel_tol=1e-5)
        assert math.isclose(float(padded_nll_sum(flat, padded)), 2 * math.log(vocab), rel_tol=1e-5)
        # ...and with the real model it is -log p(9 | 5 6 7 8) - log p(10 | 5 6 7 8 9), nothing else
        logps = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits.log_softmax(-1)[0]  # (5, V)
        by_hand = -(logps[3, 9] + logps[4, 10])
        assert math.isclose(float(packed_nll_sum(model, packed)), float(by_hand), rel_tol=1e-5)


@pytest.mark.parametrize("pack_length, chunk_tokens", [(1000, 1024), (12, 5)])
def test_packed_loss_and_gradients_equal_padded(model, pack_length, chunk_tokens):
    examples = examples_for_loss()
    packed = pack_examples(examples, pack_length)
    padded = pad_examples(examples, pad_token_id=0)
    assert packed.num_targets == padded.num_targets == sum(len(e.completion_ids) for e in examples)
    assert packed.input_ids.shape[0] == (1 if pack_length == 1000 else len(first_fit(
        [e.input_length for e in examples], pack_length)))
    twin = copy.deepcopy(model)
    packed_loss = packed_nll_sum(model, packed, chunk_tokens=chunk_tokens) / packed.num_targets
    padded_loss = padded_nll_sum(twin, padded) / padded.num_targets
    packed_loss.backward()
    padded_loss.backward()
    assert torch.allclose(packed_loss, padded_loss, atol=1e-5)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-4), name


def test_first_fit_respects_capacity():
    bins = first_fit([5, 9, 3, 7, 4, 20], 12)
    assert sorted(i for b in bins for i in b) == list(range(6))
    lengths = [5, 9, 3, 7, 4, 20]
    assert all(sum(lengths[i] for i in b) <= 12 or len(b) == 1 for b in bins)


DOCUMENTED = {  # docs/rft.md's profile table
    "plain": dict(packing=False, gradient_checkpointing=True, gradient_accumulation_steps=1, adamw="plain",
                  precision="fp32", compile="off", num_workers=0),
    "conservative": dict(packing=True, gradient_checkpointing=True, gradient_accumulation_steps=8, adamw="fused",
                         precision="auto", compile="off", num_workers=0),
    "balanced": dict(packing=True, gradient_checkpointing=False, gradient_accumulation_steps=4, adamw="fused",
                     precision="auto", compile="off", num_workers=0),
    "aggressive": dict(packing=True, gradient_checkpointing=False, gradient_accumulation_steps=4, adamw="fused",
                       precision="bf16", compile="gpu", num_workers=1),
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_profiles_resolve_to_documented_settings(name):
    cfg = load_rft_config("sft", None, [], profile=name)
    assert {key: getattr(cfg.sft, key) for key in DOCUMENTED[name]} == DOCUMENTED[name]
    assert cfg.model.lora and cfg.task.num_eval == 100 and cfg.eval.num_examples == 100
    default = Config().sft  # profiles never touch what is learned
    assert (cfg.sft.lr, cfg.sft.epochs, cfg.sft.batch_size) == (default.lr, default.epochs, default.batch_size)


def test_profile_is_overridable_flag_by_flag_and_by_yaml(tmp_path):
    cfg = load_rft_config("sft", None, [("sft.gradient_checkpointing", Raw("false"))], profile="conservative")
    assert cfg.sft.gradient_checkpointing is False and cfg.sft.gradient_accumulation_steps == 8
    path = tmp_path / "run.yaml"
    path.write_text("sft:\n  gradient_accumulation_steps: 2\nmodel:\n  lora: false\n")
    cfg = load_rft_config("sft", path, [], profile="conservative")
    assert cfg.sft.gradient_accumulation_steps == 2 and cfg.model.lora is False and cfg.sft.packing
    assert set(PROFILES) == set(DOCUMENTED)
    with pytest.raises(ConfigError, match="--profile must be one of"):
        load_rft_config("sft", None, [], profile="ludicrous")
    with pytest.raises(ConfigError, match="sft.precision must be one of"):
        load_rft_config("sft", None, [("sft.precision", Raw("fp8"))])


def test_profiles_learn_the_same_parameters(model, tokenizer):
    """plain (padded, 1 micro-batch, for-loop AdamW) and conservative (packed, checkpointed,
    8 micro-batches, fused AdamW) take the same optimizer steps, so the weights agree."""
    examples = examples_for_loss() * 2
    trained = {}
    for name in ("plain", "conservative"):
        cfg = load_rft_config("sft", None, [("sft.batch_size", 5), ("sft.epochs", 1), ("sft.lr", 1e-2)],
                              profile=name)
        twin = copy.deepcopy(model)
        settings, losses = train_examples(twin, examples, cfg, 0, log=lambda _: None)
        assert settings["packing"] == (name != "plain") and len(losses) == 2
        trained[name] = (twin, losses)
    (a, loss_a), (b, loss_b) = trained["plain"], trained["conservative"]
    assert loss_a == pytest.approx(loss_b, abs=1e-5)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), model.parameters()))
    assert moved > 1e-3  # the steps really changed the weights
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-5)


def test_in_process_sft_says_when_it_runs_on_another_allocator(model, monkeypatch):
    """SFT from Python (the API, these tests) cannot re-execute: asked for a malloc this process does not
    run on, it trains anyway and says so in one line, as GRPO's prepare() does."""
    from hasten.kernels import allocator

    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    lines = []
    cfg = load_rft_config("sft", None, [("sft.batch_size", 5), ("sft.epochs", 1), ("speed.allocator", "tcmalloc")])
    settings, losses = train_examples(copy.deepcopy(model), examples_for_loss(), cfg, 0, log=lines.append)
    assert len(losses) == 1 and settings["allocator"] in ("glibc", "tcmalloc")  # what really runs
    assert sum("speed.allocator=tcmalloc: this process runs on glibc" in line for line in lines) == 1


def test_precision_and_compile_fallbacks(monkeypatch):
    assert resolve_precision("auto", torch.device("cpu")) is None
    assert resolve_precision("bf16", torch.device("cpu")) == torch.bfloat16  # opt-in on CPU
    with pytest.raises(ConfigError, match="sft.precision=fp16 needs a CUDA GPU"):
        resolve_precision("fp16", torch.device("cpu"))
    logs = []

    def broken_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    forward = CompiledOrEager(lambda x: x + 1, logs.append)
    assert forward(1) == 2 and not forward.active and "inductor exploded" in logs[0]
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (_ for _ in ()).throw(RuntimeError("no compiler")))
    forward = CompiledOrEager(lambda x: x * 3, logs.append)
    assert forward(2) == 6 and "no compiler" in logs[1]


def test_prompt_format_follows_the_task():
    task = make_task(TaskConfig(num_train=4, num_eval=2))
    prompts = PromptFormat(task)
    row = task.train_rows[1]
    assert prompts(row["question"]) == row["prompt"]
    new = prompts("How many feet are there in 2 miles?")
    assert new[:-1] == row["prompt"][:-1] and new[-1] == {"role": "user", "content": "How many feet are there in 2 miles?"}


def test_sft_cli_end_to_end_on_tiny(tmp_path, capsys):
    task = make_task(load_rft_config("sft", None, [("task.num_train", 4)]).task)
    records = [RFTRecord(r["question"], r["answer"], f"<answer>{r['answer']:g}</answer>") for r in task.train_rows]
    data = write_records(tmp_path / "rft.json", records)
    code = cli_main(["sft", "--model", "tiny", "--data", str(data), "--profile", "balanced", "--json",
                     "--task.num_train=4", "--sft.epochs=1", "--sft.batch_size=2", "--eval.num_examples=2",
                     "--eval.max_new_tokens=4", f"--output.dir={tmp_path / 'runs'}", "--output.progress=off"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["examples"] == 4 and report["optimizer_steps"] == 2 and report["adapter_mb"] > 0
    assert report["lora"] and "model_mb" not in report  # LoRA: the size is the adapters'
    assert report["settings"]["profile"] == "balanced" and report["eval"]["num_examples"] == 2
    checkpoint = tmp_path / "runs" / report["run_dir"].split("/")[-1] / "checkpoint"
    assert (checkpoint / "adapter_config.json").is_file()
    from safetensors.torch import load_file

    adapters = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapters and all("lora_" in key for key in adapters)  # the trained adapters, not an empty file
    code = cli_main(["rft", "test", "--model", str(checkpoint), "--num-examples", "2", "--eval.max_new_tokens=4",
                     "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out.strip())["num_examples"] == 2


def test_sft_report_names_the_size_for_what_was_saved():
    """A full model's size is model_mb (a 538 MB model is no adapter), LoRA adapters' adapter_mb."""
    from hasten.rft.sft import SFTReport

    fields = dict(run_dir="r", checkpoint="r/checkpoint", examples=1, optimizer_steps=1, train_seconds=1.0,
                  trained_tokens=1, target_tokens=1, first_loss=1.0, final_loss=0.5, weights_mb=538.1)
    full, adapters = SFTReport(**fields, lora=False).to_dict(), SFTReport(**fields, lora=True).to_dict()
    assert full["model_mb"] == 538.1 and "adapter_mb" not in full and "weights_mb" not in full
    assert adapters["adapter_mb"] == 538.1 and "model_mb" not in adapters
