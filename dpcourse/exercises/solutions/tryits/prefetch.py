def prefetch_ahead(model):
    # model: each of model.blocks and then the root are fully_shard-ed; the root holds an input
    # layer, computed before block 0. Have FSDP issue each block's forward all-gather two blocks
    # early: when block i starts computing, the gathers of blocks i+1 and i+2 have been issued;
    # when the input layer starts, those of blocks 0 and 1. Nothing to return.
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:2])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
