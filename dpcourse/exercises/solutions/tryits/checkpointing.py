from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

def checkpoint_some(model, chosen):
    # chosen: indices into model.blocks. Checkpoint exactly those blocks, no other module, so
    # that each keeps only its input for backward and recomputes the rest. Return the model.
    wanted = [model.blocks[i] for i in chosen]
    apply_activation_checkpointing(model, check_fn=lambda m: any(m is w for w in wanted))
    return model
