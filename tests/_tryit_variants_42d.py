"""4.2d's try-its: answers written apart from the references (see _tryit_variants.py)."""

_CONVERT = "    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"
_JOIN_LOOP = ("    with Join([ddp_model], divide_by_initial_world_size=False):\n"
              "        for x, y in batches:\n"
              "            F.mse_loss(ddp_model(x), y).backward()\n"
              "            optimizer.step()\n"
              "            optimizer.zero_grad()\n")

VARIANTS = {
    "sync_batchnorm": {
        "mistakes": [
            ("plain BatchNorm: statistics per rank", [(_CONVERT, "")],
             "model[1] and model[5] normalised each rank's batch with that rank's own mean"),
            ("only the first BatchNorm layer converted",
             [(_CONVERT, "    model[1] = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model[1])\n")],
             "model[5] normalised"),
            ("converted, not wrapped in DDP", [("    return DDP(model)", "    return model")],
             "averages the gradients"),
        ],
        "correct": [
            ("converted after wrapping in DDP", [(_CONVERT + "    return DDP(model)",
                                                 "    ddp_model = DDP(model)\n"
                                                 "    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(ddp_model)")]),
            ("each layer replaced by hand", [(_CONVERT,
                                              "    for i, layer in enumerate(model):\n"
                                              "        if isinstance(layer, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):\n"
                                              "            model[i] = torch.nn.SyncBatchNorm.convert_sync_batchnorm(layer)\n")]),
        ],
    },
    "join": {
        "mistakes": [
            ("the finished rank's share made up by hand, for 2 ranks: right on 2, wrong on 3", [(_JOIN_LOOP,
                "    n = torch.tensor(len(batches))\n"
                "    dist.all_reduce(n, op=dist.ReduceOp.MIN)\n"
                "    short = int(n)\n"
                "    with Join([ddp_model]):\n"
                "        for s, (x, y) in enumerate(batches):\n"
                "            F.mse_loss(ddp_model(x), y).backward()\n"
                "            if s >= short:\n"
                "                for p in ddp_model.parameters():\n"
                "                    p.grad *= 2\n"
                "            optimizer.step()\n"
                "            optimizer.zero_grad()\n")], "on 3 ranks (it passed on 2)"),
            ("no Join: the longer rank hangs", [("    with Join([ddp_model], divide_by_initial_world_size=False):\n", "    if True:\n")],
             "different numbers of all-reduces"),
            ("every rank stops at the shortest count", [(_JOIN_LOOP,
                "    n = torch.tensor(len(batches))\n"
                "    dist.all_reduce(n, op=dist.ReduceOp.MIN)\n"
                "    for x, y in batches[:int(n)]:\n"
                "        F.mse_loss(ddp_model(x), y).backward()\n"
                "        optimizer.step()\n"
                "        optimizer.zero_grad()\n")], "never trained on"),
            ("Join without the model as a joinable", [("Join([ddp_model], ", "Join([optimizer], ")], "join_hook"),
            ("the finished rank's zeros counted", [("Join([ddp_model], divide_by_initial_world_size=False)", "Join([ddp_model])")],
             "counting as zeros"),
            ("gradients left over from earlier batches", [("            optimizer.zero_grad()\n", "")], "left over"),
        ],
        "correct": [
            ("DDP's own join()", [("Join([ddp_model], divide_by_initial_world_size=False)",
                                   "ddp_model.join(divide_by_initial_world_size=False)")]),
        ],
    },
}
