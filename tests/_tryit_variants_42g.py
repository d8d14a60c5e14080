"""4.2g's try-its: answers written apart from the references (see _tryit_variants.py)."""

_LOOP = ("    for block in model.blocks:\n"
         "        fully_shard(block)\n"
         "        block.compile(backend=backend)\n"
         "    fully_shard(model)\n")

VARIANTS = {
    "compile_blocks": {
        "mistakes": [
            ("torch.compile(block) whose result is dropped: nothing compiled",
             [("        block.compile(backend=backend)", "        torch.compile(block, backend=backend)")],
             "leaves the one it was given as it was"),
            ("a compiled wrapper put in the block's place: the names change",
             [(_LOOP, "    for i, block in enumerate(model.blocks):\n"
                      "        fully_shard(block)\n"
                      "        model.blocks[i] = torch.compile(block, backend=backend)\n"
                      "    fully_shard(model)\n")],
             "names changed"),
            ("the whole model in one graph, asked with fullgraph=True",
             [(_LOOP, "    for block in model.blocks:\n"
                      "        fully_shard(block)\n"
                      "    fully_shard(model)\n"
                      "    model.compile(backend=backend, fullgraph=True)\n")],
             "one graph without a break"),
            ("only the root sharded", [("        fully_shard(block)\n", "")], "the units are the root"),
        ],
        "correct": [
            ("compiled first, sharded after, on an explicit mesh",
             [(_LOOP, "    mesh = init_device_mesh(\"cpu\", (dist.get_world_size(),))\n"
                      "    for block in model.blocks:\n"
                      "        block.compile(backend=backend)\n"
                      "        fully_shard(block, mesh=mesh)\n"
                      "    fully_shard(model, mesh=mesh)\n"),
              ("from torch.distributed.fsdp import fully_shard",
               "from torch.distributed.device_mesh import init_device_mesh\n"
               "from torch.distributed.fsdp import fully_shard")]),
            ("each block compiled with fullgraph=True, nothing returned",
             [("block.compile(backend=backend)", "block.compile(backend=backend, fullgraph=True)"),
              ("    return model\n", "")]),
        ],
    },
    "hsdp_clip": {
        "mistakes": [
            ("a 1-D mesh: FSDP, not HSDP",
             [("(dist.get_world_size() // shard_size, shard_size),\n"
               "                            mesh_dim_names=(\"replicate\", \"shard\")",
               "(dist.get_world_size(),)")], "which is FSDP, not HSDP"),
            ("the axes' lengths swapped: right on 4 ranks, wrong on 2",
             [("(dist.get_world_size() // shard_size, shard_size)", "(shard_size, dist.get_world_size() // shard_size)")],
             "the mesh is 2 x 1 ranks"),
            ("the notebook's 2 x 2 written in: right on 4 ranks, wrong on 2",
             [("(dist.get_world_size() // shard_size, shard_size)", "(2, 2)")], "found 4 ranks"),
            ("the local shards clipped: they hold no gradient",
             [("clip_grad_norm_(model.parameters(), max_norm)",
               "clip_grad_norm_([p.to_local() for p in model.parameters()], max_norm)"),
              ("    return norm.full_tensor().item()", "    return float(norm)")],
             "before clipping"),
        ],
        "correct": [
            ("the axes' lengths from the mesh call's keywords, the norm read with float()",
             [("init_device_mesh(device_type, (dist.get_world_size() // shard_size, shard_size),",
               "init_device_mesh(device_type=device_type, mesh_shape=(dist.get_world_size() // shard_size, shard_size),"),
              ("    return norm.full_tensor().item()", "    return float(norm.full_tensor())")]),
        ],
    },
}
