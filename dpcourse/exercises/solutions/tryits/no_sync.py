import contextlib
import torch.nn.functional as F

def accumulate(ddp_model, micro_batches):
    # micro_batches: a list of (x, y), this rank's share of one optimizer step. Leave in each
    # parameter's .grad the gradient of the mean loss over the global batch (every rank's
    # micro-batches), with DDP all-reducing only once. The loss: F.mse_loss(ddp_model(x), y).
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            loss = F.mse_loss(ddp_model(x), y) / len(micro_batches)
            loss.backward()
