"""The hf server's weight-group endpoints, as SGLang's: `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`.

Group operations run one at a time (one lock), each in a daemon thread (a receive stuck until
its group timeout never holds up the server's shutdown), and run to completion even when the
sender hangs up: collectives on a group must run in the same order on every rank.

One exception, for the heal: the sender destroys a group while this engine is still inside a
receive on it. That is what a peer engine dying mid-broadcast leaves behind: the learner's
side fails at once (its connection to the dead peer closes), this engine's waits for bytes that
will never come, and gloo cannot interrupt that wait short of the group timeout (minutes).
Holding the lock that long would queue the destroy and the new group's init behind it, and the
heal would time out. So the destroy abandons the receive (`WeightReceiver.abandon`): the group
is dropped, the lock released, and the receive, whenever its timeout ends it, changes nothing.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from asyncrl.engine.hf.protocol import field, group_init, ok_reply, read_json, version
from asyncrl.engine.hf.weights import WeightReceiver, abandoned
from asyncrl.net import in_daemon_thread

RECEIVER = web.AppKey("receiver", WeightReceiver)
_LOCK = web.AppKey("group_lock", asyncio.Lock)
# group name -> the future that abandons the receive in flight on it (set while one runs)
_IN_FLIGHT = web.AppKey("group_receives", dict)
_TIMEOUT_S = web.AppKey("group_timeout_s", float)


def add_weight_routes(app: web.Application, receiver: WeightReceiver, timeout_s: float) -> None:
    """Serve `receiver`'s groups on `app`; `timeout_s`: a group's timeout when init names none."""
    app[RECEIVER], app[_LOCK], app[_IN_FLIGHT], app[_TIMEOUT_S] = (
        receiver, asyncio.Lock(), {}, timeout_s,
    )  # fmt: skip
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)


async def _locked(app: web.Application, fn, *args, receive_on: str | None = None):
    """`fn(*args)` in a daemon thread under the group lock, immune to client disconnects (the
    shield: a sender that gives up must not release the lock while the thread is inside a
    collective). `receive_on`: a receive on that group, which a destroy may abandon."""

    async def run():
        async with app[_LOCK]:
            work = in_daemon_thread(fn, *args)
            if receive_on is None:
                return await work
            abandon = asyncio.get_running_loop().create_future()
            app[_IN_FLIGHT][receive_on] = abandon
            try:
                await asyncio.wait({work, abandon}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                app[_IN_FLIGHT].pop(receive_on, None)
            if work.done():
                return work.result()
            work.add_done_callback(lambda f: f.exception())  # ends at its timeout, unread
            return False, abandoned(receive_on)

    return await asyncio.shield(asyncio.ensure_future(run()))


async def init_weights_update_group(request: web.Request) -> web.Response:
    args = group_init(read_json(await request.read()), request.app[_TIMEOUT_S])
    ok, msg = await _locked(request.app, request.app[RECEIVER].init_group, *args)
    return ok_reply(ok, msg)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = read_json(await request.read())
    name = field(body, "group_name", str, "weight_update_group")
    receiver, abandon = request.app[RECEIVER], request.app[_IN_FLIGHT].get(name)
    if abandon is None:
        ok, msg = await _locked(request.app, receiver.destroy_group, name)
        return ok_reply(ok, msg)

    async def abandoning() -> tuple[bool, str]:  # its sender is gone: no byte of it will come
        result = await asyncio.to_thread(receiver.abandon, name)
        if not abandon.done():
            abandon.set_result(None)  # the receive's handler answers and releases the lock
        return result

    ok, msg = await asyncio.shield(asyncio.ensure_future(abandoning()))  # even if we hang up
    return ok_reply(ok, msg)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = read_json(await request.read())
    names, dtypes, shapes = (field(body, k, list) for k in ("names", "dtypes", "shapes"))
    group = field(body, "group_name", str, "weight_update_group")
    fmt = field(body, "load_format", str, None)
    new_version = version(body, "weight_version", required=False)
    receiver = request.app[RECEIVER]
    args = (names, dtypes, shapes, group, fmt, new_version)  # the version loads with the bucket
    ok, msg = await _locked(request.app, receiver.update, *args, receive_on=group)
    if ok and new_version is not None:
        msg += f" Weight version updated to {receiver.engine.weight_version}."
    return ok_reply(ok, msg)
