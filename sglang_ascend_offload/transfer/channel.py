"""Control-plane endpoint: one ZMQ socket owned by one I/O thread.

ZMQ sockets are not thread-safe, so exactly one thread (the endpoint's loop)
touches the socket. Other threads hand outgoing messages to :meth:`send`, which
queues them and wakes the loop through a pipe. Every received frame goes through
:func:`~.protocol.decode_message` before anything looks at it; a frame that fails
is answered with :class:`~.protocol.Rejected`, reported to ``on_invalid`` and
otherwise ignored.

* ``router`` mode (decode TP rank): binds ``tcp://host:port``; peers are told
  apart by their ZMQ identity.
* ``dealer`` mode (prefill TP rank): connects to one decode rank; ``peer`` is
  always ``b""``.

Callbacks run on the loop thread: ``on_message(peer, msg)`` for valid messages,
``on_invalid(peer, error)`` for rejected frames, ``on_tick(now)`` at least every
``tick_s`` seconds (deadline checks). An exception escaping a callback is logged
and counted in :attr:`handler_errors`; it never stops the loop.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Deque, Optional, Tuple

import zmq

from .errors import ProtocolError, TransferError
from .protocol import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Message, Rejected, decode_message,
                       encode_message)

logger = logging.getLogger(__name__)

OnMessage = Callable[[bytes, Message], None]
OnInvalid = Callable[[bytes, ProtocolError], None]
OnTick = Callable[[float], None]
SendFilter = Callable[[Message, bytes], Optional[bytes]]

CLOSE_LINGER_S = 0.5  # longest a close waits for already-sent messages to reach a peer


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class ControlEndpoint:
    """A ROUTER (bind) or DEALER (connect) socket served by a background thread."""

    def __init__(self, mode: str, host: str, port: int, *, expect: Tuple[type, ...],
                 on_message: OnMessage, on_invalid: Optional[OnInvalid] = None,
                 on_tick: Optional[OnTick] = None, tick_s: float = 0.02,
                 send_filter: Optional[SendFilter] = None, name: str = "pd-endpoint"):
        if mode not in ("router", "dealer"):
            raise ValueError(f"mode must be 'router' or 'dealer', got {mode!r}")
        self.mode = mode
        self.address = tcp_address(host, port)
        self._expect = expect
        self._on_message = on_message
        self._on_invalid = on_invalid
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._send_filter = send_filter
        self._outbox: Deque[Tuple[bytes, Message]] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER if mode == "router" else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self.handler_errors = 0
        self.rejected = 0
        self.sent = 0
        self.received = 0
        try:
            if mode == "router":
                self._sock.bind(self.address)
            else:
                self._sock.connect(self.address)
        except zmq.ZMQError as exc:
            self._close_resources()
            raise TransferError(f"cannot {'bind' if mode == 'router' else 'connect'} control socket "
                                f"{self.address}: {exc} (is the port in use? change pd_transfer.kv_port "
                                "or pd_transfer.host)") from exc
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ public
    def start(self) -> "ControlEndpoint":
        self._thread.start()
        return self

    def send(self, msg: Message, peer: bytes = b"") -> None:
        """Queue ``msg`` for ``peer`` (router mode) or the connected peer (dealer mode)."""
        if self.mode == "router" and not peer:
            raise ValueError("router endpoint: send needs the peer identity")
        data = encode_message(msg)  # validates: we never send what a peer would reject
        if self._send_filter is not None:
            data = self._send_filter(msg, data)
            if data is None:
                return
        with self._lock:
            if self._stop.is_set():
                return
            self._outbox.append((peer, data))
        self._wake()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (pending outgoing messages are flushed first) and free the socket."""
        if self._stop.is_set() and not self._thread.is_alive():
            return
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_resources()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ loop
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (already woken) or closing

    def _close_resources(self) -> None:
        try:
            # messages queued last (e.g. abort verdicts) get a bounded chance to leave
            self._sock.close(linger=int(CLOSE_LINGER_S * 1000))
            self._ctx.term()
        finally:
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _flush_outbox(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                peer, data = self._outbox.popleft()
            try:
                if self.mode == "router":
                    self._sock.send_multipart([peer, data], flags=zmq.NOBLOCK)
                else:
                    self._sock.send(data, flags=zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                logger.warning("%s: send queue full, message to %r dropped", self.address, peer)
            except zmq.ZMQError as exc:
                logger.warning("%s: send failed: %s", self.address, exc)

    def _receive_all(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.received += 1
            if self.mode == "router":
                peer, payload = frames[0], frames[1:]
            else:
                peer, payload = b"", frames
            if len(payload) != 1:
                self._reject(peer, ProtocolError(f"expected one payload frame, got {len(payload)}"))
                continue
            try:
                msg = decode_message(payload[0], expect=self._expect)
            except ProtocolError as exc:
                self._reject(peer, exc)
                continue
            self._call(self._on_message, peer, msg)

    def _reject(self, peer: bytes, error: ProtocolError) -> None:
        self.rejected += 1
        logger.warning("%s: rejected a message from %r: %s", self.address, peer, error)
        if self._on_invalid is not None:
            self._call(self._on_invalid, peer, error)
        if self.mode == "dealer" or peer:
            data = encode_message(Rejected(version=PROTOCOL_VERSION, reason=str(error)[:1000]))
            with self._lock:
                self._outbox.append((peer, data))

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a callback bug must not kill the control plane
            self.handler_errors += 1
            logger.exception("%s: callback %s failed", self.address, getattr(fn, "__name__", fn))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while True:
                timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000.0)
                events = dict(poller.poll(timeout_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                if self._sock in events:
                    self._receive_all()
                now = time.monotonic()
                if now >= next_tick:
                    if self._on_tick is not None:
                        self._call(self._on_tick, now)
                    next_tick = now + self._tick_s
                self._flush_outbox()
                if self._stop.is_set():
                    return
        except Exception:  # noqa: BLE001
            logger.exception("%s: control loop died", self.address)
