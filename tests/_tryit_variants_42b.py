"""4.2b's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {
    "fully_shard": {
        "mistakes": [
            ("only the root is sharded", [("    for block in model.blocks:\n"
                                           "        fully_shard(block, mesh=mesh, reshard_after_forward=False)\n", "")],
             "single collective"),
            ("the blocks reshard after forward, the default", [(", reshard_after_forward=False", "")],
             "gathered parameters again"),
            ("the root is left out", [("    return fully_shard(model, mesh=mesh)", "    return model")],
             "stayed plain tensors"),
        ],
        "correct": [
            ("the default mesh, blocks by index, the root kept gathered too, nothing returned", [
                ("    mesh = init_device_mesh(device_type, (dist.get_world_size(),))\n"
                 "    for block in model.blocks:\n"
                 "        fully_shard(block, mesh=mesh, reshard_after_forward=False)\n"
                 "    return fully_shard(model, mesh=mesh)",
                 "    for i in range(len(model.blocks)):\n"
                 "        fully_shard(model.blocks[i], reshard_after_forward=False)\n"
                 "    fully_shard(model, reshard_after_forward=False)")]),
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
