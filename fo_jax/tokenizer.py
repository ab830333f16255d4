"""Tokenizers: bytes, or a byte-level BPE (`tokenizer.json`, the `tokenizers` library).

Both kinds share one small interface, which is all the rest of fo_jax uses:

    tok.encode(text) -> int32 [n]        token ids (no special tokens added)
    tok.decode(ids) -> str               text (invalid UTF-8 replaced; special tokens dropped,
                                         the document separator as a blank line)
    tok.vocab_size                       ids are 0 .. vocab_size - 1
    tok.sep                              the document separator id
    tok.token_bytes                      int64 [vocab_size]: UTF-8 bytes each id stands for (the
                                         separator counts 1): bits per byte of a held-out text are
                                         its nats / ln 2 / token_bytes[targets].sum()

`ByteTokenizer`: ids 0-255 are bytes, 256 the separator, 257-259 reserved (vocab 260); needs
nothing. `BPETokenizer`: a `tokenizers.Tokenizer` with the byte-level pre-tokenizer and decoder
(every string encodes, nothing is unknown); `train_bpe` trains one from text. `load_tokenizer(dir)`
opens what a model directory ships: `tokenizer.json` if present, else bytes.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable

import numpy as np

BYTE_SEP = 256
BYTE_VOCAB = 260
SEP_TOKEN = "<|sep|>"
TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; `sep` (256) between documents; vocab 260 (3 ids reserved)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    sep = BYTE_SEP

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        out = bytearray()
        for t in np.asarray(ids).reshape(-1).tolist():
            if 0 <= t < 256:
                out.append(t)
            elif t == self.sep:
                out += b"\n\n"
        return out.decode("utf-8", errors="replace")

    @property
    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.int64)
        out[:256] = 1
        out[self.sep] = 1
        return out

    def describe(self) -> dict:
        return {"kind": self.kind, "sep": self.sep, "vocab_size": self.vocab_size}


class BPETokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` (see `train_bpe`), with the document separator
    `SEP_TOKEN` as a special token."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        sep = tokenizer.token_to_id(SEP_TOKEN)
        if sep is None:
            raise ValueError(f"tokenizer has no {SEP_TOKEN!r} special token (the document "
                             "separator fo_jax's byte-level BPE models are trained with); "
                             "train one with fo_jax.tokenizer.train_bpe")
        self.sep = int(sep)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._token_bytes = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(str(path))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text, in parallel threads (the library's)."""
        return [np.asarray(e.ids, np.int32)
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = [int(t) for t in np.asarray(ids).reshape(-1).tolist()]
        parts, run = [], []
        for t in ids:  # the separator is a special token: decode() would drop it
            if t == self.sep:
                parts.append(self._tok.decode(run))
                parts.append("\n\n")
                run = []
            elif 0 <= t < self.vocab_size:
                run.append(t)
        parts.append(self._tok.decode(run))
        return "".join(parts)

    @property
    def token_bytes(self) -> np.ndarray:
        if self._token_bytes is None:
            # A byte-level vocabulary spells each byte as one character (GPT-2's byte-to-
            # unicode map), so a token's length in characters is its length in bytes, also for
            # tokens holding part of a multi-byte character.
            out = np.ones(self.vocab_size, np.int64)
            for t in range(self.vocab_size):
                piece = self._tok.id_to_token(t)
                if t != self.sep and piece is not None:
                    out[t] = len(piece)
            self._token_bytes = out
        return self._token_bytes

    def describe(self) -> dict:
        return {"kind": self.kind, "sep": self.sep, "vocab_size": self.vocab_size,
                "file": TOKENIZER_FILE}


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` ids (the 256 byte symbols, `SEP_TOKEN`, merges) trained
    on `texts` with the `tokenizers` library (its threads; a 30 MB corpus takes seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 258 ids "
                         "(256 bytes, the separator, one merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEP_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer a model directory ships: `tokenizer.json` (BPE) if present, else the one
    its `config.json` names ("tokenizer": {"kind": "bytes"}), else bytes."""
    directory = pathlib.Path(directory)
    if (directory / TOKENIZER_FILE).exists():
        return BPETokenizer.from_file(directory / TOKENIZER_FILE)
    meta = directory / "config.json"
    if meta.exists():
        kind = json.loads(meta.read_text()).get("tokenizer", {}).get("kind", "bytes")
        if kind != "bytes":
            raise FileNotFoundError(f"{meta} names a {kind!r} tokenizer but {directory} has no "
                                    f"{TOKENIZER_FILE}")
    return ByteTokenizer()
