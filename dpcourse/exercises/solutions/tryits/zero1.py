from torch.distributed.optim import ZeroRedundancyOptimizer

def make_optimizer(ddp_model):
    # Return an optimizer for ddp_model: SGD with momentum 0.9 and learning rate 0.05, whose
    # state (the momentum buffers) each rank holds for its own share of the parameters only.
    return ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.SGD,
                                   lr=0.05, momentum=0.9)
