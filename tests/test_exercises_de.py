"""Exercises D (ring from isend/irecv) and E (bucketed DDP): each checker passes the reference,
says "not attempted" for the notebook's untouched starter, and fails, naming the right
item, on typical mistakes. Every check runs the learner's code on real Gloo ranks."""
from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from nbclient import NotebookClient

import dpcourse as dpc
from dpcourse.collectives.ring import ring_all_gather, ring_reduce_scatter
from dpcourse.collectives.schedule import simulate
from dpcourse.collectives.traced import rank_input
from dpcourse.exercises import exercise_e
from dpcourse.exercises.solutions import bucketed_e, ring_d

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks" / "exercises"
RING = Path(ring_d.__file__).read_text()
BUCKETED = Path(bucketed_e.__file__).read_text()


def starter(notebook: str, marker: str) -> str:
    """The source of the notebook's code cell that contains ``marker``."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{notebook}: expected one cell with {marker!r}"
    return cells[0]


def define(source: str, *names):
    """Run ``source`` as a notebook cell would (its module is not importable, so the pool
    sends its functions by value) and return the objects called ``names``."""
    namespace = {"__name__": "exercise_cell", "dpc": dpc}
    exec(compile(source, "<exercise cell>", "exec"), namespace)
    return [namespace[n] for n in names]


def edited(text: str, old: str, new: str) -> str:
    assert old in text, f"the reference changed: {old!r} is no longer in it"
    return text.replace(old, new)


def item(report, start: str):
    return next(i for i in report.items if i.name.startswith(start))


@pytest.fixture(scope="module")
def rings(cluster2, cluster3, cluster4, cluster5):
    return [cluster2, cluster3, cluster4, cluster5]


# --- Exercise D --------------------------------------------------------------------------------

def test_d_reference_and_the_course_ring_pass_and_replay_the_schedule(rings):
    for fns in ((ring_d.ring_reduce_scatter, ring_d.ring_all_gather),
                (ring_reduce_scatter, ring_all_gather)):
        report = dpc.exercises.check_d(*fns, cluster=rings)
        assert report.passed and "passed (5 of 5 checks)" in str(report), str(report)
        # the example the bytes item gives: the largest N, 60 float32 elements: 2*4/5 * 240 B
        assert "e.g. N=5, Ψ = 240 bytes: 384 bytes per rank" in item(report, "each rank sends 2").detail
        trace = report.trace  # the learner's own sends, as the player replays them
        plan = simulate("ring_all_reduce", 4, 8)
        assert [(t.phase, t.step, t.src, t.dst, t.chunk, t.nbytes) for t in trace.transfers] == \
            [(t.phase, t.step, t.src, t.dst, t.chunk, t.nbytes) for t in plan.transfers]
        last = trace.frames()[-1]
        assert all(set(who) == set(range(4)) for row in last.holding for who in row)
        total = sum(rank_input(r, 8, seed=4).float() for r in range(4))
        assert all(torch.equal(v, total) for v in last.values)
        fig = dpc.viz.plot_ring_trace(trace)
        assert len(fig.axes) >= trace.num_steps + 1 == 7


STEP_RS = ("        send = dist.isend(chunks[send_c], dst=right)\n"
           "        recv = dist.irecv(buf, src=left)\n"
           "        send.wait(); recv.wait()\n")
STEP_AG = ("        send = dist.isend(chunks[send_c], dst=right)\n"
           "        recv = dist.irecv(chunks[recv_c], src=left)  # straight into place\n"
           "        send.wait(); recv.wait()\n")
# Written apart from the reference: the same schedule, other calls.
BATCHED = edited(edited(RING, STEP_RS,
    "        ops = [dist.P2POp(dist.isend, chunks[send_c], right), dist.P2POp(dist.irecv, buf, left)]\n"
    "        for work in dist.batch_isend_irecv(ops):\n"
    "            work.wait()\n"), STEP_AG,
    "        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send_c], right),\n"
    "                                            dist.P2POp(dist.irecv, chunks[recv_c], left)]):\n"
    "            work.wait()\n")
BLOCKING = edited(edited(RING, STEP_RS,
    "        if rank % 2 == 0:   # even ranks send first, odd ranks receive first: no cycle of waits\n"
    "            dist.send(chunks[send_c], right); dist.recv(buf, left)\n"
    "        else:\n"
    "            dist.recv(buf, left); dist.send(chunks[send_c], right)\n"), STEP_AG,
    "        if rank % 2 == 0:\n"
    "            dist.send(chunks[send_c], right); dist.recv(chunks[recv_c], left)\n"
    "        else:\n"
    "            dist.recv(chunks[recv_c], left); dist.send(chunks[send_c], right)\n")


@pytest.mark.parametrize("source", [BATCHED, BLOCKING], ids=["batch_isend_irecv", "blocking send/recv"])
def test_d_other_correct_calls_pass(rings, source):
    report = dpc.exercises.check_d(*define(source, "ring_reduce_scatter", "ring_all_gather"), cluster=rings)
    assert report.passed, str(report)
    assert report.trace is not None and len(report.trace.transfers) == 2 * 3 * 4  # N=4: 2(N-1) steps x N


def test_d_sending_to_a_rank_that_is_no_neighbour_fails(rings):
    far = edited(edited(RING, "    right, left = (rank + 1) % n, (rank - 1) % n\n    chunks = tensor.view(-1).tensor_split(n)  # views",
                        "    right, left = (rank + 1) % n, (rank - 1) % n\n    right, left = (rank + 2) % n, (rank - 2) % n\n"
                        "    chunks = tensor.view(-1).tensor_split(n)  # views"),
                    "    right, left = (rank + 1) % n, (rank - 1) % n\n    chunks = tensor.view(-1).tensor_split(n)\n",
                    "    right, left = (rank + 2) % n, (rank - 2) % n\n    chunks = tensor.view(-1).tensor_split(n)\n")
    report = dpc.exercises.check_d(*define(far, "ring_reduce_scatter", "ring_all_gather"), cluster=rings,
                                   world_sizes=(3, 5))
    bad = item(report, "each rank sends only to its right neighbour")
    assert bad.status == "fail" and re.match(r"rank \d sent to rank \d \(N=\d\)", bad.detail), str(report)


def test_d_untouched_starter_is_not_attempted_without_starting_ranks():
    rs_source = starter("D-ring-all-reduce.ipynb", "def ring_reduce_scatter")
    ag_source = starter("D-ring-all-reduce.ipynb", "def ring_all_gather")
    rs, ag = define("import torch\nimport torch.distributed as dist\n" + rs_source + "\n" + ag_source,
                    "ring_reduce_scatter", "ring_all_gather")
    start = time.monotonic()
    report = dpc.exercises.check_d(rs, ag)
    assert time.monotonic() - start < 2  # judged from the code alone: no ranks started
    assert not report.attempted and not report.passed and report.trace is None
    assert "not attempted yet" in str(report) and "`...`" in str(report)


def test_d_half_done_judges_the_finished_half(rings):
    ag_source = starter("D-ring-all-reduce.ipynb", "def ring_all_gather")
    rs, ag = define(RING + "\n" + ag_source, "ring_reduce_scatter", "ring_all_gather")
    report = dpc.exercises.check_d(rs, ag, cluster=rings, world_sizes=(2, 3))
    assert item(report, "reduce-scatter:").status == "pass"
    gather = item(report, "all-gather:")
    assert gather.status == "fail" and "fill in the `...` in ring_all_gather" in gather.detail
    assert item(report, "reduce-scatter then").status == "skip"


def test_d_an_off_by_one_chunk_index_is_named_with_the_element_and_values(rings):
    wrong = edited(RING, "send_c = (rank - step - 1) % n", "send_c = (rank - step) % n")
    wrong = edited(wrong, "recv_c = (rank - step - 2) % n", "recv_c = (rank - step - 1) % n")
    report = dpc.exercises.check_d(*define(wrong, "ring_reduce_scatter", "ring_all_gather"),
                                   cluster=rings, world_sizes=(2, 3))
    bad = item(report, "reduce-scatter:")
    assert bad.status == "fail", str(report)
    found = re.fullmatch(r"rank (\d)'s chunk \1 differs from dist\.all_reduce at element (\d+): "
                         r"(\S+) vs (\S+) \(N=(\d), (\d+) elements?\)", bad.detail)
    assert found, bad.detail
    rank, element, got, want, n, numel = found.groups()
    # the expected value, derived here: the sum over the ranks of the checker's inputs
    assert float(want) == sum(rank_input(r, int(numel), seed=int(n))[int(element)].item() for r in range(int(n)))
    assert float(got) != float(want)
    assert item(report, "all-gather:").status == "pass"


def test_d_sending_the_whole_tensor_every_step_fails_on_bytes_only(rings):
    wrong = edited(RING, "        buf = incoming[:chunks[recv_c].numel()]\n"
                         "        send = dist.isend(chunks[send_c], dst=right)\n",
                   "        whole = torch.empty_like(tensor.view(-1))\n"
                   "        send = dist.isend(tensor.view(-1), dst=right)\n"
                   "        buf = whole.tensor_split(n)[recv_c]\n")
    wrong = edited(wrong, "recv = dist.irecv(buf, src=left)", "recv = dist.irecv(whole, src=left)")
    report = dpc.exercises.check_d(*define(wrong, "ring_reduce_scatter", "ring_all_gather"),
                                   cluster=rings, world_sizes=(3, 4))
    assert [i.status for i in report.items] == ["pass", "pass", "pass", "fail", "pass"], str(report)
    found = re.match(r"rank 0 sent (\d+) bytes in the reduce-scatter; a ring sends .* = (\d+) "
                     r"\(N=(\d), (\d+) float32", item(report, "each rank sends 2").detail)
    assert found, str(report)
    sent, ring, n, numel = map(int, found.groups())
    assert sent == (n - 1) * 4 * numel  # N-1 whole tensors
    assert ring == 4 * numel - 4 * (numel // n + (numel % n > 0))  # every chunk but rank 0's


def test_d_a_hang_is_a_failed_item_and_the_cluster_stays_usable(rings, cluster3):
    wrong = edited(RING, "recv = dist.irecv(buf, src=left)", "recv = dist.irecv(buf, src=right)")
    start = time.monotonic()
    report = dpc.exercises.check_d(*define(wrong, "ring_reduce_scatter", "ring_all_gather"),
                                   cluster=rings, world_sizes=(2, 3), timeout=5)
    bad = item(report, "reduce-scatter:")
    # at N=2 left == right, so the bug shows from N=3 on
    assert bad.status == "fail" and bad.detail.startswith("N=3, 0 elements: the ranks did not finish within 5 s")
    assert "never sent" in bad.detail
    assert time.monotonic() - start < 60
    assert cluster3.run(lambda: 7) == [7, 7, 7]


# --- Exercise E --------------------------------------------------------------------------------

LAUNCH = "            self.work[i] = dist.all_reduce(self.flat[i], async_op=True)  # returns at once\n"
AVERAGE = "torch.cat([p.grad.flatten() for p in self.buckets[i]]) / self.world_size"
# Written apart from the reference: the mean taken after the wait, the gradients replaced by
# views of the bucket (no copy), the Works kept in a dict.
INDEPENDENT_E = edited(edited(edited(BUCKETED,
    "            self.flat[i] = " + AVERAGE + "\n",
    "            self.flat[i] = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])\n"),
    """            self.work[i].wait()
            for p, averaged in zip(bucket, self.flat[i].split([p.numel() for p in bucket])):
                p.grad.copy_(averaged.view_as(p.grad))""",
    """            self.work[i].wait()
            self.flat[i].div_(self.world_size)
            offset = 0
            for p in bucket:
                p.grad = self.flat[i][offset:offset + p.numel()].view_as(p)
                offset += p.numel()"""),
    "            self.ready[i].clear()\n            self.work[i] = self.flat[i] = None",
    "            self.ready[i] = set()\n            self.work[i] = None")

MISTAKES_E = [
    ("waits inside the hook",
     [(LAUNCH, LAUNCH.rstrip("\n") + "\n            self.work[i].wait()\n")],
     "a bucket's all-reduce is in flight", "every all-reduce was over before the next layer's backward"),
    ("every bucket launched after backward",
     [("        if len(self.ready[i]) == len(self.buckets[i]):", "        if False:"),
      ("        for i, bucket in enumerate(self.buckets):\n            self.work[i].wait()",
       "        for i, bucket in enumerate(self.buckets):\n"
       "            self.flat[i] = torch.cat([p.grad.flatten() for p in bucket]) / self.world_size\n"
       "            self.work[i] = dist.all_reduce(self.flat[i], async_op=True)\n"
       "        for i, bucket in enumerate(self.buckets):\n            self.work[i].wait()")],
     "a bucket's all-reduce is in flight", "launch each bucket in grad_ready"),
    ("blocking all-reduce",
     [("dist.all_reduce(self.flat[i], async_op=True)", "dist.all_reduce(self.flat[i]) or _Done()"),
      ("class MyBucketedDDP", "class _Done:\n    def wait(self):\n        pass\n\n\nclass MyBucketedDDP")],
     "a bucket's all-reduce is in flight", "async_op=True"),
    ("sums instead of averaging",
     [(" / self.world_size\n            self.work", "\n            self.work")],
     "gradients equal torch DDP's", "summed, not averaged"),
    ("one all-reduce per parameter",
     [(LAUNCH, "            self.work[i] = [dist.all_reduce(p.grad.div_(self.world_size), async_op=True)"
               " for p in self.buckets[i]]\n"),
      ("            self.work[i].wait()\n            for p, averaged in zip(bucket, self.flat[i].split([p.numel() for p in bucket])):\n"
       "                p.grad.copy_(averaged.view_as(p.grad))\n",
       "            for work in self.work[i]:\n                work.wait()\n")],
     "each bucket's gradients travel as one all-reduce", "all-reduce that once"),
    ("the averages never reach the gradients",
     [("                p.grad.copy_(averaged.view_as(p.grad))\n", "                pass\n")],
     "gradients equal torch DDP's", "this rank's own gradients"),
]


def test_e_reference_and_an_independent_version_pass(cluster2):
    for source in (BUCKETED, INDEPENDENT_E):
        (cls,) = define(source, "MyBucketedDDP")
        report = dpc.exercises.check_e(cls, cluster=cluster2)
        assert report.passed and "passed (4 of 4 checks)" in str(report), str(report)
        plan = exercise_e.bucket_plan(dpc.models.build_model("mlp", **exercise_e.SIZES))
        assert item(report, "each bucket").detail == f"{len(plan)} buckets x 3 steps"
        titles = [ax.get_title() for ax in report.figure.axes]
        assert titles == ["your bucketed DDP", "torch DDP, same bucket cap"]


def test_e_the_starter_is_the_solutions_scaffold_and_is_not_attempted():
    source = starter("E-bucketed-ddp.ipynb", "class MyBucketedDDP")
    scaffold = BUCKETED.split("class MyBucketedDDP", 1)[1].split("    def grad_ready", 1)[0]
    assert scaffold in source, "the notebook's scaffold and the solution's differ"
    (cls,) = define(source, "MyBucketedDDP")
    assert not any(name in vars(cls) for name in ("add_grad", "launch")) and cls.__bases__ == (torch.nn.Module,)
    start = time.monotonic()
    report = dpc.exercises.check_e(cls)
    assert time.monotonic() - start < 2
    assert not report.attempted and not report.passed and report.figure is None
    assert "not attempted yet" in str(report) and "MyBucketedDDP.grad_ready" in str(report)


def test_e_buckets_are_the_ones_torch_ddp_builds(cluster2):
    """The checker's plan (the scaffold's buckets: ``assign_buckets``) is torch DDP's, derived
    two ways: PyTorch's own assignment over the gradient-ready order, with the first bucket's
    cap equal to the others' (torch 2.13 when ``bucket_cap_mb`` is given), and the buckets a
    real torch DDP all-reduces once it has rebuilt them. The notebook states their number."""
    model = dpc.models.build_model("mlp", **exercise_e.SIZES)
    names = [n for n, _ in model.named_parameters()]
    order = list(range(len(names)))[::-1]  # backward's order: reverse registration
    cap = int(exercise_e.BUCKET_CAP_MB * 2**20)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [p for p in model.parameters()][::-1], [cap, cap], [False] * len(names), order)
    plan = exercise_e.bucket_plan(model)
    assert [bucket for bucket, _ in plan] == [[names[i] for i in b] for b in theirs]
    assert cluster2.run(_torch_ddp_bucket_bytes, exercise_e.BUCKET_CAP_MB)[0] == [n for _, n in plan]
    nb = nbformat.read(NOTEBOOKS / "E-bucketed-ddp.ipynb", as_version=4)
    check = next(c.source for c in nb.cells if c.source.startswith("## Check"))
    assert f"the MLP's {len(names)} gradients travel in {len(theirs)} buckets" in check


def _scaffold_buckets(caps_mb):
    """The names in each of the scaffold's buckets (the reference keeps the scaffold as it is),
    for each cap."""
    model = dpc.models.build_model("mlp", **exercise_e.SIZES)
    names = {p: n for n, p in model.named_parameters()}
    return [[[names[p] for p in bucket] for bucket in bucketed_e.MyBucketedDDP(model, cap).buckets]
            for cap in caps_mb]


def test_e_the_scaffold_packs_as_the_checker_plans(cluster2):
    """The scaffold writes the bucket rule out for the learner; the checker's plan uses the
    course's ``assign_buckets``: the same buckets at caps that give one bucket per tensor, the
    exercise's four (the rule that closes a bucket before the cap makes seven), two, and one."""
    caps = [1e-6, exercise_e.BUCKET_CAP_MB, 1.5, 25.0]
    model = dpc.models.build_model("mlp", **exercise_e.SIZES)
    want = [[names for names, _ in exercise_e.bucket_plan(model, cap)] for cap in caps]
    assert len({len(plan) for plan in want}) == len(caps)  # the caps tell the rules apart
    assert cluster2.run(_scaffold_buckets, caps) == [want, want]


def _torch_ddp_bucket_bytes(bucket_cap_mb):
    """Bytes of each bucket torch DDP all-reduces in its second backward (after the rebuild)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    seen = {}

    def hook(state, bucket):
        seen[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp = DDP(dpc.models.build_model("mlp", **exercise_e.SIZES), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, hook)
    x, _ = dpc.models.make_dataset("mlp", 8, **exercise_e.SIZES).tensors
    for _ in range(2):  # the first backward sends one bucket; the buckets are rebuilt after it
        seen.clear()
        ddp(x).sum().backward()
    return [seen[i] for i in sorted(seen)]


def test_e_the_course_wrapper_is_not_the_learners():
    """Passing the course's own BucketedDDP (it would pass every item) is refused, without ranks."""
    start = time.monotonic()
    report = dpc.exercises.check_e(dpc.scratch.BucketedDDP)
    assert time.monotonic() - start < 2
    assert not report.passed and report.figure is None
    first = report.items[0]
    assert first.status == "fail" and "BucketedDDP.grad_ready is the course's own" in first.detail, str(report)
    assert [i.status for i in report.items[1:]] == ["skip"] * 3


@pytest.mark.parametrize("mistake, edits, failing, words", MISTAKES_E, ids=[m[0] for m in MISTAKES_E])
def test_e_each_mistake_fails_with_its_item_named(cluster2, mistake, edits, failing, words):
    source = BUCKETED
    for old, new in edits:
        source = edited(source, old, new)
    (cls,) = define(source, "MyBucketedDDP")
    report = dpc.exercises.check_e(cls, cluster=cluster2)
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)


def test_e_a_rank_error_is_a_failed_item(cluster2):
    (cls,) = define(edited(BUCKETED, "p.grad.flatten() for p in self.buckets[i]", "p.grad.t() for p in self.buckets[i]"),
                    "MyBucketedDDP")
    report = dpc.exercises.check_e(cls, cluster=cluster2)
    first = report.items[0]
    assert first.status == "fail" and first.detail.startswith("rank 0 raised RuntimeError"), str(report)
    assert [i.status for i in report.items[1:]] == ["skip"] * 3


# --- Both ----------------------------------------------------------------------------------------

def test_solutions_are_the_reference_files():
    assert dpc.exercises.solution("d") == RING and dpc.exercises.solution("E") == BUCKETED
    solutions = Path(dpc.exercises.__file__).parent / "solutions"
    assert dpc.exercises.solution("A") == (solutions / "train_lm_ddp.py").read_text()
    assert dpc.exercises.solution("F") == (solutions / "train_lm_fsdp.py").read_text()
    with pytest.raises(ValueError, match=r"choose one of \['A', 'B', 'C', 'D', 'E', 'F'\]"):
        dpc.exercises.solution("Z")


def test_exercise_e_notebook_with_the_solution_filled_in(tmp_path):
    """In a real kernel: the learner's class, defined in a cell, travels to the ranks by value."""
    nb = nbformat.read(NOTEBOOKS / "E-bucketed-ddp.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "class MyBucketedDDP" in c.source)
    cell.source = "import dpcourse as dpc\n" + BUCKETED
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if c.source.startswith("report = ") and o.get("output_type") == "execute_result"]
    assert shown and "passed (4 of 4 checks)" in shown[0]["data"]["text/plain"]
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) == 1
