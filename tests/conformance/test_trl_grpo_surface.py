"""TRL's GRPOTrainer surface and errors that issue 53 found missing, guarded offline on tiny models.

Each test is written from what a test of TRL main's tests/test_grpo_trainer.py (f2cd57710) asserts, and runs
on both libraries by the `lib` switch (conftest.py): TRL 1.16.0 is the control. The TRL test each one stands
for is named in its docstring.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import prompt_dataset
from .test_trl_conformance import assert_trained, grpo_args, snapshot, varied_reward


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory) -> str:
    """A tiny GLM-4 MoE: a mixture of experts (output_router_logits) whose config declares no
    router_aux_loss_coef and whose forward returns no router loss (aux_loss None)."""
    import transformers

    from hasten.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = transformers.Glm4MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("glm4-moe") / "glm4_moe"
    transformers.Glm4MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------ the MoE aux loss's coefficient


def test_moe_without_declared_coef_trains_without_aux_loss(lib, glm4_moe, tmp_path):
    """test_train[tiny-Glm4MoeForCausalLM]: the coefficient is the model config's own (none here: 0), so the
    missing router loss is never multiplied."""
    trainer = lib.GRPOTrainer(model=glm4_moe, reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path))
    assert trainer.aux_loss_enabled is False
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)
    assert "aux_loss" not in trainer.state.log_history[-1]


def test_aux_loss_coef_on_a_dense_model_raises(lib, models, tmp_path):
    """TRL 1.16's construction check: a coefficient for a model that has no router loss to weight."""
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                        args=grpo_args(lib, tmp_path, router_aux_loss_coef=0.01))
