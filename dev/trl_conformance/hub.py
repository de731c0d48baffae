"""Tiny local stand-ins for the hub ids TRL's tests load, written as an offline
Hugging Face cache.

Models: random weights, two layers, hidden size 64, built from the architecture
named in the id ("tiny-Qwen3MoeForCausalLM" -> qwen3_moe). Tokenizer: hasten's
offline byte tokenizer plus the family's special tokens, with the chat template
TRL ships for that family (trl/chat_templates/*.jinja) where one exists, so that
TRL's template checks (tool-call parsing, training templates) see what they
would see on the real tiny models; other families get ChatML.

Datasets: "trl-internal-testing/zen" in the configs the tests use, from the
Zen of Python (17 train rows, 2 test rows, as the real one), saved with
`save_to_disk`; the pytest plugin (plugin.py) redirects `load_dataset` to them.

Ids this cannot build (vision models, remote code, harmony/toolcall data) are
left absent: a test that needs one fails on both sides and is not counted.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

REVISION = "0" * 40  # the snapshot name under refs/main; any fixed hash works offline

CAUSAL_LMS = [
    "tiny-Qwen2ForCausalLM-2.5", "tiny-Qwen3ForCausalLM", "tiny-Qwen3MoeForCausalLM",
    "tiny-LlamaForCausalLM-3.2", "tiny-LlamaForCausalLM-3.1", "tiny-LlamaForCausalLM-3",
    "tiny-MistralForCausalLM-0.2", "tiny-MistralForCausalLM-0.1", "tiny-GptOssForCausalLM",
    "tiny-Gemma2ForCausalLM", "tiny-GemmaForCausalLM", "tiny-GPTNeoXForCausalLM", "tiny-CohereForCausalLM",
    "tiny-Cohere2ForCausalLM", "tiny-Lfm2ForCausalLM", "tiny-Lfm2ForCausalLM-2.5", "tiny-Glm4MoeForCausalLM",
    "tiny-Phi3ForCausalLM", "tiny-Olmo3ForCausalLM", "tiny-DeepseekV3ForCausalLM",
    "tiny-DeepseekV3ForCausalLM-0528", "tiny-NemotronHForCausalLM-nano",
]
REWARD_MODELS = ["tiny-Qwen2ForSequenceClassification-2.5", "tiny-Qwen3ForSequenceClassification",
                 "tiny-LlamaForSequenceClassification-3.2"]

# family (lower-case id fragment) -> (TRL template file, eos, pad, bos)
FAMILIES = {
    "qwen2forcausallm-2.5": ("qwen2_5.jinja", "<|im_end|>", "<|endoftext|>", None),
    "qwen2forsequenceclassification-2.5": ("qwen2_5.jinja", "<|im_end|>", "<|endoftext|>", None),
    "qwen3": ("qwen3.jinja", "<|im_end|>", "<|endoftext|>", None),
    "llama": ("llama3_2.jinja", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
    "llamaforcausallm-3.1": ("llama3_1.jinja", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
    "llamaforcausallm-3": ("llama3.jinja", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
    "gptoss": ("gptoss.jinja", "<|return|>", "<|endoftext|>", "<|startoftext|>"),
}
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.",
    "Unless explicitly silenced.", "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]


def _family(name: str) -> tuple[str | None, str, str, str | None]:
    lowered = name.lower().removeprefix("tiny-")
    for key in sorted(FAMILIES, key=len, reverse=True):  # most specific first
        if lowered.startswith(key) or (key in lowered and key in ("qwen3", "gptoss", "llama")):
            return FAMILIES[key]
    return None, "<|im_end|>", "<|endoftext|>", None


def tokenizer_for(name: str, trl_source: Path):
    from hasten.models.tiny import tiny_tokenizer

    template_file, eos, pad, bos = _family(name)
    tokenizer = tiny_tokenizer()
    template = (trl_source / "trl" / "chat_templates" / template_file).read_text() if template_file else CHATML
    specials = sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", template)) | {eos, pad} | ({bos} if bos else set()))
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token, tokenizer.pad_token = eos, pad
    tokenizer.bos_token = bos
    tokenizer.chat_template = template
    return tokenizer


def _model(name: str, vocab_size: int, tokenizer, seed: int):
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    class_name = re.sub(r"-[0-9.]+$|-nano$|-0528$", "", name.removeprefix("tiny-"))
    by_class = {klass: model_type
                for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
                for model_type, klass in mapping.items()}
    model_type = by_class[class_name]
    small = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
             "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
             "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
             "bos_token_id": tokenizer.bos_token_id, "num_labels": 1}
    if model_type == "nemotron_h":
        small.update(hybrid_override_pattern="M*", layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                     mamba_head_dim=16, n_groups=1, ssm_state_size=16)
    if model_type == "lfm2":
        small.update(layer_types=["conv", "full_attention"], block_ff_dim=64)
    if model_type in ("gemma2", "cohere2", "gpt_oss", "olmo3"):
        small.update(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    # only the fields this architecture has: a stray `output_router_logits` would make TRL treat a dense model as MoE
    default = transformers.AutoConfig.for_model(model_type)
    known = {key: value for key, value in small.items() if hasattr(default, key) or key == "num_labels"}
    config = transformers.AutoConfig.for_model(model_type, **known)
    torch.manual_seed(seed)
    return getattr(transformers, class_name)(config)


def _snapshot(root: Path, repo: str) -> Path:
    """The snapshot folder of `repo` in a hub cache at `root`, with refs/main pointing at it."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(REVISION)
    snapshot = folder / "snapshots" / REVISION
    if snapshot.exists():
        shutil.rmtree(snapshot)
    snapshot.mkdir(parents=True)
    return snapshot


def _datasets(root: Path) -> None:
    from datasets import Dataset, DatasetDict

    pairs = [(line.rsplit(" ", 1)[0], " " + line.rsplit(" ", 1)[1]) for line in ZEN]

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text}]

    columns = {
        "standard_prompt_only": lambda p, c: {"prompt": p},
        "conversational_prompt_only": lambda p, c: {"prompt": user(p)},
        "standard_language_modeling": lambda p, c: {"text": p + c},
        "conversational_language_modeling": lambda p, c: {"messages": user(p) + assistant(c.strip())},
        "standard_prompt_completion": lambda p, c: {"prompt": p, "completion": c},
        "conversational_prompt_completion": lambda p, c: {"prompt": user(p), "completion": assistant(c.strip())},
        "standard_implicit_prompt_preference": lambda p, c: {"chosen": p + c, "rejected": p + " no."},
    }
    for config, row in columns.items():
        rows = [row(p, c) for p, c in pairs]
        splits = DatasetDict({"train": Dataset.from_list(rows[:17]), "test": Dataset.from_list(rows[17:])})
        splits.save_to_disk(str(root / "datasets" / "zen" / config))


def build(cache: Path, trl_source: Path) -> Path:
    """Write every stand-in under `cache` (once per TRL checkout and hasten version); returns the hub dir."""
    stamp = hashlib.sha1((Path(__file__).read_text() + str(trl_source.resolve())).encode()).hexdigest()[:12]
    done = cache / f"built-{stamp}"
    hub = cache / "hub"
    if done.exists():
        return hub
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    for name in CAUSAL_LMS + REWARD_MODELS:
        tokenizer = tokenizer_for(name, trl_source)
        try:
            model = _model(name, len(tokenizer), tokenizer, seed=len(name))
        except Exception as error:  # noqa: BLE001  an architecture this transformers cannot build small: left absent
            print(f"  (not built: {name}: {str(error).splitlines()[0][:120]})", file=sys.stderr)
            continue
        snapshot = _snapshot(hub, f"trl-internal-testing/{name}")
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
    _datasets(cache)
    done.touch()
    return hub
