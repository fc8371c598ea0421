"""kv.export at any world size (the Keras toy model of toy.py on kv.Trainer).

Every rank writes its own part of the embedding dictionary, holding exactly the rows
its shard holds; rank 0 builds the SavedModel from the parts, and the SavedModel,
loaded in a fresh process that imports only TensorFlow, predicts what Trainer.predict
predicts (to 1e-6) on a batch with ids never seen.
"""

import json
import os

import ckpt_driver as drv
import numpy as np

import kvcoll as kv
from kvcoll.routing import OwnerMap, owner_of


def test_parts_and_saved_model(comm, shared_dir):
    tr = drv.make_trainer()
    kv.broadcast_variables(tr.model.variables, root_rank=0)
    for step in range(1, 4):
        drv.train_step(tr, step)
    out = os.path.join(shared_dir, "export")
    info = kv.export(out, tr)
    rows = {n: int(comm.allreduce(np.array([len(t)], np.int64))[0]) for n, t in tr.tables.items()}
    assert info["tables"] == rows and info["parts"] == comm.size
    emb = os.path.join(out, "embeddings")
    with open(os.path.join(emb, "index.json")) as f:
        index = json.load(f)
    assert index["world_size"] == comm.size
    owners = OwnerMap.from_json(index["owners"])  # the map that put each id in its part
    assert owners == OwnerMap.even(comm.size)
    for name, t in tr.tables.items():
        spec = index["tables"][name]
        assert spec["rows"] == rows[name] == sum(p["rows"] for p in spec["parts"])
        part = spec["parts"][comm.rank]
        ids = np.load(os.path.join(emb, part["ids"]))
        vecs = np.load(os.path.join(emb, part["vectors"]))
        assert part["rank"] == comm.rank and ids.size == part["rows"] == len(t)
        assert (owner_of(ids, owners) == comm.rank).all() and np.unique(ids).size == ids.size
        np.testing.assert_array_equal(vecs, t.find(ids))
    feats = drv.serving_features()
    want = tr.predict(feats)  # every rank: the whole batch
    if comm.rank == 0:
        work = os.path.join(shared_dir, "serve")
        os.mkdir(work)
        got, imported = drv.serve_with_tensorflow_alone(os.path.join(out, "saved_model"),
                                                        feats, work)
        assert not [m for m in imported if m.split(".")[0] in ("kvcoll", "mpi4py")], imported
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    comm.barrier()
    tr.close()
