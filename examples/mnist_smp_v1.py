"""An SMP v1 MNIST script (the shape of AWS's pt_mnist.py) running on smp: only the import changed,
the CUDA calls are gone (CPU ranks) and the data is MNIST-sized synthetic digits (no download).

    torchrun --nproc-per-node 4 examples/mnist_smp_v1.py --epochs 2

Config as in the AWS example: 2 partitions, 4 microbatches, `spread` placement, `interleaved`,
optimize speed, ddp (so 4 ranks = 2 pipelines x 2 data-parallel replicas).
"""

from __future__ import annotations

import argparse
import json
import os

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Net1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return F.max_pool2d(x, 2)


class Net2(nn.Module):
    def __init__(self, dropout: float = 0.5) -> None:
        super().__init__()
        self.dropout2 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), 1)


class GroupedNet(nn.Module):
    def __init__(self, dropout: float = 0.5) -> None:
        super().__init__()
        self.net1 = Net1()
        self.net2 = Net2(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


def synthetic_mnist(n: int, seed: int) -> TensorDataset:
    """Digits drawn as bars at a class-dependent position, plus noise: learnable, MNIST-shaped."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for i, y in enumerate(labels.tolist()):
        images[i, 0, 2 + 2 * y: 4 + 2 * y, 4:24] += 2.0
    return TensorDataset((images - 0.1307) / 0.3081, labels)


class SplitDataset(Dataset):  # as in pt_mnist.py: each DP rank reads its own share
    def __init__(self, dataset: Dataset, partitions: dict[int, float]) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        start = int(sum(v for k, v in partitions.items() if k < smp.dp_rank()) * size)
        self.indices = list(range(start, start + int(partitions[smp.dp_rank()] * size)))
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> object:
        return self.dataset[self.indices[i]]


@smp.step
def train_step(model: smp.DistributedModel, scaler: smp.amp.GradScaler, data: torch.Tensor,
               target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(scaler.scale(loss))
    return output, loss


@smp.step
def test_step(model: smp.DistributedModel, data: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--save", default="")
    # For comparing with one process (tests/torch/test_smp_v1_scripts.py): dropout masks and the
    # shuffled order depend on each rank's generator, so a comparison turns both off.
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--no-shuffle", action="store_true")
    parser.add_argument("--losses", default="", help="write each rank's per-step train losses to LOSSES_<rank>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    smp.init({"partitions": 2, "microbatches": 4, "placement_strategy": "spread", "pipeline": "interleaved",
              "optimize": "speed", "ddp": True})
    torch.manual_seed(1 + smp.dp_rank())
    fraction = 1.0 / smp.dp_size()
    partitions = {i: fraction for i in range(smp.dp_size())}
    train_loader = DataLoader(SplitDataset(synthetic_mnist(args.samples, 0), partitions), batch_size=args.batch_size,
                              shuffle=not args.no_shuffle, drop_last=True)
    test_loader = DataLoader(SplitDataset(synthetic_mnist(args.samples // 4, 1), partitions),
                             batch_size=args.batch_size, drop_last=True)

    model = smp.DistributedModel(GroupedNet(args.dropout))
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(optim.Adadelta(model.parameters(), lr=args.lr))
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    every_loss: list[float] = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for data, target in train_loader:
            optimizer.zero_grad()
            _, loss_mb = train_step(model, scaler, data, target)
            loss = loss_mb.reduce_mean()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        every_loss += losses
        model.eval()
        test_loss, correct, seen = 0.0, 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                loss_batch, correct_batch = test_step(model, data, target)
                test_loss += sum(loss_batch)
                correct += sum(correct_batch)
                seen += len(data)
        scheduler.step()
        if smp.rank() == 0:
            print(f"epoch {epoch}: train loss {sum(losses) / len(losses):.4f} (first {losses[0]:.4f}, last "
                  f"{losses[-1]:.4f}), test loss {test_loss / seen:.4f}, accuracy {correct / seen:.3f}", flush=True)
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"dp_rank": smp.dp_rank(), "losses": every_loss}, f)
    if args.save and smp.dp_rank() == 0:
        smp.save({"model_state_dict": model.local_state_dict(), "optimizer_state_dict": optimizer.local_state_dict()},
                 os.path.join(args.save, "mnist_checkpoint"), partial=True)
    smp.barrier()


if __name__ == "__main__":
    main()
