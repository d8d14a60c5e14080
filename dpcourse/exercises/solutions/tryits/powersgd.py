from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

def register_powersgd(ddp_model):
    # Register PowerSGD on ddp_model: factors of rank 2, after 3 steps of plain all-reduce.
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=3)
    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)
