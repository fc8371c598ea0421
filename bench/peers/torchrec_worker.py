"""TorchRec's side of `./dev bench peers`: DeepFM on an EmbeddingBagCollection, under torchrun.

    .venv-peers/torchrec/bin/python -m torch.distributed.run --nproc-per-node 2 \\
        -m bench.peers.torchrec_worker --data D --out O --steps 300

Runs in its own venv (bench/peers/requirements-torchrec.txt: torch 2.13.0 CPU, torchrec
1.9.2 with FBGEMM's CPU build, fbgemm-gpu-cpu 1.8.0).

The model is the same DeepFM as examples/models.py (per field a row of dim + 1 floats:
column 0 the first-order weight, the rest the FM vector; FM second order; an MLP on the
vectors and numerics; glorot-uniform kernels and zero biases, as Keras' defaults), its
embeddings one `EmbeddingBagCollection` of 26 fixed-size tables (one per field, one id
per sample and field, sum pooling). TorchRec's tables have a fixed number of rows: a
field's ids are taken modulo --table-rows (1M by default), so distinct ids that meet
modulo the table size share a row. --table-rows 0 instead gives each field exactly one
row per distinct id of the training steps (a dictionary built before training, not
timed; unseen eval ids share one extra, untrained row): the same model without
collisions, to measure what they cost.

As TorchRec's DLRM example does it: the embedding parameters get a fused row-wise Adagrad
(`apply_optimizer_in_backward(RowWiseAdagrad)`: FBGEMM's CPU kernel updates the rows
inside the backward pass), the model is sharded by `DistributedModelParallel` with a
plan from `EmbeddingShardingPlanner` (the tables table-wise, FBGEMM's fused
table-batched kernel; over gloo when there are 2 ranks), and the dense weights train
with Adam through a `KeyedOptimizerWrapper`, their gradients averaged by the
DistributedDataParallel that DMP wraps them in. torch's intra-op pool gets --threads
threads, its inter-op pool 1. The tables are created on the meta device and
materialised by DMP (each rank allocates only its own shards); sharded tables initialise
uniformly, so rows start as U(-a, a) with a = sqrt(3) * init_std, the same spread as the
other frameworks' N(0, init_std^2).
"""

from __future__ import annotations

import importlib.metadata
import os
import time

import numpy as np

from . import common


def extra_flags(p) -> None:
    p.add_argument("--table-rows", type=int, default=1_000_000,
                   help="rows per table (ids modulo this); 0: one row per distinct training id")


class _Ids:
    """Field-local ids -> table rows: modulo the table size, or a dictionary."""

    def __init__(self, data: common.Data, table_rows: int, steps: int):
        self.offsets = data.offsets
        self.table_rows = table_rows
        ids = data.train_ids(steps) - self.offsets                 # [n, F] field-local
        self.distinct = [np.unique(ids[:, f]) for f in range(ids.shape[1])]
        self.touched = [np.unique(d % table_rows) if table_rows else d for d in self.distinct]
        self.rows = ([table_rows] * ids.shape[1] if table_rows
                     else [len(d) + 1 for d in self.distinct])    # + 1: unseen ids' row

    def __call__(self, cat: np.ndarray) -> np.ndarray:
        """[n, F] global ids -> [F, n] table rows (feature-major, as a KJT's values)."""
        local = (cat - self.offsets).T
        if self.table_rows:
            return np.ascontiguousarray(local % self.table_rows)
        out = np.empty_like(local)
        for f, d in enumerate(self.distinct):
            pos = np.searchsorted(d, local[f])
            pos[pos == len(d)] = 0
            out[f] = np.where(d[pos] == local[f], pos, len(d))
        return out


def main(argv=None) -> None:
    args = common.parse(argv, extra_flags)
    import torch
    import torch.distributed as dist
    import torchrec
    from torch import nn
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(args.seed)

    data = common.Data(args.data)
    nf, nn_, dim = data.num_fields, data.num_numeric, args.dim
    width = dim + 1
    ids = _Ids(data, args.table_rows, args.warmup + args.steps)
    keys = [f"C{i + 1}" for i in range(nf)]
    a = float(np.sqrt(3.0) * args.init_std)
    tables = [torchrec.EmbeddingBagConfig(
        name=f"t_{k}", embedding_dim=width, num_embeddings=int(ids.rows[i]), feature_names=[k],
        pooling=torchrec.PoolingType.SUM, weight_init_min=-a, weight_init_max=a)
        for i, k in enumerate(keys)]

    class DeepFM(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
            self.numeric_linear = nn.Linear(nn_, 1)
            layers, units = [], nf * dim + nn_
            for h in args.hidden:
                layers += [nn.Linear(units, h), nn.ReLU()]
                units = h
            layers.append(nn.Linear(units, 1))
            self.deep = nn.Sequential(*layers)
            for m in self.modules():
                if isinstance(m, nn.Linear):                      # Keras' defaults
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.zeros_(m.bias)

        def forward(self, kjt, numeric):
            pooled = self.ebc(kjt)
            rows = pooled.values().view(-1, nf, width)            # keys in table order
            first, vecs = rows[:, :, 0], rows[:, :, 1:]
            linear = first.sum(1, keepdim=True) + self.numeric_linear(numeric)
            fm = 0.5 * (vecs.sum(1).square() - vecs.square().sum(1)).sum(1, keepdim=True)
            deep = self.deep(torch.cat([vecs.reshape(-1, nf * dim), numeric], 1))
            return (linear + fm + deep).squeeze(1)

    model = DeepFM()
    _apply_optimizer_in_backward(                                  # fused in FBGEMM's kernel
        torchrec.optim.RowWiseAdagrad, model.ebc.parameters(),
        {"lr": args.sparse_lr, "eps": 1e-7})
    per_rank = common.even_split(data.batch_size, 0, world)[1]
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                                compute_kernels=["fused"]) for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=world, compute_device="cpu"),
        batch_size=per_rank, constraints=constraints)
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(model, None, pg)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    # FBGEMM's row-wise Adagrad has no initial-accumulator setting: its per-row
    # accumulators (momentum1, views of the kernel's own buffer) start at 0. Set them to
    # the value the other frameworks start from.
    for state in model.fused_optimizer.state.values():
        for v in state.values():
            for shard in v.local_shards():
                shard.tensor.fill_(args.sparse_init_accum)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=args.lr, eps=1e-7))
    loss_fn = nn.BCEWithLogitsLoss()

    def inputs(b):
        rows = torch.from_numpy(ids(b["cat"]).reshape(-1))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=rows, lengths=torch.ones(rows.numel(), dtype=torch.int32))
        return kjt, torch.from_numpy(b["num"])

    def step(s):
        b = data.batch(s, rank, world)
        kjt, num = inputs(b)
        loss = loss_fn(model(kjt, num), torch.from_numpy(b["label"]))
        dense.zero_grad()
        loss.backward()                                            # rows updated here
        dense.step()
        return loss.detach()

    model.train()
    for s in range(args.warmup):
        step(s)
    dist.barrier()
    t0 = time.perf_counter()
    losses = [step(s) for s in range(args.warmup, args.warmup + args.steps)]
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = common.peak_rss_bytes()
    held = 0                                                       # rows of this rank's shards
    for v in model.state_dict().values():
        if hasattr(v, "local_shards"):
            held += sum(s.tensor.shape[0] for s in v.local_shards())

    ev = data.eval_part(rank, world)
    chunks = common.eval_chunks(data.eval_size(), world, args.eval_batch)  # same on every rank
    model.eval()
    preds = []
    with torch.no_grad():
        for c in range(chunks):
            lo, hi = common.even_split(len(ev["label"]), c, chunks)
            kjt, num = inputs({k: v[lo:hi] for k, v in ev.items()})
            preds.append(model(kjt, num).numpy())
    sharding = sorted({f"{p.sharding_type}/{p.compute_kernel}" for m in plan.plan.values()
                       for p in m.values()})
    placement = {n: [s.placement.rank() for s in p.sharding_spec.shards]
                 for m in plan.plan.values() for n, p in m.items() if p.sharding_spec}
    config = {
        "model": "DeepFM as examples/models.py, written in torch",
        "tables": (f"{nf} EmbeddingBagConfig tables (sum pooling, one id per sample), "
                   + (f"{args.table_rows:,} rows each: ids modulo {args.table_rows:,}"
                      if args.table_rows else "one row per distinct training id (a dictionary "
                      "made before training) + one row for unseen ids")),
        "sharding": f"DistributedModelParallel, EmbeddingShardingPlanner: {', '.join(sharding)}"
                    + (f" over gloo, {world} ranks" if world > 1 else ", one rank"),
        "placement": placement,
        "training": "a plain loop: forward, loss.backward() (fused row update), Adam step",
        "dense_optimizer": f"torch Adam({args.lr}, eps=1e-7) in KeyedOptimizerWrapper; "
                           "gradients averaged by DDP" ,
        "row_optimizer": (f"torchrec RowWiseAdagrad(lr={args.sparse_lr}, eps=1e-7) applied "
                          "in backward, fused (FBGEMM EXACT_ROWWISE_ADAGRAD, CPU): one "
                          "accumulator per row (the mean of the row's squared gradients), "
                          f"set to {args.sparse_init_accum} after DMP made them (FBGEMM "
                          "starts them at 0 and has no setting for it)"),
        "row_init": f"U(-{a:.4f}, {a:.4f})",
        "threads": f"torch intra-op {args.threads}, inter-op 1",
        "versions": {d: importlib.metadata.version(d)
                     for d in ("torch", "torchrec", "fbgemm-gpu-cpu")},
    }
    common.report(args, framework="torchrec", rank=rank, world=world, seconds=seconds,
                  rows=held, preds=np.concatenate(preds), config=config,
                  train_loss=float(torch.stack(losses).mean()) if losses else float("nan"),
                  peak_rss=peak, rows_touched=int(sum(len(t) for t in ids.touched)),
                  distinct_ids=int(sum(len(d) for d in ids.distinct)),
                  table_rows=args.table_rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
