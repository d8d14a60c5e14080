from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def hsdp_clipped(model, loss_fn, max_norm, shard_size, device_type):
    # model: the MLP, the same weights on every rank; loss_fn(model): this rank's loss on its
    # batch. Shard it with HSDP on a 2-D mesh of device_type ("cpu" here), axes named
    # ("replicate", "shard"): shard groups of shard_size ranks, replicated over all the others;
    # one unit per block, then the root. Then compute the loss's gradients and clip them to a
    # total norm of max_norm over the whole model. Return that norm, before clipping, as a float.
    mesh = init_device_mesh(device_type, (dist.get_world_size() // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_fn(model).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor().item()
