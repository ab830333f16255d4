"""The suite's XLA:CPU flag (tests/conftest.py: no expensive LLVM passes) leaves the arithmetic
as it is: a model's prefill and decode logits (dense and MoE layers, resident and offloaded,
hot-cache misses included) are bit for bit those of a process compiling with XLA's default
passes, and a process at optimization level 0 (no FMA contraction) is not, so the comparison
can tell.

Runs alone too: `python tests/test_compile_flags.py` prints the digest of this process's
logits."""

import hashlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = "--xla_llvm_disable_expensive_passes=true"


def logits_digest() -> str:
    """sha256 of the logits of `tiny_moe` (a dense layer, then MoE layers): a prefill and three
    decode steps resident, and three offloaded decode steps whose context passes the hot cache
    (16 slots, 32 tokens: misses read from the host pool). Weights drawn in numpy (no init
    program to compile)."""
    from fo_jax import resident
    from fo_jax.config import get_config
    from fo_jax.model.dsa import init_params
    from fo_jax.offload.config import OffloadConfig
    from fo_jax.offload.decode import decode_step
    from fo_jax.offload.state import DecodeState

    config = get_config("tiny_moe").replace(max_ways=1)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    params = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                          shapes)
    tokens = rng.integers(0, config.vocab_size, (2, 35)).astype(np.int32)
    state = resident.ResidentState.create(config, batch=2, capacity=64)
    logits, state = resident.prefill(params, state, tokens[:, :32], config=config)[:2]
    out = [logits]
    offload = OffloadConfig(capacity=64, hot_slots=16, page_size=4)
    offloaded = DecodeState.from_resident(state.kv, state.index_keys, state.lengths,
                                          config=config, offload=offload)
    for i in range(32, 35):
        logits, offloaded = decode_step(params, offloaded, tokens[:, i:i + 1], config=config,
                                        offload=offload)[:2]
        out.append(logits)
    for i in range(32, 35):
        logits, state = resident.decode_step(params, state, tokens[:, i:i + 1],
                                             config=config)[:2]
        out.append(logits)
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in out)).hexdigest()


def test_logits_do_not_depend_on_the_llvm_passes():
    assert FLAG in os.environ.get("XLA_FLAGS", ""), "tests/conftest.py sets the flag"
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if f != FLAG)
    env = dict(os.environ, XLA_FLAGS=flags, FO_JAX_TEST_FULL_LLVM="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-1] == logits_digest()


if __name__ == "__main__":
    print(logits_digest())
