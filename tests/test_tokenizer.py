"""fo_jax.tokenizer: bytes and byte-level BPE share one interface; round trips; bits per byte."""

import json

import numpy as np
import pytest

from fo_jax import tokenizer as T

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass  # é ü 中\n",
         "import os\nprint(os.path.join('a', 'b'))\n"] * 20


@pytest.fixture(scope="module")
def bpe():
    return T.train_bpe(TEXTS, 300)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_round_trip_and_token_bytes(kind, bpe):
    tok = T.ByteTokenizer() if kind == "bytes" else bpe
    text = "def g(y):\n\treturn y  # naïve 中文 \U0001F600\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    # token_bytes adds up to the UTF-8 length of what the ids stand for.
    assert int(tok.token_bytes[ids].sum()) == len(text.encode("utf-8"))
    # The separator decodes as a blank line between documents.
    joined = np.concatenate([tok.encode("a = 1"), [tok.sep], tok.encode("b = 2")])
    assert tok.decode(joined) == "a = 1\n\nb = 2"


def test_bpe_compresses_and_saves(tmp_path, bpe):
    text = "".join(TEXTS)
    assert len(bpe.encode(text)) < 0.5 * len(text.encode("utf-8"))
    bpe.save(tmp_path / T.TOKENIZER_FILE)
    loaded = T.load_tokenizer(tmp_path)
    assert loaded.kind == "bpe" and loaded.vocab_size == bpe.vocab_size
    np.testing.assert_array_equal(loaded.encode(text), bpe.encode(text))


def test_load_tokenizer_defaults_and_errors(tmp_path):
    assert T.load_tokenizer(tmp_path).kind == "bytes"
    (tmp_path / "config.json").write_text(json.dumps({"tokenizer": {"kind": "bpe"}}))
    with pytest.raises(FileNotFoundError, match="names a 'bpe' tokenizer but .* has no "
                                                "tokenizer.json"):
        T.load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="at least 258 ids"):
        T.train_bpe(TEXTS, 100)
