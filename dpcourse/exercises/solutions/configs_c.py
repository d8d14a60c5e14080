"""Exercise C, reference solution: four FSDP configurations in FSDP2 (and, for comparison,
FSDP1 in the comments), and the figures, written before anything runs, that order them."""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def per_block(model, **options):  # FSDP2's auto-wrap: each block a unit, then the root
    for block in model.blocks:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def full_shard(model):      # FSDP1: FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
    return per_block(model)  #         auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}), device_id=...)


def shard_grad_op(model):    # FSDP1: ShardingStrategy.SHARD_GRAD_OP
    return per_block(model, reshard_after_forward=False)


def hybrid_shard(model):     # FSDP1: ShardingStrategy.HYBRID_SHARD with device_mesh=the same 2-D mesh
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    return per_block(model, mesh=mesh)


def one_unit(model):         # FSDP1: FULL_SHARD without an auto_wrap_policy
    return fully_shard(model)


configs = {"FULL_SHARD": full_shard, "SHARD_GRAD_OP": shard_grad_op, "HYBRID_SHARD": hybrid_shard,
           "one unit": one_unit}


def predict(units, world_size, config):
    """Rank 0's bytes: held between steps, at the fullest moment of a step, sent per step."""
    P, block, root = sum(units), max(units[:-1]), units[-1]
    shard = 2 if config == "HYBRID_SHARD" else world_size  # the ranks one copy is sharded over
    at_rest = 16 * P / shard  # float32 parameters and gradients, Adam's two moments: 16 bytes each
    if config == "one unit":        # the whole model gathered, then all its gradients before the scatter
        gathered = 4 * P + 4 * P
    elif config == "SHARD_GRAD_OP":  # every block kept gathered from forward to backward
        gathered = 4 * P + 4 * block
    else:                            # one block at a time (and the root, which stays gathered)
        gathered = 4 * (block + root) + 4 * block
    ring = (shard - 1) / shard       # a ring phase over the shard group
    if config in ("SHARD_GRAD_OP", "one unit"):
        sent = ring * 2 * 4 * P      # one gather, one reduce-scatter (the root unit is not gathered again)
    else:
        sent = ring * (3 * 4 * P - 4 * root)  # gather for forward, again for backward but the root; scatter
    if config == "HYBRID_SHARD":     # then each shard all-reduced across the world_size // shard groups
        groups = world_size // shard
        sent += 2 * (groups - 1) / groups * 4 * P / shard
    return {"at_rest": at_rest, "peak": at_rest + gathered, "sent_per_step": sent}
