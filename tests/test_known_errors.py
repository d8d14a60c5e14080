"""PyTorch errors a learner's code meets on the ranks keep their message and gain the course's
sentence on the likely cause: the table, read without processes, and one case end to end (the
root sharded before its blocks, in the fully_shard try-it)."""
from __future__ import annotations

import pytest

import dpcourse as dpc
from dpcourse.exercises import known_errors
from dpcourse.exercises.known_errors import first_cause, hint, lost_a_peer, with_hint
from dpcourse.grading.judging import failure_of
from dpcourse.pool import RankError
from dpcourse.pool.errors import RankReport

# (what PyTorch said, as a rank's summary, words the course's sentence must hold)
SAID = [
    ("raised TypeError: Invariant encountered: value was None when it should not be",
     "Shard the blocks first and the root last"),
    ("raised ValueError: FSDP param tok.weight is shared with a parameter already managed by another FSDP group",
     "which unit can hold both of its users"),
    ("raised RuntimeError: Expected to have finished reduction in the prior iteration before starting a new "
     "one. This error indicates that your module has parameters that were not used in producing loss.",
     "find_unused_parameters"),
    ("raised RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))",
     "tensors of different shapes"),
    ("raised RuntimeError: Detected mismatch between collectives on ranks", "tensors of different shapes"),
    ("raised RuntimeError: [pair.cc:537] Read error [127.0.0.1]:676: Connection reset by peer.",
     "look for the first rank's own error"),
    ("raised RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:7365.",
     "look for the first rank's own error"),
]


@pytest.mark.parametrize("said, words", SAID, ids=[s[0][7:40] for s in SAID])
def test_a_known_error_keeps_its_message_and_gains_one_sentence(said, words):
    told = with_hint(f"rank 1 {said}")
    assert told.startswith(f"rank 1 {said}\n") and words in told
    assert told.count("Likely cause:") == 1 and with_hint(told) == told   # added once


def test_an_unknown_error_is_passed_on_as_it_is():
    assert hint("raised ValueError: raised by the answer") is None
    assert with_hint("rank 0 raised ValueError: raised by the answer") == "rank 0 raised ValueError: raised by the answer"
    # a state dict's size mismatch is no collective's
    assert hint("Error(s) in loading state_dict: size mismatch for head.weight") is None


def test_each_pattern_has_a_sentence_and_the_echo_of_a_lost_peer_comes_last():
    assert all(sentence.startswith("Likely cause: ") for _, sentence in known_errors.KNOWN)
    assert lost_a_peer("Connection reset by peer") and not lost_a_peer("invalid tensor size")
    both = "Connection reset by peer\nAnother rank said first: Is there a distributed collective mismatch in your code?"
    assert "tensors of different shapes" in hint(both)   # the cause, not its echo


def test_the_first_cause_in_a_runs_output_is_a_ranks_own_error():
    output = ("[rank0]: RuntimeError: Connection reset by peer\n"
              "  what():  [enforce fail at gloo/pair.cc:456] op.preamble.length <= op.nbytes. Received data size "
              "doesn't match expected size. Is there a distributed collective mismatch in your code?\n")
    assert first_cause(output).startswith("op.preamble.length <= op.nbytes.")
    assert first_cause("[rank0]: RuntimeError: Connection reset by peer\n") is None


def test_a_failure_is_told_by_the_rank_whose_error_is_its_own():
    echo = RankReport(0, "raised", "raised RuntimeError: Connection closed by peer [127.0.0.1]:7365.")
    own = RankReport(1, "raised", "raised RuntimeError: Expected to have finished reduction in the prior iteration")
    failure = failure_of(RankError([echo, own], restarted=True))
    assert failure.kind == "raised" and failure.summary.startswith("rank 1 raised RuntimeError: Expected")
    assert "find_unused_parameters" in failure.summary


ROOT_FIRST = '''
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def shard_transformer(model, device_type):
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return model
'''


def test_the_root_sharded_before_its_blocks_is_named_on_the_ranks(cluster2):
    namespace = {"dist": __import__("torch.distributed", fromlist=["x"]), "__name__": "__main__"}
    exec(compile(ROOT_FIRST, "<root first>", "exec"), namespace)
    report = dpc.exercises.check_answer("4.2b", "fully_shard", namespace["shard_transformer"], cluster2)
    first, *others = report.items
    assert first.status == "fail" and first.name.startswith("runs on every rank"), str(report)
    assert "Invariant encountered" in first.detail                    # PyTorch's own words, kept
    assert "Shard the blocks first and the root last" in first.detail  # and the course's sentence
    assert all(i.status == "skip" for i in others), str(report)
