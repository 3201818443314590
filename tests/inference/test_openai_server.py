"""The server driven by the official ``openai`` client: its response models parse every reply (strictly);
text, ids, lists of them, n, echo + logprobs equal to the model's log-probs (1e-5), stop strings, streaming
with usage, /v1/models; a failing request fails alone with its own status; a dead engine is a 503."""

import asyncio
import json
import logging
import os
import time

import pytest
import torch

from megalite.inference import LLM, SamplingParams
from tests.inference.common import poison_logits
from tests.inference.server_harness import BYTES, Server, byte_model

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("aiohttp")
from openai.types import Completion  # noqa: E402


def _create(client, **body):
    """The reply's JSON, validated strictly by the client's own model, and the parsed object."""
    raw = client.completions.with_raw_response.create(model="megalite", **body)
    payload = json.loads(raw.http_response.text)
    checked = json.loads(raw.http_response.text)
    if body.get("echo") and body.get("logprobs") is not None:
        # The echoed prompt's first token has no log-prob: null, as OpenAI and vLLM send it and lm-eval expects
        # (it indexes the arrays by token); the client's type says float, so that one entry is set aside here.
        for choice in checked["choices"]:
            assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
            choice["logprobs"]["token_logprobs"][0], choice["logprobs"]["top_logprobs"][0] = 0.0, {}
    Completion.model_validate(checked)
    return payload, raw.parse()


def test_completions_through_the_openai_client(caplog):
    model = byte_model()
    with Server(model) as server, caplog.at_level(logging.INFO, logger="megalite.inference.access"):
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["megalite"]
        payload, parsed = _create(client, prompt="Hello", max_tokens=5, temperature=0)
        offline = LLM.from_model(model, tokenizer=BYTES).generate(["Hello"], SamplingParams(max_tokens=5,
                                                                                           temperature=0))[0]
        assert parsed.choices[0].text == offline.outputs[0].text
        assert parsed.usage.prompt_tokens == 5 and parsed.usage.total_tokens == 5 + parsed.usage.completion_tokens

        # A list of strings and lists of ids, n=2: choices numbered prompt * n + sample.
        payload, parsed = _create(client, prompt=["ab", "cde"], max_tokens=3, n=2, seed=1)
        assert [c.index for c in parsed.choices] == [0, 1, 2, 3]
        assert parsed.usage.prompt_tokens == 5
        _, by_ids = _create(client, prompt=[BYTES.tokenize("ab"), BYTES.tokenize("cde")], max_tokens=3, n=2, seed=1)
        _, one = _create(client, prompt=BYTES.tokenize("ab"), max_tokens=3, n=2, seed=1)
        assert [c.text for c in by_ids.choices] == [c.text for c in parsed.choices]
        assert [c.text for c in one.choices] == [c.text for c in parsed.choices[:2]]

        # echo + logprobs: the prompt's log-probs and the completion's equal the model's forward.
        payload, parsed = _create(client, prompt="Hello", max_tokens=1, temperature=0, logprobs=1, echo=True)
        lp = parsed.choices[0].logprobs
        ids = BYTES.tokenize("Hello") + payload["choices"][0]["token_ids"]
        with torch.no_grad():
            full = model(torch.tensor([ids]))[0].float().log_softmax(-1)
        assert lp.tokens[:5] == list("Hello") and lp.token_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - full[i - 1, ids[i]].item()) < 1e-5
        assert lp.text_offset == list(range(6)) and parsed.choices[0].text.startswith("Hello")
        assert all(max(top.values()) >= lp.token_logprobs[i] - 1e-6 for i, top in enumerate(lp.top_logprobs[1:], 1))

        chunks = list(client.completions.create(model="megalite", prompt="Hello", max_tokens=1, temperature=0,
                                                logprobs=1, echo=True, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == parsed.choices[0].text
        streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
        assert streamed == lp.token_logprobs

        # stop strings are cut from the text; streaming with usage gives the same text.
        _, plain = _create(client, prompt="abc", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        text = plain.choices[0].text
        stop = text[3:5]
        _, stopped = _create(client, prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == text[:text.index(stop)] and stopped.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model="megalite", prompt="abc", max_tokens=12, temperature=0,
                                                stop=[stop], stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == stopped.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == stopped.usage.completion_tokens
        assert chunks[-2].choices[0].finish_reason == "stop"

        with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
            client.completions.create(model="megalite", prompt="a", suffix="b")
        assert server.idle()
    lines = [r.getMessage() for r in caplog.records if r.name == "megalite.inference.access"]
    assert len(lines) == 11 and "GET /v1/models 200" in lines[0] and " 400 " in lines[-1]
    assert all("POST /v1/completions 200" in line for line in lines[1:-1])
    assert all("prompt_tokens=" in line and "latency=" in line for line in lines)


def test_a_failing_request_fails_alone_and_the_server_keeps_serving():
    """Issue 37's crashes: temperature 1e-300 / 5e-324 get a 400; NaN weights a 500 (server_error) per request,
    while the engine keeps serving."""
    with Server(byte_model()) as server:
        client = server.client()
        for temperature in (1e-300, 5e-324):
            with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
                client.completions.create(model="megalite", prompt=[1, 2, 3], max_tokens=3, temperature=temperature)
        _create(client, prompt=[1, 2, 3], max_tokens=3)
    poisoned = byte_model()
    with torch.no_grad():
        for param in poisoned.parameters():
            param.fill_(float("nan"))
    with Server(poisoned) as server:
        for body in ({"temperature": 1.0}, {"temperature": 0}, {"temperature": 1.0}):
            reply = requests.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, **body})
            assert reply.status_code == 500
            error = reply.json()["error"]
            assert error["type"] == "server_error" and "not finite" in error["message"]
        assert requests.get(f"{server.url}/health").status_code == 200
        metrics = dict(line.split() for line in requests.get(f"{server.url}/metrics").text.splitlines())
        assert float(metrics["megalite_requests_failed_total"]) == 3
        assert server.idle()


def test_a_failing_request_fails_alone_beside_others(monkeypatch):
    """Concurrent requests: the one whose logits turn NaN gets its 500, the others their normal replies."""
    import concurrent.futures

    model = byte_model()
    bodies = [{"prompt": [1 + i, 2, 3], "max_tokens": 6, "seed": i} for i in range(4)]
    alone = LLM.from_model(model, tokenizer=BYTES)  # the server's tokenizer: its end of document stops a sample too
    expected = [alone.generate([b["prompt"]], SamplingParams(max_tokens=6, seed=b["seed"]))[0] for b in bodies]
    poison_logits(monkeypatch, seed=1)
    with Server(model) as server:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: requests.post(f"{server.url}/v1/completions", json=b), bodies))
        assert [r.status_code for r in replies] == [200, 500, 200, 200]
        for i in (0, 2, 3):
            assert replies[i].json()["choices"][0]["token_ids"] == expected[i].outputs[0].token_ids
        assert server.idle() and server.loop.alive


def test_a_dead_engine_answers_503():
    with Server(byte_model()) as server:
        def broken():
            raise RuntimeError("scheduler bug")

        server.llm.engine.step = broken
        reply = requests.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert reply.status_code == 500 and "engine failure: scheduler bug" in reply.json()["error"]["message"]
        assert reply.json()["error"]["type"] == "server_error"
        for _ in range(100):
            if not server.loop.thread.is_alive():
                break
            time.sleep(0.02)
        assert requests.get(f"{server.url}/health").status_code == 503
        reply = requests.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"


@pytest.mark.slow
def test_the_cli_exits_nonzero_when_the_engine_dies_and_loads_no_weights_itself(tmp_path, monkeypatch):
    """``serve``'s engine process serves a request, then dies (killed, as by the OOM killer): the server stops
    with status 1 so a supervisor restarts it.  The HTTP process never loads the weights (loading them raises
    here; the spawned engine process is a fresh interpreter, which loads them)."""
    import signal

    from megalite.checkpoint import save_sharded
    from megalite.inference import llm as llm_module
    from megalite.inference import serve
    from tests.inference.server_harness import exits

    model = byte_model()
    save_sharded(str(tmp_path / "ckpt"), 1, [model], extra={"args": {}})
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    expected = LLM.from_model(model).generate([[1, 2, 3]], params)
    seen = []

    def no_weights_here(*args, **kwargs):
        raise AssertionError("the HTTP process loaded the model")

    async def drive(client, config, tokenizer, template, args):  # in place of the HTTP server
        events = client.submit("r0", [1, 2, 3], params)
        while not (event := await events.get())["done"]:
            pass
        seen.append(event["output"].outputs[0].token_ids)
        os.kill(client.pid, signal.SIGKILL)
        seen.append(exits(client.pid))
        while client.alive:
            await asyncio.sleep(0.05)
        seen.append(client.error)

    monkeypatch.setattr(llm_module, "_load", no_weights_here)
    monkeypatch.setattr(serve, "_serve", drive)
    assert serve.main(["--load", str(tmp_path / "ckpt")]) == 1
    assert seen == [expected[0].outputs[0].token_ids, True, "the engine process exited with status -9"]
