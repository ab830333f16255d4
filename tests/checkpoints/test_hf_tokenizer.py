"""The tokenizer of a Hugging Face checkpoint: tokenizer.json, tokenizer_config.json (special
tokens, BOS, chat template), chat_template.jinja, generation_config.json (EOS ids)."""

import json
import shutil

import numpy as np
import pytest

from fo_jax import tokenizer as T
from tests.checkpoints.hf_tiny import ASSISTANT, BOS, EOS, USER, write_tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer(directory, eos_token_id=[7, 5])
    (directory / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV32ForCausalLM"], "eos_token_id": 1}))
    return directory, ids


def test_encode_adds_bos_and_decode_skips_special_tokens(tok_dir):
    directory, ids = tok_dir
    tok = T.load_tokenizer(directory)
    assert isinstance(tok, T.HFTokenizer) and tok.kind == "hf"
    assert tok.vocab_size == 300 and tok.bos_id == ids[BOS]
    text = "def g(y):\n\treturn y  # naïve 中文 \U0001F600\n"
    body = tok.encode(text, add_special_tokens=False)
    full = tok.encode(text)
    assert full.dtype == np.int32 and full[0] == ids[BOS]
    np.testing.assert_array_equal(full[1:], body)
    assert ids[BOS] not in body.tolist()
    assert tok.decode(full) == text  # BOS skipped
    assert tok.decode(full, skip_special_tokens=False) == BOS + text
    # Special tokens written in the text are single ids, never split into bytes.
    chat = tok.encode(f"{USER}hi{ASSISTANT}", add_special_tokens=False).tolist()
    assert chat[0] == ids[USER] and chat[-1] == ids[ASSISTANT] and len(chat) <= 4
    # Without add_bos_token nothing is added.
    write_tokenizer(directory / "nobos", add_bos_token=False)
    np.testing.assert_array_equal(T.HFTokenizer.from_dir(directory / "nobos").encode(text), body)


def test_eos_ids_come_from_generation_config_then_config_then_tokenizer_config(tok_dir):
    directory, ids = tok_dir
    assert T.load_tokenizer(directory).eos_ids == (7, 5)
    other = directory / "int"
    write_tokenizer(other, eos_token_id=9)
    assert T.HFTokenizer.from_dir(other).eos_ids == (9,)
    plain = directory / "plain"
    write_tokenizer(plain)
    assert T.HFTokenizer.from_dir(plain).eos_ids == (ids[EOS],)
    (plain / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert T.HFTokenizer.from_dir(plain).eos_ids == (3, 4)


def test_chat_template_renders_as_hugging_face_does(tok_dir):
    directory, ids = tok_dir
    tok = T.load_tokenizer(directory)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == (f"{BOS}You are terse.{USER}hi{ASSISTANT}hello{EOS}{USER}bye{ASSISTANT}")
    assert tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=False) == (
        f"{BOS}You are terse.{USER}hi")
    # The template writes BOS itself: encoding its text adds none.
    encoded = tok.encode(text, add_special_tokens=False).tolist()
    assert encoded[0] == ids[BOS] and encoded.count(ids[BOS]) == 1
    assert encoded[-1] == ids[ASSISTANT]
    # raise_exception(...) in the template becomes a ValueError with its message.
    with pytest.raises(ValueError, match="the chat template of .* refused the messages: Only "
                                         "system, user and assistant roles are supported, got "
                                         "tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    # The sandbox refuses unsafe attribute access.
    evil = T.HFTokenizer.from_dir(directory)
    evil.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="refused the messages"):
        evil.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_and_hugging_face_extras(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}[{{ m.role }}]{{ m.content | tojson }}"
        "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}<{{ pad_token }}>"
        "{% endif %}")
    tok = T.HFTokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "中 \"q\""}]) == (
        f"[user]\"中 \\\"q\\\"\"<{EOS}>")


def test_errors_name_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json: fo_jax reads a Hugging "
                                                r"Face checkpoint's tokenizer from tokenizer.json"):
        T.HFTokenizer.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV32ForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        T.load_tokenizer(tmp_path)
    write_tokenizer(tmp_path, template=None)
    tok = T.load_tokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"has no chat template \(tokenizer_config.json "
                                         r"\"chat_template\" or chat_template.jinja\): give the "
                                         r"prompt already formatted"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="the bytes tokenizer has no chat template"):
        T.apply_chat_template(T.ByteTokenizer(), MESSAGES)


# A bad tokenizer file is a one-line ValueError naming the file and the field.
BAD_FILES = {
    "tokenizer_config.json a list": ("tokenizer_config.json", "[]",
                                     "tokenizer_config.json: expected a JSON object, got a list"),
    "generation_config.json not JSON": ("generation_config.json", "{",
                                        "generation_config.json is not valid JSON (Expecting"),
    "tokenizer.json not a tokenizer": ("tokenizer.json", "{}",
                                       "tokenizer.json is not a tokenizer the `tokenizers` "
                                       "library reads ("),
    "eos_token_id a string": ("generation_config.json", '{"eos_token_id": "7"}',
                              "generation_config.json eos_token_id='7' must be a token id or "
                              "a list of them (ints >= 0)"),
    "eos_token_id true": ("generation_config.json", '{"eos_token_id": [true]}',
                          "generation_config.json eos_token_id=[True] must be a token id"),
    "bos_token an int": ("tokenizer_config.json", '{"bos_token": 5}',
                         "tokenizer_config.json bos_token=5 must be a string or an object "
                         "whose \"content\" is one"),
    "chat_template an int": ("tokenizer_config.json", '{"chat_template": 5}',
                             "tokenizer_config.json chat_template=5 must be a string or a list "
                             "of {\"name\", \"template\"} objects"),
    "chat_template a list of strings": ("tokenizer_config.json", '{"chat_template": ["a"]}',
                                        "tokenizer_config.json chat_template=['a'] must be"),
    "add_bos_token a string": ("tokenizer_config.json", '{"add_bos_token": "yes"}',
                               "tokenizer_config.json add_bos_token='yes' must be true, false "
                               "or null"),
    "chat_template.jinja not UTF-8": ("chat_template.jinja", b"\xff\xfe{{ x }}",
                                      "chat_template.jinja is not UTF-8 text ("),
    "config.json a list": ("config.json", "[1]", "config.json: expected a JSON object, got a "
                                                 "list"),
}


@pytest.mark.parametrize("file, text, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_tokenizer_files_are_refused_naming_the_file_and_field(tok_dir, tmp_path, file, text,
                                                                   message):
    shutil.copytree(tok_dir[0], tmp_path / "tok")
    path = tmp_path / "tok" / file
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as err:
        T.load_tokenizer(tmp_path / "tok")
    assert str(err.value).startswith(f"{tmp_path / 'tok'}/") and message in str(err.value)
    assert "\n" not in str(err.value)
