"""PyTorch's own hang-debugging tools on real Gloo ranks: the messages a learner meets, asserted."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

import dpcourse as dpc
from dpcourse import hangs

pytestmark = pytest.mark.timeout(240)


def test_detail_debug_names_the_mismatched_collectives():
    code, lines = hangs.torchrun("mismatch", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120)
    text = "\n".join(lines)
    assert code != 0  # the ranks raise instead of hanging
    assert "RuntimeError: Detected mismatch between collectives on ranks." in text
    assert "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE" in text
    assert "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST" in text
    assert "Op type: ALLREDUCEvs BROADCAST" in text


def test_detail_debug_names_mismatched_shapes():
    code, lines = hangs.torchrun("shape", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                                               "TORCH_CPP_LOG_LEVEL": "INFO"}, timeout=120)
    text = "\n".join(lines)
    assert code != 0
    assert "TensorShape=[4]" in text and "TensorShape=[5]" in text
    assert "Collectives differ in the following aspects:   Tensor Tensor shapes: 4vs 5" in text  # rank 0's view
    assert "[c10d] The debug level is set to DETAIL." in text  # TORCH_CPP_LOG_LEVEL=INFO's c10d lines


def test_the_process_group_timeout_and_the_flight_recorder(cluster2, tmp_path):
    out = str(tmp_path / "hang")
    codes = cluster2.run_script(hangs.__file__, "timeout", "--out", out, "--timeout", "2", timeout=60)
    assert codes == [0, 0]
    records = [json.load(open(f"{out}.rank{r}.json")) for r in range(2)]
    # The first rank to time out reports it (Gloo names the operation that waited, recv or send)
    # and Gloo closes that connection; a rank whose own timeout had not fired yet then reads
    # "Connection closed by peer" (seen on a loaded machine).
    timed_out = [bool(re.search(r"Timed out waiting 2000ms for (recv|send) operation to complete", r["error"]))
                 for r in records]
    assert any(timed_out), records
    assert all(t or "Connection closed by peer" in r["error"] for t, r in zip(timed_out, records)), records
    # each rank's flight recorder: the one collective it was stuck in, never completed
    assert [r["flight_recorder"] for r in records] == [
        [{"collective": "gloo:all_reduce", "seq": 1, "sizes": [[4]], "state": "scheduled"}],
        [{"collective": "gloo:broadcast", "seq": 1, "sizes": [[4]], "state": "scheduled"}]]
    assert cluster2.run(lambda: os.environ.get("TORCH_FR_BUFFER_SIZE")) == [None, None]  # env restored


def test_py_spy_dump_shows_where_each_rank_is_stuck(cluster2):
    assert hangs.py_spy_path(), "py-spy is a dev dependency: pip install -e '.[dev]'"
    dumps, err = hangs.dump_stacks_during(
        lambda: cluster2.run(hangs.mismatched_collectives, "op", timeout=6), cluster2.pids, after=1.5)
    assert isinstance(err, dpc.RankTimeout)
    stacks = [hangs.main_thread_stack(d) for d in dumps]
    assert stacks[0][0].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    assert stacks[1][0].startswith("broadcast (torch/distributed/distributed_c10d.py:")
    for stack in stacks:
        assert any(frame.startswith("mismatched_collectives (dpcourse/hangs.py:") for frame in stack)
    assert cluster2.run(lambda: torch.distributed.get_rank()) == [0, 1]  # the cluster recovered


def test_main_thread_stack_reads_a_py_spy_dump():
    dump = ('Process 1: python\nPython v3.11\n\nThread 1 (idle): "MainThread"\n    f (a.py:3)\n'
            '    g (a.py:9)\nThread 2 (idle): "other"\n    h (b.py:1)\n')
    assert hangs.main_thread_stack(dump) == ["f (a.py:3)", "g (a.py:9)"]
    assert hangs.main_thread_stack("nothing") == []


def test_nccl_settings_name_variables_this_torch_knows():
    lib = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    if not lib:
        pytest.skip("no libtorch_cpu.so to read")
    data = open(lib[0], "rb").read()
    for setting in hangs.NCCL_SETTINGS:
        name = setting.split("=")[0]
        if name.startswith("TORCH_") and name not in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DESYNC_DEBUG"):
            assert name.encode() in data, name  # the flight recorder's names live in the CPU library
    assert os.path.exists(os.path.join(os.path.dirname(torch.__file__), "distributed", "flight_recorder",
                                       "fr_trace.py"))
