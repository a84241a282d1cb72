"""One small tokenizer interface for HF tokenizers and the byte tokenizer of the `tiny` target."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, user_message: str) -> list[int]: ...

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The UTF-8 bytes each id contributes to `decode(ids)` (b"" for skipped specials)."""
        ...


class ByteTokenizer:
    """Bytes 0..255 plus a few specials; enough to drive the random-init `tiny` target."""

    BOS, EOS, MASK = 256, 257, 258
    vocab_size = 320  # leaves room; ids above 258 are never produced by `encode`

    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, user_message: str) -> list[int]:
        return [self.BOS, *self.encode(f"user: {user_message}\nassistant: ")]

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        return [bytes((i,)) if 0 <= i < 256 else b"" for i in ids]


class HFTokenizer:
    """Wraps a `transformers` tokenizer; prompts go through its chat template when it has one."""

    def __init__(self, tok) -> None:
        self.tok = tok
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        # Chat models end turns with a marker that may differ from eos (SmolLM2: <|im_end|> = eos).
        for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_token_ids = tuple(sorted(eos))
        self._bytes: list[bytes] | None = None

    def _byte_table(self) -> list[bytes]:
        """id -> bytes, for byte-level BPE vocabularies (GPT-2 / Llama-3 / SmolLM2 / Qwen style)."""
        if self._bytes is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            decoder = getattr(getattr(self.tok, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ != "ByteLevel":
                raise NotImplementedError("token_bytes needs a byte-level BPE tokenizer")
            unbyte = {c: b for b, c in bytes_to_unicode().items()}
            special = set(self.tok.all_special_ids)
            table = []
            for i, piece in enumerate(self.tok.convert_ids_to_tokens(list(range(len(self.tok))))):
                if i in special or piece is None:
                    table.append(b"")
                elif all(c in unbyte for c in piece):
                    table.append(bytes(unbyte[c] for c in piece))
                else:  # an added (non byte-level) token: decodes to its own text
                    table.append(piece.encode())
            self._bytes = table
        return self._bytes

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        table = self._byte_table()
        return [table[i] if 0 <= i < len(table) else b"" for i in ids]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user_message: str) -> list[int]:
        if self.tok.chat_template:
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": user_message}],
                tokenize=False,
                add_generation_prompt=True,
            )
            return self.encode(text)
        return self.encode(user_message)
