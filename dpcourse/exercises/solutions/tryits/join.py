from torch.distributed.algorithms import Join

def train(ddp_model, optimizer, batches):
    # batches: this rank's list of (x, y); the ranks have different numbers of them. Train on
    # every one of them, one optimizer step per batch (loss: F.mse_loss(ddp_model(x), y)),
    # and return once every rank has finished, all replicas holding the same weights.
    with Join([ddp_model]):
        for x, y in batches:
            F.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
