import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

def train_and_save(model, x, y, path):
    # Runs as torchrun runs a script: torchrun's environment, no process group yet. Join one
    # (Gloo), take one SGD step (lr=0.1, loss F.mse_loss) with this rank's share of the global
    # batch x, y, have rank 0 alone save the weights to path so that they load into a plain
    # model, and leave the group.
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), path)
    dist.destroy_process_group()
