"""`fo-jax generate --model-dir` and `fo-jax plan --model-dir` on a tiny Hugging Face
checkpoint (conftest.py's `hf_dir`): its weights, tokenizer, chat template and EOS ids."""

import json
import re
import shutil

import numpy as np
import pytest

from fo_jax import generate as gen
from fo_jax import tokenizer as T
from fo_jax.checkpoints import load_checkpoint
from fo_jax.cli import main
from fo_jax.embedded import EMBEDDED_DIR
from fo_jax.model.dsa import param_bytes
from tests.checkpoints.hf_tiny import ASSISTANT, BOS, EOS, USER, tiny_hf_config, write_tokenizer

ARGS = ["--max-new-tokens", "6", "--no-progress"]
OFFLOAD = ["--offload", "--check", "--hot-slots", "64", "--page-size", "8"]


def _text(out: str) -> str:
    return out.split("--- request 0 ---\n")[1].split("\n--- summary ---")[0]


def _greedy(directory, prompt: str, n: int) -> np.ndarray:
    config, params = load_checkpoint(directory, progress=False)
    tok = T.load_tokenizer(directory)
    ids = tok.encode(prompt).tolist()
    engine = gen.ResidentEngine(params, config, batch=1, capacity=64)
    return gen.generate(engine, [ids], max_new_tokens=n).tokens[0]


def test_generate_runs_a_hf_checkpoint_resident_and_offloaded_checked(hf_dir, capsys):
    tok = T.load_tokenizer(hf_dir)
    assert main(["generate", "--model-dir", str(hf_dir), "--prompt", "hello world", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "model: tiny-hf   path: resident" in out
    greedy = _greedy(hf_dir, "hello world", 6)
    assert EOS not in tok.decode(greedy, skip_special_tokens=False)  # ran all 6 tokens
    assert _text(out) == "hello world" + tok.decode(greedy)
    assert "generated: 6 tokens" in out
    # The prompt starts with BOS (add_bos_token): 1 + the text's tokens + 5 fed back.
    n_prompt = 1 + len(tok.encode("hello world", add_special_tokens=False))
    assert f"context length: {n_prompt + 5} tokens" in out
    assert main(["generate", "--model-dir", str(hf_dir), "--prompt", "hello world", *ARGS,
                 *OFFLOAD]) == 0
    offloaded = capsys.readouterr().out
    assert _text(offloaded) == _text(out)
    assert "bitwise equal to the resident model's over 5 decode steps" in offloaded


def test_generation_stops_at_the_eos_ids(hf_dir, tmp_path, capsys):
    greedy = _greedy(hf_dir, "def f", 8)
    stop = int(greedy[3])
    first = int(np.argmax(greedy == stop))  # the first time it comes
    directory = tmp_path / "ckpt"
    shutil.copytree(hf_dir, directory)
    ids = write_tokenizer(directory, eos_token_id=[stop, 0])
    tok = T.load_tokenizer(directory)
    assert tok.eos_ids == (stop, 0) and ids[BOS] != stop
    want = "def f" + tok.decode(greedy[:first])
    for extra in ([], ["--decode-steps-per-call", "3"], OFFLOAD):
        code = main(["generate", "--model-dir", str(directory), "--prompt", "def f",
                     "--max-new-tokens", "8", "--no-progress", *extra])
        out = capsys.readouterr().out
        assert code == 0, out
        assert _text(out) == want, extra
        assert f"request 0 stopped at EOS id {stop} after {first + 1} tokens" in out, extra
    # generate(stop_tokens=...) ends once every request sampled one.
    config, params = load_checkpoint(directory, progress=False)
    engine = gen.ResidentEngine(params, config, batch=1, capacity=64)
    result = gen.generate(engine, [tok.encode("def f").tolist()], max_new_tokens=8,
                          stop_tokens=(stop,))
    np.testing.assert_array_equal(result.tokens[0], greedy[:first + 1])


def test_chat_wraps_the_prompt_in_the_template(hf_dir, capsys):
    assert main(["generate", "--model-dir", str(hf_dir), "--prompt", "hi there", "--chat",
                 *ARGS]) == 0
    out = capsys.readouterr().out
    tok = T.load_tokenizer(hf_dir)
    chat = f"{BOS}{USER}hi there{ASSISTANT}"
    assert _text(out).startswith(chat)
    assert _text(out) == chat + tok.decode(_greedy_ids(hf_dir, tok.encode(
        chat, add_special_tokens=False), 6))


def _greedy_ids(directory, ids, n):
    config, params = load_checkpoint(directory, progress=False)
    engine = gen.ResidentEngine(params, config, batch=1, capacity=64)
    return gen.generate(engine, [ids.tolist()], max_new_tokens=n).tokens[0]


def test_plan_reads_a_model_dir_weights_included(hf_dir, capsys):
    assert main(["plan", "--model-dir", str(hf_dir), "--context", "200", "--hot-slots",
                 "64"]) == 0
    out = capsys.readouterr().out
    config = tiny_hf_config()
    assert out.startswith("fo-jax plan: tiny-hf, context 200 tokens")
    total = json.loads((hf_dir / "model.safetensors.index.json").read_text())["metadata"][
        "total_size"]
    assert total == param_bytes(config)  # float32 written, float32 loaded
    kb = f"{param_bytes(config) / 1e3:.2f} kB"
    assert re.search(rf"weights:\s+{re.escape(kb)} float32 \(checkpoint files {re.escape(kb)}",
                     out), out
    assert re.search(r"hot-cache KV:\s+0.00 GB", out)
    # A fo_jax model directory (the embedded model's).
    assert main(["plan", "--model-dir", str(EMBEDDED_DIR), "--context", "1024",
                 "--hot-slots", "512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fo-jax plan: trained-small, context 1,024 tokens")
    assert re.search(r"weights:\s+17.\d\d MB float32 \(checkpoint files 8.\d\d MB", out), out


@pytest.fixture
def broken(hf_dir, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(hf_dir, directory)
    return directory


def test_errors_name_the_field_and_the_fix(broken, capsys):
    def error(*argv):
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    (broken / "tokenizer.json").unlink()
    assert "has no tokenizer.json: fo_jax reads a Hugging Face checkpoint's tokenizer" in error(
        "generate", "--model-dir", str(broken), *ARGS)
    write_tokenizer(broken, template=None)
    assert "has no chat template (tokenizer_config.json \"chat_template\" or " \
           "chat_template.jinja): give the prompt already formatted, without --chat" in error(
               "generate", "--model-dir", str(broken), "--chat", *ARGS)
    assert "--chat: the bytes tokenizer has no chat template" in error(
        "generate", "--model", "tiny", "--chat", *ARGS)
    hf = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(hf, architectures=["LlamaForCausalLM"])))
    unsupported = ("config.json architectures=['LlamaForCausalLM']: fo_jax loads exactly one of "
                   "['DeepseekV32ForCausalLM', 'GlmMoeDsaForCausalLM']")
    assert unsupported in error("generate", "--model-dir", str(broken), *ARGS)
    assert unsupported in error("plan", "--model-dir", str(broken), "--context", "64")
    (broken / "config.json").write_text(json.dumps({"vocab_size": 300}))
    assert ("config.json has neither a \"model\" section (a fo_jax model directory) nor "
            "\"architectures\" (a Hugging Face checkpoint)") in error(
                "plan", "--model-dir", str(broken), "--context", "64")
    assert "--model-dir brings its own config: drop --model" in error(
        "plan", "--model-dir", str(broken), "--model", "glm52", "--context", "64")
