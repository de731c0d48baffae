"""The cost model (hasten/bench/cost.py) against counts done by hand."""

from __future__ import annotations

import types

import pytest

from hasten.bench.cost import (BYTES, Limits, ModelSize, StepShape, context_reads, decode_bytes, decode_floor,
                               generation_flops, learning_flops, model_size, size_from_config, step_floors)
from hasten.models.tiny import tiny_model


def test_flops_by_hand():
    size = ModelSize(body=100, head=10, layers=2, kv_width=4)
    assert generation_flops(size, prompt_tokens=3, generated_tokens=5) == 2 * 100 * 8 + 2 * 10 * 5
    assert learning_flops(size, 3, 5) == 6 * 100 * 8 + 6 * 10 * 5
    assert learning_flops(size, 3, 5, lora=True) == 4 * 100 * 8 + 4 * 10 * 5


def test_decode_bytes_and_cache_reads_by_hand():
    # one row, prompt 2, 3 new tokens: it reads 2, 3 and 4 cached tokens at steps 0, 1, 2
    assert context_reads([2], [3]) == 9
    assert context_reads([2, 5], [3, 1]) == 9 + 5
    size = ModelSize(body=100, head=10, layers=2, kv_width=4)
    # 3 steps x 110 weights x 4 bytes + 9 tokens x (K and V) x 2 layers x 4 values x 4 bytes
    assert decode_bytes(size, "fp32", 3, 9) == 3 * 110 * 4 + 9 * 2 * 2 * 4 * 4
    assert decode_bytes(size, "bf16", 3, 9) == decode_bytes(size, "fp32", 3, 9) / 2 == 3 * 110 * 2 + 9 * 2 * 2 * 4 * 2
    assert BYTES["bf16"] == 2


def test_a_floor_is_the_slower_of_compute_and_memory():
    size = ModelSize(body=1000, head=0, layers=1, kv_width=1)
    slow_memory = Limits(fp32_gflops=1e6, bf16_gflops=1e6, bandwidth_gbs=1e-6)
    slow_compute = Limits(fp32_gflops=1e-6, bf16_gflops=1e-6, bandwidth_gbs=1e6)
    assert decode_floor(size, slow_memory, "fp32", 4, 4, 10).bound == "memory"
    assert decode_floor(size, slow_compute, "fp32", 4, 4, 10).bound == "compute"
    floors = step_floors(size, Limits(1.0, 2.0, 1.0), StepShape([3], [2, 2], num_generations=2))
    # learning: 6 x 1000 x (3 prompt + 4 completion) FLOPs at 1 GFLOP/s
    assert floors["learn"].seconds == pytest.approx(6 * 1000 * 7 / 1e9)
    assert step_floors(size, Limits(1.0, 2.0, 1.0), StepShape([3], [2, 2], 2), "bf16", "bf16")["learn"].seconds \
        == pytest.approx(floors["learn"].seconds / 2)


def test_sizes_from_a_model_and_from_its_config_agree():
    model = tiny_model(300)
    loaded = model_size(model)
    assert loaded.body + loaded.head + model.get_input_embeddings().weight.numel() * (
        model.get_input_embeddings().weight is not model.get_output_embeddings().weight) == sum(
        p.numel() for p in model.parameters())
    from_config = size_from_config(model.config)
    assert (from_config.body, from_config.head, from_config.layers, from_config.kv_width) == (
        loaded.body, loaded.head, loaded.layers, loaded.kv_width)


def test_qwen2_shape_counts_its_biases():
    config = types.SimpleNamespace(hidden_size=896, num_hidden_layers=24, vocab_size=151936, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, model_type="qwen2")
    size = size_from_config(config)
    # Qwen2.5-0.5B: 494M parameters with the tied embedding counted once (published figure 0.49B)
    assert 0.49e9 < size.body + size.head < 0.50e9


def test_the_docs_prediction_table_is_the_codes():
    from pathlib import Path

    from hasten.bench.cost import prediction_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "cost-model.md").read_text()
    missing = [line for line in prediction_table() if line not in doc]
    assert missing == []
