def build_sharded(mesh, device, init):
    # Build dpc.models.build_model("transformer") so that this rank never holds it whole: each
    # of model.blocks and then the root sharded with fully_shard on mesh, this rank's shards
    # given storage on device and filled by init(model). Return the model.
    with torch.device("meta"):
        model = dpc.models.build_model("transformer")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    init(model)
    return model
