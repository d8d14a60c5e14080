from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def shard_transformer(model, device_type):
    # model: a small transformer on every rank, the same weights; model.blocks: its 2 blocks.
    # Shard it over all ranks on a 1-D mesh of device_type ("cpu" here): one unit per block,
    # then the root. Every block frees its gathered parameters after its forward except the
    # last, which keeps them for its backward. Return the sharded model.
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
    return fully_shard(model, mesh=mesh)
