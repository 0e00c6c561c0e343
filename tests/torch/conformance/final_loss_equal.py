"""The shape of SMP v1's own test ``test/torch/mpi_hybrid/test_final_loss_equal.py`` (tp2 x pp2 x ddp).

Kept from the original: every rank seeded differently (smp must broadcast the initial weights),
``smp.set_tensor_parallelism(model.net2.fc1, True)``, ``placement_strategy: spread``, the
interleaved pipeline, Adadelta in ``smp.DistributedOptimizer``, ``smp.amp.GradScaler``, StepLR,
``output_mb.stack()``, a test step returning Python floats, ``smp.allgather(test_loss,
group=smp.DP_GROUP)``, and the checkpoint modes: ``--save-partial-model`` (``local_state_dict`` on
``rdp_rank() == 0``, ``smp.save(partial=True)``), ``--save-full-model`` (``model.state_dict()`` and
``optimizer.state_dict()`` on ``rdp_rank() == 0``, ``smp.save(partial=False)``),
``--partial-checkpoint`` (loaded directly, or in a post-partition hook after deleting
``_smp_load_info["partition_info"]``) and ``--full-checkpoint`` (model only). MNIST is a synthetic
MNIST-shaped set (no download); the original's absolute loss thresholds become "the loss falls".
"""

from __future__ import print_function

import argparse
import json
import math
import random

import numpy as np
import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Subset, TensorDataset


class Net1(nn.Module):
    def __init__(self):
        super(Net1, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        return x


class Net2(nn.Module):
    def __init__(self):
        super(Net2, self).__init__()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        output = F.log_softmax(x, 1)
        return output


class GroupedNet(nn.Module):
    def __init__(self):
        super(GroupedNet, self).__init__()
        self.net1 = Net1()
        self.net2 = Net2()

    def forward(self, x):
        x = self.net1(x)
        x = self.net2(x)
        return x


def synthetic_mnist(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for i, y in enumerate(labels.tolist()):
        images[i, 0, 2 + 2 * y: 4 + 2 * y, 4:24] += 2.0
    return TensorDataset((images - 0.1307) / 0.3081, labels)


@smp.step
def train_step(args, model, scaler, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    scaled_loss = scaler.scale(loss) if args.amp else loss
    model.backward(scaled_loss)
    return output, loss


def train(args, model, scaler, device, train_loader, optimizer, epoch, losses):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output_mb, loss_mb = train_step(args, model, scaler, data, target)
        loss = loss_mb.reduce_mean()
        output = output_mb.stack()
        assert output.shape[0] == args.num_microbatches
        optimizer.step()
        losses.append(loss.item())
        if smp.rank() == 0 and batch_idx % args.log_interval == 0:
            print("Train Epoch: {} [{}/{}]\tLoss: {:.6f}".format(epoch, batch_idx * len(data),
                                                              len(train_loader.dataset), loss.item()))
        if args.num_batches and batch_idx + 1 == args.num_batches:
            break


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
    pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def test(args, model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for batch_idx, (data, target) in enumerate(test_loader):
            data, target = data.to(device), target.to(device)
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
            if args.num_batches and batch_idx + 1 == args.num_batches:
                break
    test_loss /= len(test_loader.dataset)
    if smp.pp_rank() == 0:
        print("\nTest set: Average loss: {:.6f}, Accuracy: {}/{}\n".format(test_loss, correct,
                                                                           len(test_loader.dataset)))
    return test_loss


def test_loss_equal(args, device, test_loss):
    """Equal over the DP group at the start (broadcast) and at the end (allreduce), whatever the seeds."""
    losses = smp.allgather(test_loss, group=smp.DP_GROUP)
    for l in losses:  # noqa: E741
        assert math.isclose(l, losses[0], abs_tol=1e-5), losses


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--test-batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--partial-checkpoint", type=str, default="")
    parser.add_argument("--full-checkpoint", type=str, default="")
    parser.add_argument("--save-full-model", action="store_true", default=False)
    parser.add_argument("--save-partial-model", action="store_true", default=False)
    parser.add_argument("--back_compat", action="store_true", default=False)
    parser.add_argument("--load-in-hook", type=int, default=0)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--num-batches", type=int, default=6)
    parser.add_argument("--num-partitions", type=int, default=2)
    parser.add_argument("--tensor-parallel-degree", type=int, default=2)
    parser.add_argument("--horovod", type=int, default=0)
    parser.add_argument("--overlapping_allreduce", type=int, default=1)
    parser.add_argument("--ddp", type=int, default=1)
    parser.add_argument("--amp", type=int, default=0)
    parser.add_argument("--pipeline", type=str, default="interleaved")
    parser.add_argument("--results", type=str, default="")
    args = parser.parse_args()
    use_ddp = args.ddp > 0
    use_horovod = args.horovod > 0

    cfg = {
        "microbatches": args.num_microbatches,
        "placement_strategy": "spread",
        "pipeline": args.pipeline,
        "optimize": "speed",
        "partitions": args.num_partitions,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "horovod": use_horovod,
        "ddp": use_ddp,
    }
    smp.init(cfg)

    # different seeds for each rank so they initialize params differently
    random.seed(args.seed + smp.rank())
    np.random.seed(args.seed + smp.rank())
    torch.manual_seed(args.seed + smp.rank())

    device = torch.device("cpu")
    kwargs = {"batch_size": args.batch_size, "shuffle": False}
    dataset1 = synthetic_mnist(args.batch_size * args.num_batches * 2, 0)
    if (use_ddp or use_horovod) and smp.dp_size() > 1:
        share = len(dataset1) // smp.dp_size()
        dataset1 = Subset(dataset1, range(smp.dp_rank() * share, (smp.dp_rank() + 1) * share))
    dataset2 = synthetic_mnist(args.test_batch_size * 4, 1)
    train_loader = torch.utils.data.DataLoader(dataset1, **kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **{**kwargs, "batch_size": args.test_batch_size})

    model = GroupedNet()
    if args.tensor_parallel_degree > 1:
        smp.set_tensor_parallelism(model.net2.fc1, True)
    model.to(device)
    model = smp.DistributedModel(model, overlapping_allreduce=args.overlapping_allreduce > 0,
                                 gradient_as_bucket_view=False)
    scaler = smp.amp.GradScaler()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    optimizer = smp.DistributedOptimizer(optimizer)

    if args.partial_checkpoint:
        checkpoint = smp.load(args.partial_checkpoint, partial=True, back_compat=args.back_compat)

        def model_optim_callable(model, optimizer):
            model.load_state_dict(checkpoint["model_state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer_state_dict"])

        if args.load_in_hook:
            # delete partition_info as loading happened after partition
            del checkpoint["model_state_dict"]["_smp_load_info"]["partition_info"]
            model.register_post_partition_hook(model_optim_callable)
        else:
            model_optim_callable(model, optimizer)
    elif args.full_checkpoint:
        checkpoint = smp.load(args.full_checkpoint, partial=False)

        def model_optim_callable(model, optimizer):
            model.load_state_dict(checkpoint["model_state_dict"])
            # do not load optimizer states when loading full checkpoint

        if args.load_in_hook:
            model.register_post_partition_hook(model_optim_callable)
        else:
            model_optim_callable(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    results = {"rank": smp.rank(), "losses": []}
    test_loss = test(args, model, device, test_loader)
    test_loss_equal(args, device, test_loss)
    results["first_test_loss"] = test_loss

    if not (args.partial_checkpoint or args.full_checkpoint):
        for epoch in range(1, args.epochs + 1):
            train(args, model, scaler, device, train_loader, optimizer, epoch, results["losses"])
            test_loss = test(args, model, device, test_loader)
            scheduler.step()
        if args.save_partial_model:
            if smp.rdp_rank() == 0:
                model_dict = model.local_state_dict()
                opt_dict = optimizer.local_state_dict()
                smp.save({"model_state_dict": model_dict, "optimizer_state_dict": opt_dict},
                         "./pt_mnist_checkpoint.pt", partial=True)
        if args.save_full_model:
            if smp.rdp_rank() == 0:
                model_dict = model.state_dict()
                opt_dict = optimizer.state_dict()
                smp.save({"model_state_dict": model_dict, "optimizer_state_dict": opt_dict},
                         "./pt_mnist_checkpoint.pt", partial=False)
        # Waiting the save checkpoint to be finished before run another allgather_object
        smp.barrier()
        test_loss_equal(args, device, test_loss)
    else:  # one more epoch from the loaded state
        train(args, model, scaler, device, train_loader, optimizer, 1, results["losses"])
    results["test_loss"] = test_loss
    if args.results:
        with open(f"{args.results}_{smp.rank()}.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
