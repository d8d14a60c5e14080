"""Rank output, the rank's end: everything written to file descriptors 1 and 2 -- Python prints,
C++ warnings, progress bars -- sent to the kernel as it is written (``printer`` shows it there).

Runs on the ranks.
"""
from __future__ import annotations

import codecs
import contextlib
import fcntl
import io
import os
import selectors
import struct
import sys
import termios
import threading
import time

from ...patching import patched
from ..wire import Output


def _unbuffered(fd: int) -> io.TextIOWrapper:
    """A text stream that writes through to ``fd`` at once (never closing it)."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


class OutputForwarder:
    """Forwards what is written to fds 1 and 2 (pipes) to the kernel.

    The launcher makes the pipes and keeps their read ends too (``launcher``): what a rank
    wrote just before it died -- the C++ runtime's ``what():`` line before an abort -- is still
    in the pipe when this thread dies with the rank, and the launcher reads it out then."""

    def __init__(self, send, read_fds: tuple[int, int] | None = None):
        """``send(message)``: put a ``wire.Output`` on the kernel's control socket; ``read_fds``:
        the read ends of the pipes fds 1 and 2 already write to (None: make them here)."""
        self._send = send
        self._busy = threading.Lock()  # held from reading a chunk until it is sent
        self._fds = {}
        for i, (stream, fd) in enumerate((("stdout", 1), ("stderr", 2))):
            if read_fds is None:
                r, w = os.pipe()
                os.dup2(w, fd)
                os.close(w)
            else:
                r = read_fds[i]
            self._fds[r] = (stream, codecs.getincrementaldecoder("utf-8")("replace"))
        # Unbuffered text streams: a print() or a "\r" progress update reaches the pipe at once.
        # They stay for the rank's life; ``_streams.close()`` would put the old ones back.
        self._streams = contextlib.ExitStack()
        self._streams.enter_context(patched(sys, stdout=_unbuffered(1), stderr=_unbuffered(2)))
        threading.Thread(target=self._pump, name="dpcourse-output", daemon=True).start()

    def _pump(self):
        sel = selectors.DefaultSelector()
        for r in self._fds:
            sel.register(r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                with self._busy:
                    data = os.read(key.fd, 65536)
                    stream, decoder = self._fds[key.fd]
                    text = decoder.decode(data)
                    if text:
                        self._send(Output(stream, text))

    def _pending(self) -> int:
        total = 0
        for r in self._fds:
            total += struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0\0\0\0"))[0]
        return total

    def drain(self, limit: float = 2.0) -> None:
        """Return once everything written so far has been sent to the kernel."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._pending() == 0:
                with self._busy:  # a chunk already read is sent before we get the lock
                    pass
                if self._pending() == 0:
                    return
            time.sleep(0.0005)
