"""B8, the scaling grid (bench/scaling.py): its cells, its reasons for a missing number, its outputs.

Tiny configurations only (the tiny Llama and a tiny Qwen2 shape built the way
the 0.5B/1.5B shapes are, lengths 4 and 8): what is checked is that every
cell runs in its own process to a fixed number of new tokens, that a cell a
side cannot run says why, and that --report writes the page, the JSON and
the plot. No timing is asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from hasten.bench import cost, main
from hasten.bench.scaling import HASTEN_MARGIN, SHAPES, choose_mode, memory_estimate

trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL side: needs `trl` (hasten[bench])")


def run(capsys, *argv: str) -> tuple[str, dict]:
    code = main(["--quick", "--workloads", "B8", *argv])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])


def test_quick_grid_runs_every_cell_to_the_fixed_length_and_writes_the_report(capsys, tmp_path):
    table, payload = run(capsys, "--peers", "none", "--b8-steps", "2", "--report", str(tmp_path / "page"))
    b8 = payload["workloads"]["B8"]
    grid = b8["settings"]["grid"]
    assert [(c["model"], c["length"], c["side"]) for c in grid] == [
        ("tiny", 4, "hasten"), ("tiny", 8, "hasten"), ("qwen-tiny", 4, "hasten"), ("qwen-tiny", 8, "hasten")]
    samples = 2 * 4  # --quick: 2 prompts x 4 generations
    for cell in grid:
        assert "skipped" not in cell and cell["mode"] == "full" and cell["steps"] == 2
        # EOS cannot end a row: every sample generated exactly `length` tokens
        assert cell["tokens_per_s"] * cell["s_per_step"] == pytest.approx(samples * cell["length"])
        assert cell["peak_rss_mib"] > 0 and cell["generate_s"] > 0 and cell["learn_s"] > 0
        assert [set(threads) for threads in cell["threads"]] == [{"threads/generate", "threads/learn"}]
    rows = {row["name"]: row for row in b8["rows"]}
    assert set(rows) == {"hasten tiny L=4", "hasten tiny L=8", "hasten qwen-tiny L=4", "hasten qwen-tiny L=8"}
    assert all(set(row["phase_limits"]) == {"generate", "learn"} for row in rows.values())
    assert b8["settings"]["qwen-tiny"]["random_weights"] is True
    assert b8["settings"]["qwen-tiny"]["shape"]["attention_bias"] is True  # a Qwen2 model, built locally
    page = tmp_path / "page"
    assert (page / "b8-scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((page / "results.json").read_text()) == payload
    markdown = (page / "results.md").read_text()
    assert "hasten tiny L=8" in markdown and "![B8](b8-scaling.png)" in markdown
    assert "B8       hasten qwen-tiny L=8" in table


def test_a_cell_over_the_memory_budget_or_the_step_cap_says_why(capsys):
    _, payload = run(capsys, "--peers", "none", "--b8-models", "tiny", "--b8-lengths", "4",
                     "--b8-memory-gib", "0.000001")
    (cell,) = payload["workloads"]["B8"]["settings"]["grid"]
    assert cell["skipped"].startswith("out of memory by estimate") and "s_per_step" not in cell
    assert payload["workloads"]["B8"]["rows"] == []
    assert any("no number: out of memory" in note for note in payload["workloads"]["B8"]["notes"])

    _, payload = run(capsys, "--peers", "none", "--b8-models", "tiny", "--b8-lengths", "4,8", "--b8-step-cap", "0.01")
    short, long = payload["workloads"]["B8"]["settings"]["grid"]
    assert short["skipped"] == "a step ran past the 0.01 s cap (killed)"
    # a longer cell of the same model would only burn the cap again: not started, and it says why
    assert long["length"] == 8 and long["skipped"] == "not started: tiny length 4 already ran past the step cap"


@trl
def test_quick_grid_against_trl_generates_the_same_tokens(capsys):
    _, payload = run(capsys, "--peers", "trl", "--b8-models", "tiny", "--b8-lengths", "6", "--b8-steps", "2")
    hasten, peer = payload["workloads"]["B8"]["settings"]["grid"]
    assert (hasten["side"], peer["side"]) == ("hasten", "trl") and "skipped" not in peer
    for cell in (hasten, peer):
        assert cell["tokens_per_s"] * cell["s_per_step"] == pytest.approx(8 * 6)  # min_new_tokens on TRL's side
        assert cell["peak_rss_mib"] > 0
    (row,) = [row for row in payload["workloads"]["B8"]["rows"] if row["side"] == "peer"]
    assert row["baseline"] == "hasten tiny L=6" and row["ratio"] is not None


def test_full_fine_tune_where_it_fits_lora_otherwise():
    from transformers import LlamaConfig, Qwen2Config

    from hasten.config import load_config

    cfg = load_config(None, [("generation.max_new_tokens", 256)])  # B1's 4 x 8 samples
    small = cost.Shape.from_config(LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                               num_key_value_heads=3, intermediate_size=1536, vocab_size=49152))
    large = cost.Shape.from_config(Qwen2Config(**SHAPES["qwen2.5-1.5b"]))
    assert choose_mode(small, cfg, budget_gib=24)[0] is False
    lora, why = choose_mode(large, cfg, budget_gib=24)
    assert lora is True and why.startswith("LoRA r=16 (full fine-tune estimate")
    # the estimate: AdamW + gradients are 3x the weights on top of them; TRL repeats the prompt per sample
    # and keeps every completion token's logits, hasten chunks them
    hasten, peer = memory_estimate(large, cfg, "hasten"), memory_estimate(large, cfg, "trl")
    assert hasten["model"] == 4 * 4 * large.parameters()
    assert peer["logits"] > hasten["logits"] and peer["activations"] > hasten["activations"]


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "B8", "--b8-models", "gpt5"], "--b8-models: unknown model gpt5"),
    (["--workloads", "B8", "--b8-lengths", "0"], "--b8-lengths needs integers >= 1"),
    (["--workloads", "B8", "--b8-lengths", "a"], "--b8-lengths must be a comma list of integers"),
    (["--workloads", "B8", "--b8-step-cap", "0"], "--b8-step-cap and --b8-memory-gib > 0"),
])
def test_bad_b8_arguments_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_report_refuses_a_file_in_the_way(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert main(["--workloads", "B8", "--report", str(tmp_path / "f")]) == 2
    assert "--report" in capsys.readouterr().err
    assert Path(tmp_path / "f").read_text() == "x"


def test_a_model_whose_full_fine_tune_does_not_fit_trains_lora(capsys, tmp_path):
    from hasten.bench.scaling import GIB, cell_config, model_config, model_dir
    from hasten.bench.workloads import BenchOptions

    opts = BenchOptions(workloads=["B8"], peers=[], model="tiny", quick=True)
    shape = cost.Shape.from_config(model_config(model_dir("tiny", tmp_path)))
    full = memory_estimate(shape, cell_config(opts, "tiny", 4, False, 2), "hasten")["total"]
    lora = memory_estimate(shape, cell_config(opts, "tiny", 4, True, 2), "hasten")["total"]
    assert lora < full
    _, payload = run(capsys, "--peers", "none", "--b8-models", "tiny", "--b8-lengths", "4", "--b8-steps", "2",
                     "--b8-memory-gib", str((lora + full) / 2 / HASTEN_MARGIN / GIB))
    b8 = payload["workloads"]["B8"]
    assert b8["settings"]["tiny"]["mode"].startswith("LoRA r=16 (full fine-tune estimate")
    (cell,) = b8["settings"]["grid"]
    assert cell["mode"] == "lora" and "skipped" not in cell and cell["steps"] == 2
    assert [row["name"] for row in b8["rows"]] == ["hasten tiny L=4 lora"]


@trl
def test_trl_side_trains_lora_with_hastens_adapter_settings_to_the_fixed_length():
    from hasten.bench.scaling import cell_config, run_trl_cell, trl_cell_spec
    from hasten.bench.workloads import BenchOptions

    cfg = cell_config(BenchOptions(workloads=["B8"], peers=["trl"], model="tiny", quick=True), "tiny", 5, True, 2)
    spec = trl_cell_spec(cfg, 5)
    assert spec["lora"]["r"] == cfg.model.lora_r and spec["config"]["generation_kwargs"] == {"min_new_tokens": 5}
    records = run_trl_cell(spec, steps=2, cap=300)
    assert [record["completion_tokens"] for record in records] == [8 * 5, 8 * 5]
    assert all(record["generate"] > 0 and record["peak_rss_mib"] > 0 for record in records)


def test_activation_checkpointing_is_chosen_for_a_cell_only_where_it_is_needed(capsys, tmp_path):
    from hasten.bench.scaling import (
        GIB,
        cell_config,
        model_config,
        model_dir,
        with_checkpointing,
    )
    from hasten.bench.workloads import BenchOptions

    opts = BenchOptions(workloads=["B8"], peers=[], model="tiny", quick=True)
    shape = cost.Shape.from_config(model_config(model_dir("tiny", tmp_path)))
    short, long = (cell_config(opts, "tiny", length, False, 2) for length in (4, 32))
    plain = memory_estimate(shape, long, "hasten")["total"]
    lean = memory_estimate(shape, with_checkpointing(long), "hasten")["total"]
    assert lean < plain and memory_estimate(shape, short, "hasten")["total"] < lean
    _, payload = run(capsys, "--peers", "none", "--b8-models", "tiny", "--b8-lengths", "4,32", "--b8-steps", "2",
                     "--b8-memory-gib", str((lean + plain) / 2 / HASTEN_MARGIN / GIB))
    grid = payload["workloads"]["B8"]["settings"]["grid"]
    assert [(cell["length"], cell["mode"]) for cell in grid] == [(4, "full"), (32, "full+gc")]
    assert all("skipped" not in cell for cell in grid)
    assert grid[1]["tokens_per_s"] * grid[1]["s_per_step"] == pytest.approx(8 * 32)


def test_past_the_cap_skips_only_cells_with_at_least_the_work_of_one_that_ran_past_it():
    from hasten.bench.scaling import past_the_cap

    capped = [(500, 256, "qwen2.5-0.5b")]
    assert past_the_cap(capped, "qwen2.5-0.5b", 500, 64, "trl", False) is None  # shorter: still runs
    assert past_the_cap(capped, "smollm2-135m", 135, 1024, "trl", False) is None  # smaller: still runs
    cell = past_the_cap(capped, "qwen2.5-1.5b", 1500, 256, "trl", True)
    assert cell.skipped == "not started: qwen2.5-0.5b length 256 already ran past the step cap"
    assert (cell.side, cell.mode, cell.steps) == ("trl", "lora", [])


def test_a_cell_whose_extrapolated_step_is_past_the_cap_is_not_started():
    from hasten.bench.scaling import Cell, extrapolated_past_the_cap

    def ran(length, seconds, side="hasten", model="qwen2.5-0.5b"):
        return Cell(model, length, side, "full", steps=[{"seconds": seconds, "completion_tokens": 1, "generate": 0,
                                                          "learn": 0, "peak_rss_mib": 1}] * 2)

    cells = [ran(64, 80.0), ran(256, 300.0), ran(256, 700.0, side="trl"), ran(64, 10.0, model="smollm2-135m")]
    # 300 + (300 - 80) * (1024 - 256) / (256 - 64) = 1180 s > 1.25 x 600
    cell = extrapolated_past_the_cap(cells, "qwen2.5-0.5b", 1024, "hasten", False, 600.0)
    assert cell.skipped.startswith("not started: at least 1180 s a step, past the 600 s cap")
    assert (cell.side, cell.length, cell.steps) == ("hasten", 1024, [])
    assert extrapolated_past_the_cap(cells, "qwen2.5-0.5b", 1024, "hasten", False, 1000.0) is None  # 1180 < 1250
    assert extrapolated_past_the_cap(cells, "qwen2.5-0.5b", 1024, "trl", False, 60.0) is None  # one length only
    assert extrapolated_past_the_cap(cells, "smollm2-135m", 1024, "hasten", False, 60.0) is None
    skipped = Cell("qwen2.5-1.5b", 64, "hasten", "lora", skipped="out of memory by estimate")
    assert extrapolated_past_the_cap([skipped, ran(256, 300.0, model="qwen2.5-1.5b")], "qwen2.5-1.5b", 1024,
                                     "hasten", True, 60.0) is None  # a cell with no number is no point


def test_hasten_estimate_counts_the_token_budgets_micro_batches():
    from transformers import Qwen2Config

    from hasten.bench.scaling import cell_config
    from hasten.bench.workloads import BenchOptions
    from hasten.train.learner import token_budget
    from hasten.train.microbatch import activation_bytes_per_token

    config = Qwen2Config(**SHAPES["qwen2.5-0.5b"])
    shape = cost.Shape.from_config(config)
    opts = BenchOptions(workloads=["B8"], peers=[], model="tiny", quick=False)
    cfg = cell_config(opts, "tiny", 1024, False, 2)  # 32 samples x 1024 tokens: ~33k tokens in one pass
    budget = token_budget(cfg, False, config)
    assert 1024 <= budget < 32 * 1024
    whole = memory_estimate(shape, cfg, "hasten")
    split = memory_estimate(shape, cfg, "hasten", model_config=config)
    per_micro_batch = split["activations"] / activation_bytes_per_token(config, False)  # tokens, evenly cut
    assert per_micro_batch == int(per_micro_batch) and budget * 0.9 < per_micro_batch <= budget
    assert split["activations"] < whole["activations"] / 4
    assert {key: split[key] for key in ("model", "logits", "kv_cache", "runtime")} == {
        key: whole[key] for key in ("model", "logits", "kv_cache", "runtime")}
    assert memory_estimate(shape, cfg, "trl", model_config=config) == memory_estimate(shape, cfg, "trl")  # one pass
    off = dataclasses.replace(cfg, speed=dataclasses.replace(cfg.speed, token_budget=0))
    assert memory_estimate(shape, off, "hasten", model_config=config) == whole


def test_the_matmul_probe_runs_in_its_own_process(capsys, tmp_path, monkeypatch):
    """The per-model matmul rates come from a child process: in the bench's own, mimalloc kept the probe's freed
    pages (2.3 GB at 0.5B), so every later cell read that much less memory available, and TRL's side fell to
    checkpointing. Here the parent's probe raises, and the grid still has its rates."""
    from hasten.bench import machine, scaling
    from hasten.bench.scaling import rates_in_child

    in_grid, probe, grid = [], machine.matmul_at_shapes, scaling.run_b8

    def refuse(*args, **kwargs):  # the machine's header figures, measured before the grid, may probe here
        assert not in_grid, "the bench process ran the grid's matmul probe itself"
        return probe(*args, **kwargs)

    def run_grid(opts):
        in_grid.append(True)
        try:
            return grid(opts)
        finally:
            in_grid.clear()

    monkeypatch.setattr(machine, "matmul_at_shapes", refuse)
    monkeypatch.setattr(scaling, "run_b8", run_grid)
    _, payload = run(capsys, "--peers", "none", "--b8-models", "tiny", "--b8-lengths", "4", "--b8-steps", "2")
    rates = payload["workloads"]["B8"]["settings"]["matmul_gflops_at_model_shapes"]["tiny"]
    from hasten.bench.machine import model_shapes
    from hasten.bench.scaling import model_config

    shapes = set(model_shapes(model_config("tiny")))  # every shape of the model, each with its kernels' rates
    assert len(rates) == 2 and all({name.split(" ")[0] for name in per_shape} == shapes
                                   and all(shape for shape in per_shape.values()) for per_shape in rates.values())
    with pytest.raises(RuntimeError, match="matmul probe exited with code 1"):
        rates_in_child(str(tmp_path / "no-such-model"), True)
