"""Tokenizers: bytes, a byte-level BPE (`tokenizer.json`, the `tokenizers` library), or a Hugging
Face checkpoint's tokenizer with its chat template.

The kinds share one small interface, which is all the rest of fo_jax uses:

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
(every string encodes, nothing is unknown); `train_bpe` trains one from text.

`HFTokenizer`: the tokenizer of a Hugging Face checkpoint (DeepSeek-V3.2, GLM-5), read as
`transformers` reads it: `tokenizer.json` (the `tokenizers` library), `tokenizer_config.json`
(bos / eos / pad tokens, `add_bos_token`, `chat_template`), `chat_template.jinja` (a template in
its own file; it takes precedence), `generation_config.json` (`eos_token_id`, an id or a list).
It has no document separator (`sep` is None, no `token_bytes`): it runs models, it does not
train them. `encode` adds BOS where the config says so, `decode` skips special tokens (BOS,
EOS, the chat markers), `apply_chat_template` renders the checkpoint's Jinja template as
`transformers` does (`render_chat_template`), and `eos_ids` are the ids that end a generation.
A file that is not what it should be (not a JSON object, a tokenizer.json `tokenizers` cannot
read, a special token or eos_token_id of the wrong type, a template that is not text) is a
one-line ValueError naming the file and the field.

`load_tokenizer(dir)` opens what a model directory ships: a Hugging Face checkpoint's tokenizer
(config.json with "architectures"), else `tokenizer.json` (BPE) if present, else bytes.
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
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"


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


class HFTokenizer:
    """The tokenizer of a Hugging Face checkpoint (see the module docstring); `from_dir` reads it.

    Attributes:
      vocab_size: ids are 0 .. vocab_size - 1 (added tokens included).
      bos_token, eos_token, pad_token: the special tokens' text (None if the config has none).
      bos_id: the id of `bos_token`, or None.
      add_bos_token: `encode` puts `bos_id` first (None: the tokenizer.json post-processor
        decides, as in `transformers` when tokenizer_config.json does not say).
      eos_ids: the ids that end a generation (generation_config.json, else config.json, else
        `eos_token`).
      chat_template: the Jinja template (str), or None.
    """

    kind = "hf"
    sep = None

    def __init__(self, tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool = False, chat_template: str | None = None,
                 eos_ids: tuple[int, ...] = (), source: str = "tokenizer"):
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_id = self._special_id(bos_token, "bos_token")
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        if add_bos_token and self.bos_id is None:
            raise ValueError(f"{source}: add_bos_token is true but there is no bos_token")
        self.chat_template = chat_template
        self.eos_ids = tuple(int(t) for t in eos_ids)
        bad = [t for t in self.eos_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{source}: eos ids {bad} are outside the vocabulary of "
                             f"{self.vocab_size} ids")
        self.source = source

    def _special_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        found = self._tok.token_to_id(token)
        if found is None:
            raise ValueError(f"{what}={token!r} is not a token of tokenizer.json")
        return int(found)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "HFTokenizer":
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja,
        generation_config.json (and config.json's eos_token_id) of a checkpoint directory;
        only tokenizer.json is required."""
        from tokenizers import Tokenizer

        directory = pathlib.Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"{directory} has no {TOKENIZER_FILE}: fo_jax reads a Hugging Face "
                f"checkpoint's tokenizer from {TOKENIZER_FILE} (the `tokenizers` format; a "
                "sentencepiece tokenizer.model alone is not read): add the checkpoint's "
                f"{TOKENIZER_FILE}")
        config = directory / TOKENIZER_CONFIG
        meta = _read_json(config)
        tokens = {key: _token_text(meta.get(key), config, key) for key in (
            "bos_token", "eos_token", "pad_token")}
        template = meta.get("chat_template")
        if isinstance(template, list) and all(isinstance(t, dict) for t in template):
            named = {t.get("name"): t.get("template") for t in template}  # named templates
            template = named.get("default")
        if not (template is None or isinstance(template, str)):
            raise ValueError(f"{config} chat_template={_show(meta['chat_template'])} must be a "
                             'string or a list of {"name", "template"} objects')
        for key in ("add_bos_token", "add_eos_token"):
            if not (meta.get(key) is None or isinstance(meta[key], bool)):
                raise ValueError(f"{config} {key}={_show(meta[key])} must be true, false or "
                                 "null")
        if (directory / CHAT_TEMPLATE_FILE).exists():
            try:
                template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{directory / CHAT_TEMPLATE_FILE} is not UTF-8 text ({err})"
                                 ) from None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the `tokenizers` library raises plain Exception
            raise ValueError(f"{path} is not a tokenizer the `tokenizers` library reads "
                             f"({err})") from None
        for source in (directory / GENERATION_CONFIG, directory / "config.json"):
            eos = _read_json(source).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in ids):
                    raise ValueError(f"{source} eos_token_id={_show(eos)} must be a token id or "
                                     "a list of them (ints >= 0)")
                break
        if eos is None and tokens["eos_token"] is not None:
            eos = tok.token_to_id(tokens["eos_token"])
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(tok, **tokens, add_bos_token=meta.get("add_bos_token"),
                   add_eos_token=bool(meta.get("add_eos_token", False)),
                   chat_template=template, eos_ids=eos_ids, source=str(directory))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids int32 [n] of `text`; special tokens written in it (`<｜User｜>`) are single
        ids. `add_special_tokens`: BOS first where add_bos_token says so (EOS last where
        add_eos_token does), or, when tokenizer_config.json does not say, what tokenizer.json's
        post-processor adds; off for text a chat template rendered (it holds BOS already)."""
        if add_special_tokens and self.add_bos_token is None:
            return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, np.int32)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            eos = self._special_id(self.eos_token, "eos_token") if self.add_eos_token else None
            ids = ([self.bos_id] if self.add_bos_token else []) + ids + (
                [] if eos is None else [eos])
        return np.asarray(ids, np.int32)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (ids outside the vocabulary dropped); special tokens skipped unless
        `skip_special_tokens=False`."""
        ids = [int(t) for t in np.asarray(ids).reshape(-1).tolist() if 0 <= t < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *,
                            add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template rendered over `messages` ([{"role", "content"}]);
        encode the text with add_special_tokens=False."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.source} has no chat template (tokenizer_config.json \"chat_template\" "
                f"or {CHAT_TEMPLATE_FILE}): give the prompt already formatted, without --chat")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token,
            source=self.source)

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": TOKENIZER_FILE,
                "eos_ids": list(self.eos_ids), "chat_template": self.chat_template is not None}


def apply_chat_template(tokenizer, messages: list[dict], *,
                        add_generation_prompt: bool = True) -> str:
    """`tokenizer.apply_chat_template(...)`, or a ValueError naming a kind that has no
    template (bytes, fo_jax's BPE)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"the {tokenizer.kind} tokenizer has no chat template: chat formatting "
                         "needs a Hugging Face checkpoint's tokenizer with one")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def render_chat_template(template: str, messages: list[dict], *,
                         add_generation_prompt: bool = True, source: str = "tokenizer",
                         **special_tokens) -> str:
    """Render a Hugging Face chat template as `transformers` does: Jinja2's
    `ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loopcontrols
    extension, the `{% generation %}` tag (rendered as its body), `tojson` without ASCII
    escaping, the globals `raise_exception(message)` and `strftime_now(format)`, and the
    variables `messages`, `add_generation_prompt` and the special tokens (bos_token, ...).

    Raises:
      ValueError: the template does not parse, raised (`raise_exception`) or broke the
        sandbox's rules.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **special_tokens)
    except jinja2.TemplateError as err:
        raise ValueError(f"the chat template of {source} refused the messages: {err}") from err


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with
    it); rendered as its body."""
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


def _read_json(path: pathlib.Path) -> dict:
    """The JSON object in `path` ({} if there is no such file); ValueError naming the file if
    it is not one."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_bytes())
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def _show(value) -> str:
    """repr(value), cut to 80 characters (messages stay one short line)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _token_text(token, source: pathlib.Path, key: str) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict."""
    text = token.get("content") if isinstance(token, dict) else token
    if not (text is None or isinstance(text, str)):
        raise ValueError(f'{source} {key}={_show(token)} must be a string or an object whose '
                         '"content" is one')
    return text


def is_hf_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory`'s config.json is a Hugging Face one ("architectures"), not a fo_jax
    model directory's ("model")."""
    meta = _read_json(pathlib.Path(directory) / "config.json")
    return "architectures" in meta and "model" not in meta


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer a model directory ships: a Hugging Face checkpoint's (`HFTokenizer`),
    else `tokenizer.json` (BPE) if present, else the one its `config.json` names
    ("tokenizer": {"kind": "bytes"}), else bytes."""
    directory = pathlib.Path(directory)
    if is_hf_checkpoint(directory):
        return HFTokenizer.from_dir(directory)
    if (directory / TOKENIZER_FILE).exists():
        return BPETokenizer.from_file(directory / TOKENIZER_FILE)
    meta = directory / "config.json"
    if meta.exists():
        section = _read_json(meta).get("tokenizer") or {}
        kind = section.get("kind", "bytes") if isinstance(section, dict) else section
        if kind != "bytes":
            raise FileNotFoundError(f"{meta} names a {kind!r} tokenizer but {directory} has no "
                                    f"{TOKENIZER_FILE}")
    return ByteTokenizer()
