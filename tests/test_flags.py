"""The flags `generate`, `serve` and `bench-serve` share (fo_jax.flags): one vocabulary, the
model flags as `ModelArgs`, the drafting flags resolved by `drafting`."""

import argparse
import dataclasses

import pytest

from fo_jax import cli, flags
from fo_jax.config import get_config
from fo_jax.engine.args import EngineArgs
from fo_jax.flags import ModelArgs, add_drafting_args, drafting
from fo_jax.resolve import resolve_model

TINY = get_config("tiny")  # max_ways 4


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_the_three_commands_share_the_model_and_drafting_flags():
    shared = argparse.ArgumentParser()
    ModelArgs.add_cli_args(shared)
    add_drafting_args(shared)
    for command in ("generate", "serve", "bench-serve"):
        missing = _options(shared) - _options(_subparser(command))
        assert not missing, (command, sorted(missing))


def test_model_args_from_the_flags_as_parsed():
    parser = argparse.ArgumentParser()
    ModelArgs.add_cli_args(parser)
    parser.add_argument("--other", default=1)  # another command's flag: left alone
    args = ModelArgs.from_cli_args(parser.parse_args(
        ["--model", "tiny", "--kv-format", "fp8_ds_mla", "--seed", "3", "--no-progress"]))
    assert args == ModelArgs(model="tiny", kv_format="fp8_ds_mla", seed=3, no_progress=True)
    assert {f.name for f in dataclasses.fields(ModelArgs)} == {
        "model", "model_dir", "weights", "checkpoint_weights", "kv_format", "seed",
        "max_param_gb", "no_progress"}


def test_engine_args_hold_the_model_args():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", "tiny", "--seed", "5"]))
    assert engine_args.model_args == ModelArgs(model="tiny", seed=5)
    config, load, tokenizer = resolve_model(engine_args.model_args)
    assert (config.name, load, tokenizer) == ("tiny", None, None)


def test_resolve_model_takes_model_args_only():
    with pytest.raises(TypeError, match="resolve_model takes a fo_jax.flags.ModelArgs "
                                        r"\(ModelArgs.from_cli_args\), got Namespace"):
        resolve_model(argparse.Namespace(model="tiny"))


@pytest.mark.parametrize("drafter, num_drafts, expected", [
    (None, None, (None, 0)),
    (None, 0, (None, 0)),
    (None, 2, ("ngram", 2)),  # --num-drafts alone: n-gram drafts
    ("ngram", None, ("ngram", 3)),  # a drafter alone: max_ways - 1
    ("mtp", 1, ("mtp", 1)),
])
def test_drafting_resolves_the_defaults(drafter, num_drafts, expected):
    assert drafting(drafter, num_drafts, TINY) == expected


@pytest.mark.parametrize("drafter, num_drafts, message", [
    ("mtp", 0, "--drafter mtp needs --num-drafts >= 1"),
    ("eagle", 1, "--drafter eagle: choose one of ngram, mtp"),
    # D checked against the model (fo_jax.config.check_num_drafts), with or without --drafter.
    ("ngram", 4, r"--num-drafts 4: num_drafts=4 makes steps of W = 5 ways, but config 'tiny' "
                 r"allows at most max_ways=4: use num_drafts <= 3"),
    (None, 9, r"--num-drafts 9: num_drafts=9 makes steps of W = 10 ways"),
])
def test_drafting_refuses_what_cannot_run(drafter, num_drafts, message):
    with pytest.raises(ValueError, match=message):
        drafting(drafter, num_drafts, TINY)


def test_num_drafts_is_checked_as_parsed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--num-drafts", "-1"])
    assert "argument --num-drafts: -1 must be an int >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, drafter", [
    (["--draft", "ngram"], "ngram"),
    (["--draft", "mtp"], "mtp"),
    (["--draft", "none"], None),
])
def test_the_old_draft_flag_is_a_deprecated_alias(capsys, argv, drafter):
    parser = argparse.ArgumentParser()
    add_drafting_args(parser)
    assert parser.parse_args(argv).drafter == drafter
    err = capsys.readouterr().err
    assert err.startswith("fo-jax: warning: --draft is deprecated: ") and err.count("\n") == 1
    assert "--draft " not in parser.format_help() and "--draft\n" not in parser.format_help()


def test_flags_module_exports():
    assert {"ModelArgs", "add_drafting_args", "drafting", "DEFAULT_MODEL"} <= set(flags.__all__)
