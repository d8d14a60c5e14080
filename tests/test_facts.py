"""What the course says about PyTorch 2.13 and NCCL, checked against what they do or say, and
the order in which the chapters teach what they use.

Each fact is read from the installed torch (its Python source, its C++ headers, a run on real
ranks) and then looked for in the text that states it; each order rule finds the first code
cell that uses a name and the prose that teaches it. A test here failed on the text it fixed:
the flight recorder "kept when TORCH_FR_BUFFER_SIZE is set", the bf16 fallback that never
falls back, NCCL's network latency "up to 2.17", "FSDP1 deprecated", a Gloo-only 30 minutes,
fp16's rounding as its only risk, autocast's copies "only during forward", the offloaded
state dict "only rank 0 receives", and FSDP1, `fully_shard`, the ledger, mixed precision and
DTensor clipping used before they were taught."""
from __future__ import annotations

import inspect
import json
import re
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import dpcourse as dpc

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TORCH = Path(torch.__file__).parent
C10D_HEADERS = TORCH / "include" / "torch" / "csrc" / "distributed" / "c10d"


def cells(name: str) -> list[dict]:
    return json.loads(next(NOTEBOOKS.rglob(name)).read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def prose(name: str) -> str:
    """The notebook's markdown, whitespace folded (a phrase may wrap anywhere)."""
    return " ".join(" ".join(source(c) for c in cells(name) if c["cell_type"] == "markdown").split())


def code(name: str) -> str:
    return "\n".join(source(c) for c in cells(name) if c["cell_type"] == "code")


def header(name: str) -> str:
    path = C10D_HEADERS / name
    if not path.exists():
        pytest.skip(f"this torch build ships no {path}")
    return " ".join(path.read_text().split())


# --- the flight recorder is on by default ---------------------------------------------------

def test_the_flight_recorder_keeps_2000_entries_unless_told_otherwise():
    text = header("FlightRecorder.hpp")
    assert 'getCvarInt( {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)' in text
    assert "enabled_ = max_entries_ > 0;" in text       # 0 turns it off


def test_the_text_says_the_flight_recorder_is_on_by_default():
    """4.2d's hang section and table, and the reader's docstring (the run on real ranks with
    neither variable set is tests/test_flight_recorder.py's)."""
    name = "4.2d-launching-faults-and-pitfalls.ipynb"
    text = prose(name)
    assert "records by default (2,000 per process; `TORCH_FR_BUFFER_SIZE` changes the count, 0 turns it off)" in text
    assert "how many collectives the flight recorder keeps per process: on by default, 2000" in text
    assert "kept when `TORCH_FR_BUFFER_SIZE` is set" not in text and "turn on the flight recorder" not in text
    hang = next(source(c) for c in cells(name) if c.get("id") == "hang-1")
    assert "TORCH_FR_BUFFER_SIZE" not in hang       # nothing to switch on
    doc = " ".join(dpc.observe.Comm.read_flight_recorder.__doc__.split())
    assert "on by default in 2.13, the last 2000 entries" in doc and "kept when" not in doc


def test_gloo_leaves_every_entry_scheduled_and_the_text_reads_the_order():
    """Gloo never moves an entry past "scheduled" (the torchrun run in
    tests/test_flight_recorder.py records two finished collectives in that state), so a hung
    collective is told by its place, not its state."""
    text = prose("4.2d-launching-faults-and-pitfalls.ipynb")
    assert "The script writes no `state`: Gloo leaves every entry `scheduled`, finished or not" in text
    assert "The order tells: every entry before the last returned" in text
    assert "still `scheduled`" not in text


# --- bf16: the fallback must ask for bf16 units, not emulation -------------------------------

def test_is_bf16_supported_counts_emulation_unless_told_not_to():
    fn = torch.cuda.is_bf16_supported
    assert inspect.signature(fn).parameters["including_emulation"].default is True
    body = inspect.getsource(fn)
    # Ampere and newer: True; older GPUs: True as well unless including_emulation=False
    assert body.index(".major >= 8") < body.index("if not including_emulation:") < body.index("_check_bf16_tensor_supported")


FALLBACKS = ["dpcourse/scripts/train_fsdp.py", "dpcourse/train/config.py",
             "dpcourse/exercises/solutions/train_lm_fsdp.py"]


def bare_calls(text: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"is_bf16_supported\(([^)]*)\)", text)
            if m.group(1).replace(" ", "") != "including_emulation=False"]


def test_every_bf16_fallback_asks_without_emulation():
    for path in FALLBACKS:
        text = (ROOT / path).read_text()
        assert "is_bf16_supported(including_emulation=False)" in text and not bare_calls(text), path
    assert not bare_calls(code("4.2b-fsdp.ipynb"))
    assert "is_bf16_supported(including_emulation=False)" in code("4.2b-fsdp.ipynb")
    task = " ".join(source(cells("F-single-device-to-fsdp2.ipynb")[3]).split())
    assert "`torch.cuda.is_bf16_supported(including_emulation=False)`" in task and "V100, T4" in task


def test_no_file_of_the_package_asks_bf16_with_emulation():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "dpcourse").rglob("*.py") if bare_calls(p.read_text())]
    assert not offenders, offenders


# --- NCCL's network latency per ring step, by release ---------------------------------------

# src/graph/tuning.cc, hwLat[NET][Ring][Simple] (us), read at each tag; 14.0 from v2.18.1-1 is
# tests/test_slips.py's.
NCCL_NET_RING_SIMPLE = {"v2.11.4-1": 9.6, "v2.12.7-1": 28.0, "v2.12.12-1": 28.0, "v2.13.4-1": 28.0,
                        "v2.14.3-1": 9.6, "v2.16.5-1": 9.6, "v2.17.1-1": 9.6}


def test_the_network_latency_before_2_18_is_said_by_release():
    said = "28 µs in `v2.12.7-1` to `v2.13.4-1`, 9.6 µs in `v2.14.3-1` to `v2.17.1-1`"
    assert NCCL_NET_RING_SIMPLE["v2.12.7-1"] == NCCL_NET_RING_SIMPLE["v2.13.4-1"] == 28.0
    assert NCCL_NET_RING_SIMPLE["v2.14.3-1"] == NCCL_NET_RING_SIMPLE["v2.17.1-1"] == 9.6
    text = prose("4.2b-fsdp.ipynb")
    assert said in text and "up to 2.17 the network's was 9.6" not in text
    comment = " ".join((ROOT / "dpcourse/collectives/alpha_beta.py").read_text().replace("#", "").split())
    assert "28 us in v2.12.7-1 and v2.13.4-1, 9.6 us from v2.14.3-1 to v2.17.1-1" in comment
    assert "up to 2.17 NET was 9.6" not in comment


# --- default timeouts: Gloo 30 minutes, NCCL 10 ---------------------------------------------

def test_the_default_timeouts_are_30_minutes_for_gloo_and_10_for_nccl():
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.distributed_c10d import Backend, _get_default_timeout

    assert default_pg_timeout == timedelta(minutes=30) == _get_default_timeout(Backend.GLOO)
    assert "constexpr auto kProcessGroupNCCLDefaultTimeout = std::chrono::milliseconds(10 * 60 * 1000);" \
        in header("ProcessGroupNCCL.hpp")
    text = prose("4.2d-launching-faults-and-pitfalls.ipynb")
    assert "until the group's default timeout: 30 minutes on Gloo, 10 on NCCL" in text
    assert "for the default 30 minutes" not in text


# --- FSDP1: deprecated by its tutorial, not by its API ---------------------------------------

def _fsdp1_warnings():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    said = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FSDP(dpc.models.build_model("mlp"), sharding_strategy=strategy, device_id=torch.device("cpu"))
        said[strategy.name] = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    return said


def test_fsdp1_warns_of_deprecation_for_no_shard_only(cluster2):
    said = cluster2.run(_fsdp1_warnings)[0]
    assert said["FULL_SHARD"] == [] and said["SHARD_GRAD_OP"] == []
    assert any("`NO_SHARD` sharding strategy is deprecated" in m for m in said["NO_SHARD"]), said
    text = prose("4.2b-fsdp.ipynb")
    assert "marks deprecated" not in text and "PyTorch marks FSDP1" not in text
    assert "FSDP1 itself still works without a warning, except for its `NO_SHARD` strategy" in text
    assert "FSDP1 warns only for `NO_SHARD`" in text


# --- a full state dict with cpu_offload: every rank gathers, rank 0 keeps -------------------

def _offloaded_full_state_dict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from dpcourse.tracking.tracker import TRACKER

    model = dpc.models.build_model("mlp", seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    seen = []
    with TRACKER.listen(lambda call: seen.append(call.collective)):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return seen.count("all_gather"), {k: (tuple(v.shape), str(v.device)) for k, v in state.items()}


def test_with_cpu_offload_every_rank_gathers_and_rank_0_alone_keeps(cluster2):
    (gathers0, kept0), (gathers1, kept1) = cluster2.run(_offloaded_full_state_dict)
    plain = dpc.models.build_model("mlp").state_dict()
    assert gathers0 == gathers1 >= len(plain)                  # both ranks join every all-gather
    assert kept0 == {k: (tuple(v.shape), "cpu") for k, v in plain.items()} and kept1 == {}
    src = inspect.getsource(__import__("torch.distributed.checkpoint.state_dict", fromlist=["x"]))
    assert "else (0,)" in " ".join(src.split())                # ranks_only=(0,) with cpu_offload
    text = prose("4.2b-fsdp.ipynb")
    assert "every rank joins each tensor's all-gather (`full_tensor()`)" in text
    assert "`ranks_only=(0,)` in `torch/distributed/checkpoint/state_dict.py`" in text
    assert "only rank 0 receives the tensors" not in text
    for path in ("dpcourse/scripts/train_fsdp.py",):
        assert "only rank 0 receives" not in (ROOT / path).read_text()


# --- fp16_compress_hook: cast, then divide; its risk is underflow ----------------------------

def _fp16_hook(values):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    bucket = torch.tensor(values)            # the same gradient values on every rank
    return default_hooks.fp16_compress_hook(None, (bucket,)).wait().tolist()


def test_fp16_compress_hook_casts_then_divides_so_small_gradients_vanish(cluster2):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    body = " ".join(inspect.getsource(default_hooks._compress_hook).split())
    assert "buffer.to(dtype).div_(world_size)" in body          # cast, then divide
    tiny, large = 6e-8, 60000.0                                 # fp16: 2^-24 ~ 6e-8 < tiny; max 65504
    assert torch.tensor(tiny).half().item() > 0                 # the cast alone keeps it ...
    mean = cluster2.run(_fp16_hook, [tiny, 1e-3, large])[0]
    assert mean[0] == 0.0                                       # ... halved in fp16 it is gone
    assert mean[2] == large and abs(mean[1] - 1e-3) < 1e-6      # divided first: the sum cannot overflow
    text = prose("4.2e-ddp-and-fsdp-at-work.ipynb")
    assert "Its risk for gradients is **underflow**" in text
    assert "`fp16_compress_hook` casts each bucket to fp16 *and then* divides it by the world size" in text
    assert "so large gradients cannot overflow it" not in text


# --- autocast's 16-bit weight copies are saved for backward ----------------------------------

def test_autocast_saves_its_16_bit_weight_copy_for_backward():
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)                   # a layer inside a network
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    saved = y.grad_fn._saved_mat2                               # kept after the autocast region
    assert saved.dtype == torch.bfloat16 and saved.shape == layer.weight.t().shape
    assert saved.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()
    y.float().sum().backward()
    with pytest.raises(RuntimeError, match="freed"):           # backward used it, then let it go
        y.grad_fn._saved_mat2
    text = prose("4.1b-ring-fsdp-and-memory.ipynb")
    assert "Its 16-bit weight copies are made in forward and saved for backward" in text
    assert "exist only during forward" not in text


# --- order: nothing used before it is taught -------------------------------------------------

def first_code(name: str, pattern: str) -> int:
    return next(i for i, c in enumerate(cells(name)) if c["cell_type"] == "code" and re.search(pattern, source(c)))


def first_prose(name: str, *needles: str) -> int:
    found = [i for i, c in enumerate(cells(name))
             if c["cell_type"] == "markdown" and all(n in " ".join(source(c).split()) for n in needles)]
    return found[0] if found else len(cells(name))


@pytest.mark.parametrize("name, use, teaching", [
    ("4.1b-ring-fsdp-and-memory.ipynb", r"\b(FSDP|FullyShardedDataParallel)\(",
     ("`FullyShardedDataParallel(model, sharding_strategy=...)`", "**auto-wrap policy**")),
    ("4.1b-ring-fsdp-and-memory.ipynb", r"\bfully_shard\(", ("`fully_shard(module)`", "`DTensor`")),
    ("4.1b-ring-fsdp-and-memory.ipynb", r"\bledger\(", ("## Memory ledger",)),
    ("4.2b-fsdp.ipynb", r"\bMixedPrecisionPolicy\(", ("## Mixed precision",)),
    ("4.2b-fsdp.ipynb", r"\bclip_grad_norm_\(", ("## Mixed precision",)),
    ("4.2b-fsdp.ipynb", r"\bclip_grad_norm_\(", ("`clip_grad_norm_`", "DTensor", "its slices' squares")),
], ids=["4.1b FSDP1", "4.1b fully_shard", "4.1b ledger", "4.2b MixedPrecisionPolicy",
        "4.2b clipping after mixed precision", "4.2b clipping on DTensors"])
def test_a_name_is_taught_before_the_first_cell_that_uses_it(name, use, teaching):
    used, taught = first_code(name, use), first_prose(name, *teaching)
    assert taught < used, f"{name}: cell {used} uses {use} before the prose that teaches it ({teaching}, cell {taught})"


def sections(name: str) -> list[tuple[str, str]]:
    """(heading, code) of each `## ` section, up to where data parallelism stops paying."""
    out: list[tuple[str, str]] = []
    for c in cells(name):
        text = source(c)
        for line in text.splitlines() if c["cell_type"] == "markdown" else []:
            if line.startswith("## "):
                out.append((line[3:], ""))
        if c["cell_type"] == "code" and out:
            out[-1] = (out[-1][0], out[-1][1] + text + "\n")
    stop = next((i for i, (h, _) in enumerate(out) if h.startswith("Where data parallelism stops paying")), len(out))
    return out[:stop]


def test_4_2e_has_ddp_at_work_first_then_fsdp_at_work():
    found = sections("4.2e-ddp-and-fsdp-at-work.ipynb")
    ddp = [i for i, (_, c) in enumerate(found) if re.search(r"\bDDP\(", c)]
    fsdp = [i for i, (_, c) in enumerate(found) if re.search(r"\bfully_shard\(", c)]
    assert ddp and fsdp and max(ddp) < min(fsdp), \
        "sections in order: " + "; ".join(f"{h} ({'DDP' if i in ddp else 'FSDP' if i in fsdp else '-'})"
                                          for i, (h, _) in enumerate(found))


# --- %%ranks needs the extension ------------------------------------------------------------

def test_every_notebook_that_uses_or_mentions_ranks_loads_the_extension_first():
    books = sorted(NOTEBOOKS.glob("4*.ipynb")) + sorted((NOTEBOOKS / "exercises").glob("*.ipynb"))
    mention = [p for p in books if any("%%ranks" in source(c) for c in json.loads(p.read_text())["cells"])]
    assert {p.name for p in mention} >= {"4.2a-communication-and-ddp.ipynb", "4.2d-launching-faults-and-pitfalls.ipynb"}
    for path in mention:
        nb = json.loads(path.read_text())["cells"]
        first = next(i for i, c in enumerate(nb) if "%%ranks" in source(c))
        loads = [i for i, c in enumerate(nb) if c["cell_type"] == "code"
                 and any(line.strip() in ("%load_ext dpcourse", "%reload_ext dpcourse")   # reload: quiet on a rerun
                         for line in source(c).splitlines())]
        assert loads and loads[0] <= first, f"{path.name}: %%ranks in cell {first}, %load_ext dpcourse in {loads}"
