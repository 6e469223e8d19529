"""Trajectory transport throughput: codec + ZMQ vs Ray actor calls vs raw ZMQ, side by side.

For groups of 1k, 4k and 16k response tokens (n=8 responses, 256 prompt tokens, 13 bytes per
token on the wire) it measures groups/s and GB/s of:

- codec+zmq: a sender process connects with the run's secret (ZMTP PLAIN, as a run's workers
  reach a receiver bound to loopback) and sends its backlog, `--batch` groups at a time
  (`Sender.send_many`: encode, one message per `BATCH_BYTES` of groups, so 16k-token groups
  still go one per message); this process's consumer `get`s every group from the Receiver,
  which reads, decodes and validates each message in `get`. Authentication is per
  connection: no per-message cost.
- codec+zmq, CURVE: the same over CURVE, as a run whose receiver binds a routable address
  (0.0.0.0, an interface): libzmq's I/O threads encrypt and decrypt every byte.
- raw zmq: the same messages (the very frames the codec sends, encoded once beforehand) over a
  bare PUSH/PULL pair with the same socket options and the same PLAIN authentication; the
  receiver only `recv_multipart`s them (no decode). Like for like: the same number of
  messages, frames and bytes, the same handshake. The ceiling for any codec on this channel.
- codec+zmq single / raw zmq single: both again with one group per message (no backlog).
- ray: a Ray actor method takes the TrajectoryGroup as its argument; `ray.get` on every call
  (ray sync, the baseline named in the issue), and with 32 calls in flight (ray pipelined).

The pump's `check_group` (orchestrator.py) is not in the measured path.

Then the cost that matters (`_transport_cost`): per shipped recipe, the transport's CPU time
per trajectory (sender + receiver, fitted over the three sizes) against the engine's time to
generate that trajectory (the hf engine's measured rate; SGLang recipes at a stated
`--gpu-tokens-per-s`).

Targets: codec+zmq >= 10x ray (sync); the transport's CPU per trajectory <= 1 % of its
generation time for every recipe. Reported, not held: codec+zmq vs raw zmq (a diagnostic:
Python against C at rates, ~38k groups/s, no cluster produces) and CURVE's ratio (encryption
is the price of a routable network, not the codec's). Prints the tables, writes
bench/results/transport.json and transport.png and compares with the recorded baseline.

    asyncrl bench transport [--smoke] [--quick] [--skip-ray] [--repeats N] [--batch K]
        [--gpu-tokens-per-s 50000] [--record-baseline]
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from typing import Any

import _transport_cost as cost
import numpy as np
import zmq
from common import finish, headline, make_parser

from asyncrl.transport.auth import ConnectionGate, Credentials
from asyncrl.transport.batch import BATCH_BYTES, chunk_groups, encode_groups
from asyncrl.transport.codec import message_nbytes
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import PING, Receiver, ReceiverConfig
from asyncrl.types import TrajectoryGroup

SIZES = (1024, 4096, 16384)
HWM = 128
#: Groups per message when the sender has a backlog (`Sender.send_many`); 1: one per message.
BATCH = 8
TARGET_RAY, DIAGNOSTIC_RAW = 10.0, 0.8
#: The sender process reads the run's secret from here (hex), as a worker gets it from its
#: settings: never on a command line.
SECRET_ENV = "ASYNCRL_BENCH_SECRET"


def synthetic_group(tokens: int, n: int = 8, prompt: int = 256, seed: int = 0) -> TrajectoryGroup:
    """A group of n responses with `tokens` response tokens in all (no advantages: rollout
    actors send groups before the learner computes them)."""
    rng = np.random.default_rng(seed)
    lengths = np.full(n, tokens // n, np.int32)
    total = int(lengths.sum())
    return TrajectoryGroup(
        group_id=f"prompt-{seed:06d}",
        prompt_ids=rng.integers(0, 150_000, prompt, dtype=np.int32),
        response_lengths=lengths,
        response_ids=rng.integers(0, 150_000, total, dtype=np.int32),
        rollout_logprobs=-rng.exponential(1.0, total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        versions=np.full(total, 7, np.int32),
        rewards=rng.random(n).astype(np.float32),
        finish_reasons=["stop"] * n,
        metadata={"task": "gsm8k", "prompt_index": seed},
    )


def _groups(tokens: int, k: int = 8) -> list[TrajectoryGroup]:
    return [synthetic_group(tokens, seed=s) for s in range(k)]


def _batches(tokens: int, batch: int) -> list[list[TrajectoryGroup]]:
    """The sender's backlog, `batch` groups at a time (8 distinct groups, cycled)."""
    groups = _groups(tokens)
    return [[groups[(i + j) % len(groups)] for j in range(batch)] for i in range(len(groups))]


# -- sender side (a separate process: `--_sender MODE TOKENS MESSAGES PORT BATCH`) -------------
def _sender_main(mode: str, tokens: int, messages: int, port: int, batch: int) -> None:
    """`messages` backlogs of `batch` groups each, on a connection authenticated with the
    run's secret. codec: `Sender.send_many` encodes every backlog (one message, or more past
    `BATCH_BYTES`). raw: the very messages the codec sends (encoded once, beforehand) go
    through a bare PUSH socket with the same options and credentials: the same messages,
    bytes and handshake, no codec."""
    batches = _batches(tokens, batch)
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    curve = mode == "curve"
    if mode == "raw":
        _raw_sender(port, [_backlog_frames(b) for b in batches], messages, secret)
        return
    config = SenderConfig(port=port, hwm=HWM, send_timeout_s=120.0, secret=secret, curve=curve)
    with Sender(config) as sender:
        cpu = time.process_time()
        for i in range(messages):
            sender.send_many(batches[i % len(batches)])
        print(f"cpu_s={time.process_time() - cpu}", flush=True)
        _wait_for_receiver()


def _backlog_frames(backlog: list[TrajectoryGroup]) -> list[list[Any]]:
    """The messages `Sender.send_many(backlog)` sends (its default size limit)."""
    return [encode_groups(chunk) for chunk in chunk_groups(backlog, BATCH_BYTES)]


def _raw_sender(port: int, frames: list[list[list[Any]]], messages: int, secret: bytes) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    for option, value in ((zmq.SNDHWM, HWM), (zmq.IMMEDIATE, 1), (zmq.LINGER, 0)):
        sock.setsockopt(option, value)
    Credentials.from_secret(secret).secure_client(sock, curve=False)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(PING)  # as a Sender does: queued once the handshake is through
    cpu = time.process_time()
    for i in range(messages):
        for message in frames[i % len(frames)]:
            sock.send_multipart(message, copy=False)
    print(f"cpu_s={time.process_time() - cpu}", flush=True)
    _wait_for_receiver()
    sock.close(linger=0)
    ctx.term()


def _wait_for_receiver() -> None:
    """Keep the socket open (linger=0 drops what is still queued) until the receiver says it
    has everything: a line on stdin, or EOF if the bench process is gone."""
    sys.stdin.readline()


def _spawn_sender(
    mode: str, tokens: int, messages: int, port: int, batch: int, secret: bytes
) -> subprocess.Popen:
    args = [sys.executable, os.path.abspath(__file__), "--_sender", mode]
    env = {**os.environ, SECRET_ENV: secret.hex()}
    return subprocess.Popen(
        [*args, str(tokens), str(messages), str(port), str(batch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )


def _sender_cpu(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(b"done\n", timeout=120)  # all received (or given up): close
    return float(out.decode().strip().rsplit("cpu_s=", 1)[1])


# -- receiver side: each returns (wall seconds per group, CPU seconds per group, both sides) ----
# Both sides time the same span: from the end of the first message (connection up, first
# backlog in) to the last group, i.e. `messages - 1` backlogs of `batch` groups.
def run_codec_zmq(
    tokens: int, count: int, curve: bool = False, batch: int = BATCH
) -> tuple[float, float]:
    """Sender.send_many -> Receiver.get (recv + decode + validation of every group), on a
    connection authenticated with a fresh secret (PLAIN, or CURVE)."""
    secret, messages = secrets.token_bytes(32), count // batch
    with Receiver(ReceiverConfig(hwm=HWM, secret=secret, curve=curve)) as receiver:
        mode = "curve" if curve else "plain"
        proc = _spawn_sender(mode, tokens, messages, receiver.port, batch, secret)
        try:
            for _ in range(batch):  # the first message
                receiver.get(timeout_s=60)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range((messages - 1) * batch):
                receiver.get(timeout_s=60)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            sender_cpu = _sender_cpu(proc)
        stats = receiver.stats()
        assert stats.rejected == 0 and stats.unauthenticated == 0
    groups = messages * batch
    return wall / (groups - batch), (cpu + sender_cpu) / groups


def run_raw_zmq(tokens: int, count: int, batch: int = BATCH) -> tuple[float, float]:
    """The same messages (the codec's frames, pre-encoded) through a bare PULL socket with the
    same options and authentication (PLAIN, its handshakes checked by the same gate): no
    decode."""
    secret, messages = secrets.token_bytes(32), count // batch
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    for option, value in ((zmq.RCVHWM, HWM), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, 256 << 20)):
        sock.setsockopt(option, value)
    credentials = Credentials.from_secret(secret)
    credentials.secure_server(sock, curve=False)
    gate = ConnectionGate(ctx, sock, credentials, lambda why: None)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = _spawn_sender("raw", tokens, messages, port, batch, secret)
    per_backlog = len(_backlog_frames(_batches(tokens, batch)[0]))  # every backlog alike
    try:
        sock.recv_multipart(copy=False)  # the READY ping
        for _ in range(per_backlog):  # the first backlog
            sock.recv_multipart(copy=False)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range((messages - 1) * per_backlog):
            sock.recv_multipart(copy=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        sender_cpu = _sender_cpu(proc)
        sock.close(linger=0)
        gate.close()
        ctx.term()
    groups = messages * batch
    return wall / (groups - batch), (cpu + sender_cpu) / groups


def run_ray(tokens: int, count: int, in_flight: int) -> float:
    """Seconds per actor call carrying one group; `in_flight` calls outstanding at a time."""
    import ray

    @ray.remote(num_cpus=0)
    class Sink:
        def put(self, group: TrajectoryGroup) -> int:
            return group.num_tokens

    groups = _groups(tokens)
    sink = Sink.remote()
    ray.get(sink.put.remote(groups[0]))  # actor started and warm
    start = time.perf_counter()
    pending: list[Any] = []
    for i in range(count):
        pending.append(sink.put.remote(groups[i % len(groups)]))
        if len(pending) >= in_flight:
            ray.get(pending)
            pending = []
    ray.get(pending)
    elapsed = time.perf_counter() - start
    ray.kill(sink)
    return elapsed / count


# -- driver -------------------------------------------------------------------------------------
def _measure(
    tokens: int, quick: bool, skip_ray: bool, repeats: int, batch: int = BATCH
) -> dict[str, Any]:
    """One row: the ZMQ methods alternate `repeats` times (the machine's load drifts); the
    median trial of each is reported, every trial is kept. codec/raw at `batch` groups per
    message, and at one group per message (`*_single`)."""
    zmq_count = int((0.2 if quick else 1.0) * 8000 * (1024 / tokens) ** 0.5) // batch * batch
    ray_count = int((0.1 if quick else 1.0) * 2000 * (1024 / tokens) ** 0.5)
    nbytes = sum(message_nbytes(m) for m in _backlog_frames(_batches(tokens, batch)[0])) / batch
    runs = {
        "codec_zmq": lambda: run_codec_zmq(tokens, zmq_count, batch=batch),
        "codec_zmq_curve": lambda: run_codec_zmq(tokens, zmq_count, curve=True, batch=batch),
        "raw_zmq": lambda: run_raw_zmq(tokens, zmq_count, batch=batch),
        "codec_zmq_single": lambda: run_codec_zmq(tokens, zmq_count, batch=1),
        "raw_zmq_single": lambda: run_raw_zmq(tokens, zmq_count, batch=1),
    }
    trials: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            trials[name].append(run())
    if not skip_ray:
        trials["ray_sync"] = [(run_ray(tokens, ray_count, in_flight=1), 0.0)]
        trials["ray_pipelined"] = [(run_ray(tokens, ray_count, in_flight=32), 0.0)]
    row: dict[str, Any] = {"tokens": tokens, "bytes_per_group": nbytes, "batch": batch}
    row["count"] = {"zmq": zmq_count, "ray": 0 if skip_ray else ray_count, "repeats": repeats}
    sec = {}
    for name, runs in trials.items():
        sec[name] = float(np.median([w for w, _ in runs]))
        row[name] = {
            "groups_per_s": 1.0 / sec[name],
            "gb_per_s": nbytes / sec[name] / 1e9,
            # CPU of sender + receiver processes (ZMQ only; Ray's is spread over its daemons)
            "cpu_us_per_group": float(np.median([c for _, c in runs])) * 1e6 or None,
            "trials_groups_per_s": [1.0 / w for w, _ in runs],
        }
    row["vs_raw_zmq"] = sec["raw_zmq"] / sec["codec_zmq"]
    row["curve_vs_raw_zmq"] = sec["raw_zmq"] / sec["codec_zmq_curve"]
    row["single_vs_raw_zmq_single"] = sec["raw_zmq_single"] / sec["codec_zmq_single"]
    row["batched_vs_raw_zmq_single"] = sec["raw_zmq_single"] / sec["codec_zmq"]
    row["cpu_vs_raw_zmq"] = (
        row["raw_zmq"]["cpu_us_per_group"] / row["codec_zmq"]["cpu_us_per_group"]
    )
    if not skip_ray:
        row["vs_ray_sync"] = sec["ray_sync"] / sec["codec_zmq"]
        row["vs_ray_pipelined"] = sec["ray_pipelined"] / sec["codec_zmq"]
    return row


METHODS = ("codec_zmq", "codec_zmq_curve", "raw_zmq", "codec_zmq_single", "raw_zmq_single")
METHODS += ("ray_sync", "ray_pipelined")


def _print_table(rows: list[dict[str, Any]]) -> None:
    methods = [m for m in METHODS if m in rows[0]]
    batch = rows[0]["batch"]
    print(f"groups/s; codec_zmq, codec_zmq_curve, raw_zmq: backlogs of {batch} groups, batched")
    print(f"up to {BATCH_BYTES >> 10} KiB per message; *_single: one group per message")
    head = f"{'tokens':>6} {'KB/grp':>7} | " + " | ".join(f"{m:>16}" for m in methods)
    print(head + " | vs raw (cpu) | single vs raw single | CURVE vs raw | vs ray sync")
    for r in rows:
        cells = " | ".join(f"{r[m]['groups_per_s']:>16.0f}" for m in methods)
        ratios = f" | {r['vs_raw_zmq']:>5.2f}x ({r['cpu_vs_raw_zmq']:.2f}x)"
        ratios += f" | {r['single_vs_raw_zmq_single']:>19.2f}x | {r['curve_vs_raw_zmq']:>11.2f}x"
        if "vs_ray_sync" in r:
            ratios += f" | {r['vs_ray_sync']:>10.1f}x"
        print(f"{r['tokens']:>6} {r['bytes_per_group'] / 1024:>7.1f} | {cells}{ratios}")


def _plot(rows: list[dict[str, Any]], ax: Any) -> None:
    methods = [m for m in METHODS if m in rows[0]]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[m]["groups_per_s"] for r in rows], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['tokens'] // 1024}k tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("groups / s (log)")
    ax.set_title("TrajectoryGroup transport, n=8 (one sender, one receiver, loopback)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(methods), frameon=False)


def _start_ray() -> None:
    import ray

    ray.init(
        address="local",  # always a fresh local instance, never someone else's cluster
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        object_store_memory=512 << 20,
    )


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="5-10x fewer messages, 2 trials")
    parser.add_argument("--skip-ray", action="store_true", help="ZMQ rows only (no Ray start)")
    parser.add_argument("--repeats", type=int, default=None, help="trials per ZMQ method")
    parser.add_argument("--batch", type=int, default=BATCH, help="groups per batched message")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=50_000.0,
                        help="stated aggregate decode rate of one SGLang engine (the GPU recipes)")  # fmt: skip
    args = parser.parse_args(argv)
    quick, skip_ray = args.quick or args.smoke, args.skip_ray or args.smoke
    repeats = args.repeats or (1 if args.smoke else 2 if quick else 3)
    if not skip_ray:
        _start_ray()
    try:
        rows = [_measure(t, quick, skip_ray, repeats, max(1, args.batch)) for t in SIZES]
    finally:
        if not skip_ray:
            import ray

            ray.shutdown()
    _print_table(rows)
    per_recipe = cost.cost_table(rows, args.gpu_tokens_per_s)
    cost.print_cost(per_recipe)
    met = {"transport_vs_generation": per_recipe["met"]}
    headlines = {f"vs_raw_zmq_{r['tokens'] // 1024}k": headline(r["vs_raw_zmq"], True, "x")
                 for r in rows}  # fmt: skip
    for r in rows:
        key = f"single_vs_raw_zmq_single_{r['tokens'] // 1024}k"
        headlines[key] = headline(r["single_vs_raw_zmq_single"], True, "x")
    headlines["codec_groups_per_s_1k"] = headline(rows[0]["codec_zmq"]["groups_per_s"], True, "/s")
    headlines["transport_vs_generation_worst"] = headline(per_recipe["worst"], False, "")
    if not skip_ray:
        met["vs_ray_sync"] = all(r["vs_ray_sync"] >= TARGET_RAY for r in rows)
        headlines["vs_ray_sync_1k"] = headline(rows[0]["vs_ray_sync"], True, "x")
    result = {
        "targets": {"vs_ray_sync": TARGET_RAY, "transport_vs_generation": cost.TARGET},
        "diagnostics": {"vs_raw_zmq": DIAGNOSTIC_RAW},
        "met": met, "headline": headlines, "rows": rows, "per_recipe": per_recipe,
    }  # fmt: skip
    return finish("transport", result, args, lambda fig: _plot(rows, fig.subplots()), argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_sender":
        _sender_main(sys.argv[2], *(int(a) for a in sys.argv[3:7]))
    else:
        main()
