"""The cost model's arithmetic (bench/cost.py, docs/cost-model.md) and the fractions of the hardware limit.

Counts are checked by hand on a toy shape, against the parameters of real
transformers models built from the same configs (Llama, and Qwen2 with its
q/k/v biases), and against SmolLM2-135M's published sizes. The fractions:
the denominator is the best rate over every kernel measured, and a figure
over 100% is refused or flagged, never printed as a result.
"""

from __future__ import annotations

import pytest
import torch

from hasten.bench import cost
from hasten.bench.machine import best_rates, memory_bandwidth
from hasten.bench.report import (
    Result,
    Row,
    Work,
    format_table,
    limit,
    mfu,
    phase_limits,
)

TOY = cost.Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_toy_counts_by_hand():
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, MLP 3 x 8 x 16 = 384, two norms 16 -> 592; x2 + final norm 8
    assert TOY.body == 2 * 592 + 8 == 1192 and TOY.head == 80
    assert cost.forward_flops(TOY, tokens=3, logits=1) == 2 * 1192 * 3 + 2 * 80 == 7312
    assert cost.learning_flops(TOY, prompt_tokens=2, completion_tokens=1) == 3 * 7312  # 6N per trained token
    assert cost.learning_flops(TOY, 2, 1, lora=True) == 2 * 7312  # 4N with LoRA
    assert cost.attention_flops(TOY, context=5) == 4 * 2 * 8 * 5
    assert cost.kv_bytes_per_position(TOY) == 2 * 2 * 4 * 4  # k and v, 2 layers, 1 kv head x 4, fp32
    assert cost.kv_bytes_per_position(TOY, "bf16") == 32
    # one decode step over 3 rows at context 5: weights once (1272 x 4 bytes), then 3 x 5 positions of KV
    assert cost.decode_step_bytes(TOY, rows=3, context=5) == 1272 * 4 + 3 * 5 * 64
    # 4 steps from prompts of 5: contexts 5, 6, 7, 8 (mean 6.5)
    assert cost.decode_bytes(TOY, rows=3, prompt_tokens=5, new_tokens=4) == 4 * (1272 * 4 + 3 * 6.5 * 64)
    assert cost.decode_floor_bytes(TOY, steps=4, generated_tokens=12, context=5) == 4 * 1272 * 4 + 12 * 5 * 64
    # learning: weights read forward and backward, then gradients + AdamW (7 fp32 tensors of N) when trained
    assert cost.learning_bytes(TOY, lora=True) == 2 * 1272 * 4
    assert cost.learning_bytes(TOY) == 2 * 1272 * 4 + 1272 * (4 + 28)


def test_smollm2_sizes_match_the_published_counts():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    shape = cost.Shape.from_config(config)
    assert shape.body == 106_203_456 and shape.head == 28_311_552  # report.py: 106.2M and 28.3M
    assert shape.parameters(tied=True) == 134_515_008  # SmolLM2-135M


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shape_counts_equal_a_real_model_built_from_the_config(family):
    import transformers

    kwargs = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, vocab_size=100, tie_word_embeddings=False)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    shape = cost.Shape.from_config(config)
    assert shape.attention_bias == (family == "qwen2")
    assert (shape.body, shape.head) == (body, head.numel())
    assert shape.parameters(tied=False) == sum(p.numel() for p in model.parameters())


def test_best_rates_take_the_fastest_kernel_of_each_precision():
    rates = {"M=1700": {"qkv": {"mkl": 210.0, "onednn": 470.0, "bf16": 930.0}},
             "M=64": {"qkv": {"mkl": 150.0, "onednn": 480.5, "bf16": 300.0}}}
    assert best_rates(rates, square_fp32=205.0) == {"fp32": 480.5, "bf16": 930.0}
    assert best_rates({}, square_fp32=205.0) == {"fp32": 205.0}  # no bf16 measured: none claimed


def test_issue_33_learning_pass_reads_under_100_percent_with_the_right_peak():
    # B1 on the 2026-11 EPYC: a learning pass at 1.16 x MKL's 210 GFLOP/s read "116%" against MKL's peak
    limits = cost.Limits({"fp32": 470.0, "bf16": 930.0}, bandwidth_gbs=20.0)
    row = Row("packed", "hasten", "tok/s", [1.0], work=[1.0], flops=[243.6e9],
              phases=[{"learn": Work(243.6e9, 0.0, "fp32")}])
    assert mfu(row, 210.0) == pytest.approx(1.16)  # the old denominator: MKL's fp32 peak alone
    assert limit(row, limits) == pytest.approx(243.6 / 470)
    bf16 = Row("packed bf16", "hasten", "tok/s", [1.0], work=[1.0], flops=[355e9], precision="bf16",
               phases=[{"learn": Work(355e9, 0.0, "bf16")}])
    assert mfu(bf16, limits) == pytest.approx(355 / 930) and limit(bf16, limits) == pytest.approx(355 / 930)


def test_decode_is_bounded_by_bandwidth_and_a_step_sums_its_phases():
    limits = cost.Limits({"fp32": 100.0}, bandwidth_gbs=10.0)
    # decode: 1 GFLOP (0.01 s at 100 GFLOP/s) but 1 GB to read (0.1 s at 10 GB/s): memory-bound, floor 0.1 s
    assert cost.floor_seconds(limits, 1e9, 1e9, "fp32") == pytest.approx(0.1)
    step = {"generate": Work(1e9, 1e9), "learn": Work(30e9, 1e8)}  # floors 0.1 + 0.3 s
    row = Row("hasten", "hasten", "s/step", [0.8, 0.8], phases=[step, step], extra={"generate": 0.2, "learn": 0.6})
    assert limit(row, limits) == pytest.approx(0.4 / 0.8)
    assert phase_limits(row, limits) == pytest.approx({"generate": 0.5, "learn": 0.5})


def test_a_fraction_over_100_percent_is_refused_or_flagged():
    with pytest.raises(cost.LimitError, match="wrong denominator"):
        cost.fraction(floor=2.0, seconds=1.0)
    assert cost.fraction(0.5, 1.0) == 0.5
    with pytest.raises(ValueError, match="bf16"):
        cost.Limits({"fp32": 1.0}, 1.0).peak("bf16")
    limits = cost.Limits({"fp32": 1.0}, 0.0)  # a peak far below what the row did
    row = Row("fast", "hasten", "s", [1.0], phases=[{"learn": Work(5e9)}])
    table = format_table([Result("B3", "t", [row])], limits, {})
    assert "500.0%!" in table and "WARNING: 1 limit figure(s) over 100%" in table


def test_h100_predictions_are_floors_that_shrink_with_gpus():
    shape = cost.Shape(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960,
                       vocab=151936, attention_bias=True)  # Qwen2.5-1.5B
    one = cost.predict_step(shape, cost.H100, 1, samples=256, prompt_tokens=128, completion_tokens=1024, group=8)
    eight = cost.predict_step(shape, cost.H100, 8, samples=256, prompt_tokens=128, completion_tokens=1024, group=8)
    assert one["all_reduce_s"] == 0 and eight["all_reduce_s"] > 0
    assert eight["learn_s"] == pytest.approx(one["learn_s"] / 8, rel=0.01)  # compute-bound: splits evenly
    assert eight["step_s"] < one["step_s"]
    assert one["step_s"] == pytest.approx(one["generate_s"] + one["learn_s"])


def test_memory_probe_reports_each_kernel_and_the_best():
    figures = memory_bandwidth(quick=True)
    assert set(figures) == {"read", "copy", "triad", "best"}
    assert figures["best"] == max(figures["read"], figures["copy"], figures["triad"])
    assert torch.get_num_threads() >= 1


def test_b8_qwen_shapes_have_the_published_parameter_counts():
    from transformers import Qwen2Config

    from hasten.bench.scaling import QWEN_COMMON, SHAPES

    counts = {name: cost.Shape.from_config(Qwen2Config(**SHAPES[name], **QWEN_COMMON)).parameters(tied=True)
              for name in ("qwen2.5-0.5b", "qwen2.5-1.5b")}
    assert counts == {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}  # 0.49B and 1.54B


def test_an_int8_generate_floor_reads_int8_weights_and_an_fp32_cache():
    # generation.precision=int8: one byte per weight, while the KV cache stays fp32 (rollout/lean.py)
    weights = TOY.body + TOY.head
    assert cost.decode_step_bytes(TOY, rows=3, context=5, precision="int8") == (
        weights * 1 + 3 * 5 * cost.kv_bytes_per_position(TOY, "fp32"))
    rates = best_rates({"M=64": {"qkv 8x16": {"onednn": 100.0, "bf16": 50.0, "int8": 300.0}}}, square_fp32=80.0)
    assert rates == {"fp32": 100.0, "bf16": 50.0, "int8": 300.0}  # the int8 floor divides by the int8 kernel
