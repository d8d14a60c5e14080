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
    "dcp": {
        "mistakes": [
            ("only the model is saved", [
                ('dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)',
                 'dcp.save({"model": model_state}, checkpoint_id=folder)'),
                ('state = {"model": model_state, "optim": optim_state}', 'state = {"model": model_state}'),
                ('optim_state_dict=state["optim"]', "optim_state_dict=optim_state")], "step count"),
            ("loaded, never put into the model and optimizer", [
                ('        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n',
                 "")], "weights are not the ones saved"),
            ("model.state_dict() with torch.save on each rank", [
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)',
                 '        torch.save(model.state_dict(), f"{folder}/model-{dist.get_rank()}.pt")'),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        state = {"model": model_state, "optim": optim_state}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])',
                 '        model.load_state_dict(torch.load(f"{folder}/model-{dist.get_rank()}.pt", weights_only=False))')],
             "Error(s) in loading state_dict"),
        ],
        "correct": [
            ("the model_ and optimizer_ forms, one state dict each", [
                ("from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict",
                 "from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,\n"
                 "                                                     set_model_state_dict, set_optimizer_state_dict)"),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)',
                 '        dcp.save({"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer)},\n'
                 '                 checkpoint_id=folder)'),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        state = {"model": model_state, "optim": optim_state}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])',
                 '        state = {"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer)}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        set_model_state_dict(model, state["m"])\n'
                 '        set_optimizer_state_dict(model, optimizer, state["o"])')]),
        ],
    },
    "gradient_sync": {
        "mistakes": [
            ("every micro-batch synchronises", [("        model.set_requires_gradient_sync(i == len(micro_batches) - 1)\n", "")],
             "3 times for 3 micro-batches"),
            ("the loss is not divided", [(" / len(micro_batches)", "")], "3 times the right size"),
            ("synchronisation switched off, never back on", [("i == len(micro_batches) - 1", "False")],
             "no reduce-scatter ran"),
        ],
        "correct": [
            ("off before the loop, on before the last backward", [
                ("    for i, (x, y) in enumerate(micro_batches):\n"
                 "        model.set_requires_gradient_sync(i == len(micro_batches) - 1)\n"
                 "        (F.mse_loss(model(x), y) / len(micro_batches)).backward()",
                 "    model.set_requires_gradient_sync(False)\n"
                 "    for i, (x, y) in enumerate(micro_batches):\n"
                 "        if i + 1 == len(micro_batches):\n"
                 "            model.set_requires_gradient_sync(True)\n"
                 "        loss = F.mse_loss(model(x), y)\n"
                 "        (loss * (1 / len(micro_batches))).backward()")]),
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
