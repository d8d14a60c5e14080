import functools
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

def wrap_fsdp1(model):
    # model: the MLP (block 0: 2,112 parameters, blocks 1-3: 4,160 each, head: 520), the same
    # weights on every rank. Return it wrapped in FSDP1 on the CPU with: an auto-wrap policy
    # whose units are blocks 1, 2 and 3, the root keeping block 0 and the head (one size
    # threshold does it); parameters kept gathered from forward to backward; gathers in bf16,
    # gradients reduced in fp32.
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=3000)
    return FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
