"""Fixtures of the checkpoint tests: `hf_dir`, a tiny Hugging Face checkpoint (the parts in
tests/checkpoints/hf_tiny.py)."""

import json

import jax
import pytest

from fo_jax.checkpoints import save_checkpoint
from fo_jax.model.dsa import init_params
from tests.checkpoints.hf_tiny import BOS, EOS, tiny_hf_config, write_tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF checkpoint (DeepseekV32ForCausalLM, float32, two shards) with its tokenizer
    files; generation_config.json ends generation at the EOS token."""
    directory = tmp_path_factory.mktemp("hf")
    config = tiny_hf_config()
    save_checkpoint(directory, init_params(config, jax.random.key(0)), config,
                    max_shard_bytes=200_000, progress=False)
    ids = write_tokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS]]}))
    return directory
