"""cffi builder of the synthetic data generator's own C extension (API mode).

The synthetic CTR set's kernels (csrc/synth/kv_synth.c: id scrambling, samples, the
planted logit) belong to the data generator, not to kvcoll's C core: they build into
`kvcoll.data._kvsynth_c`, apart from `kvcoll._kvcoll_c` (kvcoll/_build.py). `setup.py`
names this file in `cffi_modules`; `./dev` builds it in place.
"""

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "csrc")
SYNTH = os.path.join(CSRC, "synth")

ffibuilder = FFI()
with open(os.path.join(SYNTH, "kv_synth.cdef"), encoding="utf-8") as f:
    ffibuilder.cdef(f.read())

ffibuilder.set_source(
    "kvcoll.data._kvsynth_c",
    '#include "kv_synth.h"\n',
    # kv_status.c: the allocator and status codes it shares with the core (a copy)
    sources=[os.path.relpath(os.path.join(SYNTH, "kv_synth.c")),
             os.path.relpath(os.path.join(CSRC, "kv_status.c"))],
    include_dirs=[os.path.relpath(SYNTH), os.path.relpath(CSRC)],
    # as the core's (kvcoll/_build.py): -fno-wrapv and -fno-math-errno let GCC vectorise
    extra_compile_args=["-O3", "-std=c99", "-D_GNU_SOURCE", "-fno-strict-aliasing",
                        "-fno-math-errno", "-fno-wrapv"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
