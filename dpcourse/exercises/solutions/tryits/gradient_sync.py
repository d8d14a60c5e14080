import torch.nn.functional as F

def accumulate(model, micro_batches):
    # model: the MLP under fully_shard (each block a unit, then the root); micro_batches: a
    # list of (x, y) of 2, 4 and 6 samples, this rank's share of one step. Leave in each
    # parameter's .grad (its shard) the gradient of the mean loss over all the samples of the
    # global batch (every rank's), with FSDP reduce-scattering once. Loss: F.mse_loss(model(x), y).
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        share = len(x) / sum(len(b) for b, _ in micro_batches)
        (F.mse_loss(model(x), y) * share).backward()
