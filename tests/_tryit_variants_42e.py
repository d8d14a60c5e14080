"""4.2e's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {
    "eval_metric": {
        "mistakes": [
            ("DistributedSampler pads the parts", [
                ("range(rank, len(dataset), world)", "DistributedSampler(dataset, shuffle=False)")],
             "repeating samples"),
            ("a mean of the ranks' means", [
                ("    dist.all_reduce(counts)\n    return (counts[0] / counts[1]).item()",
                 "    mean = counts[0] / counts[1]\n    dist.all_reduce(mean)\n    return (mean / world).item()")],
             "weigh every sample alike"),
            ("no all-reduce", [("    dist.all_reduce(counts)\n", "")], "different values"),
            ("the whole dataset on every rank", [("sampler=mine", "shuffle=False")], "whole dataset"),
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
        ],
    },
    "zero1": {
        "mistakes": [
            ("plain SGD, replicated state", [
                ("ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.SGD,\n"
                 "                                   lr=0.05, momentum=0.9)",
                 "torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)")],
             "replicated"),
            ("momentum forgotten", [(",\n                                   lr=0.05, momentum=0.9)",
                                     ", lr=0.05)")], "without momentum"),
        ],
        "correct": [
            ("the module's parameters, one bucket view per rank", [
                ("ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.SGD,\n"
                 "                                   lr=0.05, momentum=0.9)",
                 "ZeroRedundancyOptimizer(list(ddp_model.module.parameters()), torch.optim.SGD,\n"
                 "                                   parameters_as_bucket_view=True, momentum=0.9, lr=5e-2)")]),
        ],
    },
    "powersgd": {
        "mistakes": [
            ("rank 1 factors", [("matrix_approximation_rank=2", "matrix_approximation_rank=1")], "How many columns"),
            ("compression from step 2", [("start_powerSGD_iter=3", "start_powerSGD_iter=2")], "warm-up"),
            ("the hook never registered", [("    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)", "    state")],
             "no compression ran"),
            ("fp16 instead", [("    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)",
                               "    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                               "    ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)")], "cast"),
        ],
        "correct": [
            ("the names imported, the group given, the rate said", [
                ("from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd",
                 "from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook"),
                ("    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,\n"
                 "                                   start_powerSGD_iter=3)\n"
                 "    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)",
                 "    ddp_model.register_comm_hook(\n"
                 "        PowerSGDState(dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=3,\n"
                 "                      min_compression_rate=2, use_error_feedback=True),\n"
                 "        powerSGD_hook)")]),
        ],
    },
}
