"""Concurrent /generate calls merged into one request (`engine/coalesce.py`): the Coalescer with
a recording send, and the real EngineClient against the fake engine of test_client.py."""

from __future__ import annotations

import asyncio

import pytest
from test_client import GOOD, variant, with_fake

from asyncrl.engine.coalesce import Coalescer
from asyncrl.engine.replies import EngineError, refused_request


class Sends:
    """A send that records each call and answers each request with (request, call number);
    `fail`: an exception for calls whose requests include any of `bad` (all calls if empty)."""

    def __init__(self, fail: BaseException | None = None, bad: tuple = ()) -> None:
        self.calls: list[tuple[object, list]] = []
        self.fail, self.bad = fail, bad
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, key, requests: list) -> list:
        self.calls.append((key, list(requests)))
        number = len(self.calls)
        await self.gate.wait()
        if self.fail is not None and (not self.bad or set(requests) & set(self.bad)):
            raise self.fail
        return [(r, number) for r in requests]


def run(coro):
    return asyncio.run(coro)


def test_calls_of_one_turn_with_one_key_go_out_as_one_each_getting_its_own_replies():
    async def main():
        send = Sends()
        c = Coalescer(send, refused_request)
        outs = await asyncio.gather(
            c.submit("k", ["a", "b"]), c.submit("k", ["c"]), c.submit("other", ["d"])
        )
        assert outs == [[("a", 1), ("b", 1)], [("c", 1)], [("d", 2)]]
        assert send.calls == [("k", ["a", "b", "c"]), ("other", ["d"])]
        assert c.merged == 2
        assert await c.submit("k", ["e"]) == [("e", 3)]  # a later turn: a call of its own

    run(main())


def test_a_refused_merged_call_is_sent_again_per_caller_so_only_the_bad_one_fails():
    async def main():
        refused = EngineError("http://e", "/generate answered HTTP 400: bad token", 400)
        send = Sends(fail=refused, bad=("bad",))
        c = Coalescer(send, refused_request)
        good, bad = await asyncio.gather(
            c.submit("k", ["ok"]), c.submit("k", ["bad"]), return_exceptions=True
        )
        assert good == [("ok", 2)] and bad is refused
        assert [r for _, r in send.calls] == [["ok", "bad"], ["ok"], ["bad"]]

    run(main())


@pytest.mark.parametrize("status", [None, 500, 503])
def test_any_other_failure_is_every_callers_without_a_resend(status):
    async def main():
        error = EngineError("http://e", "/generate failed: reset", status)
        send = Sends(fail=error)
        c = Coalescer(send, refused_request)
        outs = await asyncio.gather(c.submit("k", [1]), c.submit("k", [2]), return_exceptions=True)
        assert outs == [error, error] and len(send.calls) == 1

    run(main())


def test_a_cancelled_caller_drops_its_share_and_the_last_one_cancels_the_request():
    async def main():
        send = Sends()
        send.gate.clear()  # the request is in flight until the gate opens
        c = Coalescer(send, refused_request)
        first = asyncio.ensure_future(c.submit("k", ["a"]))
        second = asyncio.ensure_future(c.submit("k", ["b"]))
        while not send.calls:
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        (task,) = c._tasks
        assert not task.cancelled()  # the other caller still waits on it
        send.gate.set()
        assert await second == [("b", 1)]
        send.gate.clear()
        third = asyncio.ensure_future(c.submit("k", ["c"]))
        while len(send.calls) < 2:
            await asyncio.sleep(0)
        (task,) = c._tasks
        third.cancel()
        await asyncio.gather(third, task, return_exceptions=True)
        assert task.cancelled()  # its only caller left: the connection closes

    run(main())


def test_the_client_merges_a_workers_groups_into_one_post_and_checks_each_reply_alone():
    async def test(fake, client):
        fake.reply = [GOOD, variant(weight_version="8"), variant(output_token_logprobs=None)]
        group_a = [{"input_ids": [3], "rid": "a0"}, {"input_ids": [3], "rid": "a1"}]
        group_b = [{"input_ids": [4], "rid": "b0"}]
        a, b = await asyncio.gather(
            client.generate(group_a), client.generate(group_b), return_exceptions=True
        )
        assert len(fake.bodies) == 1  # one POST for both groups
        body = fake.bodies[0][1]
        assert body["input_ids"] == [[3], [3], [4]] and body["rid"] == ["a0", "a1", "b0"]
        assert [o.version for o in a] == [7, 8]
        assert isinstance(b, EngineError) and "logprob" in str(b)  # its own reply was bad
        fake.reply = [GOOD]
        await asyncio.gather(client.generate(group_b, priority=1), client.generate(group_b))
        assert [b.get("priority") for _, b in fake.bodies[1:]] == [1, None]  # keys differ

    asyncio.run(with_fake(test))


def test_groups_of_other_namespaces_are_not_merged_so_each_body_has_one_extra_key():
    async def test(fake, client):
        fake.reply = [GOOD]
        own = [{"input_ids": [3], "extra_key": "mine"}]
        await asyncio.gather(client.generate(own), client.generate([{"input_ids": [4]}]))
        assert sorted(b["extra_key"] for _, b in fake.bodies) == ["asyncrl-w0", "mine"]

    asyncio.run(with_fake(test))
