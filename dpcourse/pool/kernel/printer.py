"""Rank output shown in the kernel, labelled by rank (what ``forwarder`` sends from the ranks).

Runs in the kernel. Complete lines go to the kernel's own stdout/stderr as they arrive
("[rank 1] epoch 3"). A line still being rewritten with "\\r" (a progress bar) is shown, in a
Jupyter kernel, in one live display per rank, so bars of different ranks do not overwrite each
other; when the line ends, its final state is printed like any other line.
"""
from __future__ import annotations

import re
import sys
import time


def _in_ipykernel() -> bool:
    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    return shell is not None and hasattr(shell, "kernel")


# Lines a rank writes to stderr that say nothing to a learner and would show as a red block:
# Kineto (torch.profiler's engine) marks every profiler start and stop with a tracepoint line,
# "USDT:2026-01-01 10:00:00 4711:4711 SyncActivityProfilerHandler.cpp:52] profiler_start".
# Only these exact lines are dropped; Kineto's warnings and errors still show.
HARMLESS_STDERR = (re.compile(r"USDT:\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] profiler_(start|stop)\s*"),)


def harmless(line: str) -> bool:
    """Whether a rank's stderr ``line`` is one of ``HARMLESS_STDERR`` (not shown)."""
    return any(pattern.fullmatch(line) for pattern in HARMLESS_STDERR)


def collapse_carriage_returns(line: str) -> str:
    """What a terminal shows for a line rewritten with "\\r": the text after the last one."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


# One colour per rank, the drawings' own (matplotlib's tab10, as ``dpcourse.viz.colors``; the
# pool imports no drawing code, so the values are repeated here and a test keeps them equal).
RANK_RGB = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))


class RankPrinter:
    """Buffers partial lines per (rank, stream) and prints complete ones with a label.

    Labels line up whatever the world size ("[rank  3]" next to "[rank 12]"). In a Jupyter
    kernel each line also starts with a bar in the rank's colour, so the lines of 4-8 ranks
    printing at once can be told apart at a glance; the label itself stays plain text.
    """

    REFRESH_S = 0.1  # at most ten progress redraws per second per rank

    def __init__(self, world_size: int = 1, color: bool | None = None):
        self.partial: dict[tuple[int, str], str] = {}
        self.bars: dict[tuple[int, str], list] = {}  # key -> [handle, text shown, time, pending]
        self.live = _in_ipykernel()
        self.color = self.live if color is None else color
        self.width = len(str(max(world_size - 1, 0)))

    def label(self, rank: int) -> str:
        """"[rank 3] ", padded to the widest rank number, after a coloured bar if ``color``."""
        text = f"[rank {rank:>{self.width}}] "
        if not self.color:
            return text
        r, g, b = RANK_RGB[rank % len(RANK_RGB)]
        return f"\x1b[38;2;{r};{g};{b}m\u258c\x1b[0m{text}"  # U+258C: a left half block

    def feed(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        *lines, rest = (self.partial.get(key, "") + text).split("\n")
        if stream == "stderr":
            lines = [x for x in lines if not harmless(x)]
        if lines:
            self._clear_bar(key)
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write("".join(f"{self.label(rank)}{collapse_carriage_returns(x)}\n" for x in lines))
        self.partial[key] = rest
        if "\r" in rest and self.live:
            self._show_bar(key, self.label(rank) + collapse_carriage_returns(rest))

    def _show_bar(self, key, text: str) -> None:
        from IPython.display import display

        bar = self.bars.get(key)
        now = time.monotonic()
        if bar is None:
            handle = display({"text/plain": text}, raw=True, display_id=True)
            self.bars[key] = [handle, text, now, None]
        elif now - bar[2] >= self.REFRESH_S:
            bar[0].update({"text/plain": text}, raw=True)
            bar[1:] = [text, now, None]
        else:
            bar[3] = text

    def _clear_bar(self, key) -> None:
        bar = self.bars.pop(key, None)
        if bar is not None:
            bar[0].update({"text/plain": ""}, raw=True)

    def tick(self) -> None:
        """Redraw progress bars whose latest text was held back by the refresh limit."""
        now = time.monotonic()
        for bar in self.bars.values():
            if bar[3] is not None and now - bar[2] >= self.REFRESH_S:
                bar[0].update({"text/plain": bar[3]}, raw=True)
                bar[1:] = [bar[3], now, None]

    def flush(self) -> None:
        """Print every unfinished line as it stands (at the end of a call, or on error)."""
        for (rank, stream), rest in sorted(self.partial.items()):
            if rest:
                self._clear_bar((rank, stream))
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(f"{self.label(rank)}{collapse_carriage_returns(rest)}\n")
        self.partial.clear()
        for key in list(self.bars):
            self._clear_bar(key)
        sys.stdout.flush()
        sys.stderr.flush()


class StartProgress:
    """One line, updated in place, while a cluster starts (its first start takes seconds, most
    of them importing torch): shown in a Jupyter kernel only, as a display the kernel updates;
    elsewhere (scripts, tests) nothing is printed."""

    def __init__(self, world_size: int, backend: str, shown: bool = True):
        self.world_size, self.backend = world_size, backend
        self.started = time.monotonic()
        self.ready: list[int] = []
        self._handle = None
        if shown and _in_ipykernel():
            from IPython.display import display

            self._handle = display(self._text("the launcher imports torch (once per cluster)"),
                                   display_id=True)

    def _text(self, doing: str):
        from IPython.display import Pretty

        return Pretty(f"dpcourse: starting {self.world_size} rank{'s' if self.world_size != 1 else ''} "
                      f"({self.backend}), {time.monotonic() - self.started:.1f} s: {doing}")

    def _show(self, doing: str) -> None:
        if self._handle is not None:
            self._handle.update(self._text(doing))

    def launcher_ready(self) -> None:
        self._show(f"ranks joining the process group (0 of {self.world_size} ready)")

    def rank_ready(self, rank: int) -> None:
        self.ready.append(rank)
        self._show(f"ranks joining the process group ({len(self.ready)} of {self.world_size} ready: "
                   + ", ".join(f"rank {r}" for r in sorted(self.ready)) + ")")

    def done(self, ok: bool) -> None:
        if self._handle is not None:
            from IPython.display import Pretty

            took = time.monotonic() - self.started
            self._handle.update(Pretty(f"dpcourse: {self.world_size} ranks ready in {took:.1f} s" if ok
                                       else f"dpcourse: the ranks did not start ({took:.1f} s); see below"))
