"""The parts of a tiny Hugging Face checkpoint directory (conftest.py's `hf_dir` puts them
together with random weights saved by fo_jax's own Hugging Face writer): a byte-level BPE
`tokenizer.json` trained with `tokenizers`, DeepSeek-style special tokens and chat template in
`tokenizer_config.json`, EOS ids in `generation_config.json`."""

import json
import pathlib

from fo_jax.config import get_config

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIALS = [BOS, EOS, USER, ASSISTANT]
TEXTS = ["def f(x):\n    return x + 1\n", "hello world, hello chat\n",
         "class A:\n    pass  # é ü 中\n", "the user asks and the assistant answers\n"] * 20
VOCAB = 300

# DeepSeek-V3's chat template, shortened (no tools): system prompt first, then user and
# assistant turns; written over several lines, with block tags on lines of their own that only
# trim_blocks and lstrip_blocks (as Hugging Face sets them) keep out of the text.
DEEPSEEK_TEMPLATE = """\
{% if not add_generation_prompt is defined %}
    {% set add_generation_prompt = false %}
{% endif %}
{% set ns = namespace(system_prompt='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system_prompt = message['content'] %}
    {% endif %}
{% endfor %}
{{ bos_token }}{{ ns.system_prompt -}}
{% for message in messages %}
    {% if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] -}}
    {% elif message['role'] == 'assistant' %}
        {{- '<｜Assistant｜>' + message['content'] + eos_token -}}
    {% elif message['role'] != 'system' %}
        {{- raise_exception('Only system, user and assistant roles are supported, got '
                            + message['role']) -}}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<｜Assistant｜>' -}}
{% endif %}
"""


def tiny_hf_config():
    return get_config("tiny").replace(name="tiny-hf", vocab_size=VOCAB, max_seq_len=256)


def write_tokenizer(directory, *, template=DEEPSEEK_TEMPLATE, add_bos_token=True,
                    eos_token_id=None) -> dict:
    """tokenizer.json, tokenizer_config.json and (with `eos_token_id`) generation_config.json;
    returns {special token: id}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": add_bos_token, "add_eos_token": False,
              "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False,
                            "normalized": True, "rstrip": False, "single_word": False},
              "eos_token": EOS, "pad_token": EOS, "model_max_length": 256,
              "tokenizer_class": "LlamaTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    if eos_token_id is not None:
        (directory / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids[BOS], "eos_token_id": eos_token_id, "do_sample": False}))
    return ids




FP8_SKIP = ("embed_tokens", "lm_head", "norm", "layernorm", "gate.weight", "weights_proj",
            "e_score_correction_bias")


def quantize_checkpoint(directory, block=(128, 128), scale_fmt=None) -> dict:
    """Store a saved checkpoint's 2-D projections (all but the routers, the head, norms and
    the indexer's weights_proj) as float8 e4m3 with `weight_scale_inv` blocks of `block`
    (amax / 448 scales), as DeepSeek's FP8 checkpoints; config.json gets the
    quantization_config. Returns {name: the stored float32 weight's dequantised values}."""
    import numpy as np

    from fo_jax.checkpoints import dequantize_fp8
    from fo_jax.checkpoints.hf import INDEX
    from fo_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
    from fo_jax.model.linear import Fp8Weight

    directory = pathlib.Path(directory)
    index = json.loads((directory / INDEX).read_text())
    dequantized = {}
    for shard in sorted(set(index["weight_map"].values())):
        file = SafetensorsFile(directory / shard)
        tensors = {n: file.get(n) for n in file.keys()}
        for name in [n for n, t in tensors.items() if t.ndim == 2
                     and not any(s in n for s in FP8_SKIP)]:
            w = Fp8Weight.quantize(np.asarray(tensors[name], np.float32), block, scale_fmt)
            q, scale = np.asarray(w.q), np.asarray(w.scale_inv)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            index["weight_map"][name + "_scale_inv"] = shard
            dequantized[name] = dequantize_fp8(q, scale, block)
        write_safetensors(directory / shard, tensors)
    (directory / INDEX).write_text(json.dumps(index))
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)}
    if scale_fmt is not None:
        hf["quantization_config"]["scale_fmt"] = scale_fmt
    (directory / "config.json").write_text(json.dumps(hf))
    return dequantized
