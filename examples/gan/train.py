"""A two-engine GAN on a ring of eight Gaussians, in the style of DeepSpeed's GAN example: one engine for the
generator, one for the discriminator, the discriminator backpropagating a real and a fake loss before its
step and the generator backpropagating through the discriminator.

    dsfunc --num_gpus 2 examples/gan/train.py --deepspeed_config examples/gan/ds_config.json

It reports how much of the generator's output lands near a mode of the ring, and how many of the eight
modes it covers, before and after training (measured with the generator module itself, which its
engine trains in place).
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dsfunc as deepspeed

MODES = torch.tensor([[math.cos(2 * math.pi * k / 8), math.sin(2 * math.pi * k / 8)] for k in range(8)]) * 2.0
NZ = 8


def get_args():
    parser = argparse.ArgumentParser(description="GAN on a ring of Gaussians")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                                  nn.Linear(128, 1))

    def forward(self, x):
        return self.main(x).squeeze(-1)


def ring(n, generator):
    """``n`` samples of the ring: a random mode plus Gaussian noise of std 0.05."""
    modes = MODES[torch.randint(0, 8, (n,), generator=generator)]
    return modes + 0.05 * torch.randn(n, 2, generator=generator)


def quality(netG, device):
    """(% of samples within 0.2 of a mode, modes that got at least 3% of the samples)."""
    with torch.no_grad():
        samples = netG(torch.randn(2000, NZ, generator=torch.Generator().manual_seed(5)).to(device)).cpu()
    distance, nearest = torch.cdist(samples, MODES).min(dim=1)
    good = distance < 0.2
    covered = sum(int((nearest[good] == k).sum() >= 60) for k in range(8))
    return 100.0 * good.float().mean().item(), covered


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=deepspeed.accelerator.get_accelerator().communication_backend_name())
    torch.manual_seed(0)
    world = deepspeed.comm.get_world_size()
    data = TensorDataset(ring(64 * args.steps * world, torch.Generator().manual_seed(1)))  # one pass, every rank

    netG, netD = Generator(), Discriminator()
    model_engineD, _, dataloader, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                           training_data=data)
    model_engineG, _, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters())
    device = model_engineG.device
    criterion = nn.BCEWithLogitsLoss()
    before = quality(netG, device)

    for i, (real,) in enumerate(dataloader):
        if i == args.steps:
            break
        real = real.to(device)
        batch_size = real.size(0)
        label = torch.full((batch_size,), 1.0, device=device)

        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        model_engineD.zero_grad()
        errD_real = criterion(model_engineD(real), label)
        model_engineD.backward(errD_real)
        noise = torch.randn(batch_size, NZ, device=device)
        fake = model_engineG(noise)
        label.fill_(0.0)
        errD_fake = criterion(model_engineD(fake.detach()), label)
        model_engineD.backward(errD_fake)
        model_engineD.step()

        # (2) Update G: maximize log(D(G(z)))
        model_engineG.zero_grad()
        label.fill_(1.0)  # fake labels are real for the generator cost
        errG = criterion(model_engineD(fake), label)
        model_engineG.backward(errG)
        model_engineG.step()
        if i % 500 == 0 and model_engineG.global_rank == 0:
            print(f"[{i}/{args.steps}] Loss_D: {(errD_real + errD_fake).item():.4f} Loss_G: {errG.item():.4f}",
                  flush=True)

    after = quality(netG, device)
    if model_engineG.global_rank == 0:
        print(f"samples near a mode: {before[0]:.1f} % -> {after[0]:.1f} %; modes covered: {before[1]}/8 -> {after[1]}/8")


if __name__ == "__main__":
    main()
