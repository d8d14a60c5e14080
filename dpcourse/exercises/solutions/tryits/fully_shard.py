from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def shard_transformer(model, device_type):
    # model: a small transformer on every rank, the same weights; model.blocks: its 2 blocks.
    # Shard it over all ranks on a 1-D mesh of device_type ("cpu" here): one unit per block,
    # then the root; each block keeps its gathered parameters from its forward to its
    # backward. Return the sharded model.
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)
