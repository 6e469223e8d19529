"""The weight sync stages on the learner's device, and every thread it allocates or
communicates on selects that device first.

No GPU here: the learner reports `cuda:5`, and only the edges are fake -- `torch.cuda.
set_device` (recorded per thread, as CUDA keeps the current device per thread), the NCCL group
itself (`create_group`), the engines' HTTP side and their processes. The sender and the fleet
run for real; the learners' exports yield nothing, so no tensor ever needs a real cuda:5. The
same on a real GPU (learner on cuda:1 / cuda:0): tests/gpu/test_staging_device_gpu.py.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.device import SPECS
from asyncrl.net import AsyncRunner
from asyncrl.weights import sync as sync_module
from asyncrl.weights.group import staging_device
from asyncrl.weights.sync import WeightSender, WeightSyncError

LEARNER = torch.device("cuda", 5)


class Devices:
    """`torch.cuda.set_device`, recorded: each thread's current device, and every call."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[int, torch.device]] = []

    def set_device(self, device: object) -> None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self.calls.append((threading.get_ident(), dev))
        self._local.device = dev

    def current(self) -> torch.device | None:
        """This thread's selected device; None: never selected (CUDA's device 0)."""
        return getattr(self._local, "device", None)


class Group:
    """The NCCL group (edge): where its creating thread stood when it was made."""

    def __init__(self, devices: Devices) -> None:
        self.devices, self.made_on, self.destroyed = devices, [], False

    def create(self, backend, address, port, rank, world, name, timeout):
        self.made_on.append((threading.get_ident(), self.devices.current(), backend, rank))
        return self


class Engine:
    """An engine's weight-update endpoints (the HTTP edge), each call recorded."""

    def __init__(self, url: str = "http://engine-0") -> None:
        self.url, self.calls = url, []

    async def init_weights_update_group(self, *args) -> dict:
        self.calls.append("init")
        return {"success": True}

    async def update_weights(self, *args, **kwargs) -> dict:
        self.calls.append("update")
        return {"success": True}

    async def prepare_update(self, pause_mode, timeout_s) -> None:
        self.calls.append("prepare")

    async def finish_update(self, version, pause_mode) -> None:
        self.calls.append("finish")

    async def destroy_weights_update_group(self, group_name) -> dict:
        self.calls.append("destroy")
        return {"success": True}

    async def close(self) -> None:
        pass


class Learner:
    """A learner on cuda:5 whose export notes the thread driving it and that thread's device
    when it starts (where a Megatron export allocates its pipeline buffers), then ends."""

    version = 0

    def __init__(self, devices: Devices) -> None:
        self.devices, self.exports = devices, []
        self.sync_device = LEARNER

    def weights_for_sync(self):
        self.exports.append((threading.get_ident(), self.devices.current()))
        yield from ()


@pytest.fixture
def cuda5(monkeypatch):
    devices = Devices()
    group = Group(devices)
    monkeypatch.setattr(torch.cuda, "set_device", devices.set_device)
    monkeypatch.setattr(sync_module, "create_group", group.create)
    monkeypatch.setattr(sync_module, "destroy_group", lambda g: None)
    return devices, group


def test_staging_device_is_the_learners():
    assert staging_device("nccl", LEARNER) == LEARNER
    assert staging_device("nccl", torch.device("cuda")) == torch.device("cuda", 0)
    assert staging_device("gloo", LEARNER) == torch.device("cpu")
    # a learner on the CPU feeding NCCL engines: device 0 (nothing better is known)
    assert staging_device("nccl", torch.device("cpu")) == torch.device("cuda", 0)


def test_sender_forms_the_group_and_exports_on_the_learners_device(cuda5):
    """Rank 0 is created on cuda:5 in its own thread, which selected it first; the control
    thread selects it before the learner's export starts; nothing selects device 0."""
    devices, group = cuda5
    learner, engine = Learner(devices), Engine()

    async def go() -> threading.Thread:
        sender = WeightSender(group_name="cuda5", timeout_s=5)
        await sender.init_group([engine], master_port=1, backend="nccl", device=LEARNER)
        assert sender.device == LEARNER
        loop_thread = threading.get_ident()
        assert devices.current() is None  # the group's thread selected it, not this one
        with pytest.raises(WeightSyncError, match="no tensors to send"):
            await sender.sync(learner.weights_for_sync(), 1, device=learner.sync_device)
        await sender.close()
        return loop_thread

    loop_thread = asyncio.run(go())
    ((made_by, made_on, backend, rank),) = group.made_on
    assert (made_on, backend, rank) == (LEARNER, "nccl", 0) and made_by != loop_thread
    assert learner.exports == [(loop_thread, LEARNER)]
    assert {d for _, d in devices.calls} == {LEARNER}
    assert engine.calls == ["init", "prepare", "destroy"]


def test_sync_refuses_a_learner_on_another_device_before_any_call(cuda5):
    devices, _ = cuda5
    engine = Engine()

    async def go() -> None:
        sender = WeightSender(group_name="moved", timeout_s=5)
        await sender.init_group([engine], master_port=1, backend="nccl", device=LEARNER)
        with pytest.raises(WeightSyncError, match="cuda:4.*formed on cuda:5"):
            await sender.sync([], 1, device=torch.device("cuda", 4))
        assert engine.calls == ["init"]  # not paused: the group stays usable

    asyncio.run(go())


def test_gloo_never_selects_an_accelerator(cuda5):
    """The CPU path: a learner's accelerator does not matter to a gloo group (host buckets)."""
    devices, group = cuda5

    async def go() -> None:
        sender = WeightSender(group_name="host", timeout_s=5)
        await sender.init_group([Engine()], master_port=1, backend="gloo", device=LEARNER)
        assert sender.device == torch.device("cpu")
        with pytest.raises(WeightSyncError, match="no tensors"):
            await sender.sync([], 1, device=LEARNER)

    asyncio.run(go())
    assert devices.calls == [] and group.made_on[0][1] is None


class Handle:
    def __init__(self, url: str) -> None:
        self.url = url

    def stop(self) -> None:
        pass


class Launcher:
    """Engine processes (edge): one CUDA engine, already up."""

    device, tp_size = SPECS["cuda"], 1

    def launch(self, index: int) -> Handle:
        return Handle(f"http://engine-{index}")

    def close(self) -> None:
        pass


def test_fleet_made_before_the_learner_syncs_on_the_learners_device(cuda5, monkeypatch, tmp_path):
    """As in a run: the fleet (and its senders) exist before the learner; the group and every
    sync take the device the learner reports then, on each thread that touches the weights:
    the group's, the control loop's (export), the caller's (an overlapped sync's copies)."""
    from asyncrl.engine import fleet as fleet_module

    devices, group = cuda5
    engines: list[Engine] = []

    def client(url: str, **_: object) -> Engine:
        engines.append(Engine(url))
        return engines[-1]

    monkeypatch.setattr(fleet_module, "EngineClient", client)
    cfg = load_config(None, [f"output_dir={tmp_path}", "weight_sync.timeout_s=5"])
    runner = AsyncRunner()
    try:
        fleet = fleet_module.EngineFleet(
            cfg.actor_infer, cfg.weight_sync, "abort", Path(tmp_path), tmp_path, seed=0,
            request_timeout_s=5.0, runner=runner,
        )  # fmt: skip
        fleet.launcher = Launcher()
        learner = Learner(devices)  # built after the fleet, as `asyncrl run` does
        with pytest.raises(WeightSyncError, match="no tensors to send"):
            fleet.start(learner)  # group, then the first sync (of nothing)
        assert fleet.backend == "nccl" and fleet.sender.device == LEARNER
        assert [(d, b, r) for _, d, b, r in group.made_on] == [(LEARNER, "nccl", 0)]
        control = runner.run(_thread_id())
        assert learner.exports == [(control, LEARNER)]
        future = fleet.start_sync(learner, copy=True)  # the copies: taken on this thread
        assert learner.exports[-1] == (threading.get_ident(), LEARNER)
        with pytest.raises(WeightSyncError, match="no tensors to send"):
            future.result(10)
        assert {d for _, d in devices.calls} == {LEARNER}
        assert [e.calls for e in engines] == [["init", "prepare", "prepare"]]
        fleet.stop()
    finally:
        runner.close()


async def _thread_id() -> int:
    return threading.get_ident()


def test_a_torch_learner_reports_the_device_it_yields_on(tiny_model):
    from asyncrl.learner.torch.learner import TorchLearner

    cfg = load_config(None, [])
    learner = TorchLearner(
        tiny_model, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=1.0, total_steps=1,
    )  # fmt: skip
    assert learner.sync_device == torch.device("cpu")
    assert {t.device for _, t in learner.weights_for_sync()} == {learner.sync_device}
