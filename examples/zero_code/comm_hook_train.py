"""Plain DDP with its own communication hook, no ddpdoctor in it (run under torchrun).

``ddpdoctor run`` times every bucket through the user's hook: the hook keeps being the one that
reduces the gradients (this script counts its calls and prints them).

    ddpdoctor run --run-dir runs/hook -- torchrun --standalone --nproc-per-node 2 \\
        examples/zero_code/comm_hook_train.py
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at runtime.
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import DistributedDataParallel


class CountingState:
    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce(state: CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks, as DDP's default would, and count the calls."""
    state.calls += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = train(args.steps)
    print(f"rank {dist.get_rank()} hook calls {state.calls}", flush=True)
    dist.destroy_process_group()


def train(steps: int) -> CountingState:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)
    state = CountingState()
    model.register_comm_hook(state, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        loss = nn.functional.cross_entropy(
            model(torch.randn(8, 32, generator=gen)), torch.randint(0, 10, (8,), generator=gen)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return state


if __name__ == "__main__":
    main()
