"""DeepSpeed's CIFAR-10 tutorial, run by dsfunc: only the import changed (and the data loading, see below; and
``.to(model_engine.device)`` where the tutorial writes ``.to(model_engine.local_rank)``, a CUDA index that
the CPU does not take). As in the tutorial, the original ``net`` is evaluated: as in DeepSpeed, it is the
engine's module, trained in place, so after training ``net`` holds the trained weights.

    dsfunc --num_gpus 2 examples/cifar10/train.py --deepspeed_config examples/cifar10/ds_config.json

It reads CIFAR-10 from ``--data_dir`` in the standard python-pickle format (``cifar-10-batches-py/``
with ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``), so torchvision is not needed. Without
it, rank 0 says so (once) and it trains on scikit-learn's bundled 8x8 digits (no download), upsampled to
32x32 RGB so the tutorial's network is unchanged.
"""

import argparse
import os
import pickle
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dsfunc as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--log_interval", type=int, default=0,
                        help="print the running loss every N micro-batches (default: four times an epoch)")
    parser.add_argument("--data_dir", default="./data", help="folder holding cifar-10-batches-py/")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--compare_with_engine", action="store_true",
                        help="also evaluate through the engine (the same weights: net is the engine's module)")
    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def normalize(images):
    """uint8-range images in [0, 1] -> [-1, 1], as the tutorial's Normalize((0.5,) * 3, (0.5,) * 3)."""
    return (images - 0.5) / 0.5


def load_cifar10(folder):
    """(trainset, testset, classes) from CIFAR-10's python pickles, or None when they are not there."""
    root = os.path.join(folder, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not all(os.path.isfile(os.path.join(root, n)) for n in names):
        return None

    def read(name):
        with open(os.path.join(root, name), "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images = torch.from_numpy(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        return normalize(images.float() / 255), torch.tensor(batch[b"labels"], dtype=torch.long)

    parts = [read(n) for n in names[:5]]
    trainset = TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    testset = TensorDataset(*read("test_batch"))
    classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    return trainset, testset, classes


def load_digits():
    """scikit-learn's 1797 8x8 digits as 32x32 RGB images: 1437 to train, 360 to test."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit("the digits fallback needs scikit-learn: `pip install scikit-learn`, or pass --data_dir "
                         "with CIFAR-10's cifar-10-batches-py/ folder") from None

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16
    images = images.repeat_interleave(4, dim=1).repeat_interleave(4, dim=2)  # 8x8 -> 32x32
    images = normalize(images.unsqueeze(1).expand(-1, 3, -1, -1).contiguous())
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    classes = tuple(str(d) for d in range(10))
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test]), classes


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def main():
    args = add_argument()
    if "WORLD_SIZE" in os.environ:  # started by dsfunc, torchrun or mpirun (initialize would also do it)
        deepspeed.init_distributed()
    torch.manual_seed(0)

    data = load_cifar10(args.data_dir)
    if data is None:
        if deepspeed.comm.get_rank() == 0:  # one notice per run, not one per rank
            # one write, newline included: under the launcher's `python -u`, print writes the text and its
            # newline separately, and another process's output could land between them
            sys.stdout.write(f"CIFAR-10 not found in {os.path.abspath(args.data_dir)} (expects cifar-10-batches-py/ "
                             "in the python pickle format); training on scikit-learn's 8x8 digits instead\n")
            sys.stdout.flush()
        data = load_digits()
    trainset, testset, classes = data

    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    # The tutorial's 2000 is longer than an epoch of the digits (and of CIFAR-10 on several ranks): by default,
    # report four times an epoch. Only rank 0 prints; each rank reports its own micro-batches' loss.
    log_interval = args.log_interval or max(1, len(trainloader) // 4)
    rank0 = model_engine.global_rank == 0
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            # get the inputs; data is a list of [inputs, labels]
            inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()

            # print statistics
            running_loss += loss.item()
            if i % log_interval == (log_interval - 1):
                if rank0:
                    print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / log_interval:.3f}", flush=True)
                running_loss = 0.0
    if rank0:
        print("Finished Training")

    # Evaluate with the original `net`, as the tutorial does: the engine trained it in place. (On a GPU the
    # tutorial writes .to(model_engine.local_rank); model_engine.device is that device, and the CPU.)
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)
    correct = 0
    total = 0
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            outputs = net(images.to(model_engine.device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(model_engine.device)).sum().item()
    if rank0:  # every rank evaluated the same weights on the same test set: one report
        print(f"Accuracy of the network on the {total} test images: {100 * correct // total} %")

    class_correct = [0] * len(classes)
    class_total = [0] * len(classes)
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            outputs = net(images.to(model_engine.device))
            _, predicted = torch.max(outputs, 1)
            c = (predicted == labels.to(model_engine.device)).squeeze(0)
            for i in range(len(labels)):
                label = labels[i]
                class_correct[label] += c[i].item()
                class_total[label] += 1
    for i in range(len(classes)):
        if class_total[i] and rank0:
            print(f"Accuracy of {classes[i]:5s} : {100 * class_correct[i] // class_total[i]:2d} %")

    if args.compare_with_engine:
        with torch.no_grad():
            hits = sum((model_engine(x).argmax(1).cpu() == y).sum().item() for x, y in testloader)
        if rank0:
            print(f"Accuracy through the engine on the {total} test images: {100 * hits // total} %")


if __name__ == "__main__":
    main()
