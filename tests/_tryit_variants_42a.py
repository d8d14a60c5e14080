"""4.2a's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {
    "no_sync": {
        "mistakes": [
            ("every micro-batch synchronises", [("contextlib.nullcontext() if last else ddp_model.no_sync()",
                                                 "contextlib.nullcontext()")], "4 times for 4 micro-batches"),
            ("the loss is not divided", [(" / len(micro_batches)", "")], "4 times the right size"),
            ("no micro-batch synchronises", [("contextlib.nullcontext() if last else ddp_model.no_sync()",
                                              "ddp_model.no_sync()")], "never averaged"),
            ("the forward outside no_sync, only the backward in it", [
                ("        with contextlib.nullcontext() if last else ddp_model.no_sync():\n"
                 "            loss = F.mse_loss(ddp_model(x), y) / len(micro_batches)\n",
                 "        loss = F.mse_loss(ddp_model(x), y) / len(micro_batches)\n"
                 "        with contextlib.nullcontext() if last else ddp_model.no_sync():\n")],
             "DDP decides that in forward"),
            ("the sync on the first micro-batch, not the last", [("last = i == len(micro_batches) - 1", "last = i == 0")],
             "After which micro-batch's backward"),
        ],
        "correct": [
            ("an ExitStack and a running sum of the loss", [
                ("        last = i == len(micro_batches) - 1\n"
                 "        with contextlib.nullcontext() if last else ddp_model.no_sync():\n"
                 "            loss = F.mse_loss(ddp_model(x), y) / len(micro_batches)\n"
                 "            loss.backward()",
                 "        with contextlib.ExitStack() as stack:\n"
                 "            if i + 1 < len(micro_batches):\n"
                 "                stack.enter_context(ddp_model.no_sync())\n"
                 "            (F.mse_loss(ddp_model(x), y) * (1 / len(micro_batches))).backward()")]),
        ],
    },
    "sampler": {
        "mistakes": [
            ("batches of 5 with drop_last: right on 2 ranks, wrong on 3", [
                ("batch_size=2, sampler=sampler", "batch_size=5, sampler=sampler, drop_last=True")],
             "on 3 ranks (it passed on 2): together the ranks read 0 different samples"),
            ("no set_epoch", [("        sampler.set_epoch(epoch)\n", "")], "same order as epoch 0"),
            ("a shuffled DataLoader without the distributed sampler",
             [("DataLoader(dataset, batch_size=2, sampler=sampler)", "DataLoader(dataset, batch_size=2, shuffle=True)")],
             "the whole dataset"),
            ("drop_last forgotten", [("seed=seed, drop_last=True", "seed=seed")], "repeated"),
            ("the seed not passed on", [("seed=seed, drop_last=True", "drop_last=True")], "another seed"),
            ("a seed per rank", [("seed=seed, drop_last=True", "seed=seed + dist.get_rank(), drop_last=True")],
             "the ranks shuffled with different seeds"),
            ("a fixed part per rank, shuffled within it every epoch", [
                ("from torch.utils.data import DataLoader, DistributedSampler",
                 "from torch.utils.data import DataLoader, SubsetRandomSampler"),
                ("    sampler = DistributedSampler(dataset, seed=seed, drop_last=True)\n"
                 "    loader = DataLoader(dataset, batch_size=2, sampler=sampler)\n",
                 "    world = dist.get_world_size()\n"
                 "    part = list(range(dist.get_rank(), len(dataset) - len(dataset) % world, world))\n"),
                ("        sampler.set_epoch(epoch)\n",
                 "        sampler = SubsetRandomSampler(part, generator=torch.Generator().manual_seed(seed + epoch))\n"
                 "        loader = DataLoader(dataset, batch_size=2, sampler=sampler)\n")],
             "one permutation of the whole dataset, shared by all ranks and redrawn every epoch"),
        ],
        "correct": [
            ("the ranks named, bigger batches, a tensor's tolist", [
                ("DistributedSampler(dataset, seed=seed, drop_last=True)",
                 "DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),\n"
                 "                                 shuffle=True, seed=seed, drop_last=True)"),
                ("batch_size=2", "batch_size=4"),
                ("orders.append([int(i) for (batch,) in loader for i in batch])",
                 "orders.append(torch.cat([batch for (batch,) in loader]).tolist())")]),
        ],
    },
    "ddp_script": {
        "mistakes": [
            ("every rank saves", [("    if rank == 0:\n        torch.save(", "    torch.save(")], "every rank saved"),
            ("the DDP wrapper's state dict", [("model.module.state_dict()", "model.state_dict()")], "module."),
            ("no DDP", [("    model = DDP(model)\n", ""), ("model.module.state_dict()", "model.state_dict()")],
             "never averaged"),
            ("the group is not destroyed", [("    dist.destroy_process_group()\n", "")], "still had a process group"),
        ],
        "correct": [
            ("the rank from the environment, slices, a barrier, os._exit as the chapter's script", [
                ("import torch.nn.functional as F\n", "import os\nimport torch.nn.functional as F\n"),
                ("from torch.nn.parallel import DistributedDataParallel as DDP\n",
                 "from torch.nn.parallel import DistributedDataParallel\n"),
                ('    dist.init_process_group("gloo")\n', '    dist.init_process_group(backend="gloo")\n'),
                ("rank, world_size = dist.get_rank(), dist.get_world_size()",
                 'rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])'),
                ("model = DDP(model)", "model = DistributedDataParallel(model)"),
                ("    F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()\n",
                 "    share = len(x) // world_size\n"
                 "    mine = slice(rank * share, (rank + 1) * share)\n"
                 "    loss = F.mse_loss(model(x[mine]), y[mine])\n"
                 "    optimizer.zero_grad()\n"
                 "    loss.backward()\n"),
                ("    dist.destroy_process_group()\n",
                 "    dist.barrier()\n    dist.destroy_process_group()\n    os._exit(0)\n")]),
        ],
    },
    "comm_hook": {
        "mistakes": [
            ("the sum, not the mean", [("(grads / dist.get_world_size())", "grads")], "2 times the right size"),
            ("all-reduced in float32", [(".to(torch.bfloat16)", "")], "full precision"),
            ("float16, not bf16", [(".to(torch.bfloat16)", ".to(torch.float16)")], "float16, not bf16"),
            ("the bf16 result handed back", [("grads.copy_(fut.value()[0])", "fut.value()[0]")], "bfloat16 value"),
            ("the hook never registered", [("    ddp_model.register_comm_hook(None, hook)", "    hook")],
             "no comm hook was registered"),
            ("the all-reduce's own future returned", [
                ("return future.then(lambda fut: grads.copy_(fut.value()[0]))", "return future")], "list of 1 tensor"),
        ],
        "correct": [
            ("compress, then an averaging all-reduce", [
                ("(grads / dist.get_world_size()).to(torch.bfloat16)", "grads.to(torch.bfloat16)"),
                ("dist.all_reduce(compressed, async_op=True)",
                 "dist.all_reduce(compressed, op=dist.ReduceOp.AVG, async_op=True)")]),
            ("divided after the all-reduce, in float32", [
                ("(grads / dist.get_world_size()).to(torch.bfloat16)", "grads.to(torch.bfloat16)"),
                ("grads.copy_(fut.value()[0])", "grads.copy_(fut.value()[0]).div_(dist.get_world_size())")]),
            ("PyTorch's own bf16 hook", [
                ("    ddp_model.register_comm_hook(None, hook)",
                 "    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                 "    ddp_model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)")]),
        ],
    },
}
