def prepare(model):
    # model: this rank's copy of a small CNN, a Sequential with a BatchNorm2d and a BatchNorm1d.
    # Return it ready for training on the ranks: wrapped in DDP, with each BatchNorm layer
    # normalising with the mean and variance of the global batch (every rank's samples).
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DDP(model)
