"""An experiment panel: a few controls, a Run button, a progress bar, the plot, errors in place.

    def bucket_timeline(cluster, bucket_cap_mb=0.5, progress=None):   # written in the notebook
        ...                                  # run something on the ranks, draw it
        return dpc.viz.draw_timeline(events)  # an Axes, a Figure, or an Experiment
    dpc.viz.Panel("bucket size", bucket_timeline, cluster, bucket_cap_mb=[0.05, 0.5, 5])

A panel's Run calls the experiment, ``run(cluster, progress=..., **fixed, **chosen values)``,
and shows the figure it returns at its natural size. Controls are keyword arguments: a list
of choices (numbers: a slider over them; anything else: a drop-down) or an ipywidgets
control. A control named ``world_size`` chooses the cluster: the notebook's own when the
sizes match, else one the panel starts for itself (and shuts down when it starts another,
or on ``close()``).

Whatever happens stays in the panel: an exception in a widget callback would otherwise reach
only the server's log, and the learner would watch "running..." forever. A rank's error shows
its per-rank report; a shut-down or unstartable cluster says so and offers a button that
starts a fresh one. ``ErrorView`` is the part the ring player shares.
"""
from __future__ import annotations

import io
import os
import traceback
from typing import Any, NamedTuple


class Experiment(NamedTuple):
    """What an experiment's plain function returns: its numbers and its figure."""

    data: dict
    figure: Any  # matplotlib.figure.Figure, drawn without pyplot

    def _repr_png_(self):
        return figure_png(self.figure)


def as_experiment(value) -> Experiment:
    """What an experiment returned, as an ``Experiment``: an Axes or a Figure becomes its figure."""
    if isinstance(value, Experiment):
        return value
    figure = getattr(value, "figure", None) or (value if hasattr(value, "savefig") else None)
    if figure is None:
        raise TypeError(f"a panel's experiment must return a matplotlib Axes or Figure, not {type(value).__name__}")
    return Experiment({}, figure)


def _close_pyplot(figure) -> None:
    """Forget ``figure`` in pyplot, if pyplot made it: it must not pop up under the next cell."""
    import sys

    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None and getattr(figure, "number", None) in plt.get_fignums():
        plt.close(figure)


def figure_png(fig, dpi: int = 90) -> bytes:
    """``fig`` as PNG bytes (``dpi`` pixels per inch, trimmed to what is drawn)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INTERNAL = ("/ipywidgets/", "/traitlets/", "/IPython/", "/ipykernel/", "/selectors.py", "/contextlib.py")


def describe_error(err: BaseException) -> str:
    """What a learner needs from ``err``: the pool's per-rank report as it is (it already leads
    with what each rank did); for other errors the message, after the frames of the learner's
    own code if it raised there -- never the course's, the widgets' or the kernel's frames
    (the course's errors name their fix in the message)."""
    from ..pool import ClusterError

    if isinstance(err, ClusterError):
        return f"{type(err).__name__}: {err}"
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_PACKAGE) and not any(part in f.filename for part in _INTERNAL)]
    shown = "".join(traceback.format_list(frames[-4:]))
    return (f"Traceback (innermost last):\n{shown}" if shown else "") + \
        "".join(traceback.format_exception_only(type(err), err))


class ErrorView:
    """A status line and an output area under a widget's controls, for a callback's error."""

    def __init__(self):
        import ipywidgets as w

        self.status = w.HTML()
        self.errors = w.Output()

    def clear(self) -> None:
        """Forget the last error (``clear_output`` only works while a kernel captures it)."""
        self.errors.outputs = ()

    def show(self, err: BaseException, what_now: str) -> None:
        """Say in the status line what failed and ``what_now``; the report goes below it."""
        import html

        first = (str(err).strip().splitlines() or [""])[0]
        self.status.value = (f"<b style='color:var(--jp-error-color1, #b00)'>{html.escape(type(err).__name__)}: "
                             f"{html.escape(first)}</b> ({html.escape(what_now)})")
        self.errors.outputs = ()
        self.errors.append_stderr(describe_error(err) + "\n")


def make_control(name: str, spec):
    """An ipywidgets control for ``spec``: a widget as it is; a list of numbers, a slider over
    them (the first selected); any other list, a drop-down."""
    import ipywidgets as w

    if isinstance(spec, w.Widget):
        return spec
    options = list(spec)
    if not options:
        raise ValueError(f"Panel control {name}=[] has no choices")
    if all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in options):
        return w.SelectionSlider(options=options, value=options[0], description=name)
    return w.Dropdown(options=options, value=options[0], description=name)


class Panel:
    """Controls, Run, a progress bar and the experiment's figure; see the module docstring.

    run: ``run(cluster, progress=callback, **fixed, **values)`` returning an Axes, a Figure or
    an ``Experiment``; ``progress`` takes (fraction done, what is running). controls: see
    ``make_control``; ``world_size`` picks the cluster instead of being passed on. cluster: the
    notebook's.
    """

    def __init__(self, title: str, run, cluster=None, *, fixed: dict | None = None, **controls):
        import ipywidgets as w

        controls = {name: make_control(name, spec) for name, spec in controls.items()}
        self.title, self.run_fn, self.controls, self.fixed = title, run, controls, dict(fixed or {})
        for control in self.controls.values():
            control.style.description_width = "initial"  # "bucket_cap_mb" whole, not "bucket_ca..."
        self.cluster, self.own = cluster, None  # the notebook's cluster; one the panel started
        self._world_size = cluster.world_size if cluster is not None else 2
        self.result: Experiment | None = None
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.fresh = w.Button(description="start a fresh cluster", icon="refresh",
                              layout=w.Layout(display="none", width="auto"))
        self.progress = w.FloatProgress(value=0, min=0, max=1, layout=w.Layout(width="220px"))
        self.view = ErrorView()
        self.view.status.value = "press Run to run the experiment on the ranks"
        self.output = w.Output()  # what the ranks print during a run, labelled by rank
        self.image = w.Image(format="png", layout=w.Layout(display="none"))  # shown once drawn
        self.button.on_click(lambda _: self.click())
        self.fresh.on_click(lambda _: self.start_fresh())
        boxes = [w.HBox(list(self.controls.values())[i:i + 3]) for i in range(0, len(self.controls), 3)]
        self.widget = w.VBox([w.HTML(f"<b>{title}</b>"), *boxes,
                              w.HBox([self.button, self.progress, self.fresh]), self.view.status,
                              self.view.errors, self.output, self.image])

    # --- what the buttons do ------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The ranks the next run uses: the world_size control's, else the cluster's."""
        control = self.controls.get("world_size")
        return control.value if control is not None else self._world_size

    def values(self) -> dict:
        """The controls' current values, as keyword arguments of the run function."""
        return {k: c.value for k, c in self.controls.items() if k != "world_size"}

    def target(self):
        """The open cluster of the chosen size the next run uses: the notebook's, else the
        panel's own; None if there is none yet."""
        n = self.world_size
        return next((c for c in (self.cluster, self.own) if c is not None and not c.closed and c.world_size == n),
                    None)

    def click(self) -> None:
        """Run with the chosen values; never raises (a widget callback's error would be lost)."""
        self.button.disabled, self.fresh.layout.display = True, "none"
        self.view.clear()
        self.output.outputs = ()
        try:
            cluster, n = self.target(), self.world_size
            if cluster is None and self.cluster is not None and self.cluster.world_size == n:
                self._closed()  # the notebook's cluster is gone: ask before starting another
                return
            if cluster is None:  # another world size: ranks of the panel's own
                self._set(0.02, f"starting {n} ranks for this panel...")
                cluster = self._start(n)
            self._set(0.05, f"running on {n} ranks...")
            with self.output:  # in a callback, prints would otherwise reach only the log console
                self.result = as_experiment(self.run_fn(cluster, progress=self._set, **self.fixed,
                                                        **self.values()))
            self._set(0.95, "drawing...")
            from .png import show_png

            show_png(self.image, figure_png(self.result.figure))
            _close_pyplot(self.result.figure)
            self.image.layout.display = ""
            self._set(1.0, self.summary(cluster))
        except BaseException as err:  # noqa: BLE001 -- shown in the panel, nothing is lost
            self._failed(err)
        finally:
            self.button.disabled = False

    def start_fresh(self) -> None:
        """The recover button: start a cluster of the chosen size for this panel, then run."""
        self.fresh.layout.display = "none"
        try:
            self._set(0.02, f"starting a fresh cluster of {self.world_size} ranks...")
            self._start(self.world_size)
        except BaseException as err:  # noqa: BLE001
            self._failed(err)
            return
        self.click()

    def close(self) -> None:
        """Shut down the cluster the panel started (if any) and close its widgets."""
        if self.own is not None:
            self.own.shutdown()
        self.widget.close()

    # --- inside -------------------------------------------------------------------------
    def _start(self, world_size: int):
        from ..pool import Cluster

        if self.own is not None:
            self.own.shutdown()  # one cluster per panel: never two sets of ranks left running
            self.own = None
        self.own = Cluster(world_size=world_size, timeout=120)
        return self.own

    def _set(self, fraction: float, text: str) -> None:
        import html

        self.progress.value = max(0.0, min(1.0, fraction))
        self.progress.bar_style = "success" if fraction >= 1 else "info"
        self.view.status.value = html.escape(text)

    def summary(self, cluster) -> str:
        """The status line after a run: what ran where, and the experiment's own summary."""
        said = self.result.data.get("summary", "") if self.result else ""
        return f"done on {cluster.world_size} ranks ({cluster.backend})" + (f": {said}" if said else "")

    def _closed(self) -> None:
        self.progress.value, self.progress.bar_style = 0, "warning"
        self.view.status.value = (
            f"<b style='color:var(--jp-error-color1, #b00)'>The notebook's cluster of {self.world_size} ranks was shut down</b> "
            "(cluster.shutdown()). Start a fresh cluster for this panel, or create a new "
            "dpc.Cluster and run the cell that made this panel again.")
        self.fresh.layout.display = ""

    def _failed(self, err: BaseException) -> None:
        from ..pool import ClusterError, RankError, RankTimeout

        self.progress.bar_style = "danger"
        if isinstance(err, (RankError, RankTimeout)):
            what_now = "the cluster is ready again; change a setting or press Run to try again"
        elif isinstance(err, KeyboardInterrupt):
            what_now = "interrupted; press Run to try again"
        elif isinstance(err, ClusterError):  # closed, could not start, launcher gone
            what_now = "start a fresh cluster with the button"
            self.fresh.layout.display = ""
        else:
            what_now = "change a setting and press Run to try again"
        self.view.show(err, what_now)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
