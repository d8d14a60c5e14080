from torch.distributed.fsdp import CPUOffloadPolicy

def clipped_step(model, x, y, max_norm):
    # Shard each of model.blocks and then the root with fully_shard, their shards, gradients and
    # optimizer state kept in CPU memory, unpinned (the machine may have no accelerator). Then
    # one step of torch.optim.SGD(model.parameters(), lr=0.1) on F.mse_loss(model(x), y), with
    # the gradients clipped to a total norm of max_norm. Return that norm, as clipping reported it.
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return norm.full_tensor().item()
