"""Tokenizers: bytes for presets (ids 0..255 + bos/eos), the checkpoint's own via transformers otherwise."""
from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids >= 256 are specials (bos 256, eos 257, pad 258 in the tiny presets)."""

    def __init__(self, bos_token_id: int | None = 256, eos_token_id: int | None = 257):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (for logprobs); specials render as their name."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        names = {self.bos_token_id: "<s>", self.eos_token_id: "</s>"}
        return names.get(token_id, f"<|special_{token_id}|>").encode()


class HFTokenizer:
    def __init__(self, path: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's Jinja chat template (tokenizer_config.json / chat_template.jinja), if any."""
        return getattr(self.tok, "chat_template", None)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def load_tokenizer(name_or_path: str, config, trust_remote_code: bool = False):
    if os.path.isdir(name_or_path) and any(os.path.exists(os.path.join(name_or_path, f)) for f in _TOKENIZER_FILES):
        return HFTokenizer(name_or_path, trust_remote_code)
    if config.vocab_size < 258:
        raise ValueError(f"model '{config.name}' has no tokenizer files and a vocabulary of {config.vocab_size} "
                         f"(< 258) too small for the byte-level tokenizer")
    return ByteTokenizer(config.bos_token_id if config.bos_token_id is not None and config.bos_token_id >= 256 else None,
                         config.eos_token_id if config.eos_token_id is not None and config.eos_token_id >= 256 else None)
