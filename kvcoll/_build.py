"""cffi builder for the C core (API mode).

`setup.py` names this file in `cffi_modules`; `./dev` builds it in place. Every
`csrc/kv_*.c` is compiled in; the declarations live next to the C headers in
`csrc/*.cdef` (kvcoll.cdef first, then the others by name), where constants are
written as `...` so the compiler fills their values in: nothing is copied by hand.
"""

import glob
import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(_HERE), "csrc")
SOURCES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CSRC, "kv_*.c")))
HEADERS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CSRC, "kv_*.h")))
CDEFS = ["kvcoll.cdef"] + sorted(os.path.basename(p) for p in glob.glob(os.path.join(CSRC, "*.cdef"))
                                 if os.path.basename(p) != "kvcoll.cdef")

ffibuilder = FFI()
for name in CDEFS:
    with open(os.path.join(CSRC, name), encoding="utf-8") as f:
        ffibuilder.cdef(f.read())

ffibuilder.set_source(
    "kvcoll._kvcoll_c",
    "".join(f'#include "{h}"\n' for h in HEADERS),
    sources=[os.path.relpath(os.path.join(CSRC, s)) for s in SOURCES],
    include_dirs=[os.path.relpath(CSRC)],
    # Python's own CFLAGS carry -fwrapv, which stops GCC vectorising the float loops
    # of kv_init and kv_optim (the AVX-512 copy of the initial values ran
    # scalar): -fno-wrapv undoes it. The C core never relies on signed overflow
    # wrapping (its tests run under UBSan without -fwrapv).
    extra_compile_args=["-O3", "-std=c99", "-D_GNU_SOURCE", "-fno-strict-aliasing", "-fno-math-errno",
                        "-fno-wrapv"],
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
