"""``dpc.observe.Comm.read_flight_recorder()``: PyTorch's flight recorder read through the one
module of private names (4.2d's hang script calls it), checked on real ranks, and its absence
named; and the recorder on by default in 2.13, under torchrun with neither of its variables set."""
from __future__ import annotations

import json

import pytest
import torch

from dpcourse import torch_private as tp
from dpcourse.observe import Comm
from dpcourse.processes import launch_env, run_process, torchrun_command

pytestmark = pytest.mark.timeout(300)

SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist
from dpcourse.observe import Comm

dist.init_process_group("gloo")
t = torch.ones(3)
dist.all_reduce(t)
dist.broadcast(t, src=1)
entries = Comm.read_flight_recorder()
with open(f"{sys.argv[1]}.rank{dist.get_rank()}.json", "w") as f:
    json.dump([[e["profiling_name"], e["collective_seq_id"]] for e in entries], f)
dist.barrier()
dist.destroy_process_group()
'''


def test_the_flight_recorder_lists_the_ranks_last_collectives_in_order(cluster2, tmp_path):
    script = tmp_path / "recorded.py"
    script.write_text(SCRIPT)
    assert cluster2.run_script(str(script), str(tmp_path / "fr"), timeout=120) == [0, 0]
    for rank in range(2):
        entries = json.loads((tmp_path / f"fr.rank{rank}.json").read_text())
        (first, a), (second, b) = entries[-2:]
        assert (first, second) == ("gloo:all_reduce", "gloo:broadcast") and b == a + 1, entries


def test_without_the_private_reader_the_error_names_it_and_both_releases(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    with pytest.raises(tp.PrivateAPIMissing) as err:
        Comm.read_flight_recorder()
    text = str(err.value)
    assert f"`torch._C._distributed_c10d._dump_fr_trace_json`; you have {torch.__version__}" in text, text


@pytest.mark.slow
def test_under_torchrun_with_neither_variable_set_the_recorder_lists_both_collectives(tmp_path):
    """PyTorch 2.13 records by default (c10d's FlightRecorder: 2000 entries unless
    TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE says otherwise): fresh processes,
    neither variable in their environment, and both collectives are there, in order. On Gloo
    every entry stays "scheduled", finished or not (4.2d reads the order, not the state)."""
    script = tmp_path / "recorded.py"
    script.write_text(SCRIPT.replace('json.dump([[e["profiling_name"], e["collective_seq_id"]] for e in entries], f)',
                                     'json.dump([[e["profiling_name"], e["collective_seq_id"], e["state"]] for e in entries], f)'))
    env = launch_env()
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env.pop(name, None)
    done = run_process(torchrun_command(2, script, tmp_path / "fr"), 180, env=env, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        entries = json.loads((tmp_path / f"fr.rank{rank}.json").read_text())
        assert [(n, s) for n, _, s in entries] == [("gloo:all_reduce", "scheduled"),
                                                   ("gloo:broadcast", "scheduled")], entries
        assert entries[1][1] == entries[0][1] + 1
