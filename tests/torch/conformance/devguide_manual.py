"""The PyTorch example of SMP v1's developer guide ("Modify a PyTorch Training Script", manual
partitioning): ``smp.init()`` with its configuration from ``SM_HP_MP_PARAMETERS`` (the SageMaker
estimator's ``smp_options``), a model whose ``__init__`` places its layers with ``with
smp.partition(i):`` blocks, the dataset sharded by ``smp.dp_rank()``, ``smp.DistributedModel`` and
``smp.DistributedOptimizer``, an ``@smp.step`` train step returning ``(output, loss)`` and
``loss_mb.reduce_mean()``. Launched under MPI like SageMaker did. The dataset is a synthetic
MNIST-shaped one and each rank writes its per-step losses (``--losses``) for the test.
"""

import argparse
import json

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import Subset, TensorDataset


# smdistributed: Define the model, placing its layers with smp.partition (auto_partition: False)
class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        with smp.partition(0):
            self.conv1 = nn.Conv2d(1, 8, 3, 1)
            self.conv2 = nn.Conv2d(8, 16, 3, 1)
        with smp.partition(1):
            self.fc1 = nn.Linear(2304, 64)
            self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), 1)


def synthetic_mnist(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for i, y in enumerate(labels.tolist()):
        images[i, 0, 2 + 2 * y: 4 + 2 * y, 4:24] += 2.0
    return TensorDataset((images - 0.1307) / 0.3081, labels)


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer, losses):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        # smdistributed: Move input tensors to the GPU ID used by the current process,
        # based on the set_device call.
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        # Return value, loss_mb is a StepOutput object
        _, loss_mb = train_step(model, data, target)
        # smdistributed: Average the loss across microbatches.
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(loss.item())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--losses", default="")
    args = parser.parse_args()

    # smdistributed: initialize the backend (the configuration comes from SM_HP_MP_PARAMETERS)
    smp.init()
    device = torch.device("cpu")  # was: torch.cuda.set_device(smp.local_rank()); torch.device("cuda")
    torch.manual_seed(0)

    dataset = synthetic_mnist(args.samples, 0)
    # smdistributed: Shard the dataset based on data-parallel ranks
    if smp.dp_size() > 1:
        share = len(dataset) // smp.dp_size()
        dataset = Subset(dataset, range(smp.dp_rank() * share, (smp.dp_rank() + 1) * share))
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=32)

    # smdistributed: Use the DistributedModel wrapper to distribute the model
    model = Net()
    model = smp.DistributedModel(model)
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    optimizer = smp.DistributedOptimizer(optimizer)
    losses = []
    train(model, device, train_loader, optimizer, losses)
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"dp_rank": smp.dp_rank(), "losses": losses}, f)


if __name__ == "__main__":
    main()
