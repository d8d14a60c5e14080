import torch.nn.functional as F

def accumulate(model, micro_batches):
    # model: the MLP under fully_shard (each block a unit, then the root); micro_batches: a
    # list of 3 (x, y), this rank's share of one step. Leave in each parameter's .grad (its
    # shard) the gradient of the mean loss over the global batch (every rank's micro-batches),
    # with FSDP reduce-scattering only once. The loss: F.mse_loss(model(x), y).
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        (F.mse_loss(model(x), y) / len(micro_batches)).backward()
