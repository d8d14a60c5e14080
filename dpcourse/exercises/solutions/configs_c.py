"""Exercise C, reference solution: four FSDP configurations in FSDP2 (and, for comparison,
FSDP1 in the comments), and the three orderings predicted before anything runs."""
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
predicted = {
    # between steps: everything sharded over 4 ranks, except HYBRID's shards over 2
    "at_rest": ["FULL_SHARD", "SHARD_GRAD_OP", "one unit", "HYBRID_SHARD"],
    # one block gathered at a time < every block kept gathered < shards twice as large (with one
    # block gathered) < the whole model and all its gradients at once
    "peak": ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "one unit"],
    # each unit gathered once (the root stays gathered) < pairs plus an all-reduce < gathered twice
    "sent_per_step": ["SHARD_GRAD_OP", "one unit", "HYBRID_SHARD", "FULL_SHARD"],
}
