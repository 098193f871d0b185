"""A small CPU PyTorch training loop (eager, DataLoader, nn.Module, Adam) for the Python channel.

Runs for argv[1] seconds (default 60); one thread so the phases are easy to see on two cores.
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    def forward(self, x):
        return self.body(x)


def main() -> None:
    run_for = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
    loader = DataLoader(data, batch_size=128, shuffle=True)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    end = time.monotonic() + run_for
    while time.monotonic() < end:
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if time.monotonic() >= end:
                break


if __name__ == "__main__":
    main()
