"""4.2e's try-its: answers written apart from the references (see _tryit_variants.py)."""

_PSGD_REGISTER = "    ddp_model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook))"
_ZERO_GROUPS = '[{"params": others}, {"params": head, "lr": 0.005}]'

VARIANTS = {
    "eval_metric": {
        "mistakes": [
            ("the stride is the notebook's 2 ranks: right on 2, wrong on 3", [
                ("range(rank, len(dataset), world)", "range(rank, len(dataset), 2)")],
             "on 3 ranks (it passed on 2): sample 2 was counted by ranks 0 and 2, and 6 samples in all"),
            ("DistributedSampler pads the parts", [
                ("range(rank, len(dataset), world)", "DistributedSampler(dataset, shuffle=False)")],
             "repeating samples"),
            ("a mean of the ranks' means", [
                ("    dist.all_reduce(counts)\n    return (counts[0] / counts[1]).item()",
                 "    mean = counts[0] / counts[1]\n    dist.all_reduce(mean)\n    return (mean / world).item()")],
             "weigh every sample alike"),
            ("no all-reduce", [("    dist.all_reduce(counts)\n", "")], "each one's own part"),
            ("the whole dataset on every rank", [("sampler=mine", "shuffle=False")], "whole dataset"),
            ("rank 0 evaluates everything, then broadcasts", [
                ("range(rank, len(dataset), world)", "range(len(dataset)) if rank == 0 else []"),
                ("dist.all_reduce(counts)", "dist.broadcast(counts, src=0)")],
             "rank 0 read all 13 samples and rank 1 none"),
            ("rank 0 evaluates everything, then all-reduces", [
                ("range(rank, len(dataset), world)", "range(len(dataset) if rank == 0 else 0)")],
             "rank 0 read all 13 samples and rank 1 none"),
            ("each rank reads its strided part twice", [
                ("        for x, label in DataLoader(dataset, batch_size=4, sampler=mine):",
                 "        for x, label in [*DataLoader(dataset, batch_size=4, sampler=mine)] * 2:")],
             "its own part again"),
            ("integer counts and floor division", [
                ("counts = torch.zeros(2)", "counts = torch.zeros(2, dtype=torch.long)"),
                ("(counts[0] / counts[1])", "(counts[0] // counts[1])")],
             "what does the fraction of the two sums return"),
            ("dist.reduce to rank 0", [("dist.all_reduce(counts)", "dist.reduce(counts, dst=0)")],
             "the counts reached one rank only"),
            ("a model of its own, not the one handed in", [
                ("            hits = model(x).argmax(dim=1) == label",
                 "            hits = own(x).argmax(dim=1) == label"),
                ("    rank, world = dist.get_rank(), dist.get_world_size()\n",
                 "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                 "    own = dpc.models.build_model(\"mlp\", seed=0)\n")],
             "evaluated another model"),
            ("the misses counted as hits", [("argmax(dim=1) == label", "argmax(dim=1) != label")],
             "count as a hit"),
        ],
        "correct": [
            ("contiguous parts, two all-reduces of int64 counts", [
                ("    mine = range(rank, len(dataset), world)           # a strided part, no padding\n",
                 "    per = -(-len(dataset) // world)\n"
                 "    mine = range(rank * per, min(len(dataset), (rank + 1) * per))\n"),
                ("    counts = torch.zeros(2)                            # [correct, seen] on this rank\n",
                 "    right, seen = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)\n"),
                ("            counts += torch.tensor([hits.sum().item(), len(label)])\n",
                 "            right += hits.sum()\n            seen += len(label)\n"),
                ("    dist.all_reduce(counts)\n    return (counts[0] / counts[1]).item()",
                 "    dist.all_reduce(right)\n    dist.all_reduce(seen)\n    return right.item() / seen.item()")]),
            ("contiguous parts from a Sampler subclass, float64 counts", [
                ("    mine = range(rank, len(dataset), world)           # a strided part, no padding\n",
                 "    class Block(torch.utils.data.Sampler):\n"
                 "        def __init__(self, n):\n"
                 "            cut = [n * r // world for r in range(world + 1)]\n"
                 "            self.ids = list(range(cut[rank], cut[rank + 1]))\n"
                 "        def __iter__(self):\n"
                 "            return iter(self.ids)\n"
                 "        def __len__(self):\n"
                 "            return len(self.ids)\n"
                 "    mine = Block(len(dataset))\n"),
                ("counts = torch.zeros(2)", "counts = torch.zeros(2, dtype=torch.float64)"),
                ("batch_size=4", "batch_size=3")]),
        ],
    },
    "zero1": {
        "mistakes": [
            ("plain SGD, replicated state", [
                ("ZeroRedundancyOptimizer(" + _ZERO_GROUPS + ",\n"
                 "                                   optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)",
                 "torch.optim.SGD(" + _ZERO_GROUPS + ", lr=0.05, momentum=0.9)")],
             "replicated"),
            ("momentum forgotten", [(", lr=0.05, momentum=0.9)", ", lr=0.05)")], "without momentum"),
            ("one learning rate for all", [(_ZERO_GROUPS, "ddp_model.parameters()")], "one rate for all"),
            ("the rates swapped", [(_ZERO_GROUPS, '[{"params": head}, {"params": others, "lr": 0.005}]')],
             "the other way round"),
            ("the head at the others' rate, the rest at a tenth", [
                (_ZERO_GROUPS, '[{"params": others, "lr": 0.005}, {"params": head, "lr": 0.05}]'),
                (", lr=0.05, momentum=0.9)", ", lr=0.01, momentum=0.9)")],
             "the other way round"),
            ("Nesterov momentum: the first step 1.9 times as long", [
                (", lr=0.05, momentum=0.9)", ", lr=0.05, momentum=0.9, nesterov=True)")],
             "1.9 times as far"),
            ("the head at a fifth of the rate", [(_ZERO_GROUPS, _ZERO_GROUPS.replace("0.005", "0.01"))],
             "0.2 times the others' rate"),
            ("Adam instead of SGD", [("optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)",
                                      "optimizer_class=torch.optim.Adam, lr=0.05)")],
             "Adam keeps two moments"),
            ("the optimizer over a copy of the model", [
                ("    head = list(ddp_model.module.head.parameters())\n",
                 "    module = copy.deepcopy(ddp_model.module)\n    head = list(module.head.parameters())\n"),
                ("for p in ddp_model.parameters()", "for p in module.parameters()")],
             "tensors that are not the model's"),
            ("groups of generators, used up before the optimizer reads them", [
                ("    head = list(ddp_model.module.head.parameters())\n",
                 "    head = ddp_model.module.head.parameters()\n"),
                ("    others = [p for p in ddp_model.parameters() if not any(p is h for h in head)]\n",
                 "    others = ddp_model.module.blocks.parameters()\n")],
             "0 of the model's 10"),
        ],
        "correct": [
            ("groups by name, keywords in another order", [
                ("    head = list(ddp_model.module.head.parameters())\n"
                 "    others = [p for p in ddp_model.parameters() if not any(p is h for h in head)]\n",
                 "    named = list(ddp_model.module.named_parameters())\n"
                 "    head = [p for n, p in named if n.startswith(\"head.\")]\n"
                 "    others = [p for n, p in named if not n.startswith(\"head.\")]\n"),
                ("optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)",
                 "momentum=0.9, lr=5e-2, optimizer_class=torch.optim.SGD)")]),
            ("groups by module, the head added after, one bucket view per rank", [
                ("    head = list(ddp_model.module.head.parameters())\n"
                 "    others = [p for p in ddp_model.parameters() if not any(p is h for h in head)]\n"
                 "    return ZeroRedundancyOptimizer(" + _ZERO_GROUPS + ",\n"
                 "                                   optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)",
                 "    model = ddp_model.module\n"
                 "    optimizer = ZeroRedundancyOptimizer(list(model.blocks.parameters()), torch.optim.SGD,\n"
                 "                                        parameters_as_bucket_view=True, lr=0.05, momentum=0.9)\n"
                 "    optimizer.add_param_group({\"params\": list(model.head.parameters()), \"lr\": 0.05 / 10})\n"
                 "    return optimizer")]),
        ],
    },
    "powersgd": {
        "mistakes": [
            ("rank 1 factors", [("matrix_approximation_rank=2", "matrix_approximation_rank=1")], "How many columns"),
            ("compression from step 2", [("start_powerSGD_iter=3", "start_powerSGD_iter=2")], "warm-up"),
            ("compression from step 4", [("start_powerSGD_iter=3", "start_powerSGD_iter=4")],
             "compression began a step late"),
            ("the hook never registered", [(_PSGD_REGISTER, "    state")], "is a hook registered on the model"),
            ("PowerSGD in fp32, no wrapper", [
                (_PSGD_REGISTER, "    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)")],
             "4 bytes a value"),
            ("fp16 casting only", [
                (_PSGD_REGISTER, "    ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)")], "cast"),
        ],
        "correct": [
            ("the names imported, the wrapped hook registered by keywords", [
                ("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powersgd",
                 "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper\n"
                 "from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook"),
                ("    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,\n"
                 "                                   start_powerSGD_iter=3)\n" + _PSGD_REGISTER,
                 "    ddp_model.register_comm_hook(\n"
                 "        state=PowerSGDState(dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=3,\n"
                 "                            min_compression_rate=2, use_error_feedback=True),\n"
                 "        hook=fp16_compress_wrapper(hook=powerSGD_hook))")]),
        ],
    },
}
