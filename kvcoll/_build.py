"""cffi builder for the C core (API mode).

`setup.py` names this file in `cffi_modules`; `./dev` builds it in place. The
declarations live next to the C headers in `csrc/kvcoll.cdef`, where constants are
written as `...` so the compiler fills their values in: nothing is copied by hand.
"""

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(_HERE), "csrc")
SOURCES = ["kv_status.c", "kv_route.c", "kv_optim.c", "kv_table.c"]

ffibuilder = FFI()
with open(os.path.join(CSRC, "kvcoll.cdef"), encoding="utf-8") as f:
    ffibuilder.cdef(f.read())

ffibuilder.set_source(
    "kvcoll._kvcoll_c",
    '#include "kv_status.h"\n#include "kv_optim.h"\n#include "kv_route.h"\n'
    '#include "kv_table.h"\n',
    sources=[os.path.relpath(os.path.join(CSRC, s)) for s in SOURCES],
    include_dirs=[os.path.relpath(CSRC)],
    extra_compile_args=["-O3", "-std=c99", "-D_GNU_SOURCE", "-fno-strict-aliasing", "-fno-math-errno"],
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
