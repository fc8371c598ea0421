"""kvcoll's peers in `./dev bench peers`: one adapter per framework, each run in its own venv.

Every adapter trains the same DeepFM on the same batches, read from the files
bench/peers_bench.py writes once (`common.Data`), and reports through `common.report`.
The TFRA and TorchRec adapters import nothing of kvcoll but this package's `common` (numpy
and the standard library only), so they run in venvs that have neither kvcoll nor its
TensorFlow; kvcoll's adapter runs in kvcoll's own .venv.
"""
