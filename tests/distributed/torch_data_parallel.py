"""mha's torch MultiHeadAttention trained by torch's own data-parallel engines, two CPU ranks.

    python tests/distributed/torch_data_parallel.py ddp|fsdp2

spawns two processes (gloo over loopback only). Each takes half of a float64 batch, runs
DistributedDataParallel or FSDP2 (fully_shard) forward and backward and one SGD step, and
compares with a single-process step on the full batch from the same initial weights. Prints one
JSON line: per rank, the largest differences of the gradients and the weights after the step.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mha.backends.torch import MultiHeadAttention

WORLD_SIZE = 2
BATCH_SIZE, STEPS, FEATURES = 8, 5, 8
TIMEOUT = datetime.timedelta(seconds=60)

# FSDP2 warns of every module that returns a view (nn.Linear on a 3-D input does): only an
# in-place op on that output would lose its hook, and nothing here writes to one
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class Model(nn.Module):
    """Causal grouped-query self-attention with rotary positions, and a linear read-out."""

    def __init__(self):
        super().__init__()
        self.attention = MultiHeadAttention(
            16, 4, bias=True, query_size=FEATURES, key_size=FEATURES, value_size=FEATURES,
            num_kv_heads=2, rope_theta=10000.0, dtype="float64",
        )  # fmt: skip
        self.head = nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, X, valid_lens):
        Y = self.attention(X, X, X, valid_lens, causal=True, need_weights=False)
        return self.head(Y).squeeze(-1)


def loss_fn(model, X, valid_lens, target):
    # A mean over the local batch: with equal halves, the engines' average of the two ranks'
    # gradients is the gradient of the mean over the full batch
    return ((model(X, valid_lens) - target) ** 2).mean()


def data():
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(BATCH_SIZE, STEPS, FEATURES, generator=generator, dtype=torch.float64)
    target = torch.randn(BATCH_SIZE, STEPS, generator=generator, dtype=torch.float64)
    valid_lens = torch.tensor([5, 3, 1, 4, 2, 5, 4, 3])
    return X, valid_lens, target


def full(tensor):
    """A plain tensor: FSDP2's parameters and gradients are DTensors sharded over the ranks."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def largest_difference(tensors, expected):
    return max((full(a) - b).abs().max().item() for a, b in zip(tensors, expected, strict=True))


def wrap(model, engine):
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    fully_shard(model.attention, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(rank, engine):
    """This rank's half-batch step under the engine, measured against the single-process one."""
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    model = Model()
    reference, alone = copy.deepcopy(model), copy.deepcopy(model)
    X, valid_lens, target = data()
    half = slice(rank * BATCH_SIZE // WORLD_SIZE, (rank + 1) * BATCH_SIZE // WORLD_SIZE)

    # The single-process step on the full batch, and this rank's half without the engine
    loss_fn(reference, X, valid_lens, target).backward()
    loss_fn(alone, X[half], valid_lens[half], target[half]).backward()
    expected = [p.grad for p in reference.parameters()]

    parallel = wrap(model, engine)
    loss_fn(parallel, X[half], valid_lens[half], target[half]).backward()
    gradients = [p.grad for p in model.parameters()]
    W_q = model.attention.W_q.weight
    result = {
        "engine": type(parallel).__name__,
        "world_size": dist.get_world_size(),
        "local_batch": X[half].shape[0],
        "sharded": [hasattr(p, "full_tensor") for p in model.parameters()],
        # Rows of W_q's weight this rank holds: all 16 under DDP, half under FSDP2
        "local_rows": getattr(W_q, "to_local", lambda: W_q)().shape[0],
        "gradients": largest_difference(gradients, expected),
        "half_batch_alone": largest_difference([p.grad for p in alone.parameters()], expected),
    }

    for module in (model, reference):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        optimizer.step()
    weights = [full(p.detach()) for p in model.parameters()]
    result["weights"] = largest_difference(weights, [p.detach() for p in reference.parameters()])
    # The weights of the other rank, bit for bit
    flat = torch.cat([w.reshape(-1) for w in weights])
    gathered = [torch.empty_like(flat) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, flat)
    result["across_ranks"] = max((g - flat).abs().max().item() for g in gathered)
    return result


def loopback_interface():
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def main(engine):
    # The parent holds the ranks' rendezvous store on a port the system picks: no race for it
    store = dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, f"rank{rank}.json") for rank in range(WORLD_SIZE)]
        try:
            mp.spawn(run_rank, args=(store.port, engine, paths), nprocs=WORLD_SIZE, join=True)
        except mp.ProcessExitedException as error:
            # gloo can abort a rank while tearing down ("terminate called without an active
            # exception"), after every rank wrote its result and passed the barrier: the
            # results stand. A rank that died before its result fails the run.
            if not all(os.path.exists(path) for path in paths):
                raise
            print(f"a rank ended by {error.signal_name} after its result", file=sys.stderr)
        results = []
        for path in paths:
            with open(path) as file:
                results.append(json.load(file))
    print(json.dumps(results))


def run_rank(rank, port, engine, paths):
    # Loopback only: gloo's own connections use the interface named here, not the host name's
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
    try:
        result = step(rank, engine)
        # Whole or absent: written aside, then renamed
        with open(paths[rank] + ".part", "w") as file:
            json.dump(result, file)
        os.replace(paths[rank] + ".part", paths[rank])
        # Neither rank closes its connections while the other still uses them
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
