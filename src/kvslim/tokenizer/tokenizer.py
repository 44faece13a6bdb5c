"""A model's tokenizer: `tokenizer.json` through the `tokenizers` library, special tokens and the
chat template from `tokenizer_config.json` (rendered with jinja2 the way transformers does)."""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvslim.errors import ConfigError, KvslimError


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None,
                 chat_template: str | None = None):
        self.tok = tokenizer
        self.config = config or {}
        self.generation_config = generation_config or {}
        self.chat_template = chat_template or self.config.get("chat_template")
        if isinstance(self.chat_template, list):       # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer.json in {d}")
        tok = HFTokenizer.from_file(str(path))
        template_file = d / "chat_template.jinja"
        return cls(tok, _read_json(d / "tokenizer_config.json"),
                   _read_json(d / "generation_config.json"),
                   template_file.read_text() if template_file.is_file() else None)

    # ---- vocabulary ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):                       # AddedToken serialised as a dict
            token = token.get("content")
        return None if token is None else self.tok.token_to_id(token)

    def token_str(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.token_str("bos_token"))

    @property
    def prepended_bos_id(self) -> int | None:
        """The BOS id `encode` puts before a text (Gemma, Llama 2), None when it puts none."""
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        bos = self.bos_token_id
        return bos if bos is not None and with_special[:1] == [bos] else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config's list, then the tokenizer's EOS."""
        ids = self.generation_config.get("eos_token_id")
        ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
        eos = self.token_id(self.token_str("eos_token"))
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids

    # ---- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # tokenizers' error for text that is not valid Unicode ("TextEncodeInput must be
            # ..."); the usual cause is a lone UTF-16 surrogate, such as JSON's "\\ud800".
            if isinstance(text, str) and not _is_unicode(text):
                raise KvslimError("the text holds a lone UTF-16 surrogate (an unpaired "
                                  "\\ud800-\\udfff), which is not valid Unicode") from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise KvslimError("this model has no chat template (tokenizer_config.json has no "
                              "chat_template); use a plain prompt instead")
        validate_messages(messages)
        specials = {name: self.token_str(name) or "" for name in
                    ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return _compiled(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **specials, **kwargs)
        except jinja2.TemplateError as e:
            raise KvslimError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """`kwargs` reach the template as variables (`tools=[...]`, as transformers passes)."""
        # The template already writes BOS etc., so no special tokens are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template itself lays out `tools` (Qwen's, Llama 3.1's do)."""
        return bool(self.chat_template) and "tools" in self.chat_template


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise KvslimError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise KvslimError(f"messages[{i}] must be an object with 'role' and 'content'")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise(message: str):
    raise jinja2.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
