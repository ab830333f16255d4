"""`python -m fo_jax.offload.ffi {cpu,cuda} [--jaxlib VERSION] [--out PATH]`: build the host-copy
libraries (fo_jax.offload.ffi.library)."""

import sys

from fo_jax.offload.ffi.library import main

sys.exit(main())
