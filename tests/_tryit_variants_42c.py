"""4.2c's try-its: answers written apart from the references (see _tryit_variants.py)."""


OPTIMIZER_FIRST = [   # offload_clip: the optimizer made from the parameters fully_shard then replaces
    ("    policy = CPUOffloadPolicy(pin_memory=False)\n",
     "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n    policy = CPUOffloadPolicy(pin_memory=False)\n"),
    ("    fully_shard(model, offload_policy=policy)\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n",
     "    fully_shard(model, offload_policy=policy)\n")]
LOOP = ("    for i, block in enumerate(blocks):\n"
        "        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])")   # prefetch's reference loop

VARIANTS = {
    "meta_init": {
        "mistakes": [
            ("built on the CPU, then sharded", [('    with torch.device("meta"):\n        model = ',
                                                 "    model = ")], "constructing the model allocated"),
            ("no init after to_empty", [("    init(model)\n", "")], "What fills it"),
            ("to_empty before sharding", [
                ("    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n"
                 "    fully_shard(model, mesh=mesh)\n    model.to_empty(device=device)\n",
                 "    model.to_empty(device=device)\n    for block in model.blocks:\n"
                 "        fully_shard(block, mesh=mesh)\n    fully_shard(model, mesh=mesh)\n")],
             "before they were split"),
            ("the root not sharded", [("    fully_shard(model, mesh=mesh)\n", "")], "plain tensors"),
            ("only the root sharded", [("    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n", "")],
             "Which modules were to be units of their own"),
            ("init before to_empty", [("    model.to_empty(device=device)\n    init(model)\n",
                                       "    init(model)\n    model.to_empty(device=device)\n")], "What fills it"),
        ],
        "correct": [
            ("the device as a context, blocks found by type, the default mesh", [
                ('    with torch.device("meta"):\n        model = dpc.models.build_model("transformer")\n'
                 "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n",
                 '    meta = torch.device("meta")\n    with meta:\n'
                 '        model = dpc.models.build_model("transformer")\n'
                 "    kind = type(model.blocks[0])\n"
                 "    for m in [m for m in model.modules() if isinstance(m, kind)]:\n        fully_shard(m)\n"),
                ("    model.to_empty(device=device)\n    init(model)\n    return model",
                 "    return init(model.to_empty(device=device))")]),
        ],
    },
    "checkpointing": {
        "mistakes": [
            ("every block", [("any(m is w for w in wanted)", "isinstance(m, type(wanted[0]))")],
             "other modules than the chosen blocks"),
            ("indices compared with modules", [("any(m is w for w in wanted)", "m in chosen")],
             "nothing was checkpointed"),
            ("the Linear layers inside the chosen blocks", [("any(m is w for w in wanted)", "any(m is w.linear for w in wanted)")],
             "the wrong modules were checkpointed"),
            ("the root wrapped", [
                ("    wanted = [model.blocks[i] for i in chosen]\n"
                 "    apply_activation_checkpointing(model, check_fn=lambda m: any(m is w for w in wanted))\n"
                 "    return model",
                 "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
                 "    return checkpoint_wrapper(model)")], "around the model itself"),
        ],
        "correct": [
            ("checkpoint_wrapper in place, nothing returned", [
                ("apply_activation_checkpointing\n", "checkpoint_wrapper\n"),
                ("    wanted = [model.blocks[i] for i in chosen]\n"
                 "    apply_activation_checkpointing(model, check_fn=lambda m: any(m is w for w in wanted))\n"
                 "    return model",
                 "    for i in chosen:\n        model.blocks[i] = checkpoint_wrapper(model.blocks[i])")]),
            ("membership in a list of modules", [("any(m is w for w in wanted)", "m in wanted")]),
        ],
    },
    "offload_clip": {
        "mistakes": [
            ("each rank clips its own shard", [
                ("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n",
                 "    grads = [p.grad.to_local() for p in model.parameters()]\n"
                 "    norm = torch.stack([g.norm() for g in grads]).norm()\n"
                 "    for g in grads:\n"
                 "        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))\n"),
                ("    return norm.full_tensor().item()", "    return norm.item()")], "its own shard"),
            ("clipped after the step", [
                ("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n    optimizer.step()\n",
                 "    optimizer.step()\n    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n")],
             "unclipped gradients"),
            ("no offload policy", [(", offload_policy=policy", "")], "CPU memory"),
            ("the root not offloaded", [("fully_shard(model, offload_policy=policy)", "fully_shard(model)")],
             "1 of 5 FSDP units"),
            ("the optimizer created before fully_shard", OPTIMIZER_FIRST, "did not change at all"),
        ],
        "correct": [
            ("the norm read on the rank, zero_grad after the step", [
                ("    optimizer.step()\n    return norm.full_tensor().item()",
                 "    optimizer.step()\n    optimizer.zero_grad()\n    return norm.item()")]),
        ],
    },
    "prefetch": {
        "mistakes": [
            ("one block ahead", [("blocks[i + 1:i + 3]", "blocks[i + 1:i + 2]")], "fewer blocks than asked"),
            ("the blocks before", [("blocks[i + 1:i + 3]", "blocks[max(0, i - 2):i]")], "a second time"),
            ("on the root only", [(LOOP, "    model.set_modules_to_forward_prefetch(blocks[:2])")],
             "where the forward begins"),
            ("the chapter's loop: the blocks only, nothing issued by the root",
             [("    model.set_modules_to_forward_prefetch(blocks[:2])\n", "")],
             "who can issue the first blocks' gathers"),
            ("the root prefetches one block", [("model.set_modules_to_forward_prefetch(blocks[:2])",
                                                "model.set_modules_to_forward_prefetch(blocks[:1])")],
             "the root's prefetch list"),
            ("the backward prefetch set instead of the forward one",
             [("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch")],
             "Forward and backward each have a prefetch list"),
        ],
        "correct": [
            ("the next two picked by index, backward prefetch set too", [
                (LOOP, "    for i, block in enumerate(blocks):\n"
                       "        later = [b for j, b in enumerate(blocks) if i < j <= i + 2]\n"
                       "        block.set_modules_to_forward_prefetch(later)\n"
                       "        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])")]),
            ("the root's list written out", [("model.set_modules_to_forward_prefetch(blocks[:2])",
                                              "model.set_modules_to_forward_prefetch([model.blocks[0], model.blocks[1]])")]),
        ],
    },
}
