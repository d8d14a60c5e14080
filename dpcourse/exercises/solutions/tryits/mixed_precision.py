from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

def shard_mixed(model, mesh):
    # Shard each of model.blocks, then the root, on mesh. The blocks gather their parameters
    # and compute in bf16, and reduce their gradients in fp32; the root's own parameters (the
    # head) stay fp32 throughout, and the model hands back fp32 outputs.
    in_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   output_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=in_bf16)
    return fully_shard(model, mesh=mesh)
