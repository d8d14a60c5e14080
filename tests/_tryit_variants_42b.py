"""4.2b's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {
    "fully_shard": {
        "mistakes": [
            ("a mesh of the notebook's 2 ranks: right on 2, wrong on 3", [
                ("(dist.get_world_size(),)", "(2,)")], "on 3 ranks (it passed on 2)"),
            ("only the root is sharded", [("    for i, block in enumerate(model.blocks):\n"
                                           "        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)\n",
                                           "")], "single collective"),
            ("the chapter's shard_blocks(m, reshard_after_forward=False): every block kept gathered",
             [("reshard_after_forward=i < len(model.blocks) - 1", "reshard_after_forward=False")],
             "Whose backward follows its forward at once"),
            ("every block reshards after forward, the default", [(", reshard_after_forward=i < len(model.blocks) - 1", "")],
             "gathered them again at once"),
            ("the first block kept instead of the last", [("i < len(model.blocks) - 1", "i > 0")], "block 0"),
            ("the root is left out", [("    return fully_shard(model, mesh=mesh)", "    return model")],
             "stayed plain tensors"),
            ("the root sharded first, then the blocks", [   # PyTorch: "TypeError: Invariant encountered ..."
                ("    for i, block in enumerate(model.blocks):\n"
                 "        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)\n"
                 "    return fully_shard(model, mesh=mesh)",
                 "    fully_shard(model, mesh=mesh)\n"
                 "    for i, block in enumerate(model.blocks):\n"
                 "        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)\n"
                 "    return model")],
             "Shard the blocks first and the root last"),
        ],
        "correct": [
            ("the default mesh, the last block apart, nothing returned", [
                ("    mesh = init_device_mesh(device_type, (dist.get_world_size(),))\n"
                 "    for i, block in enumerate(model.blocks):\n"
                 "        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)\n"
                 "    return fully_shard(model, mesh=mesh)",
                 "    *rest, last = model.blocks\n"
                 "    for block in rest:\n"
                 "        fully_shard(block)\n"
                 "    fully_shard(last, reshard_after_forward=False)\n"
                 "    fully_shard(model)")]),
            ("a named mesh", [("(dist.get_world_size(),))", "[dist.get_world_size()], mesh_dim_names=(\"dp\",))")]),
        ],
    },
    "fsdp1": {
        "mistakes": [
            ("one unit per block, as in the chapter", [
                ("from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy",
                 "from torch.distributed.fsdp.wrap import ModuleWrapPolicy"),
                ("functools.partial(size_based_auto_wrap_policy, min_num_params=3000)",
                 "ModuleWrapPolicy({type(model.blocks[0])})")], "FSDP made 5 units"),
            ("a threshold that block 0 reaches", [("min_num_params=3000", "min_num_params=2000")],
             "which not?"),
            ("FULL_SHARD", [("ShardingStrategy.SHARD_GRAD_OP", "ShardingStrategy.FULL_SHARD")],
             "backward all-gathered parameters again"),
            ("the reduction left at the parameters' dtype", [(", reduce_dtype=torch.float32", "")],
             "reduced in bfloat16"),
        ],
        "correct": [
            ("a lambda policy naming blocks 1-3: the same units", [
                ("from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy",
                 "from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy"),
                ("functools.partial(size_based_auto_wrap_policy, min_num_params=3000)",
                 "functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: any(m is b for b in model.blocks[1:]))")]),
            ("the largest threshold, keywords in another order", [
                ("min_num_params=3000", "min_num_params=4160"),
                ("MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
                 "MixedPrecision(reduce_dtype=torch.float32, param_dtype=torch.bfloat16, buffer_dtype=torch.float32)")]),
        ],
    },
}

VARIANTS["mixed_precision"] = {
    "mistakes": [
        ("no output dtype: the head gets bf16", [(",\n                                   output_dtype=torch.float32)", ")")],
         "what dtype should a block's output leave it in"),
        ("the root in bf16 too", [("    return fully_shard(model, mesh=mesh)", "    return fully_shard(model, mesh=mesh, mp_policy=in_bf16)")],
         "Where does the dtype change"),
        ("reductions in bf16", [("reduce_dtype=torch.float32", "reduce_dtype=torch.bfloat16")], "reduce-scatters carried bfloat16"),
    ],
    "correct": [
        ("a policy per block built in the loop, the root given an fp32 policy",
         [("    in_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,\n"
           "                                   output_dtype=torch.float32)\n"
           "    for block in model.blocks:\n"
           "        fully_shard(block, mesh=mesh, mp_policy=in_bf16)\n"
           "    return fully_shard(model, mesh=mesh)",
           "    for i in range(len(model.blocks)):\n"
           "        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)\n"
           "        fully_shard(model.blocks[i], mesh=mesh, mp_policy=policy)\n"
           "    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))")]),
    ],
}
