"""Connection authentication for the trajectory stream: ZeroMQ's own security (ZMTP PLAIN or
CURVE), checked by a ZAP handler (RFC 27) and keyed by the run's secret.

Why: the receiver's port is open to every local process (and to the network when it binds
0.0.0.0 for a multi-node run); without authentication any of them could push groups the learner
trains on. The run draws a secret at start (`secrets.token_bytes`), gives it to the receiver
and, through the rollout workers' settings, to every sender. A connection is let in only if its
ZMTP handshake proves the secret; libzmq reads no message of a connection whose handshake did
not succeed, so a process without the secret can deliver nothing, not even a READY ping.

Why per connection, not per message: an HMAC-SHA256 frame on every message (12-125 us per side
per group) held codec+ZMQ to ~0.45/0.38/0.55x raw ZMQ at 1k/4k/16k-token groups; with PLAIN,
nothing per message, the same runs measured ~0.66/0.57/0.78x, as without authentication, and
CURVE ~0.41/0.42/0.47x (`asyncrl bench transport --skip-ray`, medians of 4 runs on a shared
2-core box). A handshake costs once per connection.

The mechanism follows the receiver's bind address (`needs_curve`):
- loopback: PLAIN. The password (derived from the secret) crosses loopback once per
  connection, in clear; reading loopback traffic takes root, who could read the secret from
  the processes anyway. Messages travel as they are: nothing per message.
- any other address (0.0.0.0, an interface): CURVE (libsodium, bundled in pyzmq's wheels). Both
  keypairs derive from the run's secret, so a sender needs nothing more than the secret; CURVE
  also encrypts every message (it costs per byte, measured in the bench's `codec_zmq_curve`),
  which is what a routable network needs: PLAIN would show the password to anyone on the path.
Out of scope: a peer that holds the secret (the run's own workers) is trusted.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

#: Shortest secret accepted (128 bits); `secrets.token_bytes(32)` is what a run uses.
MIN_SECRET_BYTES = 16
#: Where libzmq asks a context's ZAP handler (fixed by RFC 27): one handler per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: The ZAP domain of the trajectory stream and the PLAIN user name of its senders.
DOMAIN, USER = b"asyncrl", b"asyncrl-rollout"
#: Handshake failures of the server socket, as its monitor reports them.
FAILED_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def needs_curve(bind_host: str) -> bool:
    """CURVE unless the receiver binds a loopback address (see the module's docstring).
    Host names other than `localhost` count as routable: the safe side."""
    if bind_host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:  # "*", a host name
        return True


@dataclass(frozen=True, repr=False)
class Credentials:
    """What the run's secret derives for ZMTP: a PLAIN password and two CURVE keypairs (the
    receiver's and its senders'), each an HMAC-SHA256 of the secret under its own label, so
    none of them reveals the secret or another one. Never printed."""

    password: bytes
    server_secret: bytes  # CURVE keys: z85 text, as libzmq's socket options take them
    server_public: bytes
    client_secret: bytes
    client_public: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> Credentials:
        if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"transport secret must be at least {MIN_SECRET_BYTES} bytes")

        def derive(label: str) -> bytes:
            return hmac.digest(bytes(secret), f"asyncrl/transport/{label}".encode(), "sha256")

        # Any 32 bytes are a curve25519 secret key (libsodium clamps them).
        server, client = z85.encode(derive("curve-server")), z85.encode(derive("curve-client"))
        return cls(derive("plain"), server, zmq.curve_public(server), client,
                   zmq.curve_public(client))  # fmt: skip

    def __repr__(self) -> str:
        return "Credentials(<secret>)"

    def secure_client(self, sock: zmq.Socket, curve: bool) -> None:
        """Make `sock` (before it connects) prove the secret in its handshake."""
        if curve:
            _require_curve()
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret
        else:
            sock.plain_username = USER
            sock.plain_password = self.password

    def secure_server(self, sock: zmq.Socket, curve: bool) -> None:
        """Make `sock` (before it binds) hand every handshake to the ZAP handler."""
        sock.zap_domain = DOMAIN
        if curve:
            _require_curve()
            sock.curve_server = True
            sock.curve_secretkey = self.server_secret
        else:
            sock.plain_server = True

    def allows(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """None if the ZAP request's credentials prove the secret, else why not."""
        if mechanism == b"PLAIN" and len(credentials) == 2:
            ok = credentials[0] == USER and hmac.compare_digest(credentials[1], self.password)
            return None if ok else "wrong user or password"
        if mechanism == b"CURVE" and len(credentials) == 1:
            ok = hmac.compare_digest(credentials[0], z85.decode(self.client_public))
            return None if ok else "unknown client key"
        return f"mechanism {mechanism.decode(errors='replace')!r} not accepted"


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE: a receiver off loopback cannot be secured")


class ConnectionGate:
    """A secured receiver's gatekeeper, one thread: it answers the ZAP requests of its context
    with `credentials` and reads the server socket's monitor, calling `refused(reason)` for every
    handshake that failed (a peer without or with wrong credentials, or a wrong mechanism). The
    thread sleeps in `poll` between handshakes: it costs nothing per message. If it ever
    stopped, handshakes would wait for an answer and fail: closed, never open."""

    def __init__(
        self,
        context: zmq.Context,
        server: zmq.Socket,
        credentials: Credentials,
        refused: Callable[[str], None],
    ) -> None:
        self._credentials, self._refused = credentials, refused
        self._denied = ""  # the latest ZAP denial, named by the refusal it causes
        self._zap = context.socket(zmq.REP)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._zap.close(linger=0)
            raise RuntimeError(
                f"cannot answer ZAP requests: {e} (one handler per context)"
            ) from None
        self._monitor = server.get_monitor_socket(FAILED_HANDSHAKE)
        wake = f"inproc://asyncrl-gate-{id(self)}"
        self._wake_rx, self._wake_tx = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx.connect(wake)
        self._thread = threading.Thread(target=self._serve, name="asyncrl-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sockets = (self._zap, self._monitor, self._wake_rx)
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_rx in ready:
                    return
                if self._zap in ready:  # answered first: its refusal event comes after
                    self._zap.send_multipart(self._answer(self._zap.recv_multipart()))
                if self._monitor in ready:
                    self._on_event(parse_monitor_message(self._monitor.recv_multipart()))
        except Exception as e:  # noqa: BLE001 - reported; handshakes then fail (closed)
            log.error("transport ZAP handler stopped: %r; new connections will be refused", e)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request: 200 if it proves the secret, else 400."""
        request += [b""] * (6 - len(request))
        version, request_id, domain, address, _routing_id, mechanism, *credentials = request
        why = self._credentials.allows(mechanism, credentials)
        if version != b"1.0" or domain != DOMAIN:
            why = f"ZAP version {version!r}, domain {domain!r}"
        if why is None:
            return [b"1.0", request_id, b"200", b"OK", USER, b""]
        self._denied = f"{why} (peer {address.decode(errors='replace')})"
        return [b"1.0", request_id, b"400", b"not the run's secret", b"", b""]

    def _on_event(self, event: dict) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._refused(f"credentials refused: {self._denied or f'ZAP status {value}'}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # e.g. a peer with no credentials
            self._refused(f"handshake refused: {_PROTOCOL_ERRORS.get(value, value)}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # e.g. a peer of another mechanism
            self._refused(f"handshake failed: {os.strerror(value)}")

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread (its sockets close with it); False if it did not stop in time."""
        if self._thread.is_alive():
            self._wake_tx.send(b"")
            self._thread.join(timeout_s)
        self._wake_tx.close(linger=0)
        return not self._thread.is_alive()


#: libzmq's protocol-error codes by value (an IntFlag: iterating it skips multi-bit values).
_PROTOCOL_ERRORS = {
    int(e): name.lower()
    for name, e in zmq.Event.__members__.items()
    if name.startswith("PROTOCOL_")
}
