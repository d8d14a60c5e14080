from torch.distributed.algorithms import Join

def train(ddp_model, optimizer, batches):
    # batches: this rank's list of (x, y); the ranks have different numbers of them. Train on
    # every one of them, one optimizer step per batch (loss: F.mse_loss(ddp_model(x), y)),
    # each step's gradient the mean over the ranks still training (a rank that has run out
    # must not count), and return once every rank has finished, all replicas equal.
    with Join([ddp_model], divide_by_initial_world_size=False):
        for x, y in batches:
            F.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
