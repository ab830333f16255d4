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
from fo_jax.checkpoints.safetensors_io import SafetensorsFile
from fo_jax.cli import main, printable
from fo_jax.embedded import EMBEDDED_DIR
from fo_jax.model.dsa import param_bytes
from tests.checkpoints.hf_tiny import ASSISTANT, BOS, EOS, USER, tiny_hf_config, write_tokenizer

ARGS = ["--max-new-tokens", "6", "--no-progress"]
OFFLOAD = ["--offload", "--check", "--hot-slots", "64", "--page-size", "8"]


def _text(out: str) -> str:
    return out.split("--- request 0 ---\n")[1].split("\n--- summary ---")[0]


def _generate(directory, prompt_ids, n: int, **kwargs) -> np.ndarray:
    """Tokens [n'] of request 0, greedy (capacity 16: the CLI's for these prompts, so the
    compiled programs are shared)."""
    config, params = load_checkpoint(directory, progress=False)
    engine = gen.ResidentEngine(params, config, batch=1, capacity=16)
    return gen.generate(engine, [list(prompt_ids)], max_new_tokens=n, **kwargs).tokens[0]


def test_generate_runs_resident_and_offloaded_and_stops_at_the_eos_ids(hf_dir, tmp_path,
                                                                       capsys):
    tok = T.load_tokenizer(hf_dir)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_id  # add_bos_token
    greedy = _generate(hf_dir, ids, 8)
    assert not np.isin(greedy, tok.eos_ids).any()  # the EOS of hf_dir never comes
    assert main(["generate", "--model-dir", str(hf_dir), "--prompt", "hello world", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "model: tiny-hf   path: resident" in out
    assert _text(out) == printable("hello world" + tok.decode(greedy[:6]))
    assert "generated: 6 tokens" in out and "stopped" not in out
    assert f"context length: {len(ids) + 5} tokens" in out
    # The same checkpoint with generation_config.json's eos_token_id = [the 4th token, 0].
    stop = int(greedy[3])
    first = int(np.argmax(greedy == stop))  # the first time it comes
    directory = tmp_path / "ckpt"
    shutil.copytree(hf_dir, directory)
    write_tokenizer(directory, eos_token_id=[stop, 0])
    assert T.load_tokenizer(directory).eos_ids == (stop, 0)
    code = main(["generate", "--model-dir", str(directory), "--prompt", "hello world",
                 "--max-new-tokens", "8", "--no-progress", *OFFLOAD])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _text(out) == printable("hello world" + tok.decode(greedy[:first]))
    assert f"request 0 stopped at EOS id {stop} after {first + 1} tokens" in out
    assert f"bitwise equal to the resident model's over {first} decode steps" in out
    assert f"context length: {len(ids) + first} tokens" in out
    # generate(stop_tokens=...) ends once every request sampled one: step by step, in decode
    # loops of 3 steps (whose steps after the stop sample nothing: -1), or with drafts.
    np.testing.assert_array_equal(_generate(directory, ids, 8, stop_tokens=(stop,)),
                                  greedy[:first + 1])
    looped = _generate(directory, ids, 8, stop_tokens=(stop,), decode_steps_per_call=3)
    np.testing.assert_array_equal(looped[:first + 1], greedy[:first + 1])
    assert (looped[first + 1:] == -1).all()
    drafted = _generate(directory, ids, 8, stop_tokens=(stop,), drafter="ngram")
    np.testing.assert_array_equal(drafted, greedy[:first + 1])


def test_chat_wraps_the_prompt_in_the_template(hf_dir, capsys):
    assert main(["generate", "--model-dir", str(hf_dir), "--prompt", "hi there", "--chat",
                 *ARGS]) == 0
    out = capsys.readouterr().out
    tok = T.load_tokenizer(hf_dir)
    chat = f"{BOS}{USER}hi there{ASSISTANT}"
    assert _text(out).startswith(chat)
    # The template writes BOS: the prompt is the chat text's tokens, no second BOS.
    n_prompt = len(tok.encode(chat, add_special_tokens=False))
    assert f"context length: {n_prompt + 5} tokens" in out


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


def test_checkpoint_errors_reach_the_command_line_as_one_line(broken, capsys):
    def error(*argv):
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith("fo-jax: error: ") and err.count("\n") == 1, err
        return err

    plan = ("plan", "--model-dir", str(broken), "--context", "64")
    config = broken / "config.json"
    good = config.read_text()
    hf = json.loads(good)
    del hf["num_hidden_layers"]
    config.write_text(json.dumps(hf))
    assert f"{config} lacks ['num_hidden_layers']: fo_jax builds the model from" in error(*plan)
    config.write_text('["architectures", 1]')
    assert f"{config}: expected a JSON object of config fields" in error(*plan)
    config.write_text("{")
    assert f"{config} is not valid JSON" in error(*plan)
    config.write_text(good)
    index = broken / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    index.write_text(json.dumps(dict(meta, metadata={"total_size": "1 GB"})))
    assert f"{index}: metadata.total_size='1 GB' must be an int >= 0 (bytes)" in error(*plan)
    index.write_text("[]")
    assert f"{index}: expected a JSON object of {{\"weight_map\"" in error(*plan)
    index.write_text(json.dumps(meta))
    # The reviewer's corrupt shard: lm_head.weight's bytes overwritten with 0xff (NaN).
    shard = broken / meta["weight_map"]["lm_head.weight"]
    _, _, begin, end = SafetensorsFile(shard).entries["lm_head.weight"]
    data = bytearray(shard.read_bytes())
    data[begin:end] = b"\xff" * (end - begin)
    shard.write_bytes(bytes(data))
    assert (f"{shard}: tensor 'lm_head.weight' holds {(end - begin) // 4} non-finite values "
            "(the first, nan, at [0, 0])") in error("generate", "--model-dir", str(broken),
                                                    "--prompt", "hi", *ARGS)
