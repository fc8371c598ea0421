"""kv.callbacks.Publish during fit at any world size: every rank writes its part of each
version (its own rows), rank 0 the serving graph and the dense weights; the tables
rebuilt from the published base and deltas, through the graph, predict what
model.predict predicts (1e-5) after training."""

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_publish_keras import build, data, graph_predict  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.publish import list_versions, read_manifest  # noqa: E402


def test_publish_during_fit(comm, shared_dir):
    import tensorflow as tf

    keras = tf.keras
    d = os.path.join(shared_dir, "pub")
    model = build()
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    x, y = data(64 * comm.size, 1)
    mine = {k: v[comm.rank::comm.size] for k, v in x.items()}
    cb = kv.callbacks.Publish(d, every_n_steps=2, base_every=3)
    model.fit(mine, y[comm.rank::comm.size], batch_size=16, epochs=1, callbacks=[cb],
              verbose=0)
    assert [i.step for i in cb.published] == [2, 4]
    feeds, _ = data(12, 5)
    want = model.predict(feeds, verbose=0)  # a collective: every rank, the whole batch
    comm.barrier()
    if comm.rank == 0:
        m = read_manifest(d, "delta", 2)
        assert m["world_size"] == comm.size
        ranks = {m["files"][f]["rank"] for f in m["files"]}
        assert ranks == set(range(comm.size))
        assert list_versions(d) == {"base": [1], "delta": [2]}
        np.testing.assert_allclose(graph_predict(d, 2, feeds), want, rtol=0, atol=1e-5)
    comm.barrier()
