"""The fo-jax command: the planner's figures, generation, errors."""

import re

import pytest

from fo_jax.cli import main


@pytest.mark.parametrize("context,gb,batch", [
    (64_000, "6.09", 4), (128_000, "12.19", 2), (256_000, "24.38", 1),
    (512_000, "48.76", 0), (1_024_000, "97.52", 0),
])
def test_plan_reproduces_the_glm52_figures(capsys, context, gb, batch):
    assert main(["plan", "--model", "glm52", "--context", str(context)]) == 0
    out = capsys.readouterr().out
    assert "95.23 kB" in out and "89.86 kB" in out and "5.38 kB" in out
    assert re.search(rf"one request:\s+{gb} GB", out)
    no_offload = out.split("Decode without offload")[1].split("Decode with offload")[0]
    assert re.search(rf"max batch:\s+{batch}\b", no_offload)


def test_plan_hot_cache_figures(capsys):
    assert main(["plan", "--model", "glm52", "--context", "128000", "--hot-slots", "16384"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hot-cache KV:\s+1.47 GB", out)
    assert re.search(r"indexer keys \+ slot maps:\s+0.70 GB", out)
    assert "4 buffers" in out


def test_plan_with_the_fp8_kv_format(capsys):
    # GLM-5.2 with 656-byte rows: 78 * 656 = 51,168 B of KV per token + 21 * 128 * 2 = 5,376 B
    # of indexer keys = 56,544 B (against 95,232 in bf16).
    assert main(["plan", "--model", "glm52", "--context", "128000",
                 "--kv-format", "fp8_ds_mla"]) == 0
    out = capsys.readouterr().out
    assert "fp8_ds_mla (indexer keys bfloat16) KV" in out
    assert "56.54 kB" in out and "51.17 kB" in out and "5.38 kB" in out


def test_generate_offload_check_passes(capsys):
    code = main(["generate", "--model", "tiny",
                 "--offload", "--check", "--max-new-tokens", "6", "--prompt",
                 "hello offload world, " * 4, "--hot-slots", "64", "--page-size", "8",
                 "--no-progress", "--batch", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hello offload world" in out
    assert "tokens/s" in out and "context length: 89 tokens" in out
    assert "hit rate" in out and "bytes moved per token" in out
    assert re.search(r"KV bytes on device: .*resident model: ", out)
    assert "bitwise equal to the resident model's over 5 decode steps" in out


def test_generate_offload_check_with_the_fp8_kv_format(capsys):
    # --kv-format fp8_ds_mla: both paths store the 656-byte-layout rows (here D = 32, R = 8:
    # 32 + 4 + 16 = 52 bytes), the offloaded logits still the resident model's bit for bit.
    code = main(["generate", "--model", "tiny", "--kv-format", "fp8_ds_mla",
                 "--offload", "--check", "--max-new-tokens", "6", "--prompt",
                 "hello offload world, " * 4, "--hot-slots", "64", "--page-size", "8",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "path: offload   batch: 1   KV rows: fp8_ds_mla" in out
    assert "bitwise equal to the resident model's over 5 decode steps" in out


def test_kv_format_flag_names_itself_when_the_model_cannot_take_it():
    from fo_jax.config import get_config
    from fo_jax.resolve import with_kv_format

    tiny = get_config("tiny")
    assert with_kv_format(tiny, None) is tiny and with_kv_format(tiny, "bf16") is tiny
    assert with_kv_format(tiny, "fp8_ds_mla").kv_format == "fp8_ds_mla"
    with pytest.raises(ValueError, match=r"--kv-format fp8_ds_mla: kv_format='fp8_ds_mla' "
                                         r"needs kv_lora_rank % 128 == 0"):
        with_kv_format(tiny.replace(kv_lora_rank=192), "fp8_ds_mla")


def test_generate_offload_with_the_clock_policy(capsys):
    code = main(["generate", "--model", "tiny", "--offload", "--policy", "clock", "--check",
                 "--max-new-tokens", "3", "--prompt", "clock " * 12, "--hot-slots", "64",
                 "--page-size", "8", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "policy clock" in out
    assert "bitwise equal to the resident model's over 2 decode steps" in out


def test_generate_slices_and_small_prefill_chunks_stay_bitwise(capsys):
    # The other host-access setting and a prompt prefilled 16 tokens at a time (both the
    # offloaded engine and the resident reference): still bit for bit the resident model.
    code = main(["generate", "--model", "tiny",
                 "--offload", "--check", "--max-new-tokens", "4", "--prompt",
                 "chunked prompt " * 3, "--hot-slots", "64", "--page-size", "8",
                 "--host-access", "slices", "--prefill-chunk", "16", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bitwise equal to the resident model's over 3 decode steps" in out


def test_generate_resident_with_sampling(capsys):
    code = main(["generate", "--model", "tiny",
                 "--max-new-tokens", "4", "--temperature", "0.8", "--top-p", "0.9",
                 "--prompt", "abc", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "path: resident" in out
    # Three decode steps per compiled call, sampling on the device: the same text.
    code = main(["generate", "--model", "tiny", "--max-new-tokens", "4", "--temperature", "0.8",
                 "--top-p", "0.9", "--prompt", "abc", "--no-progress",
                 "--decode-steps-per-call", "3"])
    assert code == 0
    looped = capsys.readouterr().out
    text = lambda s: s.split("--- summary ---")[0]
    assert text(looped) == text(out)
    assert "generated: 4 tokens" in looped


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model-dir", "/nonexistent"], "no config.json in /nonexistent"),
    (["generate", "--model-dir", ".", "--model", "tiny"], "--model-dir brings its own"),
    (["generate", "--model", "tiny", "--prompt", ""], "--prompt is empty"),
    (["generate", "--check"], "--check compares the offloaded path with the resident one"),
    (["generate", "--model", "nope"], "unknown model preset 'nope'"),
    (["generate", "--host-access", "slices"], "--host-access applies to the offloaded path"),
    (["generate", "--prefill-chunk", "0"], "prefill_chunk=0 must be an int >= 1"),
    (["generate", "--offload", "--hot-slots", "20"], "hot_slots=20 < index_topk"),
    (["generate", "--offload", "--policy", "mru"],
     "unknown eviction policy 'mru'; choose one of ('ring', 'lru', 'random', 'clock')"),
    (["plan", "--context", "0"], "context"),
    (["generate", "--offload", "--implementation", "pallas"], "TPU interpret mode"),
])
def test_errors_exit_2_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_check_names_step_and_position_on_a_difference(capsys, monkeypatch):
    from fo_jax import generate as gen

    original = gen.OffloadEngine.step
    calls = []

    def perturbed(self, tokens):
        logits = original(self, tokens)
        calls.append(1)
        return logits.at[0, 0, 7].add(1.0) if len(calls) == 3 else logits

    monkeypatch.setattr(gen.OffloadEngine, "step", perturbed)
    code = main(["generate", "--model", "tiny",
                 "--offload", "--check", "--max-new-tokens", "5", "--prompt",
                 "abcdefgh" * 3, "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "CHECK FAILED: step 2: request 0, position 26, logit 7" in out


def test_generate_with_ngram_drafts_checks_bitwise_and_reports_tokens_per_step(capsys):
    # The trained model continues a repeated line by repeating it: prompt lookup drafts get
    # accepted. Offloaded with --check: the resident reference is stepped and rolled back
    # alongside, logits compared bit for bit. The text is that of W = 1 greedy decoding on the
    # resident path.
    common = ["generate", "--max-new-tokens", "12", "--no-progress",
              "--prompt", "\n".join(["        self.check_error(self.get_args, **kwargs)"] * 3)]
    assert main(common) == 0
    plain = capsys.readouterr().out
    code = main(common + ["--offload", "--check", "--drafter", "ngram"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.split("--- summary ---")[0] == plain.split("--- summary ---")[0]
    steps = re.search(r"drafts: ngram, 3 per step: ([0-9.]+) tokens per step over (\d+) steps "
                      r"\(accepted (\d+) of (\d+) drafts\)", out)
    assert steps, out
    assert int(steps.group(3)) > 0 and int(steps.group(2)) < 11  # drafts were accepted
    assert f"bitwise equal to the resident model's over {steps.group(2)} decode steps" in out


def test_generate_with_ngram_drafts_samples(capsys):
    # Drafts at temperature > 0: speculative sampling (fo_jax.generate.generate).
    code = main(["generate", "--model", "tiny", "--drafter", "ngram", "--temperature", "0.8",
                 "--top-p", "0.9", "--max-new-tokens", "4", "--prompt", "abcabc",
                 "--num-drafts", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "path: resident" in out and "generated: 4 tokens" in out
    assert re.search(r"drafts: ngram, 1 per step: [0-9.]+ tokens per step over \d+ steps", out)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "tiny", "--drafter", "mtp"],
     "drafter='mtp' needs the multi-token-prediction layer of the model (num_nextn_predict_layers "
     "of a DeepSeek-V3.2 / GLM-5 checkpoint); model 'tiny' has no MTP layer loaded"),
    (["generate", "--model", "tiny", "--drafter", "ngram", "--num-drafts", "9"],
     "--num-drafts 9: num_drafts=9 makes steps of W = 10 ways, but config 'tiny' allows at most "
     "max_ways=4: use num_drafts <= 3, or a config with max_ways >= 10"),
    (["generate", "--model", "tiny", "--drafter", "ngram", "--decode-steps-per-call", "2"],
     "--drafter ngram verifies drafts step by step from the host: use --decode-steps-per-call 1"),
    # --num-drafts D alone drafts with ngram (as serve and bench-serve); a drafter needs D >= 1.
    (["generate", "--model", "tiny", "--num-drafts", "2", "--decode-steps-per-call", "2"],
     "--drafter ngram verifies drafts step by step from the host"),
    (["generate", "--model", "tiny", "--drafter", "ngram", "--num-drafts", "0"],
     "--drafter ngram needs --num-drafts >= 1"),
    (["generate", "--model", "tiny", "--drafter", "ngram", "--devices", "1", "--offload"],
     "--drafter does not run with --devices"),
])
def test_draft_errors_exit_2_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: the flags must be refused before."""
    def refuse(*_, **__):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr("fo_jax.server.serve.build_engine", refuse)
    monkeypatch.setattr("fo_jax.model.dsa.init_params", refuse)


# Flags checked as they are parsed (fo_jax.flags), before any model is built: each once
# failed late (after a 20 s warm-up), with a traceback, or not at all.
@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "70000"],  # uvicorn listened on 70000 mod 65536 = 4464
     "argument --port: 70000 is not a TCP port: give an int in [1, 65535]"),
    (["serve", "--port", "-1"], "argument --port: -1 is not a TCP port"),
    (["serve", "--port", "x"], "argument --port: 'x' is not an int"),
    (["serve", "--shutdown-timeout", "nan"],
     "argument --shutdown-timeout: nan must be a finite number of seconds >= 0"),
    (["serve", "--host-pool-gb", "inf"],
     "argument --host-pool-gb: inf must be a size in GB: a finite number > 0"),
    (["serve", "--host-pool-gb", "nan"], "argument --host-pool-gb: nan must be a size in GB"),
    (["serve", "--host-pool-gb", "1e300"], "argument --host-pool-gb: 1e+300 must be a size"),
    (["serve", "--device-gb", "nan"], "argument --device-gb: nan must be a size in GB"),
    (["serve", "--prefix-cache-gb", "nan"],
     "argument --prefix-cache-gb: nan must be a size in GB"),
    (["serve", "--max-body-mb", "0"], "argument --max-body-mb: 0.0 must be a size in MB"),
    (["serve", "--metrics-jsonl", "/nonexistent/dir/m.jsonl"],
     "argument --metrics-jsonl: /nonexistent/dir/m.jsonl: the directory /nonexistent/dir does "
     "not exist: create it first"),
    (["serve", "--seed", "-1"], "argument --seed: -1 is not a seed: give an int in "
                                "[0, 2**63 - 2]"),
    (["generate", "--model", "tiny", "--seed", str(2**70)],
     f"argument --seed: {2**70} is not a seed"),
    (["generate", "--kv-format", "fp8"],
     "argument --kv-format: invalid choice: 'fp8' (choose from"),
    (["serve", "--kv-format", "fp8"], "argument --kv-format: invalid choice: 'fp8' (choose from"),
    (["bench-serve", "--prefix-len", "-1"], "argument --prefix-len: -1 must be an int >= 0"),
    (["bench-serve", "--out", "/nonexistent/dir/b.jsonl"],
     "argument --out: /nonexistent/dir/b.jsonl: the directory /nonexistent/dir does not"),
    (["bench-serve", "--metrics-jsonl", "."], "argument --metrics-jsonl: . is a directory"),
])
def test_bad_flags_exit_2_naming_the_flag_before_anything_runs(capsys, no_model, argv,
                                                               message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"fo-jax {argv[0]}: error: {message}" in err, err


def test_serve_refuses_a_host_or_port_it_cannot_listen_on_before_the_model(capsys, no_model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert (f"fo-jax: error: argument --port: cannot listen on 127.0.0.1:{port}: the port "
                "is in use") in capsys.readouterr().err
    assert main(["serve", "--host", "999.1.1.1"]) == 2
    assert "fo-jax: error: argument --host: cannot listen on 999.1.1.1:8000: " in \
        capsys.readouterr().err
