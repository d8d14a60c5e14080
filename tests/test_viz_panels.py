"""The experiment panel over a notebook's own function, and the cluster status widget, on real ranks.

A panel puts controls on a function the notebook writes (it runs something on the ranks and
returns a drawing); pressing Run (the button's click handler, called here) redraws the
picture; a panel on a shut-down cluster says so and its recover button starts a fresh
cluster; a world-size control starts a cluster of its own; errors stay in the panel.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.viz.panel import describe_error  # noqa: E402
from dpcourse.viz.png import png_size  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _click(panel) -> bytes:
    panel.button.click()  # what the browser's click does: the registered on_click handlers
    return bytes(panel.image.value)


def _train(bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(dpc.models.build_model("mlp"), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = dpc.models.make_dataset("mlp", 8, seed=dist.get_rank()).tensors
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return dist.get_world_size()


def bucket_timeline(cluster, bucket_cap_mb=0.01, progress=None):
    """What a notebook writes: run on the ranks under an observer, return a drawing."""
    timeline = dpc.observe.Timeline()
    cluster.run(_train, bucket_cap_mb, observe=[timeline])
    buckets = timeline.summary(rank=0)["collectives"]
    return dpc.viz.draw_timeline(timeline.events(), title=f"{buckets} buckets on {cluster.world_size} ranks")


def test_run_redraws_the_picture_at_its_natural_size(cluster2):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()  # figures an earlier test in this process left open are not ours
    panel = dpc.viz.Panel("buckets", bucket_timeline, cluster2, bucket_cap_mb=[0.01, 25])
    assert panel.image.value == b"" and "press Run" in panel.view.status.value
    assert list(panel.controls["bucket_cap_mb"].options) == [0.01, 25]
    first = _click(panel)
    assert first and panel.image.layout.max_width == f"{png_size(first)[0]}px" and panel.image.layout.width == "100%"
    assert "done on 2 ranks" in panel.view.status.value and panel.progress.value == 1.0
    assert "buckets on 2 ranks" in panel.result.figure.axes[0].get_title()
    panel.controls["bucket_cap_mb"].value = 25
    second = _click(panel)
    assert second != first and panel.result.figure.axes[0].get_title().startswith("1 buckets")
    assert panel.own is None and not panel.button.disabled  # the notebook's cluster was used
    assert plt.get_fignums() == before  # the panel's pyplot figures do not pop up under a later cell


def test_controls_are_sliders_over_numbers_dropdowns_otherwise_or_widgets_as_given():
    import ipywidgets as w

    from dpcourse.viz.panel import make_control

    assert isinstance(make_control("n", [1, 2, 4]), w.SelectionSlider)
    assert isinstance(make_control("kind", ["ddp", "fsdp"]), w.Dropdown)
    given = w.IntSlider(3)
    assert make_control("x", given) is given
    with pytest.raises(ValueError, match="no choices"):
        make_control("x", [])


def test_a_panel_on_a_shut_down_cluster_says_so_and_recovers():
    cluster = dpc.Cluster(world_size=2, timeout=60)
    panel = dpc.viz.Panel("buckets", bucket_timeline, cluster, bucket_cap_mb=[0.01])
    cluster.shutdown()
    _click(panel)  # returns at once: no run on a closed cluster
    assert "was shut down" in panel.view.status.value and panel.fresh.layout.display == ""
    assert panel.image.value == b""
    try:
        panel.fresh.click()  # the recover button: a fresh cluster of the same size, then Run
        assert panel.own is not None and not panel.own.closed and panel.own.world_size == 2
        assert panel.image.value != b"" and panel.fresh.layout.display == "none"
    finally:
        own = panel.own
        panel.close()
    assert own.closed


def test_a_world_size_change_starts_one_cluster_of_that_size_and_stops_it(cluster2):
    def sizes(cluster, progress=None):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.set_title(str(cluster.run(dist.get_world_size)))
        return fig

    panel = dpc.viz.Panel("world size", sizes, cluster2, world_size=[1, 2])
    try:
        _click(panel)
        first = panel.own
        assert first.world_size == 1 and panel.result.figure.axes[0].get_title() == "[1]"
        panel.controls["world_size"].value = 2  # back to the notebook's size: its cluster
        _click(panel)
        assert panel.result.figure.axes[0].get_title() == "[2, 2]" and panel.own is first
    finally:
        panel.close()
    assert first.closed and not cluster2.closed


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot continue")
    return dist.get_rank()


def test_a_rank_error_is_shown_in_the_panel_with_the_per_rank_report_first(cluster2):
    def run(cluster, progress=None):
        cluster.run(_fail_on_rank_1, timeout=30)

    panel = dpc.viz.Panel("failing", run, cluster2)
    _click(panel)
    assert "RankError" in panel.view.status.value and "cluster is ready again" in panel.view.status.value
    shown = "".join(o.get("text", "") for o in panel.view.errors.outputs)
    assert shown.startswith("RankError: 1 of 2 rank(s) failed: 1\nrank 1 raised ValueError")
    assert "cluster.py" not in shown and "call.py" not in shown
    assert panel.progress.bar_style == "danger" and not panel.button.disabled
    assert cluster2.run(dist.get_rank) == [0, 1]  # the cluster is usable


def test_an_experiment_that_returns_no_drawing_is_told_so(cluster2):
    panel = dpc.viz.Panel("nothing", lambda cluster, progress=None: 42, cluster2)
    _click(panel)
    assert "must return a matplotlib Axes or Figure, not int" in panel.view.status.value


def test_describe_error_shows_the_learners_frames_and_the_courses_message_only():
    try:
        dpc.collectives.step_bytes("zero3", 2, [10])
    except ValueError as err:
        text = describe_error(err)
    assert text.endswith("choose one of ddp, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, fully_shard\n")
    assert "cost.py" not in text  # the course's frames: never

    def learners_experiment(cluster, progress=None):
        return {}["figure"]

    try:
        learners_experiment(None)
    except KeyError as err:
        text = describe_error(err)
    assert "in learners_experiment" in text and text.endswith("KeyError: 'figure'\n")
    assert "test_viz_panels.py" in text and "dpcourse" not in text


def test_status_shows_alive_ranks_then_a_failed_one(cluster2):
    view = dpc.viz.cluster_status(cluster2)
    assert "2 ranks, backend gloo" in view.text and "2 of 2 alive" in view.text
    assert [r.state for r in view.status.ranks] == ["idle", "idle"]
    assert [r.device for r in view.status.ranks] == ["cpu", "cpu"]
    assert [r.pid for r in view.status.ranks] == cluster2.pids
    with pytest.raises(dpc.RankError):
        cluster2.run(_fail_on_rank_1, timeout=30)
    view.button.click()  # Refresh
    assert "failed in the last call: raised ValueError: rank 1 cannot continue" in view.text
    assert view.status.ranks[1].failed_last and not view.status.ranks[0].failed_last
    assert "last error: RankError: 1 of 2 rank(s) failed: 1" in view.text
    cluster2.run(dist.get_rank)
    view.refresh()
    assert "failed in the last call" not in view.text and "last error: RankError" in view.text


def test_status_of_a_dead_rank_and_of_a_closed_cluster():
    import os
    import signal
    import time

    cluster = dpc.Cluster(world_size=2, timeout=60)
    try:
        os.kill(cluster.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while cluster.status().ranks[1].state != "dead" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.state for r in cluster.status().ranks] == ["idle", "dead"]
        assert cluster.status().alive == [0]
    finally:
        cluster.shutdown()
    view = dpc.viz.cluster_status(cluster)
    assert "shut down" in view.text and [r.state for r in view.status.ranks] == ["closed", "closed"]


def test_a_panel_builds_without_running_anything(cluster2):
    calls = cluster2.status().calls
    panel = dpc.viz.Panel("buckets", bucket_timeline, cluster2, bucket_cap_mb=[0.01, 25])
    assert panel.image.value == b"" and panel.own is None
    assert cluster2.status().calls == calls
