"""A tokenizer over the `tokenizers` library and a jinja chat template, without transformers.

The native model path (llama.py) exists so that a run never imports
transformers; this is its tokenizer. It reads a Hugging Face model
directory's tokenizer.json, tokenizer_config.json (special tokens) and chat
template (chat_template.jinja, or the "chat_template" key), and offers the
calls hasten makes, with transformers' meaning:

    tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer.decode(ids, skip_special_tokens=True), batch_decode(...)
    eos_token(_id), pad_token(_id), bos_token(_id), len(tokenizer), save_pretrained(dir)

The chat template renders in the same sandboxed jinja environment
transformers uses (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `strftime_now`), with the special tokens as variables.
tests/test_native_llama.py checks encode, decode and the chat template
against transformers' tokenizer on the default model's files.
"""

from __future__ import annotations

import functools
import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """A chat template compiled in the sandboxed jinja environment transformers renders templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """Training templates' {% generation %}...{% endgeneration %} (transformers' assistant-mask markers):
        the text between them renders as it is; hasten finds assistant spans itself (api/sft_rows.py)."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, Generation])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class FastTokenizer:
    """The slice of transformers' PreTrainedTokenizerFast that hasten uses."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.backend = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        config_file = self.directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special = {name: _token_text(config.get(name)) for name in SPECIAL_NAMES}
        template_file = self.directory / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    # -- special tokens, as attributes
    def _id(self, name: str) -> int | None:
        token = self.special[name]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self.special["pad_token"]

    @pad_token.setter
    def pad_token(self, token: str) -> None:
        self.special["pad_token"] = token

    @property
    def bos_token(self) -> str | None:
        return self.special["bos_token"]

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    # -- text <-> ids
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs) -> str | list[int]:
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template")
        variables = {name: token for name, token in self.special.items() if token is not None}
        text = compile_template(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **variables, **kwargs)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def save_pretrained(self, directory: str | Path) -> None:
        """Copy the tokenizer files, with the current special tokens in tokenizer_config.json and the current
        chat template in chat_template.jinja."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.directory / name).is_file() and name != "tokenizer_config.json":
                shutil.copyfile(self.directory / name, directory / name)
        config_file = self.directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        config.update({name: token for name, token in self.special.items() if token is not None})
        if self.chat_template:  # the template in use, which a user may have set (SFT's chat_template_path)
            (directory / "chat_template.jinja").write_text(self.chat_template)
            config.pop("chat_template", None)
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: drop the space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
