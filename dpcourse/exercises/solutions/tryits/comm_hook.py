def register_bf16_hook(ddp_model):
    # Register on ddp_model a comm hook of your own: each gradient bucket is all-reduced as
    # bf16 (half the bytes), and the future the hook returns holds the bucket averaged over
    # the ranks, as float32 again.
    def hook(state, bucket):
        grads = bucket.buffer()
        compressed = (grads / dist.get_world_size()).to(torch.bfloat16)
        future = dist.all_reduce(compressed, async_op=True).get_future()
        return future.then(lambda fut: grads.copy_(fut.value()[0]))
    ddp_model.register_comm_hook(None, hook)
