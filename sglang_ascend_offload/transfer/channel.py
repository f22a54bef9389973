"""Control-plane endpoint: length-prefixed frames over plain TCP, no hand-off threads.

A caller writes its frame straight into the kernel socket (one lock per
connection), and one thread per connection blocks in ``recv`` and runs the callbacks
itself: a publish -> READ_DONE round trip wakes exactly two threads, because every
thread hand-off is a wake-up on the per-layer critical path. See
docs/design/pd_control_channel.md for the background (why not ZMQ, why the spin
needs an idle core).

Frame: 4-byte big-endian payload length, then the payload (one
:mod:`~.protocol` message). Every received payload goes through
:func:`~.protocol.decode_message` before anything looks at it; a payload that
fails is answered with :class:`~.protocol.Rejected`, reported to ``on_invalid``
and otherwise ignored. A frame announcing more than ``MAX_MESSAGE_BYTES`` cannot
be skipped safely on a byte stream: it is rejected and that connection closed.

* ``router`` mode (decode TP rank): listens on ``host:port``; each accepted
  connection is one peer, named by an opaque identity (``bytes``) that
  :meth:`send` takes back.
* ``dealer`` mode (prefill TP rank): connects to one decode rank, retrying
  every ``RECONNECT_S`` until it is up (like a ZMQ DEALER, messages sent before
  the connection exists are queued, at most ``SEND_QUEUE_LIMIT``); ``peer`` is
  always ``b""``.

Receive spin (``spin_us``): after a connection's reader thread has handled a
message it polls the socket without blocking for at most ``spin_us``
microseconds before it blocks in ``recv`` again, because on the P/D path the
next message usually follows within tens of microseconds (decode: the next
layer's batch after its READ_DONE). A blocked thread on an idle core costs a
kernel (and, in a VM without guest halt polling, a hypervisor) wake-up per
message. The spin is bounded: once per handled message, never while idle, and
it re-checks ``close`` on every poll; deadlines run on the tick thread and EOF
ends it at once, so failure detection is not delayed. ``spin_us=0`` disables it;
``SGLANG_ASCEND_OFFLOAD_PD_SPIN_US`` overrides the constructor's default. It only
runs while the machine has an idle core (1-minute load average below the CPUs this
process may use, checked at most once a second, :class:`IdleCores`): with every
core taken there is no halted core to avoid waking, and a spinning thread only
takes time slices from the work it waits for (and loses the scheduler's wake-up
credit of a sleeping one), which lengthens the latency tail instead of shortening it.

Threads and callbacks: ``on_message(peer, msg)`` / ``on_invalid(peer, error)``
run on the peer's connection thread, in the order the peer sent its frames
(different peers run concurrently: callbacks must lock their own state);
``on_tick(now)`` runs on a tick thread every ``tick_s`` (deadline checks). An
exception escaping a callback is logged and counted in :attr:`handler_errors`;
it never stops a thread. A failed send (peer gone, send timeout) closes that
connection and drops the message: the deadlines above the channel turn lost
messages into failures.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .errors import ProtocolError, TransferError
from .protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Message, Rejected, decode_message, encode_message

logger = logging.getLogger(__name__)

OnMessage = Callable[[bytes, Message], None]
OnInvalid = Callable[[bytes, ProtocolError], None]
OnTick = Callable[[float], None]
SendFilter = Callable[[Message, bytes], Optional[bytes]]

HEADER = struct.Struct("!I")
CLOSE_LINGER_S = 0.5  # longest a close waits for the peer to read what was already sent
RECONNECT_S = 0.05  # dealer: pause between connection attempts
SEND_TIMEOUT_S = 2.0  # a peer that stops reading for this long loses its connection
SEND_QUEUE_LIMIT = 1000  # dealer: frames queued while not connected (ZMQ's default HWM)
_RECV_BYTES = 1 << 16
SPIN_ENV = "SGLANG_ASCEND_OFFLOAD_PD_SPIN_US"
DEFAULT_SPIN_US = 0.0  # endpoints' default; the P/D sides pass their own (see decode_side / prefill_side)


def spin_us_from_env(default: float) -> float:
    """``SGLANG_ASCEND_OFFLOAD_PD_SPIN_US`` as microseconds if set, else ``default``."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TransferError(f"{SPIN_ENV}={raw!r} is not a number of microseconds (0 disables the spin)") from None
    if not 0.0 <= value <= 1e6:
        raise TransferError(f"{SPIN_ENV}={raw!r}: must be between 0 and 1000000 microseconds")
    return value


class IdleCores:
    """Whether the machine has an idle core: 1-minute load average < usable CPUs.

    Re-read at most every ``period_s`` (``os.getloadavg`` is one small read of
    ``/proc/loadavg``); thread-safe enough without a lock (a stale answer only
    decides one spin).
    """

    def __init__(self, period_s: float = 1.0):
        self._period_ns = int(period_s * 1e9)
        try:
            self._cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = os.cpu_count() or 1
        self._next_ns = 0
        self._idle = True

    def __call__(self) -> bool:
        now = time.perf_counter_ns()
        if now >= self._next_ns:
            self._next_ns = now + self._period_ns
            try:
                self._idle = os.getloadavg()[0] < self._cpus
            except OSError:
                self._idle = True
        return self._idle


def spin_recv(
    sock: socket.socket, spin_ns: int, stop: Optional[threading.Event] = None, nbytes: int = _RECV_BYTES
) -> Optional[bytes]:
    """Poll ``sock`` without blocking for at most ``spin_ns`` nanoseconds.

    Returns the bytes received (``b""`` at EOF), or None when nothing arrived within
    the window (or ``stop`` got set): the caller then blocks in ``recv``. Socket
    errors other than "would block" propagate. Each poll is one ``recv`` syscall
    with ``MSG_DONTWAIT``, which releases the GIL, so other threads of the process
    keep running; the loop yields the core between polls (``sched_yield``) so a
    loaded machine's other runnable tasks are not held off.
    """
    end = time.perf_counter_ns() + spin_ns
    while True:
        try:
            return sock.recv(nbytes, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            pass
        if time.perf_counter_ns() >= end or (stop is not None and stop.is_set()):
            return None
        os.sched_yield()


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed (for messages and logs)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def frame(payload: bytes) -> bytes:
    """One wire frame: length header + ``payload``."""
    return HEADER.pack(len(payload)) + payload


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # a blocking socket (no Python timeout) so recv and send may run on different threads;
    # the send timeout is the kernel's and does not affect the reader
    sec = int(SEND_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((SEND_TIMEOUT_S - sec) * 1e6)))


class _Conn:
    """One connected peer: its socket, send lock and reader thread."""

    def __init__(self, sock: socket.socket, identity: bytes):
        self.sock = sock
        self.identity = identity
        self.send_lock = threading.Lock()
        self.closed = False
        self.thread: Optional[threading.Thread] = None

    def send(self, data: bytes) -> None:
        with self.send_lock:
            if self.closed:
                raise OSError("connection closed")
            self.sock.sendall(data)

    def shutdown(self, how: int) -> None:
        try:
            self.sock.shutdown(how)
        except OSError:
            pass

    def close(self) -> None:
        with self.send_lock:
            if self.closed:
                return
            self.closed = True
        self.shutdown(socket.SHUT_RDWR)
        try:
            self.sock.close()
        except OSError:
            pass


class ControlEndpoint:
    """A listening (``router``) or connecting (``dealer``) framed-TCP endpoint."""

    def __init__(
        self,
        mode: str,
        host: str,
        port: int,
        *,
        expect: Tuple[type, ...],
        on_message: OnMessage,
        on_invalid: Optional[OnInvalid] = None,
        on_tick: Optional[OnTick] = None,
        tick_s: float = 0.02,
        send_filter: Optional[SendFilter] = None,
        name: str = "pd-endpoint",
        trace: bool = False,
        spin_us: Optional[float] = None,
    ):
        if mode not in ("router", "dealer"):
            raise ValueError(f"mode must be 'router' or 'dealer', got {mode!r}")
        self.mode = mode
        self.name = name
        self.address = tcp_address(host, port)
        self._host = host.strip("[]")
        self._port = port
        self._expect = expect
        self._on_message = on_message
        self._on_invalid = on_invalid
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._send_filter = send_filter
        #: stamp sends and receives (:meth:`rx_stamps`, :meth:`send`'s return value); see stages.py
        self.trace = trace
        #: bounded receive spin after each handled message (module docstring), microseconds
        self.spin_us = spin_us_from_env(DEFAULT_SPIN_US if spin_us is None else spin_us)
        self.spins = 0  # spins that caught the next bytes
        self.spin_misses = 0  # spins that ran out (the reader then blocked)
        self.spins_skipped_busy = 0  # spins not run: no idle core (IdleCores)
        self._idle_cores = IdleCores()
        self._rx = threading.local()
        self._lock = threading.Lock()  # connections and the dealer's queue
        self._conns: Dict[bytes, _Conn] = {}
        self._pending: Deque[bytes] = collections.deque()
        self._stop = threading.Event()
        self._next_id = 0
        self._threads: List[threading.Thread] = []
        self._started = False
        self.handler_errors = 0
        self.rejected = 0
        self.sent = 0
        self.received = 0
        self.dropped = 0
        self._listener: Optional[socket.socket] = None
        if mode == "router":
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            lsock = socket.socket(family, socket.SOCK_STREAM)
            try:
                lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                lsock.bind((self._host, port))
                lsock.listen(64)
                lsock.settimeout(0.1)  # accept wakes up to notice close
            except OSError as exc:
                lsock.close()
                raise TransferError(
                    f"cannot bind control socket {self.address}: {exc} (is the port in use? "
                    "change pd_transfer.kv_port or pd_transfer.host)"
                ) from exc
            self._listener = lsock
        self._main = threading.Thread(
            target=self._accept_loop if mode == "router" else self._connect_loop, name=name, daemon=True
        )

    # ------------------------------------------------------------------ public
    def start(self) -> "ControlEndpoint":
        self._started = True
        self._main.start()
        if self._on_tick is not None:
            t = threading.Thread(target=self._tick_loop, name=f"{self.name}-tick", daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def send(self, msg: Message, peer: bytes = b"") -> Optional[Tuple[int, int, int]]:
        """Write ``msg`` to ``peer`` (router mode) or the connected peer (dealer mode) now.

        Runs on the caller's thread; never blocks longer than ``SEND_TIMEOUT_S``.
        Returns None, or with ``trace`` the ``perf_counter_ns`` of entry, of the
        encoded message and of the write's return.
        """
        t0 = time.perf_counter_ns() if self.trace else 0
        if self.mode == "router" and not peer:
            raise ValueError("router endpoint: send needs the peer identity")
        data = encode_message(msg)  # validates: we never send what a peer would reject
        if self._send_filter is not None:
            data = self._send_filter(msg, data)
            if data is None:
                return None
        if not self.trace:
            self._send_frame(peer, frame(data))
            return None
        t1 = time.perf_counter_ns()
        self._send_frame(peer, frame(data))
        return t0, t1, time.perf_counter_ns()

    def rx_stamps(self) -> Optional[Tuple[int, int]]:
        """With ``trace``, inside ``on_message``: ``perf_counter_ns`` when the message's last
        bytes returned from ``recv`` and when it was decoded; else None."""
        return getattr(self._rx, "stamps", None)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting/dispatching, let the peers read what was sent, free the sockets.

        Threads still inside a callback (e.g. an engine read) are waited for up to
        ``timeout_s``.
        """
        if self._stop.is_set():
            return
        if self.mode == "dealer" and self._started:
            # like a ZMQ DEALER's linger: messages queued before the peer came up (e.g. the abort
            # verdicts after a handshake timeout) get CLOSE_LINGER_S to be delivered
            end = time.monotonic() + CLOSE_LINGER_S
            while time.monotonic() < end:
                with self._lock:
                    if not self._pending:
                        break
                time.sleep(0.005)
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        with self._lock:
            conns = list(self._conns.values())
            self._pending.clear()
        for c in conns:  # FIN after the data already written: the peer reads it, then EOF
            c.shutdown(socket.SHUT_WR)
        end = time.monotonic() + CLOSE_LINGER_S
        for c in conns:
            if c.thread is not None and c.thread is not threading.current_thread():
                c.thread.join(max(0.0, end - time.monotonic()))
        for c in conns:
            c.close()
        end = time.monotonic() + timeout_s
        for t in [self._main] + self._threads + [c.thread for c in conns if c.thread is not None]:
            if t is not threading.current_thread() and t.ident is not None:
                t.join(max(0.0, end - time.monotonic()))

    @property
    def alive(self) -> bool:
        return self._main.is_alive()

    @property
    def connected_peers(self) -> int:
        with self._lock:
            return len(self._conns)

    # ------------------------------------------------------------------ sending
    def _send_frame(self, peer: bytes, data: bytes) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            conn = self._conns.get(peer)
            if conn is None:
                if self.mode == "dealer":
                    if len(self._pending) >= SEND_QUEUE_LIMIT:
                        self.dropped += 1
                        logger.warning(
                            "%s: not connected and %d messages queued: message dropped", self.address, SEND_QUEUE_LIMIT
                        )
                    else:
                        self._pending.append(data)
                    return
                self.dropped += 1
                logger.warning("%s: peer %r is gone: message dropped", self.address, peer)
                return
        try:
            conn.send(data)
            self.sent += 1
        except OSError as exc:
            self.dropped += 1
            logger.warning("%s: send to %r failed (%s): connection closed, message dropped", self.address, peer, exc)
            self._drop_conn(conn)

    def _drop_conn(self, conn: _Conn) -> None:
        with self._lock:
            if self._conns.get(conn.identity) is conn:
                del self._conns[conn.identity]
        conn.close()

    # ------------------------------------------------------------------ threads
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stop.is_set():
                    logger.exception("%s: accept failed", self.address)
                return
            sock.settimeout(None)
            _tune(sock)
            with self._lock:
                if self._stop.is_set():
                    sock.close()
                    return
                ident = b"peer-%d" % self._next_id
                self._next_id += 1
                conn = self._conns[ident] = _Conn(sock, ident)
            conn.thread = threading.Thread(
                target=self._serve_conn, args=(conn,), name=f"{self.name}-{ident.decode()}", daemon=True
            )
            conn.thread.start()

    def _connect_loop(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                sock = socket.create_connection((self._host, self._port), timeout=1.0)
            except OSError as exc:
                if not warned:
                    logger.debug("%s: not reachable yet (%s); retrying", self.address, exc)
                    warned = True
                self._stop.wait(RECONNECT_S)
                continue
            sock.settimeout(None)
            _tune(sock)
            conn = _Conn(sock, b"")
            conn.thread = threading.current_thread()
            with self._lock:  # flush the queue before any later send can overtake it
                if self._stop.is_set():
                    sock.close()
                    return
                self._conns[b""] = conn
                try:
                    while self._pending:
                        conn.send(self._pending[0])
                        self._pending.popleft()
                        self.sent += 1
                except OSError as exc:
                    logger.warning("%s: sending queued messages failed: %s", self.address, exc)
                    del self._conns[b""]
                    conn.close()
                    continue
            self._serve_conn(conn)
            if not self._stop.is_set():
                self._stop.wait(RECONNECT_S)

    def _serve_conn(self, conn: _Conn) -> None:
        """Read frames until EOF; dispatch each (on this thread) unless the endpoint stopped."""
        buf = bytearray()
        sock = conn.sock
        trace = self.trace
        t_rx = 0
        spin_ns = int(self.spin_us * 1000)
        armed = False  # a message was handled since the last spin: the next recv may spin first
        try:
            while True:
                try:
                    data = None
                    if armed and spin_ns:
                        armed = False
                        if not self._idle_cores():
                            self.spins_skipped_busy += 1
                        else:
                            data = spin_recv(sock, spin_ns, self._stop)
                            if data is None:
                                self.spin_misses += 1
                            else:
                                self.spins += 1
                    if data is None:
                        data = sock.recv(_RECV_BYTES)
                except OSError:
                    return
                if not data:
                    return
                if trace:
                    t_rx = time.perf_counter_ns()
                if not buf and len(data) > HEADER.size:
                    # the usual case on the P/D path: exactly one whole frame arrived; decode it
                    # from the received bytes (no copies through ``buf``)
                    (n,) = HEADER.unpack_from(data)
                    if len(data) == HEADER.size + n and n <= MAX_MESSAGE_BYTES:
                        armed = self._dispatch_frame(conn, memoryview(data)[HEADER.size :], t_rx) or armed
                        continue
                buf += data
                while len(buf) >= HEADER.size:
                    (n,) = HEADER.unpack_from(buf)
                    if n > MAX_MESSAGE_BYTES:
                        self.received += 1
                        if not self._stop.is_set():
                            self._reject(
                                conn.identity,
                                ProtocolError(f"frame of {n} bytes exceeds {MAX_MESSAGE_BYTES} (connection closed)"),
                            )
                        return
                    if len(buf) < HEADER.size + n:
                        break
                    payload = bytes(buf[HEADER.size : HEADER.size + n])
                    del buf[: HEADER.size + n]
                    armed = self._dispatch_frame(conn, payload, t_rx) or armed
        finally:
            self._drop_conn(conn)

    def _dispatch_frame(self, conn: _Conn, payload, t_rx: int) -> bool:
        """Count, validate and hand one received frame's payload to ``on_message``.

        Returns True when a message was handled (the next receive may spin first);
        False while draining after stop or for a rejected frame.
        """
        self.received += 1
        if self._stop.is_set():
            return False  # draining until the peer's EOF; nothing is acted on
        try:
            msg = decode_message(payload, expect=self._expect)
        except ProtocolError as exc:
            self._reject(conn.identity, exc)
            return False
        if self.trace:
            self._rx.stamps = (t_rx, time.perf_counter_ns())
        self._call(self._on_message, conn.identity, msg)
        return True

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            self._call(self._on_tick, time.monotonic())

    def _reject(self, peer: bytes, error: ProtocolError) -> None:
        self.rejected += 1
        logger.warning("%s: rejected a message from %r: %s", self.address, peer, error)
        if self._on_invalid is not None:
            self._call(self._on_invalid, peer, error)
        data = encode_message(Rejected(version=PROTOCOL_VERSION, reason=str(error)[:1000]))
        self._send_frame(peer, frame(data))

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a callback bug must not kill the control plane
            self.handler_errors += 1
            logger.exception("%s: callback %s failed", self.address, getattr(fn, "__name__", fn))
