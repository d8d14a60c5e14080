"""Exercise C, reference solution: the orders the theory predicts and the letters.

Peak memory per rank (the ledger, one unit per block, 4 ranks): FULL_SHARD keeps 1/N of
everything and gathers one unit at a time; SHARD_GRAD_OP keeps units gathered from forward
to backward; HYBRID_SHARD shards over 2 ranks only; NO_SHARD shards nothing.
Bytes per step (ring theory): FULL_SHARD gathers twice (forward and backward) and
reduce-scatters, ~3(N-1)/N Ψ; HYBRID_SHARD does that within a group of 2 and all-reduces
its shard across groups; SHARD_GRAD_OP gathers once, and NO_SHARD all-reduces: both
2(N-1)/N Ψ.
"""
answers = {
    "peak_order": ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"],   # smallest first
    "bytes_order": ["FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],  # most first
    "q1": "c",    # slow links between nodes: HYBRID_SHARD
    "q2": "d",    # everything fits: NO_SHARD (or DDP), the fewest collectives
    "q3": "a",    # only fits fully sharded: FULL_SHARD
    "q4": "b",    # memory to spare, skip backward's all-gathers: SHARD_GRAD_OP
    "wrap": "a",  # one unit is gathered whole: the full parameters exist at once
}
