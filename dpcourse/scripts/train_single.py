"""Train a small MLP on one device: the script that train_ddp.py and train_fsdp.py make
data-parallel.

    python train_single.py --batch-size 32 --out model.pt

--batch-size is the number of samples per optimizer step. Run with the global batch of a
data-parallel run (per-rank batch x world size), this script trains exactly the same model:
the same initial weights, the same samples in every step, the same updates.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from dpcourse.models import MLP, make_dataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's MLP on one device.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffle")
    parser.add_argument("--max-norm", type=float, default=0.5, help="clip the gradients' global norm to this")
    parser.add_argument("--out", default="model.pt", help="where to save the trained weights")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(args.seed)  # the initial weights
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    dataset = make_dataset("mlp", args.num_samples)  # synthetic (inputs, targets), seeded
    shuffle = torch.Generator()
    sampler = RandomSampler(dataset, generator=shuffle)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # a new order every epoch, reproducible
        total, steps = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # the norm of all gradients
            optimizer.step()
            total += loss.detach()  # summed on the device: no sync with the CPU every step
            steps += 1
        print(f"epoch {epoch}: mean loss {total.item() / steps:.6f}")

    torch.save(model.state_dict(), args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
