"""TRL options hasten takes (hasten/api/grpo_config.py): what each maps onto, and the new pieces behind
them (normalize_then_sum advantages, dataset-order prompts)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from hasten.algo.advantages import EPS, normalized_sum_advantages
from hasten.api import APIError, GRPOConfig
from hasten.tasks.sampler import PromptSampler


def mapped(**fields) -> dict:
    return dict(GRPOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4, max_steps=1,
                           **fields).overrides(8, 0))


def test_generation_kwargs_override_the_sampling_fields():
    keys = mapped(top_k=10, generation_kwargs={"do_sample": True, "top_k": 50, "top_p": 0.9, "min_p": 0.05,
                                               "num_beams": 1, "length_penalty": 2.0, "stop_strings": ["\n"]})
    assert (keys["generation.top_k"], keys["generation.top_p"], keys["generation.min_p"]) == (50, 0.9, 0.05)
    assert keys["generation.stop_strings"] == ["\n"] and keys["generation.temperature"] == 1.0
    for bad, word in [({"do_sample": False}, "do_sample"), ({"num_beams": 2}, "num_beams"),
                      ({"max_new_tokens": 3}, "max_new_tokens"), ({"typical_p": 0.5}, "typical_p")]:
        with pytest.raises(APIError, match=f"{word}.*not supported"):
            mapped(generation_kwargs=bad)


def test_use_vllm_maps_onto_the_vllm_engine():
    assert "speed.engine" not in mapped()
    colocate = mapped(use_vllm=True, vllm_gpu_memory_utilization=0.5)
    assert colocate["speed.engine"] == "vllm" and colocate["speed.vllm_memory_fraction"] == 0.5
    assert "speed.vllm_server" not in colocate
    server = mapped(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2", vllm_server_port=8001)
    assert server["speed.vllm_server"] == "http://10.0.0.2:8001"
    assert mapped(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://h:9")["speed.vllm_server"] == "http://h:9"
    with pytest.raises(APIError, match="vllm_mode='remote' is not supported"):
        mapped(use_vllm=True, vllm_mode="remote")


def test_options_that_change_nothing_are_accepted():
    keys = mapped(dataloader_num_workers=4, pad_to_multiple_of=64, cast_lm_head_to_fp32=True, num_generations_eval=1)
    assert keys == mapped()
    assert mapped(num_generations_eval=4) == mapped()  # the trainer's sampled eval reads it (api/eval_loss.py)
    with pytest.raises(APIError, match="num_generations_eval must be None or a positive integer"):
        mapped(num_generations_eval=0)
    with pytest.raises(APIError, match="cast_lm_head_to_fp32=True with a half-precision"):
        mapped(cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"})


def test_sequence_level_and_aggregation_keys():
    assert mapped(importance_sampling_level="sequence", loss_type="grpo")["algo.loss"] == "gspo"
    keys = mapped(importance_sampling_level="sequence", loss_type="dapo")
    assert (keys["algo.loss"], keys["algo.importance_sampling_level"]) == ("dapo", "sequence")
    assert mapped(multi_objective_aggregation="normalize_then_sum")["rewards.aggregation"] == "normalize_then_sum"
    assert mapped(shuffle_dataset=False)["train.shuffle"] is False


def test_shuffle_false_draws_rows_in_dataset_order_every_epoch():
    rows = [{"prompt": str(i)} for i in range(3)]
    assert [r["prompt"] for r in PromptSampler(rows, 0, shuffle=False).next(7)] == list("0120120")
    shuffled = [r["prompt"] for r in PromptSampler([{"prompt": str(i)} for i in range(8)], 0).next(8)]
    assert shuffled != [str(i) for i in range(8)]


def test_normalize_then_sum_by_hand():
    # 2 groups of 3, 2 functions (weights 1 and 0.5); sample 5 has no score from either: unscorable
    nan = float("nan")
    scores = [[1.0, 10.0], [2.0, 10.0], [3.0, 40.0], [0.0, nan], [2.0, 5.0], [nan, nan]]
    weights = [1.0, 0.5]

    def zscores(values):
        present = [v for v in values if not math.isnan(v)]
        mean, std = statistics.mean(present), statistics.stdev(present) if len(present) > 1 else float("nan")
        return [(v - mean) / (std + EPS) if not math.isnan(v) else nan for v in values]

    columns = [[row[k] for row in scores] for k in range(2)]
    normalized = [zscores(column[0:3]) + zscores(column[3:6]) for column in columns]
    summed = []
    for i in range(6):
        parts = [normalized[k][i] * weights[k] for k in range(2) if not math.isnan(normalized[k][i])]
        summed.append(sum(parts) if any(not math.isnan(scores[i][k]) for k in range(2)) else nan)
    present = [v for v in summed if not math.isnan(v)]
    mean, std = statistics.mean(present), statistics.stdev(present)
    expected = [(v - mean) / (std + EPS) if not math.isnan(v) else 0.0 for v in summed]
    got = normalized_sum_advantages(torch.tensor(scores), torch.tensor(weights), 3)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert got[5] == 0.0 and got.abs().sum() > 1  # unscorable gets 0; the rest carry signal


@pytest.mark.parametrize("quantile", [1.0, 0.8, 0.5, 0.2, 0.0])
def test_high_entropy_mask_equals_trl(quantile):
    """hasten's top_entropy_quantile mask against TRL's own GRPOTrainer.get_high_entropy_mask (one process)."""
    from unittest.mock import Mock

    trl = pytest.importorskip("trl")
    from hasten.algo.losses import high_entropy_mask

    trainer = Mock(spec=trl.GRPOTrainer)
    trainer.accelerator = Mock(num_processes=1, gather=lambda x: x, pad_across_processes=lambda x, dim, pad_index: x)
    generator = torch.Generator().manual_seed(0)
    entropies = torch.rand(4, 7, generator=generator)
    mask = (torch.rand(4, 7, generator=generator) > 0.3).long()
    theirs = trl.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 1 - quantile)
    ours = high_entropy_mask(entropies, mask, quantile)
    assert torch.equal(ours, theirs)
    assert int(ours.sum()) <= int(mask.sum()) and (quantile < 1 or torch.equal(ours, mask.bool()))


def test_top_entropy_quantile_maps_and_masks_the_policy_gradient():
    assert mapped(top_entropy_quantile=0.2)["algo.top_entropy_quantile"] == 0.2
    assert mapped(entropy_coef=0.1)["algo.entropy_coef"] == 0.1  # the bonus: tests/test_entropy_and_kl.py
    with pytest.raises(APIError, match="vllm_enable_sleep_mode=True is not supported"):
        mapped(vllm_enable_sleep_mode=True)


def test_top_entropy_quantile_changes_the_learner_gradient(model, tokenizer):
    """Below 1, only the high-entropy tokens carry the policy gradient; 1 is the plain loss."""
    from conftest import learner_step, rollout_of

    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=8)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)

    def configure(quantile):
        def apply(cfg):
            cfg.algo.top_entropy_quantile = quantile
        return apply

    _, full = learner_step(model, tokenizer, rollout, advantages, configure(1.0))
    _, again = learner_step(model, tokenizer, rollout, advantages, configure(1.0))
    _, masked = learner_step(model, tokenizer, rollout, advantages, configure(0.2))
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    assert any(not torch.allclose(a, b) for a, b in zip(full, masked))


def test_a_model_hasten_cannot_train_is_one_line_before_loading(tmp_path):
    import json

    from hasten.models.files import ModelFileError, check_model_dir
    from hasten.models.tiny import tiny_tokenizer

    for kind, architecture, words in [("bert", "BertForMaskedLM", "'bert' model (BertForMaskedLM)"),
                                      ("qwen2", "Qwen2ForSequenceClassification", "pass it in reward_funcs")]:
        directory = tmp_path / kind
        tiny_tokenizer().save_pretrained(directory)
        (directory / "config.json").write_text(json.dumps({"model_type": kind, "architectures": [architecture]}))
        with pytest.raises(ModelFileError, match="hasten trains causal language models") as caught:
            check_model_dir(directory)
        assert words in str(caught.value) and "\n" not in str(caught.value)
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                                "architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(ModelFileError, match="has no weights"):  # past the type check (runs through transformers):
        check_model_dir(tmp_path / "qwen2")                       # only the missing weights are left to say


def test_save_only_model_keeps_no_trainer_state(tmp_path):
    from hasten.api import GRPOTrainer

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_steps=2, save_steps=1, max_completion_length=4, save_only_model=True)
    trainer = GRPOTrainer(model="tiny", reward_funcs=length, args=args, train_dataset=[{"prompt": "a"}, {"prompt": "b"}],
                          log=lambda line: None)
    trainer.train()
    checkpoints = sorted(path.name for path in (tmp_path / "run").glob("checkpoint*"))
    assert "checkpoint" in checkpoints and len(checkpoints) >= 2
    for name in checkpoints:
        files = {path.name for path in (tmp_path / "run" / name).iterdir()}
        assert "trainer_state.pt" not in files and "config.json" in files


def test_sft_eval_loss_is_the_models_own_loss_on_the_targets(tmp_path):
    from hasten.api import SFTConfig, SFTTrainer
    from hasten.models.tiny import tiny_model, tiny_tokenizer

    rows = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}]
    tokenizer = tiny_tokenizer()
    trainer = SFTTrainer(model=tiny_model(len(tokenizer)), processing_class=tokenizer, args=SFTConfig(output_dir=str(tmp_path / "sft"), num_train_epochs=1,
                                                      eval_strategy="epoch", per_device_eval_batch_size=1),
                         train_dataset=rows, eval_dataset=rows[:1], log=lambda line: None)
    example = trainer.eval_examples[0]
    ids = torch.tensor([example.prompt_ids + example.completion_ids])
    labels = ids.clone()
    labels[0, :len(example.prompt_ids)] = -100
    with torch.no_grad():
        expected = float(trainer.model(input_ids=ids, labels=labels).loss)
    assert trainer.evaluate_loss()["loss"] == pytest.approx(expected, rel=1e-5)
    trainer.train()
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


def test_reference_mix_in_is_the_soft_update(model, tokenizer):
    from hasten.models import Policy, Reference

    policy = Policy(model, tokenizer, "tiny")
    reference = Reference(policy)
    start = [p.detach().clone() for p in reference.frozen.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)
    reference.mix_in(model, 0.6)
    for before, now, current in zip(start, reference.frozen.parameters(), model.parameters()):
        torch.testing.assert_close(now, 0.6 * current + 0.4 * before)
    assert mapped(beta=0.1, sync_ref_model=True, ref_model_sync_steps=4)["algo.ref_model_sync_steps"] == 4
    assert mapped(beta=0.1)["algo.ref_model_sync_steps"] == 0
    with pytest.raises(APIError, match="sync_ref_model=True needs beta > 0"):
        mapped(sync_ref_model=True)


def test_save_model_defaults_to_output_dir_on_a_rerun(tmp_path):
    from safetensors.torch import load_file

    from hasten.api import GRPOTrainer

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def run(seed):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_steps=1, max_completion_length=4, learning_rate=0.05, seed=seed)
        trainer = GRPOTrainer(model="tiny", reward_funcs=length, args=args,
                              train_dataset=[{"prompt": "a"}, {"prompt": "b"}], log=lambda line: None)
        trainer.train()
        return trainer, trainer.save_model()

    first, _ = run(1)
    second, saved = run(2)
    # TRL's output_dir: the second run writes "out" itself, the first is kept as out.previous-1
    assert second.run_dir == first.run_dir == saved == tmp_path / "out"
    assert (tmp_path / "out.previous-1" / "config.yaml").is_file()
    weights = load_file(str(saved / "model.safetensors"))
    name, value = next((n, v) for n, v in second.model.state_dict().items() if n in weights)
    assert torch.equal(weights[name], value.detach().cpu())


def test_trackers_log_trl_names_on_the_trl_path():
    from hasten.train.tracking import Tracker, trl_record

    class Writer:
        def __init__(self):
            self.logged = []

        def scalars(self, step, values):
            self.logged.append(values)

    record = {"reward_mean": 1.0, "lr": 0.1, "rewards/f": 2.0, "rewards/f/std": 0.5, "loss": 0.3, "step": 1}
    trl, plain = Writer(), Writer()
    Tracker([trl], 1, None, trl_record).on_step(1, record)
    Tracker([plain], 1, None).on_step(1, record)
    assert trl.logged == [{"train/reward": 1.0, "train/learning_rate": 0.1, "train/rewards/f/mean": 2.0,
                           "train/rewards/f/std": 0.5, "train/loss": 0.3}]
    assert "train/reward_mean" in plain.logged[0]  # the CLI keeps hasten's names
    assert mapped()["output.tracker_names"] == "trl"
