from torch.distributed.optim import ZeroRedundancyOptimizer

def make_optimizer(ddp_model):
    # Return an optimizer for ddp_model: SGD with momentum 0.9, learning rate 0.05 but 0.005 for
    # the head (ddp_model.module.head), other settings at their defaults; its state (the
    # momentum buffers) each rank holds for its own share of the parameters only.
    head = list(ddp_model.module.head.parameters())
    others = [p for p in ddp_model.parameters() if not any(p is h for h in head)]
    return ZeroRedundancyOptimizer([{"params": others}, {"params": head, "lr": 0.005}],
                                   optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
