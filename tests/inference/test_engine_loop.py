"""The server's engine thread and the events it hands the HTTP handlers: one thread hop per engine step (not
one per request), and a handler takes every event waiting for it at once (its chunks then go out in one
write)."""

import asyncio


from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.engine_loop import EngineLoop
from tests.inference.server_harness import BYTES, byte_model


def _event(rid, tokens, text, done=False):
    choice = {"index": 0, "token_ids": tokens, "text": text, "finish_reason": "length" if done else None,
              "logprobs": None, "top_logprobs": None}
    return {"request_id": rid, "choices": [choice], "done": done}


class _Loop:
    """Records what the engine thread hands over (an asyncio loop's ``call_soon_threadsafe``)."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, callback, *args):
        self.calls.append((callback, args))


class _Queue(list):
    put_nowait = list.append


def test_one_thread_hop_per_engine_step():
    """Every request's event of one step reaches the asyncio loop in one call (it used to be one per request,
    each waking the loop through its pipe)."""
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=64))
    loop, aio, queues = EngineLoop(llm.engine), _Loop(), [_Queue() for _ in range(4)]
    for i, events in enumerate(queues):
        loop._handle(("add", f"r{i}", [65 + i, 66], SamplingParams(max_tokens=3, temperature=0), aio, events))
    steps = 0
    while llm.engine.has_unfinished():
        loop._publish(llm.engine.step())
        loop._flush()
        steps += 1
    assert len(aio.calls) == steps == 3
    for callback, args in aio.calls:
        callback(*args)
    for events in queues:
        assert [len(e["choices"][0]["token_ids"]) for e in events] == [1, 1, 1] and events[-1]["done"]


class _Request:
    class transport:
        @staticmethod
        def is_closing():
            return False


def test_exchange_takes_every_waiting_event_at_once():
    from megalite.inference.exchange import Exchange

    async def run():
        exchange = Exchange(EngineLoop(None), _Request(), 60.0, "cmpl-1")
        exchange.open = {"cmpl-1-0"}
        waiting = asyncio.ensure_future(exchange.take())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing to take yet: it waits
        exchange.put_nowait(_event("cmpl-1-0", [0], "0"))
        assert [e["choices"][0]["text"] for e in await waiting] == ["0"]  # woken by the event
        for i in (1, 2):
            exchange.put_nowait(_event("cmpl-1-0", [i], str(i), done=i == 2))
        assert [e["choices"][0]["text"] for e in await exchange.take()] == ["1", "2"]  # both, in one take
        assert exchange.completion_tokens == 3 and not exchange.open
        exchange.close()
        assert not exchange.live

    asyncio.run(run())
