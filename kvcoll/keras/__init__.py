"""Where TensorFlow and Keras come in: the Embedding layer, DistributedOptimizer,
model.fit / evaluate / predict for models with kv.Embedding layers, kv.Trainer and
kv.callbacks.

    embedding.py   kv.Embedding, the layer over a sharded table
    optimizer.py   kv.DistributedOptimizer (a Keras optimizer) and SSP/ASP's dense kernels
    batch.py       a rank's batch checked and normalised (ids per feature, inputs, labels)
    feed.py        a rank's data for fit/evaluate/predict, batch by batch
    engine.py      the one step loop: pull, compiled step, push, global metrics
    fit.py         Keras' fit / evaluate / predict loops on the engine
    trainer.py     kv.Trainer, a step loop of your own on the same engine
    callbacks.py   kv.callbacks: Checkpoint, Export, Evict, TableStats
    dense_state.py a checkpoint's dense part (weights, optimizer state) in names every
                   Keras version reads
    _compat.py     what differs between Keras versions: _which.py picks the Keras
                   (tf.keras's), _keras3.py and _keras2.py adapt Keras 3 and Keras 2,
                   _keras_both.py holds what the two share
    _horovod.py    inside a Horovod job: one MPI world, Horovod's allreduce for the
                   dense gradients (dense_backend="horovod")
"""

from .embedding import Embedding
from .engine import broadcast_variables, engine_of
from .fit import install as _install
from .optimizer import DistributedOptimizer
from .trainer import Trainer

__all__ = ["Embedding", "DistributedOptimizer", "Trainer", "broadcast_variables", "engine_of"]

_install()
