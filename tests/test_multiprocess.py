"""Two processes x four CPU devices, joined by jax.distributed (gloo collectives), decode a batch
data-parallel exactly as one process on one device does: same greedy tokens, same logits, bit
for bit, on both decode paths (resident, and offloaded: host pools split over the processes'
devices), in one launch (experiments/decode/multiprocess_decode.py is the program each process
runs)."""

import importlib.util
import json
import os
import pathlib
import sys

import numpy as np

from fo_jax import distributed
from fo_jax.config import get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE = "experiments.decode.multiprocess_decode"
CONFIG = get_config("tiny")
PROCESSES, DEVICES_PER_PROCESS = 2, 4
BATCH, PROMPT_LEN, STEPS, SEED = 8, 8, 2, 0
PATHS = ("resident", "offloaded")
# Both processes import jax and compile each path's programs; generous for a loaded 2-core
# machine.
TIMEOUT_S = 240


def _load_script():
    spec = importlib.util.find_spec(MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_two_processes_decode_as_one_device(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # launch kills every child on its way out (failure, time limit, or an exception here).
    results = distributed.launch(
        ["-m", MODULE, "--config", CONFIG.name, "--batch", str(BATCH), "--prompt-len",
         str(PROMPT_LEN), "--steps", str(STEPS), "--seed", str(SEED), "--out", str(tmp_path),
         "--path", "both"],
        processes=PROCESSES, devices_per_process=DEVICES_PER_PROCESS, timeout_s=TIMEOUT_S,
        env=env, cwd=str(ROOT))
    report = distributed.report(results)
    assert [(r.returncode, r.killed) for r in results] == [(0, False)] * PROCESSES, report
    # One JSON line per path each (gloo prints its own lines on stdout too).
    lines = [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
             for r in results]
    assert [[(x["path"], x["process"], x["processes"], x["devices"]) for x in mine]
            for mine in lines] == [
        [(path, i, PROCESSES, PROCESSES * DEVICES_PER_PROCESS) for path in PATHS]
        for i in range(PROCESSES)], report

    script = _load_script()
    prompts, num_new = script.workload(batch=BATCH, prompt_len=PROMPT_LEN, config=CONFIG,
                                       seed=SEED)
    weights = script.host_params(CONFIG, SEED)
    per_process = BATCH // PROCESSES
    # The real positions are numbers (the NaN-poisoned states leaked nowhere).
    real = np.arange(PROMPT_LEN + STEPS)[None, :] < num_new[:, None]
    real[:, PROMPT_LEN:] = True
    for name in PATHS:
        rows = [np.load(tmp_path / f"rows_{name}_{i}.npz") for i in range(PROCESSES)]
        assert [int(r["first_row"]) for r in rows] == [
            i * per_process for i in range(PROCESSES)]
        got = {k: np.concatenate([r[k] for r in rows]) for k in ("tokens", "logits")}
        # One device, the rows a device took in the run (XLA:CPU's bits depend on a program's
        # batch: see the script's docstring); offloaded: their pages as the device's own pool.
        ref = script.reference(weights, prompts, num_new, config=CONFIG, steps=STEPS,
                               rows_per_call=BATCH // (PROCESSES * DEVICES_PER_PROCESS),
                               path=script.PATHS[name])
        assert got["tokens"].shape == (BATCH, STEPS + 1), name
        assert got["logits"].shape == (BATCH, PROMPT_LEN + STEPS, CONFIG.vocab_size), name
        np.testing.assert_array_equal(got["tokens"], ref["tokens"], err_msg=name)
        # NaN (padding) where ref's
        np.testing.assert_array_equal(got["logits"], ref["logits"], err_msg=name)
        assert np.isfinite(got["logits"][real]).all(), name
        # The tokens gathered across processes (a collective over gloo) are the whole batch's.
        for r in rows:
            np.testing.assert_array_equal(r["gathered_tokens"], ref["tokens"], err_msg=name)
