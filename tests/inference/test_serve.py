"""The HTTP server: 8 concurrent streams give the offline API's tokens; bad requests get 400; disconnects and
many requests leave no KV blocks behind; /metrics reports the engine."""

import asyncio
import json
import subprocess

import pytest

from megalite.inference import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from megalite.inference.api_server import ServerConfig, build_app
from megalite.inference.engine_client import EngineThread
from megalite.inference.chat_template import ChatTemplateError
from megalite.inference.serve import chat_template, parse_args
from tests.inference.common import VOCAB, tiny_model
from tests.inference.server_harness import engine_pid, exits, serve_command

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

ENGINE = EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=32)
PROMPTS = [[(3 * i + j) % VOCAB for j in range(2 + i)] for i in range(8)]


async def _with_server(engine, body):
    loop = EngineThread(engine)
    loop.start()
    runner = web.AppRunner(build_app(loop, ServerConfig(max_body_bytes=4096, max_tokens_limit=250)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            return await body(session, url, loop)
    finally:
        await runner.cleanup()
        loop.stop()


async def _stream(session, url, prompt, max_tokens, seed):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": seed, "stream": True,
            "logprobs": 1}
    tokens, events = [], 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events += 1
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice["token_ids"]
    return tokens, events


def _idle(engine):
    return engine.allocator.num_used() == 0 and not engine.requests and not engine.has_unfinished()


def test_concurrent_streams_bad_requests_disconnects_and_no_leaks():
    model = tiny_model(max_position_embeddings=256)
    offline = LLM.from_model(model, engine_config=ENGINE).generate(
        PROMPTS, [SamplingParams(max_tokens=5 + i, temperature=0.9, seed=100 + i) for i in range(8)])
    expected = [o.outputs[0].token_ids for o in offline]
    engine = LLM.from_model(model, engine_config=ENGINE).engine

    async def body(session, url, loop):
        results = await asyncio.gather(*[_stream(session, url, p, 5 + i, 100 + i) for i, p in enumerate(PROMPTS)])
        assert [tokens for tokens, _ in results] == expected
        assert all(events > 1 for _, events in results)

        bad = [b"{not json", json.dumps({"max_tokens": 3}).encode(), json.dumps([1, 2]).encode()]
        bad += [json.dumps({"prompt": [1, 2], **extra}).encode() for extra in (
            {"n": 0}, {"temperature": -1}, {"top_p": 0}, {"max_tokens": 251}, {"max_tokens": "3"},
            {"stream": "yes"}, {"unknown": 1}, {"stop_token_ids": ["a"]})]
        bad += [json.dumps({"prompt": [1, VOCAB]}).encode(), json.dumps({"prompt": "text"}).encode(),
                json.dumps({"prompt": [1] * 300}).encode()]
        for data in bad:
            async with session.post(f"{url}/v1/completions", data=data) as response:
                assert response.status == 400, data
                assert (await response.json())["error"]["message"]
        async with session.post(f"{url}/v1/completions", data=b"[" + b"1," * 3000 + b"1]") as response:
            assert response.status == 413

        # A client that goes away mid-stream: its request is aborted and its blocks freed.
        response = await session.post(f"{url}/v1/completions",
                                      json={"prompt": [1, 2, 3], "max_tokens": 240, "stream": True})
        await response.content.readline()
        response.close()
        for _ in range(200):
            if _idle(engine):
                break
            await asyncio.sleep(0.05)
        assert _idle(engine)

        for i in range(200):
            request = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, i % VOCAB], "max_tokens": 2, "n": 1 + i % 2}
            async with session.post(f"{url}/v1/completions", json=request) as response:
                assert response.status == 200
                payload = await response.json()
                assert len(payload["choices"]) == 1 + i % 2
                assert all(len(c["token_ids"]) == 2 for c in payload["choices"])
        assert _idle(engine)
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        values = dict(line.split() for line in text.splitlines())
        assert float(values["megalite_time_to_first_token_seconds_count"]) >= 208
        for name in ("request_submit", "request_admission", "request_queue"):  # each request, once
            assert float(values[f"megalite_{name}_seconds_count"]) >= 200, name
        assert float(values["megalite_kv_blocks_used"]) == 0
        assert float(values["megalite_requests_aborted_total"]) == 1
        assert float(values["megalite_generation_tokens_per_second"]) > 0
        assert 0 < float(values["megalite_prefix_cache_hit_rate"]) <= 1

    asyncio.run(_with_server(engine, body))


@pytest.mark.slow
def test_cli_binds_loopback_by_default_and_serves_a_checkpoint_with_its_tokenizer(tmp_path):
    """``serve --load CKPT`` with no --tokenizer answers a text prompt through the openai client, as LLM(CKPT);
    SIGTERM stops it (status 0) and its engine process with it."""
    openai = pytest.importorskip("openai")
    assert parse_args(["--load", "x"]).host == "127.0.0.1"
    from megalite.checkpoint import save_sharded
    from megalite.data.synthetic import generate_corpus
    from megalite.data.tokenizer import train_sentencepiece

    sp = train_sentencepiece(generate_corpus(100, seed=0), str(tmp_path / "sp"), 100)
    save_sharded(str(tmp_path / "ckpt"), 1, [tiny_model("gpt2", vocab_size=128)],
                 extra={"args": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp}})
    expected = LLM(str(tmp_path / "ckpt")).generate(["Ada has"], SamplingParams(max_tokens=4, temperature=0))
    command, env = serve_command(str(tmp_path / "ckpt"))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="megalite", prompt="Ada has", max_tokens=4, temperature=0)
        assert reply.choices[0].text == expected[0].outputs[0].text
        assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids)
        engine = engine_pid(proc.pid)
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        assert exits(engine)
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_cli_chat_template_flag(tmp_path):
    """``--chat-template FILE`` serves chat through the openai client; a file that does not load exits 2 before
    serving; with no template at all the server still starts and keeps the reason for chat requests' 400.  A
    server killed outright (SIGKILL) leaves no engine process behind."""
    openai = pytest.importorskip("openai")
    from megalite.checkpoint import save_sharded
    from megalite.data.synthetic import generate_corpus
    from megalite.data.tokenizer import train_sentencepiece

    sp = train_sentencepiece(generate_corpus(100, seed=0), str(tmp_path / "sp"), 100)
    save_sharded(str(tmp_path / "ckpt"), 1, [tiny_model("gpt2", vocab_size=128)],
                 extra={"args": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp}})
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                         "{% if add_generation_prompt %}assistant:{% endif %}")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    command, env = serve_command(str(tmp_path / "ckpt"))
    bad = subprocess.run(command + ["--chat-template", str(tmp_path / "bad.jinja")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and "does not compile" in bad.stdout + bad.stderr
    messages = [{"role": "user", "content": "Ada has"}]
    proc = subprocess.Popen(command + ["--chat-template", str(tmp_path / "chat.jinja")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="megalite", messages=messages, max_tokens=4, temperature=0)
        llm = LLM(str(tmp_path / "ckpt"))
        expected = llm.generate(["user: Ada has\nassistant:"], SamplingParams(max_tokens=4, temperature=0))
        assert reply.choices[0].message.content == expected[0].outputs[0].text
        assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids)
        engine = engine_pid(proc.pid)
        proc.kill()
        proc.wait(timeout=60)
        assert exits(engine)  # its pipe closed: it stopped
    finally:
        proc.kill()
        proc.wait(timeout=60)
    # No template anywhere: the server starts, and chat requests get this error's message as their 400.
    assert isinstance(chat_template(llm.tokenizer, None), ChatTemplateError)
    # The engine compiles structured outputs for the checkpoint's tokenizer and the model's vocabulary.
    pytest.importorskip("llguidance")
    assert llm.engine.compile_grammar(StructuredOutputsParams(json_object=True)).compiler.vocab_size == 128
