"""Where TensorFlow and Keras come in: kv.Model / kv.distribute (Keras drives kvcoll's
step loop, per model), the Embedding layer, DistributedOptimizer, kv.Trainer,
kv.save / kv.restore and kv.callbacks.

    model.py       kv.Model and kv.distribute: the step functions Keras' fit, evaluate
                   and predict call, and what those loops agree on over ranks
    engine.py      one model's kvcoll state: tables, the compute, the step loop
    trace.py       the batches' layout agreed over ranks; which input feeds which table
    compute.py     the model's side of a step: the compiled forward and backward, the
                   dense optimizer's apply, the metrics' state
    embedding.py   kv.Embedding, the layer over a sharded table
    optimizer.py   kv.DistributedOptimizer (a Keras optimizer) and SSP/ASP's dense kernels
    batch.py       a rank's batch checked and normalised (ids per feature, inputs, labels)
    feed.py        helpers on a rank's arrays (validation split, class weights)
    trainer.py     kv.Trainer, a step loop of your own on the same engine
    saving.py      kv.save / kv.restore (kvcoll.checkpoint's Checkpointer + DenseState)
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
from .model import Model, distribute
from .optimizer import DistributedOptimizer
from .trainer import Trainer

__all__ = ["Model", "distribute", "Embedding", "DistributedOptimizer", "Trainer",
           "broadcast_variables", "engine_of"]
