"""Train a small language model on one device: exercises A and F make it data-parallel.

    python train_lm.py --batch-size 16 --accum-steps 2 --out model.pt

The model is the course's tied transformer: its output head and its token embedding are one
weight (GPT-2 style). One optimizer step uses --accum-steps micro-batches of --batch-size
sequences each; the learning rate warms up, then decays along a cosine, once per optimizer
step. After every epoch the model is scored on held-out sequences: the mean loss per token
over the whole validation set, printed as `val_loss`.

A run takes seconds on a CPU, too few steps for the model to learn much (its loss stays near
ln 64 = 4.16, a guess among 64 tokens): what matters here is what each line becomes when the
same training runs on several ranks.
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from dpcourse.models import build_model, loss_fn, make_dataset


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's tied transformer on one device.")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of AdamW")
    parser.add_argument("--warmup-steps", type=int, default=4, help="optimizer steps of linear warm-up")
    parser.add_argument("--max-norm", type=float, default=0.1, help="clip the gradients' global norm to this")
    parser.add_argument("--num-samples", type=int, default=256, help="training sequences")
    parser.add_argument("--val-samples", type=int, default=37, help="validation sequences")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    parser.add_argument("--out", default="model.pt", help="file to write the trained weights to")
    return parser.parse_args(argv)


def lr_factor(step, warmup, total):
    """The learning rate at optimizer step `step`, as a fraction of the peak: a linear
    warm-up over `warmup` steps, then a cosine decay to a tenth of the peak at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean loss per token over every sequence `loader` yields (its last batch may be short)."""
    model.eval()
    total = torch.zeros((), device=device)
    tokens = 0
    for inputs, targets in loader:
        logits = model(inputs.to(device))
        targets = targets.to(device)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        tokens += targets.numel()
    model.train()
    return total.item() / tokens


def train(argv=None):
    args = parse_options(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model = build_model("tied_transformer", seed=args.seed).to(device)  # the same weights for a seed
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train_set = make_dataset("tied_transformer", args.num_samples, seed=1)  # synthetic, seeded
    val_set = make_dataset("tied_transformer", args.val_samples, seed=15)  # held out: another seed
    shuffle = torch.Generator()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=RandomSampler(train_set, generator=shuffle))
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    steps_per_epoch = len(train_loader) // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup_steps, total_steps))

    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # a new order every epoch, reproducible
        for i, (inputs, targets) in enumerate(train_loader):
            inputs, targets = inputs.to(device), targets.to(device)
            # One optimizer step's loss is the mean over its micro-batches: each adds its share.
            loss = loss_fn("tied_transformer", model(inputs), targets) / args.accum_steps
            loss.backward()  # adds to the gradients of the micro-batches before it
            if (i + 1) % args.accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()  # the schedule counts optimizer steps
        val_loss = evaluate(model, val_loader, device)
        print(f"epoch {epoch}: val_loss {val_loss:.6f} lr {scheduler.get_last_lr()[0]:.3e}")

    torch.save(model.state_dict(), args.out)  # the head and the embedding: one tensor, two keys
    print(f"wrote {args.out}")


if __name__ == "__main__":
    train()
