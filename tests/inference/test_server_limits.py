"""Denial-of-service limits from issue 37: n/best_of bounded, oversized integers / deep JSON / non-integer logprobs
are 400s, a slow body times out (408), a full queue answers 429 with Retry-After, a request past its timeout is
504 and aborted, and a non-streaming client that disconnects has its request aborted."""

import asyncio
import json
import re
import socket
import time

import pytest

from megalite.inference.api_server import ServerConfig
from tests.inference.server_harness import Server, byte_model

requests = pytest.importorskip("requests")
aiohttp = pytest.importorskip("aiohttp")


def _slow(server, seconds=0.01):
    """Make each engine step take at least ``seconds`` (so requests stay in flight long enough to test)."""
    engine, step = server.llm.engine, server.llm.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def _metrics(server):
    return {k: float(v) for k, v in (line.split() for line in requests.get(f"{server.url}/metrics").text.splitlines())}


def _wait_idle(server):
    for _ in range(200):
        if server.idle() and server.loop.pending == 0:
            return True
        time.sleep(0.02)
    return False


def test_bad_bodies_are_400s():
    with Server(byte_model(), ServerConfig(max_tokens_limit=100, max_n=4)) as server:
        url = f"{server.url}/v1/completions"
        cases = [
            (b'{"prompt": [1, 2], "max_tokens": ' + b"9" * 5000 + b"}", "malformed JSON"),
            (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
            (b'{"prompt": [1, 2], "temperature": NaN}', "malformed JSON"),
            (json.dumps({"prompt": [1, 2], "logprobs": "no"}).encode(), "logprobs must be null or an integer"),
            (json.dumps({"prompt": [1, 2], "logprobs": True}).encode(), "logprobs must be null or an integer"),
            (json.dumps({"prompt": [1, 2], "n": 5}).encode(), r"n must be at most 4 \(--max-n\)"),
            (json.dumps({"prompt": [1, 2], "n": 2, "best_of": 100000}).encode(), "best_of must be at most 4"),
            (json.dumps({"prompt": [1, 2], "seed": 10 ** 4000}).encode(), r"seed must be None or an integer in"),
            (json.dumps({"prompt": [1, 2], "temperature": 10 ** 400}).encode(), "temperature must be"),
            (json.dumps({"prompt": [1, 2], "logit_bias": {"x": 1}}).encode(), "logit_bias keys must be token ids"),
            (json.dumps({"prompt": [[1], "a", 3]}).encode(), "prompt must be a string, a list of strings"),
            (json.dumps({"prompt": [1], "stop": ["x"] * 17}).encode(), "stop may list at most 16 strings"),
            (json.dumps({"prompt": "a", "stream": True, "n": 1, "best_of": 2}).encode(), "cannot be streamed"),
            (json.dumps({"prompt": "a", "stream_options": {"include_usage": True}}).encode(), "only allowed with"),
        ]
        for data, message in cases:
            reply = requests.post(url, data=data)
            assert reply.status_code == 400, (data[:60], reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert re.search(message, error["message"]), (message, error["message"])
        assert server.idle()


def test_slow_body_times_out():
    with Server(byte_model(), ServerConfig(body_timeout_s=0.3)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\"")
            started = time.perf_counter()
            reply = sock.recv(4096).decode()
            assert reply.startswith("HTTP/1.1 408") and time.perf_counter() - started < 5


def test_full_queue_answers_429_and_recovers():
    """200 concurrent requests against a bound of 8: the rest get 429 + Retry-After; nothing is left behind."""
    with Server(byte_model(), ServerConfig(max_pending=8, max_tokens_limit=50)) as server:
        _slow(server, 0.005)

        async def run():
            async with aiohttp.ClientSession() as session:
                async def one(i):
                    body = {"prompt": [1 + i % 50, 2], "max_tokens": 20}
                    async with session.post(f"{server.url}/v1/completions", json=body) as reply:
                        return reply.status, reply.headers.get("Retry-After"), await reply.json()

                return await asyncio.gather(*[one(i) for i in range(200)])

        results = asyncio.run(run())
        ok = [r for r in results if r[0] == 200]
        rejected = [r for r in results if r[0] == 429]
        assert len(ok) + len(rejected) == 200 and len(ok) >= 8 and rejected
        assert all(r[1] == "1" and r[2]["error"]["type"] == "rate_limit_error" for r in rejected)
        assert _wait_idle(server)
        metrics = _metrics(server)
        assert metrics["megalite_requests_rejected_total"] == len(rejected)
        assert metrics["megalite_requests_pending"] == 0 and metrics["megalite_queue_depth"] == 0
        assert requests.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200


def test_request_timeout_is_504_and_aborts():
    with Server(byte_model(), ServerConfig(request_timeout_s=0.3)) as server:
        _slow(server, 0.02)
        reply = requests.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 150})
        assert reply.status_code == 504 and reply.json()["error"]["type"] == "timeout_error"
        assert _wait_idle(server)
        metrics = _metrics(server)
        assert metrics["megalite_requests_timed_out_total"] == 1 and metrics["megalite_requests_aborted_total"] == 1


def test_non_streaming_client_that_disconnects_is_aborted():
    with Server(byte_model()) as server:
        _slow(server, 0.02)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 150}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            for _ in range(100):
                if server.llm.engine.requests:
                    break
                time.sleep(0.01)
            assert server.llm.engine.requests
        assert _wait_idle(server)
        assert _metrics(server)["megalite_requests_aborted_total"] == 1
