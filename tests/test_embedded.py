"""Model directories (fo_jax.embedded) and the trained model shipped with the package."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fo_jax import embedded
from fo_jax.cli import main
from fo_jax.config import get_config
from fo_jax.model import dsa
from fo_jax.tokenizer import ByteTokenizer


def test_model_dir_round_trip_rounds_to_bfloat16(tmp_path):
    config = get_config("tiny")
    params = dsa.init_params(config, jax.random.key(3))
    embedded.save_model_dir(tmp_path, config, params, ByteTokenizer(), extra={"note": "x"})
    got_config, got, tok = embedded.load_model_dir(tmp_path)
    assert got_config == config and tok.kind == "bytes"
    assert json.loads((tmp_path / "config.json").read_text())["note"] == "x"
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(got)):
        assert b.dtype == a.dtype  # widened back to the config's dtype, exactly
        np.testing.assert_array_equal(np.asarray(b),
                                      np.asarray(a.astype(jnp.bfloat16).astype(a.dtype)))


def test_model_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        embedded.load_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ValueError, match="is this a Hugging Face checkpoint directory"):
        embedded.load_model_dir(tmp_path)


def test_embedded_model_loads_with_its_tokenizer():
    config, params, tok = embedded.load_embedded()
    assert config.name == embedded.EMBEDDED_NAME and tok.kind == "bpe"
    assert tok.vocab_size <= config.vocab_size
    dsa.check_params(params, config)
    meta = json.loads((embedded.EMBEDDED_DIR / "config.json").read_text())
    assert 0 < meta["trained"]["held_out_bits_per_byte"]["sparse"] < 3


def test_generate_default_is_the_trained_model_offloaded_bitwise(capsys):
    # The default command on a fresh clone: the trained model, its tokenizer, offloaded decode
    # checked bit for bit against the resident model after every step, on a context of ~3,000
    # tokens (a source file of the package) that the hot cache holds a fraction of: the
    # summary shows less device KV than the resident model's, and misses served from host.
    code = main(["generate", "--offload", "--check", "--max-new-tokens", "8", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model: trained-small" in out
    assert "[the prompt: the first 3072 tokens of fo_jax/offload/manage.py, ending with]" in out
    assert "bitwise equal to the resident model's over 7 decode steps" in out
    ratio = re.search(r"KV bytes on device: .* \(resident model: .*, ([0-9.]+)x\)", out)
    assert ratio and float(ratio.group(1)) < 0.5, out
    misses = re.search(r"hot cache: 512 slots/layer, policy ring; hit rate [0-9.]+, misses (\d+)",
                       out)
    assert misses and int(misses.group(1)) > 0, out
    assert "holds the whole context" not in out


def test_a_short_context_says_the_hot_cache_holds_it_all(capsys):
    code = main(["generate", "--model", "tiny", "--offload", "--prompt", "short",
                 "--max-new-tokens", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("(the hot cache holds the whole context of 16 positions: offload saves device "
            "memory only for contexts longer than the hot cache)") in out


def test_generate_checks_flags_and_memory_before_reading_the_weights(capsys, monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("the weights were read before the input was checked")

    monkeypatch.setattr(embedded, "load_model_dir", refuse)
    monkeypatch.setattr("fo_jax.resolve.available_bytes", lambda: 64e9)
    assert main(["generate", "--no-progress", "--max-param-gb", "0.0001"]) == 2
    assert "above --max-param-gb=0.0001" in capsys.readouterr().err
    assert main(["generate", "--no-progress", "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err
