"""ccl.train on one rank: synchronize a torch model and its optimizer state
from the last rank, then train with DistributedOptimizer on this rank's
share of a data set; prints a digest of the parameters and the parameters'
distance to a one-process reference on the whole data."""

import hashlib

import torch

import ccl
from ccl.train import DistributedDataContainer, DistributedOptimizer, synchronize, total_workers

comm = ccl.Communicator()
rank, n = comm.rank, total_workers(comm)
root = n - 1


def model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


g = torch.Generator().manual_seed(5)
x = torch.randn(96, 8, generator=g)
y = x.sum(dim=1, keepdim=True).sin()

# Every rank starts elsewhere; one step gives the optimizer some state.
model, opt = model_and_opt(100 + rank)
torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
opt.step()
synchronize(model, comm, root=root)
synchronize(opt, comm, root=root)
dopt = DistributedOptimizer(opt, comm)

# The reference: the root's start, full batches of the whole data.
ref, ref_opt = model_and_opt(100 + root)
torch.nn.functional.mse_loss(ref(x[:4]), y[:4]).backward()
ref_opt.step()

data = DistributedDataContainer(list(range(len(x))), comm)  # 96 = an equal share for 1-4 ranks
for epoch in range(5):
    data.set_epoch(epoch)
    mine = torch.tensor(data.indices)
    dopt.zero_grad()
    torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    dopt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()

h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
print(f"rank {rank} digest {h.hexdigest()[:16]} gap {gap:.3e}", flush=True)
