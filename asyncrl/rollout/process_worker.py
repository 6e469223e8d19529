"""A rollout worker as a plain child process of the driver (`rollout.worker_pool: process`):
`python -m asyncrl.rollout.process_worker CMD_FD ANSWER_FD`, started by `process_pool.py`.

The channel is two pipes the driver passed down (never the command line, which `ps` shows):
length-framed msgpack maps, never pickle. Driver → worker: first `{"settings", "secret",
"parent", "cpus"}` (the worker's own sub-config, `settings_to_wire`; the driver's pid; the
cores it may use: the driver's before it pinned itself), then `{"id", "items"}` per submission and
`{"close"}` at the end. Worker → driver: `{"started": ""}` (or why it could not start), then
one `{"id", "results"}` or `{"id", "error"}` per submission.

The worker ends with its driver, however the driver ends: the command pipe's write end is held
by the driver alone, so a driver that exits (even killed by `kill -9`) gives the worker an EOF
on it, and the worker closes its connections and exits. A worker that cannot be built keeps
running and answers every prompt with a permanent failure (as the Ray pool's shell does), so
its replacement loop cannot spin.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from asyncrl.data.prompts import PromptItem
from asyncrl.rollout.settings import PromptResult, RolloutSettings

#: At its end, how long the worker gives its connections to close before it exits anyway.
CLOSE_GRACE_S = 2.0
#: How often the worker checks that its driver still lives (the EOF is the main signal; this
#: covers a write end that leaked into another process, which would hold the pipe open).
PARENT_CHECK_S = 1.0


def pack(message: dict[str, Any]) -> bytes:
    """One message on the wire; numpy scalars and arrays in prompt metadata go as plain values."""
    return msgpack.packb(message, use_bin_type=True, default=_plain)


def unpack(frame: bytes) -> dict[str, Any]:
    message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise ValueError(f"a rollout worker's message is not a map: {type(message).__name__}")
    return message


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays (a parquet row's values)
        return value.tolist()
    raise TypeError(f"{type(value).__name__} cannot go to a rollout worker process")


def settings_to_wire(settings: RolloutSettings) -> dict[str, Any]:
    """A worker's sub-config as plain values (the secret apart: bytes, not a config value)."""
    from asyncrl.config.loader import to_dict

    plain = to_dict(dataclasses.replace(settings, transport_secret=None))
    plain.pop("transport_secret")
    return {"settings": plain, "secret": settings.transport_secret}


def settings_from_wire(message: dict[str, Any]) -> RolloutSettings:
    """`settings_to_wire`'s inverse, each value checked against its field's type."""
    from asyncrl.config.loader import build

    settings = build(RolloutSettings, message["settings"], "rollout worker settings")
    return dataclasses.replace(settings, transport_secret=message.get("secret"))


def items_to_wire(items: list[PromptItem]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(item) for item in items]


def results_from_wire(rows: list[dict[str, Any]]) -> list[PromptResult]:
    return [PromptResult(**row) for row in rows]


class _Served:
    """The worker's side of the channel, on its event loop: submissions run concurrently, each
    answered once it ends. Only the loop's thread writes answers."""

    def __init__(self, answers: Connection, worker: Any, start_error: str) -> None:
        self.answers, self.worker, self.start_error = answers, worker, start_error
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()

    def on_message(self, message: dict[str, Any] | None) -> None:
        """A message from the driver (None: the driver is gone or closed the channel)."""
        if message is None or "close" in message:
            self.stop.set()
            return
        task = asyncio.get_running_loop().create_task(self.run(message["id"], message["items"]))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, ident: int, rows: list[dict[str, Any]]) -> None:
        items = [PromptItem(**row) for row in rows]
        answer: dict[str, Any] = {"id": ident}
        try:
            if self.worker is None:
                error = f"rollout worker failed to start: {self.start_error}"
                results = [PromptResult(it.key, False, error=error, permanent=True) for it in items]
            else:
                results = await self.worker.run_prompts(items)
            answer["results"] = [dataclasses.asdict(r) for r in results]
        except Exception as e:  # noqa: BLE001 - the driver re-issues the prompts
            answer["error"] = f"{type(e).__name__}: {e}"
        try:
            self.answers.send_bytes(pack(answer))
        except OSError:  # the driver is gone
            self.stop.set()


def _read_commands(commands: Connection, loop: asyncio.AbstractEventLoop, served: _Served) -> None:
    """A thread: the driver's messages onto the loop; None once the pipe ends (EOF)."""
    while True:
        try:
            message: dict[str, Any] | None = unpack(commands.recv_bytes())
        except (EOFError, OSError, ValueError):
            message = None
        loop.call_soon_threadsafe(served.on_message, message)
        if message is None or "close" in message:
            return


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if os.getppid() != parent:  # re-parented: the driver is gone
            stop.set()
        try:
            await asyncio.wait_for(stop.wait(), PARENT_CHECK_S)
        except TimeoutError:
            pass


async def serve(commands: Connection, answers: Connection, hello: dict[str, Any]) -> None:
    """Build the worker, say whether it started, answer submissions until the driver ends."""
    from asyncrl.rollout.worker import RolloutWorker

    worker, start_error = None, ""
    try:
        worker = RolloutWorker(settings_from_wire(hello))
    except Exception as e:  # noqa: BLE001 - reported whole to the driver
        start_error = f"{type(e).__name__}: {e}"
    served = _Served(answers, worker, start_error)
    answers.send_bytes(pack({"started": start_error}))
    loop = asyncio.get_running_loop()
    reader = threading.Thread(
        target=_read_commands, args=(commands, loop, served), name="asyncrl-commands", daemon=True
    )
    reader.start()
    await _watch_parent(int(hello["parent"]), served.stop)
    for task in list(served.tasks):
        task.cancel()
    if worker is not None:
        try:
            await asyncio.wait_for(worker.aclose(), CLOSE_GRACE_S)
        except Exception:  # noqa: BLE001 - a blocked send: the process ends anyway
            pass


def main(argv: list[str]) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the driver ends its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    commands = Connection(int(argv[0]), writable=False)
    answers = Connection(int(argv[1]), readable=False)
    try:
        hello = unpack(commands.recv_bytes())
    except (EOFError, OSError, ValueError):
        os._exit(0)  # the driver went before it sent the settings
    if hello.get("cpus") and hasattr(os, "sched_setaffinity"):  # before any other thread
        os.sched_setaffinity(0, hello["cpus"])
    try:
        asyncio.run(serve(commands, answers, hello))
    except BaseException as e:  # noqa: BLE001 - said on stderr; the driver sees the exit
        print(f"asyncrl rollout worker: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal exit: it would join the sender's thread, which a dead driver can block.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
