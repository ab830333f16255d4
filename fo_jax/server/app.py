"""The OpenAI-compatible ASGI app (FastAPI) over an `EngineDriver`.

    POST /v1/completions        prompt (string or token ids) -> n texts (choices); stream=true:
                                server-sent events in OpenAI's chunk format, ending with
                                `data: [DONE]`
    POST /v1/chat/completions   messages -> n assistant messages (the chat template is
                                `protocol.simple_chat_template` unless one is given)
    GET  /v1/models             the served model
    GET  /health                200 while accepting requests, 503 when shutting down / failed
    GET  /metrics               Prometheus text: requests received / completed / cancelled /
                                rejected, running / waiting (the queue), engine counters,
                                preemptions, offload statistics (in total and per indexer
                                group), pool pages and bytes, TTFT and inter-token latency
                                histograms (fo_jax.engine.metrics)

Status codes: 400 a request the engine refuses (its `add_request` message: prompt too long for
a seat, ids outside the vocabulary, too many or too long stop strings ...), a field the
server does not implement (`protocol.Body.refusal`: named in `param`), text that is not Unicode
(a lone surrogate) or malformed JSON; 413 a body above `max_body_bytes` (refused from its
Content-Length before it is read; a chunked one once that many bytes came); 422 a field of the
wrong type or out of range (named, as pydantic reports it; types are strict:
`fo_jax.server.protocol`; a NaN or an infinity is reported as text: JSON has neither); 404
another model name; 429 with `Retry-After` when `max_queue` requests already wait for a seat
(400 naming `n` when more choices are asked than the seats and the queue could ever hold); 500
a request that failed (an error of its own; the engine goes on); 503 while shutting down or
after the engine failed. Errors have OpenAI's body `{"error": {"message", "type", "param",
"code"}}`.

Prompts are checked and tokenized (and chat templates rendered) in a worker thread, off the
event loop: a long prompt does not hold up other requests' streams.

Choices (`n`): each choice is one engine request, choice i sampled with seed + i (vLLM's rule:
the request with n = 1 and seed + i gives choice i's tokens, bit for bit; without a seed the
base seed is random); with a prefix cache the prompt is prefilled once and the other choices
map its whole chunks (`EngineDriver.submit_choices`). Usage counts the prompt once and sums the
choices' tokens; streamed, the choices' chunks interleave as their tokens come, each naming its
index, and [DONE] follows the last. The request metrics count choices (a request of n = 3
counts 3 received, and 3 completed, cancelled or rejected).

Log-probabilities (completions `logprobs: k`; chat `logprobs: true`, `top_logprobs: k`): the
engine's (`Engine.add_request(logprobs=k)`): of the raw model distribution, before temperature
and top_p (vLLM's default), computed on the device. A token's text is its own decoding
(`tokenizer.decode([id])`: an incomplete UTF-8 character shows as U+FFFD) and chat's `bytes`
are that text's UTF-8 bytes; completions' `top_logprobs` hold the sampled token first, then
the k most likely (k + 1 entries at most; tokens of equal text share one key), `text_offset`
counts the characters of those texts from the completion's start. A streamed chunk carries the
logprobs of the tokens that came with it (its text may be held back, below). Every token
generated has one, the stop token included.

Usage: `completion_tokens` counts every token generated, the stop token and the token that
completed a stop string included, though the text drops them (vLLM's convention).

A client that disconnects (mid-stream or while waiting for a whole response) has its request
cancelled in the engine, which frees its seat before the next step.

Text: the engine's decoded text, without the rendering of a final stop token (the separator);
while streaming, the last `max(len(stop)) - 1` characters and a trailing incomplete UTF-8
character (U+FFFD) are held back until the next output, so that streamed text never has to be
taken back when a stop string completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fo_jax.server.driver import (
    Accepted,
    EngineDriver,
    Failed,
    NotAccepting,
    QueueFull,
    Refused,
)
from fo_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    simple_chat_template,
)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a log-probability below is sent as this (vLLM's)
MAX_BODY_BYTES = 16_000_000  # `fo-jax serve --max-body-mb 16`
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Prometheus metrics of one server, in their own registry (several servers may live in
    one process: tests). The engine thread feeds `on_output`; the snapshot collector reads
    what the driver last published (every `stats_every` steps), never the engine itself."""

    def __init__(self, driver: EngineDriver | None = None):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.received = Counter("fojax_requests_received", "Requests with a valid body",
                                registry=reg)
        self.completed = Counter("fojax_requests_completed", "Requests that finished",
                                 ["finish_reason"], registry=reg)
        self.cancelled = Counter("fojax_requests_cancelled",
                                 "Requests cancelled (client gone, shutdown)", registry=reg)
        self.rejected = Counter("fojax_requests_rejected", "Requests refused before running",
                                ["reason"], registry=reg)
        self.failed = Counter("fojax_requests_failed", "Requests lost to an engine failure "
                              "or to an error of their own", registry=reg)
        self.prompt_tokens = Counter("fojax_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=reg)
        self.generation_tokens = Counter("fojax_generation_tokens", "Tokens generated",
                                         registry=reg)
        self.ttft = Histogram("fojax_time_to_first_token_seconds",
                              "Submit to first token (queue, prefill, first sample)",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("fojax_inter_token_latency_seconds",
                             "Time between tokens of a request (a call of N decode steps "
                             "counts its time / N per token)",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.driver = driver
        reg.register(_SnapshotCollector(self))

    def on_output(self, handle, out, now: float) -> None:
        """Engine thread: one RequestOutput (before it is handed to the client)."""
        new = len(out.new_token_ids)
        if new:
            self.generation_tokens.inc(new)
            if handle.first_token_at is None:
                self.ttft.observe(now - handle.submitted)
                new -= 1
                last = now
            else:
                last = handle.last_token_at
            if new:
                gap = (now - last) / new
                for _ in range(new):
                    self.itl.observe(gap)
        if out.finished:
            if out.finish_reason == "cancelled":
                self.cancelled.inc()
            else:
                self.completed.labels(out.finish_reason).inc()


class _SnapshotCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        driver = self.metrics.driver
        if driver is None:
            return
        snap = driver.snapshot
        yield GaugeMetricFamily("fojax_requests_running", "Requests in a seat",
                                value=snap.running)
        yield GaugeMetricFamily("fojax_requests_waiting", "Requests waiting for a seat",
                                value=snap.waiting)
        counters = CounterMetricFamily("fojax_engine_events", "Engine.counters",
                                       labels=["counter"])
        for name, value in sorted(snap.counters.items()):
            counters.add_metric([name], value)
        yield counters
        if snap.pool:
            pages = GaugeMetricFamily("fojax_pool_pages",
                                      "Pages of the shared host-KV / indexer-key pools by state "
                                      "(free, held by requests, cached by the prefix cache, "
                                      "total)", labels=["state"])
            for name in ("free", "held", "cached", "total"):
                pages.add_metric([name], snap.pool[name])
            yield pages
        if snap.offload:
            rows = CounterMetricFamily("fojax_offload_rows",
                                       "Offloaded decode: selected rows by outcome (hits, "
                                       "tail_hits, misses) and rows copied (union)",
                                       labels=["kind"])
            for name in ("hits", "tail_hits", "misses", "union"):
                rows.add_metric([name], snap.offload[name])
            yield rows
            moved = CounterMetricFamily("fojax_offload_bytes", "Offloaded decode: bytes moved",
                                        labels=["direction"])
            moved.add_metric(["h2d"], snap.offload["h2d_bytes"])
            moved.add_metric(["d2h"], snap.offload["d2h_bytes"])
            yield moved
        from fo_jax.engine import metrics as engine_metrics

        if snap.groups:
            yield engine_metrics.group_family(snap.groups)
        held = engine_metrics.pool_bytes(snap.pool, snap.page_bytes)
        if held:
            yield engine_metrics.pool_bytes_family(held)
        yield from engine_metrics.preemption_families(snap.counters)


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None,
           headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}},
                        status_code=status, headers=headers)


def _finite(value):
    """`value` (parsed JSON) with every NaN or infinity as its text ("nan", "inf"): JSON has
    neither, and the response's encoder refuses them."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _NotText(ValueError):
    """A request's text is not Unicode (HTTP 400 naming `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_text(text: str, param: str) -> None:
    """Raise `_NotText` if `text` holds a lone surrogate (JSON's "\\ud800" decodes to one;
    no tokenizer takes it). O(len(text))."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _NotText(param, f"{param}: a lone surrogate (U+{ord(text[err.start]):04X}) at "
                              f"character {err.start} is not Unicode text: send the text as "
                              "UTF-8 (or a character outside the BMP as its surrogate "
                              "pair)") from None


class _BodyLimit:
    """ASGI middleware: a request body above `limit` bytes gets 413, from its Content-Length
    before anything is read, or, a chunked body, once more than `limit` bytes came (the body
    is then read here, up to the limit, and handed on whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(f"{int(declared):,} bytes", scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._refuse(f"more than {self.limit:,} bytes", scope, receive,
                                          send)
            more = message.get("more_body", False)
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope, receive, send) -> None:
        response = _error(413, f"request body of {size}: the server takes at most "
                               f"{self.limit:,} (fo-jax serve --max-body-mb)",
                          param="body")
        await response(scope, receive, send)


class _EventStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however the response ends: a client that
    leaves before the first chunk cancels a stream whose generator never started (and so never
    runs its `finally`)."""

    def __init__(self, content, *, on_close: Callable[[], object], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(driver: EngineDriver, *, tokenizer, model_name: str, capacity: int,
              stop_token_ids: tuple[int, ...] = (), chat_template: Callable | None = None,
              metrics: ServerMetrics | None = None, shutdown_timeout: float = 10.0,
              retry_after: int = 1, max_body_bytes: int | None = MAX_BODY_BYTES) -> FastAPI:
    """The app. The driver is started by the app's startup (unless it runs already) and
    stopped by its shutdown (in-flight requests get `shutdown_timeout` seconds, then are
    cancelled).

    Args:
      driver: the EngineDriver (its engine must have this `tokenizer`).
      tokenizer: encode(str) -> ids, decode(ids) -> str.
      model_name: what /v1/models lists and requests must name (or omit).
      capacity: tokens per seat: chat requests without max_tokens get the rest of the seat.
      stop_token_ids: ids that end every request (the document separator), unless the request
        sets `ignore_eos`.
      chat_template: messages -> prompt text (default `simple_chat_template`; `build_served`
        passes a Hugging Face checkpoint's own template).
      max_body_bytes: a larger request body gets 413 (None: no limit).
    """
    metrics = metrics or ServerMetrics(driver)
    metrics.driver = driver
    if driver.on_output is None:
        driver.on_output = metrics.on_output
    template = chat_template or simple_chat_template

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not driver.alive:
            driver.start()
        yield
        driver.stop_accepting()
        await asyncio.to_thread(driver.stop, shutdown_timeout)

    app = FastAPI(title="fo_jax", lifespan=lifespan)
    app.state.driver, app.state.metrics = driver, metrics
    if max_body_bytes is not None:
        app.add_middleware(_BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        json_bad = any(e.get("type") == "json_invalid" for e in errors)
        parts, param = [], None
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            field = ".".join(loc) or "body"
            param = param or field
            value = e.get("input")
            if isinstance(value, float) and not math.isfinite(value):
                parts.append(f"{field}: must be a finite number, got {value!r}")
            else:
                parts.append(f"{field}: {e.get('msg')}")
        status = 400 if json_bad else 422
        message = ("malformed JSON body: " if json_bad else "invalid request: ") + "; ".join(parts)
        body = {"error": {"message": message, "type": "invalid_request_error", "param": param,
                          "code": status},
                "detail": _finite(json.loads(json.dumps(errors, default=str)))}
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    async def health():
        if driver.accepting:
            return {"status": "ok"}
        return _error(503, driver.failure or "the server is shutting down", "unavailable")

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": 0,
                          "owned_by": "fo_jax", "max_model_len": capacity}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _refused(body, message: str | None = None, param: str | None = None):
        """400 for a body the server does not serve (`Body.refusal`, or `message`); None if
        it is served."""
        if message is None:
            refusal = body.refusal()
            if refusal is None:
                return None
            message, param = refusal.message, refusal.param
        metrics.received.inc()
        metrics.rejected.labels("invalid").inc()
        return _error(400, message, param=param)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refused = _refused(body)
        prompts = body.prompts()
        if refused is None and len(prompts) != 1:
            refused = _refused(body, f"prompt: one prompt per request, got {len(prompts)} "
                                     "(send them as separate requests)", "prompt")
        if refused is not None:
            return refused
        prompt = prompts[0]
        if isinstance(prompt, str):
            try:
                ids = await asyncio.to_thread(_encode_prompt, prompt)
            except _NotText as err:
                return _not_text(err)
        else:
            ids = list(prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await _generate(request, body, ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        refused = _refused(body)
        if refused is not None:
            return refused
        try:
            ids = await asyncio.to_thread(_encode_chat, body.messages)
        except _NotText as err:
            return _not_text(err)
        except ValueError as err:  # the chat template refused the messages (raise_exception)
            return _not_text(_NotText("messages", str(err)))
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, capacity - len(ids))
        return await _generate(request, body, ids, max_tokens, chat=True)

    # Worker threads: a long text must not hold up the event loop.
    def _encode_prompt(text: str) -> list[int]:
        _check_text(text, "prompt")
        return tokenizer.encode(text).tolist()

    def _encode_chat(messages) -> list[int]:
        for i, message in enumerate(messages):
            _check_text(message.text(), f"messages.{i}.content")
        text = template(messages)
        try:  # a rendered template carries its own special tokens (BOS included)
            return tokenizer.encode(text, add_special_tokens=False).tolist()
        except TypeError:  # tokenizers without special tokens to add
            return tokenizer.encode(text).tolist()

    def _not_text(err: _NotText) -> JSONResponse:
        metrics.received.inc()
        metrics.rejected.labels("invalid").inc()
        return _error(400, str(err), param=err.param)

    def _final_text(out, stop_ids, stops) -> str:
        text = out.text or ""
        if (out.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in stop_ids):
            text = tokenizer.decode(out.token_ids[:-1])
            cut = [at for at in (text.find(s) for s in stops) if at >= 0]
            if cut:
                text = text[:min(cut)]
        return text

    def _piece(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def _logprobs(entries, chat: bool, offset: int = 0):
        """OpenAI's logprobs of `entries` (TokenLogprobs): chat {"content": [{token, logprob,
        bytes, top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs (the
        sampled token's then the top tokens', one dict per token), text_offset (from
        `offset`)}. A token is its own decoded text; -inf is sent as LOGPROB_FLOOR."""
        if chat:
            def item(t, v):
                piece = _piece(t)
                return {"token": piece, "logprob": max(v, LOGPROB_FLOOR),
                        "bytes": list(piece.encode("utf-8"))}
            return {"content": [dict(item(e.token_id, e.logprob),
                                     top_logprobs=[item(t, v) for t, v in e.top])
                                for e in entries]}
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            piece = _piece(e.token_id)
            tokens.append(piece)
            values.append(max(e.logprob, LOGPROB_FLOOR))
            top = {piece: values[-1]}
            for t, v in e.top:
                top.setdefault(_piece(t), max(v, LOGPROB_FLOOR))
            tops.append(top)
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    async def _generate(request: Request, body, ids: list[int], max_tokens: int, *, chat: bool):
        n = body.choices
        metrics.received.inc(n)
        if body.model is not None and body.model != model_name:
            metrics.rejected.labels("model").inc(n)
            return _error(404, f"model {body.model!r} is not served here; GET /v1/models "
                               f"lists {model_name!r}", "not_found_error", "model")
        stops = body.stop_strings()
        stop_ids = () if body.ignore_eos else tuple(stop_token_ids)
        seed = random.getrandbits(31) if body.seed is None else body.seed
        kwargs = dict(max_tokens=max_tokens,
                      temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=1.0 if body.top_p is None else body.top_p,
                      seed=seed, stop_token_ids=stop_ids, stop=stops)
        if body.engine_logprobs() is not None:
            kwargs["logprobs"] = body.engine_logprobs()
        try:  # choice i samples with seed + i (vLLM's rule): alone, the same tokens
            handles = driver.submit_choices(ids, loop=asyncio.get_running_loop(), choices=[
                dict(kwargs, seed=seed + i) for i in range(n)])
        except ValueError as err:  # more choices than the seats and the queue ever hold
            metrics.rejected.labels("invalid").inc(n)
            return _error(400, str(err), param="n")
        except QueueFull as err:
            metrics.rejected.labels("queue_full").inc(n)
            return _error(429, str(err), "rate_limit_error",
                          headers={"Retry-After": str(retry_after)})
        except NotAccepting as err:
            metrics.rejected.labels("unavailable").inc(n)
            return _error(503, str(err), "unavailable")

        def cancel_all():
            for handle in handles:
                driver.cancel(handle.request_id)

        try:
            firsts = [await handle.queue.get() for handle in handles]
        except asyncio.CancelledError:  # the handler was cancelled (shutdown) before it began
            cancel_all()
            raise
        for first in firsts:
            if isinstance(first, (Refused, Failed)):
                cancel_all()
                if isinstance(first, Refused):
                    metrics.rejected.labels("invalid").inc(n)
                    return _error(400, first.message)
                if not first.engine:  # this request's own error: the engine goes on
                    metrics.failed.inc(n)
                    return _error(500, first.message, "server_error")
                metrics.rejected.labels("unavailable").inc(n)
                return _error(503, first.message, "unavailable")
            assert isinstance(first, Accepted), first
        rid, created = handles[0].request_id, int(time.time())
        prompt_tokens = len(ids)
        metrics.prompt_tokens.inc(prompt_tokens)

        def usage(outs):
            tokens = sum(len(out.token_ids) for out in outs)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                    "total_tokens": prompt_tokens + tokens}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            state = {"finished": False}
            return _EventStream(
                _stream(handles, rid, created, chat, stops, stop_ids, usage, include_usage,
                        body, state),
                on_close=lambda: state["finished"] or cancel_all(),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        finals: list = [None] * n
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            async with contextlib.aclosing(_outputs(handles, watch)) as outputs:
                async for i, out in outputs:
                    if out is None:
                        return Response(status_code=499)  # the client has gone
                    if isinstance(out, Failed):
                        metrics.failed.inc()
                        return _error(500, out.message, "server_error")
                    if out.finished:
                        finals[i] = out
        finally:
            watch.cancel()
            if any(out is None for out in finals):
                cancel_all()
        choices = []
        for i, out in enumerate(finals):
            choice = {"index": i, "logprobs": None, "finish_reason": out.finish_reason}
            text = _final_text(out, stop_ids, stops)
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if out.logprobs is not None:
                choice["logprobs"] = _logprobs(out.logprobs, chat)
            if body.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model_name, "choices": choices,
                "usage": usage(finals)}

    async def _outputs(handles, watch=None):
        """(choice index, item) as the choices' outputs arrive, in arrival order, until every
        choice has finished (or failed); (None, None) once `watch` completes (the client
        left). Gets still pending when the caller stops are cancelled."""
        gets = {i: asyncio.ensure_future(h.queue.get()) for i, h in enumerate(handles)}
        try:
            while gets:
                waiting = set(gets.values()) | ({watch} if watch is not None else set())
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch in done:
                    yield None, None
                    return
                for i in sorted(i for i, get in gets.items() if get in done):
                    item = gets.pop(i).result()
                    if not isinstance(item, Failed) and not item.finished:
                        gets[i] = asyncio.ensure_future(handles[i].queue.get())
                    yield i, item
        finally:
            for get in gets.values():
                get.cancel()

    async def _stream(handles, rid, created, chat, stops, stop_ids, usage, include_usage, body,
                      state):
        """Server-sent events: each choice's chunks as its outputs arrive (chunks of
        different choices interleave, each naming its index), then the usage (if asked) and
        [DONE]."""
        hold = max((len(s) for s in stops), default=1) - 1
        kind = "chat.completion.chunk" if chat else "text_completion"
        want_ids = body.return_token_ids
        n = len(handles)
        sent, offsets, logged = [0] * n, [0] * n, [0] * n  # text, its offset, logprobs sent
        finals: list = [None] * n

        def chunk(i, delta: str, reason, out) -> str:
            choice = {"index": i, "logprobs": None, "finish_reason": reason}
            if chat:
                choice["delta"] = {"content": delta} if delta or reason is None else {}
            else:
                choice["text"] = delta
            if out.logprobs is not None and len(out.logprobs) > logged[i]:
                choice["logprobs"] = _logprobs(out.logprobs[logged[i]:], chat, offsets[i])
                if not chat:
                    offsets[i] += sum(len(p) for p in choice["logprobs"]["tokens"])
                logged[i] = len(out.logprobs)
            if want_ids:
                choice["token_ids"] = out.new_token_ids
            data = {"id": rid, "object": kind, "created": created, "model": model_name,
                    "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n"

        finished = False
        try:
            if chat:
                for i in range(n):
                    head = {"id": rid, "object": kind, "created": created, "model": model_name,
                            "choices": [{"index": i,
                                         "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
                    yield f"data: {json.dumps(head)}\n\n"
            async with contextlib.aclosing(_outputs(handles)) as outputs:
                async for i, out in outputs:
                    if isinstance(out, Failed):
                        metrics.failed.inc()
                        finished = True
                        err = {"error": {"message": out.message, "type": "server_error",
                                         "param": None, "code": 500}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    if out.finished:
                        finals[i] = out
                        text = _final_text(out, stop_ids, stops)
                        yield chunk(i, text[sent[i]:], out.finish_reason, out)
                        continue
                    text = out.text or ""
                    visible = len(text) - hold
                    while visible > sent[i] and text[visible - 1] == "\ufffd":
                        visible -= 1
                    new_logprobs = out.logprobs is not None and len(out.logprobs) > logged[i]
                    if visible > sent[i] or want_ids or new_logprobs:
                        yield chunk(i, text[sent[i]:max(visible, sent[i])], None, out)
                        sent[i] = max(visible, sent[i])
                else:
                    finished = True
                    if include_usage:
                        data = {"id": rid, "object": kind, "created": created,
                                "model": model_name, "choices": [], "usage": usage(finals)}
                        yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state["finished"] = finished
            if not finished:
                for handle, out in zip(handles, finals):
                    if out is None:
                        driver.cancel(handle.request_id)

    return app


__all__ = ["LATENCY_BUCKETS", "LOGPROB_FLOOR", "ServerMetrics", "build_app"]
