"""Sampling: greedy, temperature and nucleus (top-p), per request, on the device; the
speculative sampling that verifies drafts; log-probabilities. One implementation, used by the
simple generation loop (`fo_jax.generate`), the compiled decode loop (`fo_jax.decode_loop`) and
the engine.

    token = sample(logits[B, V], key, temperature=0.8, top_p=0.9)      # one setting for all
    sampling = Sampling.create(B, temperature=[0.0, 0.8], top_p=0.9, stop_tokens=[[eos]] * B)
    tokens, keys = sample_tokens(logits[B, V], keys, sampling)         # per-request settings

Every sampler draws from `nucleus_logits`: the logits scaled by the temperature, sorted, -inf
past the smallest set of most likely tokens whose mass reaches top_p. `sample` with one setting
for the batch is `nucleus` with that setting in every row, so its tokens equal those of
`sample_tokens` bit for bit. Keys are typed PRNG keys: one for the batch (shape []) or one per
request (shape [B]: a request's tokens then depend on its own key only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from fo_jax.config import ModelConfig


def check_sampling(temperature, top_p) -> None:
    """Raise unless temperature is a finite number >= 0 and top_p a number in (0, 1]."""
    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if not real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                         "(0 = greedy, else the softmax temperature)")
    if not real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] (the probability mass "
                         "nucleus sampling keeps; 1 = all tokens)")


def check_sampling_values(temperature, top_p) -> None:
    """Raise unless every temperature is finite and >= 0 and every top_p in (0, 1]."""
    t, p = np.asarray(temperature, np.float64), np.asarray(top_p, np.float64)
    bad = np.flatnonzero(~np.isfinite(t) | (t < 0))
    if bad.size:
        raise ValueError(f"temperature={float(t[bad[0]])!r} of request {bad[0]} must be a finite "
                         "number >= 0 (0 = greedy, else the softmax temperature)")
    bad = np.flatnonzero(~(p > 0) | ~(p <= 1))
    if bad.size:
        raise ValueError(f"top_p={float(p[bad[0]])!r} of request {bad[0]} must be a number in "
                         "(0, 1] (the probability mass nucleus sampling keeps; 1 = all tokens)")


def _per_request(name: str, value, batch: int, dtype) -> np.ndarray:
    """A scalar or a sequence of `batch` values -> [B] numpy array of `dtype`."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = np.full((batch,), arr)
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be one value or one per request ({batch}), got shape "
                         f"{arr.shape}")
    return arr.astype(dtype)


def sample(logits, key, *, temperature: float, top_p: float):
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else nucleus sampling.

    Top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (always at least the most likely one). A NaN / infinite / negative temperature or a top_p
    outside (0, 1] is refused (`check_sampling`).
    """
    check_sampling(temperature, top_p)
    return _sample(logits, key, temperature=float(temperature), top_p=float(top_p))


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def _sample(logits, key, *, temperature: float, top_p: float):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    batch = logits.shape[0]
    return nucleus(logits, key, jnp.full((batch,), temperature, jnp.float32),
                   jnp.full((batch,), top_p, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings and stop conditions (device arrays).

    Attributes:
      temperature: [B] float32: 0 = greedy (argmax), else the softmax temperature.
      top_p: [B] float32 in (0, 1]: nucleus mass kept (ignored where greedy).
      stop_tokens: [B, E] int32: token ids that end a request (the stop token is returned,
        never fed); -1 pads rows with fewer than E.
      max_new_tokens: [B] int32: a request is done once it has sampled this many tokens (the
        one sampled from the prefill's logits included).
    """

    temperature: jax.Array
    top_p: jax.Array
    stop_tokens: jax.Array
    max_new_tokens: jax.Array

    @classmethod
    def create(cls, batch: int, *, temperature=0.0, top_p=1.0, stop_tokens=None,
               max_new_tokens=2**30) -> "Sampling":
        """Settings for `batch` requests; each argument one value for all or one per request.

        stop_tokens: None, a list of ids for all requests, or one list per request (ragged).
        Values are checked here, on the host, with messages naming the request.
        """
        if not isinstance(batch, numbers.Integral) or batch < 1:
            raise ValueError(f"batch={batch!r} must be an int >= 1")
        temperature = _per_request("temperature", temperature, batch, np.float64)
        top_p = _per_request("top_p", top_p, batch, np.float64)
        check_sampling_values(temperature, top_p)
        max_new = _per_request("max_new_tokens", max_new_tokens, batch, np.int64)
        if np.any(max_new < 1):
            b = int(np.flatnonzero(max_new < 1)[0])
            raise ValueError(f"max_new_tokens={int(max_new[b])} of request {b} must be >= 1")
        max_new = np.minimum(max_new, 2**31 - 1)
        if stop_tokens is None:
            rows = [[] for _ in range(batch)]
        elif all(isinstance(t, numbers.Integral) for t in stop_tokens):
            rows = [list(stop_tokens)] * batch
        else:
            rows = [list(r) for r in stop_tokens]
            if len(rows) != batch:
                raise ValueError(f"stop_tokens has {len(rows)} rows, expected one per request "
                                 f"({batch}) or one list of ids for all")
        width = max([len(r) for r in rows] + [1])
        stops = np.full((batch, width), -1, np.int64)
        for b, r in enumerate(rows):
            if any(not isinstance(t, numbers.Integral) or t < 0 or t >= 2**31 for t in r):
                raise ValueError(f"stop_tokens of request {b} must be token ids >= 0, got {r}")
            stops[b, :len(r)] = r
        return cls(temperature=jnp.asarray(temperature, jnp.float32),
                   top_p=jnp.asarray(top_p, jnp.float32),
                   stop_tokens=jnp.asarray(stops, jnp.int32),
                   max_new_tokens=jnp.asarray(max_new, jnp.int32))

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]


def is_key(keys) -> bool:
    """Whether `keys` is an array of typed PRNG keys (`jax.random.key`, not raw uint32 data)."""
    return jnp.issubdtype(getattr(keys, "dtype", np.float32), jax.dtypes.prng_key)


def check_keys(keys, batch: int) -> None:
    """Raise unless `keys` is a typed PRNG key array of shape [] or [batch]."""
    if not is_key(keys):
        raise ValueError(f"keys must be typed PRNG keys (jax.random.key(seed), or "
                         f"jax.random.split of one for one key per request), got "
                         f"{getattr(keys, 'dtype', type(keys).__name__)}")
    if keys.shape not in ((), (batch,)):
        raise ValueError(f"keys must have shape [] (one for the batch) or [{batch}] (one per "
                         f"request), got {list(keys.shape)}")


def nucleus_logits(logits, temperature, top_p):
    """(order [B, V], kept [B, V]): rows of logits [B, V] scaled by temperature [B] (1 where
    greedy) and sorted, most likely first (`order[b, r]`: the token of rank r), with -inf past
    the nucleus (the smallest set of most likely tokens whose mass reaches top_p [B]).
    softmax(kept) is the distribution `nucleus` samples from. O(B V log V)."""
    greedy = temperature == 0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    return order, jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)


def nucleus(logits, key, temperature, top_p):
    """Rows of logits [B, V] sampled with temperature [B] and top_p [B] from one key: the
    arithmetic of `sample` with per-row settings (greedy rows: argmax)."""
    greedy = temperature == 0
    order, kept = nucleus_logits(logits, temperature, top_p)
    choice = jax.random.categorical(key, kept, axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def sample_tokens(logits, keys, sampling: Sampling, active=None):
    """Next tokens [B] from logits [B, V] on the device, and the advanced keys.

    One key for the batch ([]): split once, the sub-key samples every row: bitwise
    `sample(logits, sub, ...)` for rows of equal settings. One key per request
    ([B]): each active request splits its own key and samples its row alone, bitwise
    `sample(logits[b:b+1], sub_b, ...)`; an inactive request's key stays. Greedy rows take the
    argmax; when every row is greedy the [B, V] sort is skipped (`lax.cond`).
    """
    batch = logits.shape[0]
    active = jnp.ones((batch,), bool) if active is None else active
    if keys.ndim == 0:
        keys, sub = jax.random.split(keys)
        sample_rows = lambda: nucleus(logits, sub, sampling.temperature, sampling.top_p)
    else:
        split = jax.vmap(jax.random.split)(keys)  # [B, 2]
        keys = select_keys(active, split[:, 0], keys)
        sub = split[:, 1]
        sample_rows = lambda: jax.vmap(
            lambda row, k, t, p: nucleus(row[None], k, t[None], p[None])[0])(
                logits, sub, sampling.temperature, sampling.top_p)
    greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(sampling.temperature > 0), sample_rows, greedy)
    return tokens, keys


def select_keys(active, new, old):
    """Typed keys: `new` where active, else `old` (jnp.where does not take key arrays)."""
    data = jnp.where(active[:, None], jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))


def token_logprobs(logits, tokens, top: int):
    """(values [B, top + 1] float32, ids [B, top + 1] int32) of logits [B, V] and the tokens
    [B] sampled from them: column 0 the token's log-probability, columns 1..top the `top` most
    likely tokens' (descending; `jax.lax.top_k`, ties to the lower id). Log-probabilities of
    the raw model distribution, log_softmax(logits) in float32: before temperature and top_p,
    as vLLM returns them by default (its `raw_logprobs`), so a token's value does not depend on
    the request's sampling settings. A token < 0 (none sampled) gets an unspecified value.
    Reads the logits only: the tokens are sampled as without it. O(B V) + top-k."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)
    values, ids = [chosen], [tokens[:, None].astype(jnp.int32)]
    if top:
        top_values, top_ids = jax.lax.top_k(logp, top)
        values.append(top_values)
        ids.append(top_ids.astype(jnp.int32))
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)


def check_logprobs(logprobs, config: ModelConfig) -> None:
    """Raise unless `logprobs` is None or an int in [0, vocab_size] (top tokens per token)."""
    if logprobs is None:
        return
    if (not isinstance(logprobs, numbers.Integral) or isinstance(logprobs, bool)
            or not 0 <= logprobs <= config.vocab_size):
        raise ValueError(f"logprobs={logprobs!r} must be None (no log-probabilities) or an int "
                         f"in [0, vocab_size={config.vocab_size}] (the most likely tokens "
                         "returned besides the sampled one)")


def _speculate_row(logits, drafts, key, temperature, top_p):
    """One sampled request's verification: (tokens [W] int32, accepted [] int32) from the
    logits [W, V] of its W ways and its drafts [D] (D = W - 1; draft i + 1 was fed at way i + 1
    and is checked against way i's distribution).

    p_i = the nucleus distribution of way i (temperature, then top_p: what `nucleus` samples
    from). Draft d_{i+1} is accepted with probability p_i(d_{i+1}) (u_i < p_i(d_{i+1}), u_i
    uniform), in order; at the first rejection, way a, the token is sampled from p_a with
    d_{a+1} removed and renormalized (the residual (p - q)+ for the point mass q of a
    deterministic drafter); after D acceptances, from p_D (the bonus token). tokens = d_1 ..
    d_a then that token (tokens[j] for j > a: unspecified). Keys: `key` splits into
    (acceptance key: the D uniforms, token key: the one categorical draw). O(W V log V)."""
    ways = logits.shape[0]
    order, kept = nucleus_logits(logits, jnp.full((ways,), temperature),
                                  jnp.full((ways,), top_p))
    probs = jax.nn.softmax(kept, axis=-1)  # [W, V] p_i by rank (0 past the nucleus)
    p_draft = jnp.sum(jnp.where(order[:-1] == drafts[:, None], probs[:-1], 0.0), axis=-1)
    accept_key, token_key = jax.random.split(key)
    uniform = jax.random.uniform(accept_key, drafts.shape)
    accepted = jnp.sum(jnp.cumprod((uniform < p_draft).astype(jnp.int32)))
    removed = jnp.concatenate([drafts, jnp.full((1,), -1, drafts.dtype)])[accepted]
    row_order = order[accepted]
    residual = jnp.where(row_order == removed, -jnp.inf, kept[accepted])
    token = row_order[jax.random.categorical(token_key, residual)].astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)]).at[accepted].set(token)
    return tokens.astype(jnp.int32), accepted.astype(jnp.int32)


def speculative_tokens(fed, logits, keys, sampling: Sampling, active):
    """Verify one step's drafts: (tokens [B, W], accepted [B], keys), uncut (see
    `draft_step_tokens`).

    fed: [B, W] the step's tokens [last, d_1 .. d_D]; logits: [B, W, V] theirs; keys as in
    `sample_tokens`. Request b yields tokens[b, :accepted[b] + 1]: its accepted drafts, then
    one more token. A greedy request (temperature 0) accepts the longest prefix of drafts
    with d_i = g_{i-1} (g: the ways' argmax) and yields g_0 .. g_a, the tokens one-token
    steps would yield. A sampled request (temperature > 0) does speculative sampling
    (Leviathan et al. 2023, Chen et al. 2023; `_speculate_row`): draft d_i is accepted with
    probability p_{i-1}(d_i), p the nucleus distribution `sample_tokens` samples from; the
    first rejected way samples p without its draft, renormalized; after D acceptances a bonus
    token is sampled from p_D. So its tokens follow p token by token, as one-token steps'
    do (tests/engine/test_speculative.py checks the law of the first two tokens), but they
    are other random draws: not those of a num_drafts=0 loop with the same key.
    (`fo_jax.generate.generate` verifies its host drafter's drafts with this same function.)

    Keys, per step: one key per request ([B]): each active request splits its key once,
    (next key, step key), as `sample_tokens` does (an inactive request's key stays), and the
    step key splits into (acceptance key: D uniforms, token key: the one categorical draw),
    so a request's tokens depend on its own key, logits and drafts only. One key for the
    batch ([]): split once per step, (next key, step key), the step key split into B row
    keys, each used as above. A greedy request's key advances too but is not read. When
    every request is greedy, the [B, W, V] sort is skipped (`lax.cond`).
    Work: O(B W V) greedy; O(B W V log V) when a request samples."""
    batch = fed.shape[0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, W]
    agree = (fed[:, 1:] == greedy[:, :-1]).astype(jnp.int32)
    greedy_accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)
    if keys.ndim == 0:
        keys, sub = jax.random.split(keys)
        subs = jax.random.split(sub, batch)
    else:
        split = jax.vmap(jax.random.split)(keys)  # [B, 2]
        keys = select_keys(active, split[:, 0], keys)
        subs = split[:, 1]
    sampled = sampling.temperature > 0

    def speculate():
        tokens, accepted = jax.vmap(_speculate_row)(logits, fed[:, 1:].astype(jnp.int32), subs,
                                                    sampling.temperature, sampling.top_p)
        return (jnp.where(sampled[:, None], tokens, greedy),
                jnp.where(sampled, accepted, greedy_accepted))

    tokens, accepted = jax.lax.cond(jnp.any(sampled), speculate,
                                    lambda: (greedy, greedy_accepted))
    return tokens, accepted, keys
