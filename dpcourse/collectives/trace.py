"""The record of one collective: every point-to-point transfer, as the ranks made them.

On a rank, pass ``trace=Trace()`` to a ring function: it appends one ``Transfer`` per send
that rank makes (``Trace(record_values=True)`` also keeps what was sent, and the rank's
input and result). Return the traces to the kernel and join them with ``Trace.merge``.
``frames()`` replays a trace step by step -- which ranks' contributions each rank holds in
each chunk, the values, and the bytes sent so far -- for drawing and for checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .chunks import PHASES, chunk_bounds


@dataclass(frozen=True)
class Transfer:
    """One send: ``src`` -> ``dst`` at ``step`` of ``phase``, chunk index ``chunk`` (None:
    the whole tensor), ``numel`` elements = ``nbytes`` bytes; ``values``: what was sent,
    when recorded (not part of equality)."""
    phase: str
    step: int
    src: int
    dst: int
    chunk: int | None
    numel: int
    nbytes: int
    values: object = field(default=None, compare=False, repr=False)


@dataclass
class Trace:
    """Transfers of one collective call; on a rank its own sends, after ``merge`` everyone's."""
    algorithm: str = ""
    world_size: int = 0
    numel: int = 0       # elements of the (flattened) tensor
    itemsize: int = 0    # bytes per element
    record_values: bool = False
    transfers: list[Transfer] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)   # rank -> 1-D input tensor (record_values)
    outputs: dict = field(default_factory=dict)  # rank -> 1-D tensor after the call

    # --- filled on the ranks ----------------------------------------------------------------
    def start(self, algorithm: str, world_size: int, rank: int, flat) -> None:
        """Called by the algorithm at its start on each rank (flat: this rank's 1-D tensor)."""
        if self.transfers or self.algorithm:
            raise ValueError("this Trace already holds a call; pass a new Trace() to each call")
        self.algorithm, self.world_size = algorithm, world_size
        self.numel, self.itemsize = flat.numel(), flat.element_size()
        if self.record_values:
            self.inputs[rank] = flat.detach().clone()

    def sent(self, phase: str, step: int, src: int, dst: int, chunk, tensor) -> None:
        """Record that ``src`` sent ``tensor`` (a chunk, or the whole tensor) to ``dst``."""
        values = tensor.detach().clone() if self.record_values else None
        self.transfers.append(Transfer(phase, step, src, dst, chunk, tensor.numel(),
                                       tensor.numel() * tensor.element_size(), values))

    def finish(self, rank: int, flat) -> None:
        if self.record_values:
            self.outputs[rank] = flat.detach().clone()

    # --- in the kernel ----------------------------------------------------------------------
    @classmethod
    def merge(cls, traces) -> "Trace":
        """One trace of the whole call from the ranks' traces (a list, in any rank order)."""
        traces = list(traces)
        if not traces:
            raise ValueError("merge needs the traces of the ranks, got none")
        first = traces[0]
        keys = {(t.algorithm, t.world_size, t.numel, t.itemsize) for t in traces}
        if len(keys) != 1:
            raise ValueError(f"these traces are of different calls: {sorted(keys)}")
        merged = cls(first.algorithm, first.world_size, first.numel, first.itemsize,
                     all(t.record_values for t in traces))
        for t in traces:
            merged.transfers.extend(t.transfers)
            merged.inputs.update(t.inputs)
            merged.outputs.update(t.outputs)
        merged.transfers.sort(key=lambda x: (x.step, x.src, x.dst))
        return merged

    @property
    def num_steps(self) -> int:
        """Number of communication steps (a step: transfers that can all happen at once)."""
        return len({t.step for t in self.transfers})

    def steps(self) -> list[list[Transfer]]:
        """Transfers grouped by step, in order."""
        out: dict[int, list[Transfer]] = {}
        for t in sorted(self.transfers, key=lambda x: (x.step, x.src, x.dst)):
            out.setdefault(t.step, []).append(t)
        return [out[k] for k in sorted(out)]

    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent, by rank (logical: tensor payload, no headers)."""
        sent = [0] * self.world_size
        for t in self.transfers:
            sent[t.src] += t.nbytes
        return sent

    def __len__(self) -> int:
        return len(self.transfers)

    def frames(self) -> list["Frame"]:
        """The state before the first step and after each step: see ``Frame``."""
        n, bounds = self.world_size, chunk_bounds(self.numel, self.world_size)
        everything = range(n)
        # holding[r][c]: ranks whose inputs are summed in rank r's copy of chunk c
        holding = [[frozenset([r]) for _ in everything] for r in everything]
        forwarded = [list(row) for row in holding]  # whole-ring: what r passes on next
        values = None
        if self.record_values and len(self.inputs) == n:
            values = [self.inputs[r].clone() for r in everything]
        sent = [0] * n
        frames = [Frame(0, "start", [], [list(h) for h in holding],
                        [v.clone() for v in values] if values else None, list(sent))]
        for number, transfers in enumerate(self.steps(), start=1):
            arriving = []
            for t in transfers:  # read every message before applying any (one step = at once)
                chunks = [t.chunk] if t.chunk is not None else list(everything)
                source = forwarded if t.phase == "pass" else holding
                arriving.append((t, {c: source[t.src][c] for c in chunks}))
                sent[t.src] += t.nbytes
            for t, contributions in arriving:
                lo, hi = bounds[t.chunk] if t.chunk is not None else (0, self.numel)
                add = PHASES[t.phase] == "add"
                for c, who in contributions.items():
                    holding[t.dst][c] = holding[t.dst][c] | who if add else who
                    if t.phase == "pass":
                        forwarded[t.dst][c] = who
                if values is not None and t.values is not None:
                    if add:
                        values[t.dst][lo:hi] += t.values
                    else:
                        values[t.dst][lo:hi] = t.values
            frames.append(Frame(number, transfers[0].phase, transfers, [list(h) for h in holding],
                                [v.clone() for v in values] if values else None, list(sent)))
        return frames


@dataclass
class Frame:
    """The ranks' state after ``number`` steps (0: before the first).

    holding[rank][chunk]: the set of ranks whose contributions that chunk sums on that rank;
    values[rank]: the rank's 1-D tensor (None unless values were recorded);
    bytes_sent[rank]: bytes the rank has sent so far; transfers: what this step sent.
    """
    number: int
    phase: str
    transfers: list
    holding: list
    values: list | None
    bytes_sent: list
