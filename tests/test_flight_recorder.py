"""``dpc.observe.Comm.read_flight_recorder()``: PyTorch's flight recorder read through the one
module of private names (4.2d's hang script calls it), checked on real ranks, and its absence
named."""
from __future__ import annotations

import json

import pytest
import torch

from dpcourse import torch_private as tp
from dpcourse.observe import Comm

pytestmark = pytest.mark.timeout(300)

SCRIPT = '''
import json, os, sys
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")       # before the process group exists
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
