"""Train an MTP layer for the embedded model (its main weights frozen): what MTP drafts accept.

No model here ships a trained multi-token-prediction layer, so the MTP drafter's acceptance
cannot be measured on one. This trains MTP layer 0 (`fo_jax.model.mtp`, own head off: the
main model's embed and head are shared, as DeepSeek's layer is) on the embedded model
(`trained-small`) over the Python standard library's sources (its training corpus, the same
held-out split): the main model's last hidden states h_i of windows of T tokens, the layer fed
the pairs (h_i, t_{i+1}) and trained to predict t_{i+2} (cross entropy), Adam. The main model
never changes, so the MTP layer's drafts are verified against the same greedy tokens as
before. Writes the MTP parameters (an .npz of the flattened tree: `load_mtp`) and prints the
held-out loss and top-1 accuracy of t_{i+2} (what a first draft's acceptance is, teacher
forced).

    python -m experiments.training.train_mtp --steps 300 --out /tmp/mtp.npz
    python -m experiments.decode.decode_loop_bench --num-drafts 2 --drafter ngram mtp \\
        --mtp /tmp/mtp.npz
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fo_jax import resident
from fo_jax.embedded import load_embedded
from fo_jax.model.mtp import init_mtp_params
from fo_jax.resident import create_mtp_state, mtp_step
from fo_jax.training import load_split, sample_batch, split_files, stdlib_files


def save_mtp(path: str, mtp: dict) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(mtp)
    np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})


def load_mtp(path: str, config) -> dict:
    """MTP parameters `save_mtp` wrote, for `config` (num_nextn_predict_layers >= 1)."""
    like = jax.eval_shape(lambda: init_mtp_params(config, jax.random.key(0)))
    data = np.load(path)
    leaves, tree = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(
        tree, [jnp.asarray(data[jax.tree_util.keystr(k)], v.dtype) for k, v in leaves])


def _hidden(params, tokens, *, config):
    """The main model's last hidden states [B, T, E] of tokens [B, T] (frozen)."""
    state = resident.ResidentState.create(config, batch=tokens.shape[0],
                                          capacity=tokens.shape[1])
    _, _, hidden = resident.prefill(params, state, tokens, config=config, check=False,
                                    return_hidden=True)
    return jax.lax.stop_gradient(hidden)


def _loss(mtp, params, hidden, tokens, *, config):
    """(mean cross entropy of t_{i+2}, top-1 accuracy) over the pairs (h_i, t_{i+1})."""
    batch, length = tokens.shape
    state = create_mtp_state(config, batch=batch, capacity=length)
    logits, _, _ = mtp_step(params, mtp, state, hidden[:, :-2], tokens[:, 1:-1],
                            jnp.full((batch,), length - 2, jnp.int32), config=config)
    target = tokens[:, 2:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return nll.mean(), (jnp.argmax(logits, axis=-1) == target).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="tokens per window")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--out", required=True, help="the MTP parameters (.npz)")
    parser.add_argument("--max-bytes", type=int, default=4_000_000,
                        help="bytes of source text read (train split)")
    args = parser.parse_args(argv)
    config, params, tokenizer = load_embedded()
    config = config.replace(num_nextn_predict_layers=1)
    train_files, held_files = split_files(stdlib_files())
    stream = load_split(train_files, max_bytes=args.max_bytes, tokenizer=tokenizer)
    held_stream = load_split(held_files, max_bytes=args.max_bytes // 10, tokenizer=tokenizer)
    rng = np.random.default_rng(0)
    mtp = init_mtp_params(config, jax.random.key(1))
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(mtp)
    hidden_of = jax.jit(functools.partial(_hidden, config=config))
    loss_of = functools.partial(_loss, config=config)

    @jax.jit
    def step(mtp, opt_state, hidden, tokens):
        (loss, acc), grads = jax.value_and_grad(loss_of, has_aux=True)(mtp, params, hidden,
                                                                         tokens)
        updates, opt_state = optimizer.update(grads, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, loss, acc

    evaluate = jax.jit(loss_of)
    held_rng = np.random.default_rng(1)
    held_batch = jnp.asarray(sample_batch(held_stream, args.eval_windows, args.length,
                                          held_rng))
    held_hidden = hidden_of(params, held_batch)
    print(f"MTP layer of {config.name}: {sum(x.size for x in jax.tree_util.tree_leaves(mtp)):,} "
          f"parameters, {stream.size:,} training tokens, {args.steps} steps of "
          f"{args.batch} x {args.length}")
    start = time.perf_counter()
    for i in range(args.steps + 1):
        if i % 50 == 0 or i == args.steps:
            loss, acc = evaluate(mtp, params, held_hidden, held_batch)
            print(f"step {i:5d}  held-out loss {float(loss):.3f}  top-1 of t+2 "
                  f"{float(acc):.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
        if i == args.steps:
            break
        tokens = jnp.asarray(sample_batch(stream, args.batch, args.length, rng))
        mtp, opt_state, loss, acc = step(mtp, opt_state, hidden_of(params, tokens), tokens)
    save_mtp(args.out, mtp)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
