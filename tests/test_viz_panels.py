"""Experiment panels and the cluster status widget, on real ranks.

Each panel's plain function returns what the notebooks assert; pressing Run (the button's
click handler, called here) redraws the picture; a panel on a shut-down cluster says so and
its recover button starts a fresh cluster; the status widget shows live and failed ranks.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.viz import panels_ddp, panels_fsdp  # noqa: E402
from dpcourse.viz.panel import describe_error  # noqa: E402
from dpcourse.viz.png import png_size  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _click(panel) -> bytes:
    panel.button.click()  # what the browser's click does: the registered on_click handlers
    return bytes(panel.image.value)


def test_ddp_experiment_equals_one_process_on_the_global_batch(cluster2):
    result = dpc.viz.run_ddp_experiment(cluster2, batch_size=4, steps=4)
    data = result.data
    assert data["global_batch"] == 8 and len(data["losses"]) == len(data["single_losses"]) == 4
    assert data["max_difference"] < 1e-5 and len(data["step_ms"]) == 2
    assert result.figure.axes[0].get_title() == "global batch 4 x 2 = 8"


@pytest.mark.parametrize("kind", ["bucketed", "ddp"])
def test_bucket_experiment_has_the_buckets_the_rule_plans(cluster2, kind):
    result = dpc.viz.run_bucket_experiment(cluster2, bucket_cap_mb=0.2, kind=kind)
    data = result.data
    assert data["num_buckets"] == len(data["planned_bucket_bytes"]) > 1
    assert 0.0 <= data["hidden_fraction"] <= 1.0
    assert {e.rank for e in data["events"]} == {0, 1}
    one = dpc.viz.run_bucket_experiment(cluster2, bucket_cap_mb=25, kind=kind)
    assert one.data["num_buckets"] == 1


def test_bucket_sweep_counts_buckets_per_cap(cluster2):
    result = dpc.viz.run_bucket_sweep(cluster2, caps_mb=(1, 0.05), kinds=("bucketed",))
    rows = result.data["rows"]
    assert [r["bucket_cap_mb"] for r in rows] == [0.05, 1]
    assert [r["num_buckets"] for r in rows] == [result.data["planned"][c] for c in (0.05, 1)]
    if result.data["alpha"] is not None:  # the fit may refuse noisy timings
        assert result.data["alpha"] >= 0 and result.data["beta"] > 0


def test_strategy_experiment_measures_the_ledger_and_the_theory(cluster2):
    result = dpc.viz.run_strategy_experiment(cluster2, ("ddp", "FULL_SHARD"), d_hidden=64, depth=2)
    ddp, fsdp = result.data["rows"]["ddp"], result.data["rows"]["FULL_SHARD"]
    for row in (ddp, fsdp):  # at rest, measured == the memory ledger, by category
        assert {c: row["at_rest"].get(c, 0) for c in row["theory_at_rest"]} == row["theory_at_rest"]
    assert ddp["comm_measured"] == ddp["comm_theory"]  # DDP: one all-reduce of every gradient
    assert sum(fsdp["at_rest"].values()) < sum(ddp["at_rest"].values())
    assert result.data["param_bytes"] == ddp["comm_theory"]["all_reduce"]


def test_strategy_experiment_refuses_hybrid_shard_on_two_ranks_in_the_kernel(cluster2):
    with pytest.raises(dpc.train.ConfigError, match="shard_group_size"):
        dpc.viz.run_strategy_experiment(cluster2, ("HYBRID_SHARD",))


def test_auto_wrap_experiment_counts_units_and_peaks(cluster2):
    result = dpc.viz.run_auto_wrap_experiment(cluster2, ("none", "block"), d_hidden=64, depth=3)
    units = result.data["units"]
    assert units == {"auto_wrap=none": 1, "auto_wrap=block": 4}  # the root, + one per block
    rows = result.data["rows"]
    assert rows["auto_wrap=block"]["peak_bytes"] < rows["auto_wrap=none"]["peak_bytes"]
    # the ledger's peak (from parameter shapes alone) next to the measured one, both policies
    for name, predicted in result.data["ledger_peak"].items():
        assert abs(rows[name]["peak_bytes"] / predicted - 1) < 0.02, (name, rows[name]["peak_bytes"], predicted)


def test_run_redraws_the_picture_at_its_natural_size(cluster2):
    panel = dpc.viz.bucket_panel(cluster2)
    assert panel.image.value == b"" and "press Run" in panel.view.status.value
    first = _click(panel)
    assert first and panel.image.layout.width == f"{png_size(first)[0]}px"
    assert "done on 2 ranks" in panel.view.status.value and panel.progress.value == 1.0
    panel.controls["bucket_cap_mb"].value = 25
    second = _click(panel)
    assert second != first and "1 bucket (the rule plans 1)" in panel.view.status.value
    assert panel.own is None and not panel.button.disabled  # the notebook's cluster was used


def test_a_panel_on_a_shut_down_cluster_says_so_and_recovers():
    cluster = dpc.Cluster(world_size=2, timeout=60)
    panel = dpc.viz.ddp_panel(cluster)
    cluster.shutdown()
    _click(panel)  # returns at once: no run on a closed cluster
    assert "was shut down" in panel.view.status.value and panel.fresh.layout.display == ""
    assert panel.image.value == b""
    try:
        panel.fresh.click()  # the recover button: a fresh cluster of the same size, then Run
        assert panel.own is not None and not panel.own.closed and panel.own.world_size == 2
        assert panel.image.value != b"" and panel.fresh.layout.display == "none"
        assert panel.result.data["max_difference"] < 1e-5
    finally:
        own = panel.own
        panel.close()
    assert own.closed


def test_a_world_size_change_starts_one_cluster_of_that_size_and_stops_it(cluster2):
    panel = dpc.viz.ddp_panel(cluster2)
    panel.controls["world_size"].value = 1
    panel.controls["batch_size"].value = 4
    try:
        _click(panel)
        first = panel.own
        assert first.world_size == 1 and panel.result.data["world_size"] == 1
        panel.controls["world_size"].value = 2  # back to the notebook's size: its cluster
        _click(panel)
        assert panel.result.data["world_size"] == 2 and panel.own is first
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

    panel = dpc.viz.Panel("failing", run, {}, cluster2)
    _click(panel)
    assert "RankError" in panel.view.status.value and "cluster is ready again" in panel.view.status.value
    shown = "".join(o.get("text", "") for o in panel.view.errors.outputs)
    assert shown.startswith("RankError: 1 of 2 rank(s) failed: 1\nrank 1 raised ValueError")
    assert "cluster.py" not in shown and "call.py" not in shown
    assert panel.progress.bar_style == "danger" and not panel.button.disabled
    assert cluster2.run(dist.get_rank) == [0, 1]  # the cluster is usable


def test_describe_error_shows_the_learners_frames_and_the_courses_message_only():
    try:
        panels_fsdp._config("FULL_SHARDED", None, 64, 2, 4, 3)
    except ValueError as err:
        text = describe_error(err)
    message = "ValueError: unknown strategy 'FULL_SHARDED'; choose one of " + ", ".join(panels_fsdp.TRAINED)
    assert text.endswith(message + "\n") and "panels_fsdp.py" not in text  # the course's frames: never

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


def test_panels_build_without_running_anything(cluster2):
    calls = cluster2.status().calls
    for make in (dpc.viz.ddp_panel, dpc.viz.bucket_panel, dpc.viz.bucket_sweep_panel,
                 dpc.viz.ddp_vs_fsdp_panel, dpc.viz.sharding_panel, dpc.viz.auto_wrap_panel):
        panel = make(cluster2)
        assert panel.image.value == b"" and panel.own is None
    assert cluster2.status().calls == calls
    assert panels_ddp.CAPS_MB == tuple(sorted(panels_ddp.CAPS_MB))
