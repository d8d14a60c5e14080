from torch.utils.data import DataLoader, DistributedSampler

def epoch_orders(dataset, epochs, seed):
    # dataset: a TensorDataset of the indices 0, 1, ..., 10 (each item is its own index).
    # Return one list per epoch: the indices this rank reads through a DataLoader, in order.
    # Each epoch a new shuffle, decided by seed alone; the ranks' parts disjoint and of equal
    # size, with the uneven tail left out.
    sampler = DistributedSampler(dataset, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append([int(i) for (batch,) in loader for i in batch])
    return orders
