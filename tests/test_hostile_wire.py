"""Nothing local can poison training: wire-valid hostile groups are counted and dropped, and
connections without the run's secret are refused at the handshake (nothing they send is read),
while the good groups around them all arrive; a dataset column named like asyncrl's own keys
changes nothing; Ray listens on loopback only.

Real Receiver, GroupPump, ReplayQueue, Sender, PromptSource and GroupBuilder; only the engine's
replies (the edge) are made up."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from asyncrl.config import load_config
from asyncrl.config.schema import RolloutConfig
from asyncrl.data.prompts import PromptSource
from asyncrl.engine.client import Completion
from asyncrl.orchestrator import GroupLimits, GroupPump, check_group
from asyncrl.replay.queue import ReplayConfig, ReplayQueue
from asyncrl.rollout.settings import RolloutSettings, group_metadata
from asyncrl.rollout.single_turn import GroupBuilder
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.transport.auth import USER, Credentials, needs_curve
from asyncrl.transport.codec import encode_group
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import (
    Receiver,
    ReceiverConfig,
    TransportTimeout,
)
from asyncrl.types import NOT_GENERATED, TrajectoryGroup
from tests.helpers import descendants, wait_for

pytestmark = pytest.mark.timeout(180)
VOCAB = 100
SECRET = secrets.token_bytes(32)


def group(key: str, version: int = 3, token: int = 7, prompt: int = 5, **meta) -> TrajectoryGroup:
    """A well-formed group of two responses; `meta` replaces asyncrl's metadata keys."""
    mask = [int(version != NOT_GENERATED)] * 2  # tokens no policy generated are not trained
    responses = [
        {"response_ids": [token, 8], "rollout_logprobs": [-0.5, -0.7], "versions": [version] * 2,
         "loss_mask": mask, "reward": reward, "finish_reason": "stop"}
        for reward in (0.0, 1.0)
    ]  # fmt: skip
    metadata = {**group_metadata(key, {"answer": "2"}), **meta}
    return TrajectoryGroup.from_responses(key, [prompt, 6], responses, metadata)


class Wire:
    """A run's receive side: secret-keyed Receiver → GroupPump (vocab, learner version) →
    ReplayQueue, with the learner at `version`."""

    def __init__(self, version: int = 3, secret: bytes | None = SECRET, curve: bool = False):
        self.version = version
        self.queue = ReplayQueue(ReplayConfig(max_staleness=2, rollout_batch_size=2))
        self.queue.set_version(version)
        self.receiver = Receiver(ReceiverConfig(secret=secret, curve=curve))
        self.curve = curve
        self.pump = GroupPump(self.receiver, self.queue, GroupLimits(VOCAB, lambda: self.version))

    def __enter__(self) -> Wire:
        self.pump.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pump.__exit__()
        self.receiver.close()

    def sender(self, secret: bytes | None = SECRET, ready_timeout_s: float = 10) -> Sender:
        port, curve = self.receiver.port, self.curve
        return Sender(
            SenderConfig(port=port, secret=secret, curve=curve, ready_timeout_s=ready_timeout_s)
        )

    def refused(self, attack: Callable[[], zmq.Socket | None], what: str) -> None:
        """Run `attack`, wait until the receiver has refused a handshake since, then close the
        attacker's socket (if it left one open: closed, it stops reconnecting)."""
        before = self.receiver.stats().unauthenticated
        sock = attack()
        wait_for(lambda: self.receiver.stats().unauthenticated > before, f"refusal of {what}")
        if sock is not None:
            sock.close(linger=0)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_hostile_groups_are_counted_and_dropped_while_good_ones_arrive(curve):
    good = [f"good-{i}" for i in range(6)]
    hostile = [
        group("h-list", prompt_key=[1, 2]),  # unhashable key: killed the pump before
        group("h-vocab", token=VOCAB),  # response id == vocab: IndexError in the learner
        group("h-prompt", prompt=VOCAB + 5),  # prompt id outside the vocabulary
        group("h-future", version=1000),  # "a future version is never stale"
        group("h-env", **{"env/episodes": "many"}),  # breaks the loop's episode metrics
    ]
    with Wire(curve=curve) as wire:
        wire.queue.reserve(len(good), good)  # as the dispatcher does before issuing them
        with wire.sender() as tx:
            for key, bad in zip(good, [*hostile, None], strict=True):
                tx.send(group(key))
                if bad is not None:
                    tx.send(bad)
            taken = wire.queue.take(6, wire.version, timeout=30)
            assert taken is not None, f"good groups lost: {wire.pump.counters}"
            assert [g.group_id for g in taken] == good  # all of them, in order
            attackers = unauthenticated_attacks(wire)
            for what, attack in attackers.items():
                wire.refused(attack, what)
            tx.send(group("good-last"))
            assert wire.queue.take(1, wire.version, timeout=30)[0].group_id == "good-last"
        stats, pump = wire.receiver.stats(), wire.pump
        assert pump.error is None and pump._thread.is_alive()  # the pump never died
        metrics = wire.queue.metrics()
    assert dict(pump.counters) == {
        "rejected_groups": 5,
        "rejected_groups/metadata": 2,
        "rejected_groups/vocab": 2,
        "rejected_groups/version": 1,
    }
    assert pump.last_rejection.startswith("group 'h-env': metadata 'env/episodes'")
    assert (stats.received, stats.rejected, stats.pings) == (12, 0, 1)  # only tx's ping
    assert stats.unauthenticated >= len(attackers) and "unauthenticated" in stats.last_error
    # every good prompt left the ledger; no hostile key entered it
    assert metrics["running"] == 0 and metrics["unreserved"] == 1  # good-last: not reserved
    assert metrics["put"] == 7 and metrics["taken"] == 7


def unauthenticated_attacks(wire: Wire) -> dict[str, Callable[[], zmq.Socket | None]]:
    """Local processes without the run's secret trying to push a group: asyncrl's own Sender
    (it times out: not even its READY ping gets in), and bare PUSH sockets that queue the
    group at once and would push it the moment a handshake let them in."""
    frames = encode_group(group("u-raw"))

    def sender(secret: bytes | None) -> Callable[[], None]:
        def attack() -> None:
            with pytest.raises(TransportTimeout, match="did not become ready"):
                wire.sender(secret, ready_timeout_s=1).send(group("u-sender"))

        return attack

    def raw(
        password: bytes | None = None, key: Credentials | None = None
    ) -> Callable[[], zmq.Socket]:
        def attack() -> zmq.Socket:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            if password is not None:
                sock.plain_username, sock.plain_password = USER, password
            if key is not None:  # the receiver's real public key, a client keypair of its own
                sock.curve_serverkey = Credentials.from_secret(SECRET).server_public
                sock.curve_publickey, sock.curve_secretkey = key.client_public, key.client_secret
            sock.connect(wire.receiver.address)
            # Queued while the handshake runs. Never blocking: when the receiver has already
            # refused the handshake (a loaded box schedules the IO thread first), the socket has
            # no pipe to queue on and a blocking send would wait for ever; the refusal counted
            # below is the same either way.
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return sock

        return attack

    return {
        "a Sender with no secret": sender(None),
        "a Sender with another secret": sender(secrets.token_bytes(32)),
        "no credentials": raw(),
        "a made-up password": raw(password=bytes(32)),
        "the secret itself as password": raw(password=SECRET),
        "a password cut short": raw(password=Credentials.from_secret(SECRET).password[:-1]),
        "a client key of its own": raw(key=Credentials.from_secret(secrets.token_bytes(32))),
    }


def test_a_refused_group_frees_its_prompts_admission_slot():
    with Wire() as wire, wire.sender() as tx:
        wire.queue.reserve(2, ["p0", "p1"])
        before = wire.queue.capacity()
        tx.send(group("p0", token=VOCAB + 1))  # its own worker sent a bad group
        wait_for(lambda: wire.pump.counters["rejected_groups"] == 1, "the refusal")
        metrics = wire.queue.metrics()
    # refused and gone: no slot leaks (the stall of issue 14), nothing counted as accepted
    assert metrics["running"] == 1 and wire.queue.capacity() == before + 1
    assert metrics["accepted"] == 0 and metrics["unreserved"] == 0


def test_the_version_bound_is_the_learners_current_version():
    with Wire(version=1) as wire, wire.sender() as tx:
        tx.send(group("v2-early", version=2))  # before the learner reached version 2
        wait_for(lambda: wire.pump.counters["rejected_groups/version"] == 1, "the refusal")
        wire.version = 2  # the learner stepped (it advances before it broadcasts)
        tx.send(group("v2", version=2))
        tx.send(group("observations-only", version=NOT_GENERATED))  # no generated token
        taken = wire.queue.take(2, 2, timeout=30)
    assert [g.group_id for g in taken] == ["v2", "observations-only"]


def test_check_group_names_the_problem_in_one_line():
    limits = GroupLimits(VOCAB, lambda: 3)
    assert check_group(group("fine"), limits) == "fine"
    assert check_group(group("no-key", prompt_key="k"), None) == "k"
    bad_id = "x\n" * 100
    with pytest.raises(ValueError, match="outside the vocabulary") as err:
        check_group(group(bad_id, token=VOCAB), limits)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    for meta, kind in [({"prompt_key": ""}, "empty"), ({"data": [1]}, "'data' is a list"),
                       ({"env/failed": True}, "'env/failed' is a bool")]:  # fmt: skip
        with pytest.raises(ValueError, match=kind):
            check_group(group("m", **meta), limits)


# -- connection authentication ----------------------------------------------------------------
def test_credentials_derive_from_the_secret_and_admit_only_it():
    mine, other = Credentials.from_secret(SECRET), Credentials.from_secret(secrets.token_bytes(32))
    assert Credentials.from_secret(bytearray(SECRET)) == mine  # the same for every process
    assert mine.allows(b"PLAIN", [USER, mine.password]) is None
    assert mine.allows(b"CURVE", [z85.decode(mine.client_public)]) is None
    refused = {
        "another secret's password": (b"PLAIN", [USER, other.password]),
        "the secret itself": (b"PLAIN", [USER, SECRET]),
        "a password cut short": (b"PLAIN", [USER, mine.password[:-1]]),
        "another user": (b"PLAIN", [b"root", mine.password]),
        "another secret's client key": (b"CURVE", [z85.decode(other.client_public)]),
        "the receiver's own key": (b"CURVE", [z85.decode(mine.server_public)]),
        "no mechanism": (b"NULL", []),
        "credentials missing": (b"PLAIN", [USER]),
    }
    for what, (mechanism, credentials) in refused.items():
        assert mine.allows(mechanism, credentials) is not None, f"{what} was admitted"
    # each derived value is its own: none reveals the secret or another one
    values = [mine.password, *(z85.decode(k) for k in (mine.server_secret, mine.client_secret))]
    assert len({*values, SECRET}) == 4
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Credentials.from_secret(b"short")
    # the secret never shows in a repr (configs get printed and logged)
    assert SECRET.hex() not in repr(mine) + repr(SenderConfig(secret=SECRET))
    assert repr(SECRET) not in repr(ReceiverConfig(secret=SECRET)) + repr(
        RolloutSettings([], "127.0.0.1", 1, "tok", transport_secret=SECRET, engine_api_key="k1")
    )


def test_a_worker_dials_loopback_with_the_mechanism_of_the_receivers_bind_address(tok_dir):
    """A receiver bound to 0.0.0.0 uses CURVE; its workers reach it through 127.0.0.1, so the
    mechanism must follow the configured bind host, not the address dialled."""
    receiver = Receiver(ReceiverConfig(secret=SECRET, curve=needs_curve("0.0.0.0")))
    settings = RolloutSettings(
        [], "127.0.0.1", receiver.port, str(tok_dir), rollout=RolloutConfig(transport_host="0.0.0.0"),
        transport_secret=SECRET,
    )  # fmt: skip
    try:
        worker = RolloutWorker(settings)  # constructed: its READY ping got through
        try:
            worker.sender.send(group("through-curve"))
            assert receiver.get(timeout_s=30).group_id == "through-curve"
        finally:
            worker.close()
        assert receiver.stats().unauthenticated == 0
    finally:
        receiver.close()


# -- a dataset column named like asyncrl's keys ----------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from asyncrl.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


def test_dataset_columns_named_prompt_key_and_env_seed_arrive_normally(tmp_path, tok_dir):
    rows = [
        {"prompt": f"{i}+1=", "answer": str(i + 1), "prompt_key": "evil", "env_seed": 9}
        for i in range(1, 4)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"actor_train.data_args.file_name=[{data}]", "seed=1"])
    prompts = PromptSource(cfg, tok_dir)
    items = [prompts.next_item() for _ in range(3)]
    # still prompts of a dataset, not env seeds; the row's fields reach the reward as they are
    assert all(it.prompt_ids and it.metadata["prompt_key"] == "evil" for it in items)
    settings = RolloutSettings([], "127.0.0.1", 1, str(tok_dir), n=2)
    builder = GroupBuilder(settings)
    with Wire(version=0) as wire, wire.sender() as tx:
        wire.queue.reserve(3, [it.key for it in items], [vars(it) for it in items])
        for it in items:
            right = prompts.tokenizer(it.metadata["answer"], add_special_tokens=False)
            completions = [engine_reply(right["input_ids"]), engine_reply([22, 22, 22])]
            tx.send(builder._build_group(it, completions))
        taken = wire.queue.take(3, 0, timeout=30)
        metrics = wire.queue.metrics()
    assert taken is not None and {g.group_id for g in taken} == {it.key for it in items}
    for g in taken:
        assert g.metadata["prompt_key"] == g.group_id  # asyncrl's key, not the column
        assert g.metadata["data"]["prompt_key"] == "evil" and g.metadata["data"]["env_seed"] == 9
        assert g.rewards.tolist() == [1.0, 0.0]  # the reward read the row's answer
    assert metrics["running"] == 0 and metrics["unreserved"] == 0  # reservations cleared


def engine_reply(ids: list[int]) -> Completion:
    return Completion(
        output_ids=ids, output_logprobs=[-0.1] * len(ids), finish_reason="stop",
        weight_version="0", prompt_tokens=4,
    )  # fmt: skip


# -- Ray on loopback ---------------------------------------------------------------------------
RAY_SCRIPT = """
import os, sys
import ray  # imported first, as the CLI's log set-up does
from asyncrl.net import init_ray
init_ray()
@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid(), os.nice(0)
probe = Probe.remote()
print(*ray.get(probe.pid.remote()), ray.util.get_node_ip_address(), flush=True)
sys.stdin.readline()  # Ray stays up until the test has looked at its sockets
ray.shutdown()
"""
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(cols[1].split(":")[0])
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(socket.inet_ntop(family, raw))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_local_ray_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", RAY_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=env, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    try:
        actor_pid, niceness, node_ip = proc.stdout.readline().split()
        addresses = _listening(descendants(proc.pid))
        assert int(actor_pid) in descendants(proc.pid)
    finally:
        try:
            proc.communicate("\n", timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert node_ip == "127.0.0.1"
    assert niceness == "0"  # Ray's default 15 would starve rollout workers on a busy box
    assert len(addresses) >= 3, addresses  # GCS, raylet, the actor's worker at least
    assert set(addresses) <= LOOPBACK, f"Ray listens beyond loopback: {addresses}"
