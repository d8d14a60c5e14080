from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powersgd

def register_powersgd(ddp_model):
    # Register PowerSGD on ddp_model, everything it all-reduces in fp16: factors of rank 2;
    # steps 0, 1 and 2 all-reduce the whole gradients, steps 3 on send the factors.
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=3)
    ddp_model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook))
