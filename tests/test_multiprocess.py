"""Two processes x four CPU devices, joined by jax.distributed (gloo collectives), decode a batch
data-parallel exactly as one process on one device does: same greedy tokens, same logits, bit
for bit (experiments/multiprocess_decode.py is the program each process runs)."""

import importlib.util
import json
import os
import pathlib
import sys

import numpy as np

from fo_jax import distributed
from fo_jax.config import get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "multiprocess_decode.py"
CONFIG = get_config("tiny")
PROCESSES, DEVICES_PER_PROCESS = 2, 4
BATCH, PROMPT_LEN, STEPS, SEED = 8, 8, 2, 0
# Both processes import jax and compile two programs; generous for a loaded 2-core machine.
TIMEOUT_S = 240


def _load_script():
    spec = importlib.util.spec_from_file_location("multiprocess_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_two_processes_decode_as_one_device(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # launch kills every child on its way out (failure, time limit, or an exception here).
    results = distributed.launch(
        [str(SCRIPT), "--config", CONFIG.name, "--batch", str(BATCH), "--prompt-len",
         str(PROMPT_LEN), "--steps", str(STEPS), "--seed", str(SEED), "--out", str(tmp_path)],
        processes=PROCESSES, devices_per_process=DEVICES_PER_PROCESS, timeout_s=TIMEOUT_S,
        env=env, cwd=str(ROOT))
    report = distributed.report(results)
    assert [(r.returncode, r.killed) for r in results] == [(0, False)] * PROCESSES, report
    # One JSON line each (gloo prints its own lines on stdout too).
    lines = [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{")))
             for r in results]
    assert [(x["process"], x["processes"], x["devices"]) for x in lines] == [
        (i, PROCESSES, PROCESSES * DEVICES_PER_PROCESS) for i in range(PROCESSES)], report

    rows = [np.load(tmp_path / f"rows_{i}.npz") for i in range(PROCESSES)]
    per_process = BATCH // PROCESSES
    assert [int(r["first_row"]) for r in rows] == [i * per_process for i in range(PROCESSES)]
    got = {k: np.concatenate([r[k] for r in rows]) for k in ("tokens", "logits")}

    script = _load_script()
    prompts, num_new = script.workload(batch=BATCH, prompt_len=PROMPT_LEN, config=CONFIG,
                                       seed=SEED)
    # One device, the rows a device took in the run (XLA:CPU's bits depend on a program's
    # batch: see the script's docstring).
    ref = script.reference(script.host_params(CONFIG, SEED), prompts, num_new, config=CONFIG,
                           steps=STEPS,
                           rows_per_call=BATCH // (PROCESSES * DEVICES_PER_PROCESS))
    assert got["tokens"].shape == (BATCH, STEPS + 1)
    assert got["logits"].shape == (BATCH, PROMPT_LEN + STEPS, CONFIG.vocab_size)
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_array_equal(got["logits"], ref["logits"])  # NaN (padding) where ref's
    # The real positions are numbers (the NaN-poisoned state leaked nowhere).
    real = np.arange(PROMPT_LEN + STEPS)[None, :] < num_new[:, None]
    real[:, PROMPT_LEN:] = True
    assert np.isfinite(got["logits"][real]).all()
    # The tokens gathered across processes (a collective over gloo) are the whole batch's.
    for r in rows:
        np.testing.assert_array_equal(r["gathered_tokens"], ref["tokens"])
