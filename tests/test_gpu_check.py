"""``python -m dpcourse.gpu_check``: one line where there is no GPU; its checks, run on CPU
ranks (``--cpu``), pass here, so the GPU run exercises code that is known to work."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dpcourse import gpu_check

pytestmark = pytest.mark.timeout(240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs instead")
def test_without_a_gpu_it_skips_in_one_line():
    done = subprocess.run([sys.executable, "-m", "dpcourse.gpu_check"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped, no CUDA device here")


def test_its_checks_pass_on_cpu_ranks(capsys):
    assert gpu_check.main(["--cpu"]) == 0
    out = capsys.readouterr().out
    for item in ("collective all_reduce", "collective send/recv ring", "collective all_reduce of a CPU tensor",
                 "DDP step equals one process's", "FSDP2 step equals one process's", "Memory observer on rank 1"):
        assert f"ok   {item}" in out, out
    assert "FAIL" not in out and "gpu_check: all passed" in out
