"""`fo-jax serve` end to end in a subprocess: the embedded model (resident: the offloaded
programs take longer to compile; the offload metrics are checked in test_driver.py); the
openai client gets a reply and streams another; SIGTERM mid-stream ends the stream
("cancelled" after the drain time) and the process exits 0."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_embedded_then_sigterm():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fo_jax.cli", "serve", "--port", str(port), "--seats", "1",
           "--capacity", "64", "--prefill-chunk", "16",
           "--shutdown-timeout", "0.5", "--log-level", "warning", "--no-warmup"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="trained-small", prompt="def read_lines(path):",
                                          max_tokens=4, temperature=0)
        assert reply.choices[0].text and reply.usage.completion_tokens <= 4
        metrics = httpx.get(url + "/metrics").text
        assert 'fojax_requests_completed_total{finish_reason="length"} 1.0' in metrics

        chunks, first, errors = [], threading.Event(), []

        def stream():
            try:
                for chunk in client.chat.completions.create(
                        model="trained-small", messages=[{"role": "user", "content": "hi"}],
                        max_tokens=60, stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
                    if chunk.choices and chunk.choices[0].delta.content:
                        first.set()  # a token came: the request is decoding
            except openai.APIError as err:
                errors.append(err)
            finally:
                first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive() and not errors, errors
        assert chunks[-1].choices[0].finish_reason in ("cancelled", "length")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
