"""DataParallelEngine with MTP drafts on 2 simulated CPU devices, bit for bit a single Engine.

Run by tests/engine/test_dp_engine.py in a subprocess (the rest of the suite keeps one
device); runs alone too: `XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=.
python tests/engine/dp_mtp_cases.py [ring] [resident] [flags] [cli]` (default: ring and
flags; resident and cli by hand). Prints one line per case and "ALL OK".

ring / resident: a stream of requests with staggered arrivals is served by 2 ranks drafting
with the model's MTP layer (`Engine(num_drafts=2, drafter="mtp", mtp=...)`), offloaded and
resident; every request's tokens must equal those of the same request served alone by one
`Engine` with the same MTP drafter on the first device; every rank's MTP parameters and MTP
seat state live on its own device (the MTP parameters come committed to the first device, as
the weights do); the draft counters are the ranks' summed, and those of the solo runs.
flags: `fo-jax serve --devices 2 --drafter mtp` on a Hugging Face checkpoint with an MTP layer
(the parity fixture) builds the data-parallel engine, each rank with its own copy of the MTP
layer. cli (by hand): `fo-jax bench-serve --devices 2 --drafter mtp` on it runs and reports
its drafts.

The MTP layer is tests/engine/test_engine_mtp.py's: random parameters plus a copy of the input
token, so that drafts on prompts whose continuations repeat are accepted (a purely random
layer accepts none, and the equality would not see an accepted draft).
"""

import contextlib
import functools
import io
import os
import pathlib
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine.data_parallel import DataParallelEngine  # noqa: E402
from fo_jax.engine.engine import Engine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.model.mtp import init_mtp_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/engine/test_engine_mtp.py's model: 2 layers, top-4, W <= 3, one MTP layer.
CONFIG = get_config("tiny").replace(num_layers=2, indexer_layers=(0,), max_ways=3,
                                    index_topk=4, kv_dtype="float32",
                                    num_nextn_predict_layers=1)
CAPACITY, SEATS, RANKS, DRAFTS = 32, 2, 2, 2
# (arrival step, prompt, max_tokens): repeating prompts (drafts accepted) and a random one;
# two arrive while the first ones decode. Prompts of at most one prefill chunk (8 tokens).
STREAM = [(0, [96] * 5, 10), (0, [208] * 7, 6), (0, [100, 219, 141] * 2, 5),
          (1, list(np.random.default_rng(3).integers(0, 256, 4)), 4), (2, [44] * 3, 6)]


@functools.cache
def _params():
    """The weights, committed to the first device (so the solo engine and rank 0 share their
    compiled programs); initialised in one program."""
    params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    return jax.device_put(params, jax.devices()[0])


@functools.cache
def _mtp():
    """Random MTP parameters (own head) plus the copy of the input token, committed to the
    first device as the weights are; built in one program."""
    def build(key, embed):
        mtp = init_mtp_params(CONFIG, key, own_head=True)
        e = CONFIG.dim
        copy = jnp.concatenate([jnp.eye(e), jnp.zeros((e, e))])[None]
        return {**mtp, "eh_proj": mtp["eh_proj"] + copy.astype(mtp["eh_proj"].dtype),
                "head": mtp["head"] + embed.T[None].astype(mtp["head"].dtype)}

    mtp = jax.jit(build)(jax.random.key(1), _params()["embed"])
    return jax.device_put(mtp, jax.devices()[0])


def _kwargs(path):
    offload = None if path == "resident" else OffloadConfig(hot_slots=12, page_size=4,
                                                            capacity=CAPACITY, policy=path)
    return dict(seats=SEATS, capacity=CAPACITY, offload=offload, decode_steps_per_call=2,
                prefill_chunk=8, query_block=None, num_drafts=DRAFTS, drafter="mtp",
                mtp=_mtp())


def _solo(path):
    """Each request of STREAM alone in one single-device Engine (reused: it is empty between
    requests): its token ids, and the engine's draft counters over all of them."""
    out = []
    with jax.default_device(jax.devices()[0]):
        engine = Engine(_params(), CONFIG, **_kwargs(path))
        for _, prompt, max_tokens in STREAM:
            rid = engine.add_request(prompt, max_tokens=max_tokens)
            out.append(engine.run()[rid].token_ids)
            engine.release(rid)
    return out, {k: engine.counters[k] for k in ("draft_accepted", "draft_proposed")}


def _on_device(tree, device, what):
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    assert leaves, what
    for leaf in leaves:
        assert leaf.devices() == {device}, (what, leaf.devices(), device)


def _check_placement(engine):
    for r, (device, e) in enumerate(zip(engine.devices, engine.engines)):
        _on_device(e.params, device, f"rank {r} params")
        _on_device(e.mtp, device, f"rank {r} MTP params")
        _on_device(e.runner.mtp_seats, device, f"rank {r} MTP seats")
        _on_device(e.runner.seats, device, f"rank {r} seats")


def case_stream(path):
    want, solo_counters = _solo(path)
    devices = jax.devices()[:RANKS]
    engine = DataParallelEngine(_params(), CONFIG, devices=devices, placement="round_robin",
                                **_kwargs(path))
    _check_placement(engine)
    assert engine.engines[1].mtp is not engine.engines[0].mtp  # one copy per device
    ids, step, pending = {}, 0, list(range(len(STREAM)))
    while pending or engine.has_unfinished():
        while pending and STREAM[pending[0]][0] <= step:
            i = pending.pop(0)
            _, prompt, max_tokens = STREAM[i]
            ids[i] = engine.add_request(prompt, max_tokens=max_tokens)
        engine.step()
        step += 1
        assert step < 100
    outputs = engine.run()
    ranks = [engine.rank_of(ids[i]) for i in range(len(STREAM))]
    assert set(ranks) == set(range(RANKS)), ranks
    for i, rid in ids.items():
        assert outputs[rid].token_ids == want[i], (i, outputs[rid].token_ids, want[i])
        engine.release(rid)
    _check_placement(engine)
    counters = engine.counters
    for k in ("draft_accepted", "draft_proposed", "requests_finished"):
        assert counters[k] == sum(e.counters[k] for e in engine.engines), (k, counters)
    got = {k: counters[k] for k in solo_counters}
    assert got == solo_counters, (got, solo_counters)
    assert counters["draft_accepted"] > 0 and all(e.counters["draft_proposed"] > 0
                                                  for e in engine.engines), counters
    if path != "resident":
        assert engine.pool_occupancy()["held"] == 0
    engine.close()
    print(f"ok {path}: ranks {ranks}, drafts {got['draft_accepted']} of "
          f"{got['draft_proposed']} accepted")


@contextlib.contextmanager
def _parity_dir():
    """The parity fixture (a Hugging Face checkpoint with an MTP layer) with a tokenizer of
    two words, in a temporary directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    fixture = pathlib.Path(ROOT) / "tests" / "fixtures" / "parity" / "deepseek_v32"
    with tempfile.TemporaryDirectory() as tmp:
        parity = pathlib.Path(tmp) / "deepseek_v32"
        parity.mkdir()
        for name in ("config.json", "model.safetensors"):
            (parity / name).symlink_to(fixture / name)
        tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.save(str(parity / "tokenizer.json"))
        yield str(parity)


def case_flags():
    """`serve` / `bench-serve` flags `--devices 2 --drafter mtp` on the parity checkpoint
    build a DataParallelEngine whose ranks draft with the checkpoint's MTP layer, each rank's
    copy on its own device (nothing runs)."""
    import argparse

    from fo_jax.server.serve import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with _parity_dir() as parity:
        args = parser.parse_args(["--model-dir", parity, "--devices", "2", "--drafter", "mtp",
                                  "--num-drafts", "1", "--capacity", "32"])
        engine = build_engine(args)[0]
    assert isinstance(engine, DataParallelEngine) and engine.ranks == 2
    assert engine.placement == "least_context"
    for device, e in zip(engine.devices, engine.engines):
        assert (e.drafter, e.num_drafts) == ("mtp", 1) and "eh_proj" in e.mtp
        _on_device(e.mtp, device, "MTP params")
        _on_device(e.params, device, "params")
    engine.close()
    print("ok flags: serve --devices 2 --drafter mtp")


def case_cli():
    """`fo-jax bench-serve --devices 2 --drafter mtp` on the parity checkpoint: runs, both
    ranks serve, drafts reported (by hand: ~20 s of compiles)."""
    from fo_jax import cli

    with _parity_dir() as parity:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = cli.main(["bench-serve", "--model-dir", parity, "--devices", "2",
                           "--drafter", "mtp", "--num-drafts", "1", "--seats", "1",
                           "--capacity", "32", "--prefill-chunk", "8", "--requests", "4",
                           "--rate", "100", "--prompt-len", "2", "8", "--output-len", "2",
                           "4"])
    text = out.getvalue()
    assert rc == 0, text
    assert "drafts: " in text and "data parallel (least_context): requests per rank" in text, text
    print("ok cli: " + " | ".join(line.strip() for line in text.splitlines()
                                  if "drafts" in line or "data parallel" in line))


def main():
    assert len(jax.devices()) >= RANKS, jax.devices()
    # The resident stream by hand: a rank is an `Engine` either way, and the MTP drafter's
    # resident path is tests/engine/test_engine_mtp.py's (half the compiles here).
    cases = sys.argv[1:] or ["ring", "flags"]
    for case in cases:
        if case in ("flags", "cli"):
            (case_flags if case == "flags" else case_cli)()
        else:
            case_stream(case)
    print("ALL OK")


if __name__ == "__main__":
    sys.exit(main())
