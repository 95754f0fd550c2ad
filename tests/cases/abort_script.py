"""Run under mpirun: rank ``FAIL_RANK`` raises (main thread or a thread); the others wait in a collective."""
import sys
import threading

import numpy as np

from horovod_compress.runtime import world

mode = sys.argv[1]            # "main" | "thread" | "disabled" | "init_false"
comm = world.FrontEndWorld("horovod.torch").init(
    abort_on_exception=False if mode == "init_false" else None)
if mode in ("disabled", "init_false"):
    print(f"rank {comm.rank} installed={world.abort_on_exception_installed()}", flush=True)
    sys.exit(0)
if comm.rank == comm.size - 1:
    if mode == "main":
        raise RuntimeError("boom from the failing rank")
    t = threading.Thread(target=lambda: 1 / 0, name="hvdc-comm-test")
    t.start()
    t.join()
comm.allreduce(np.ones(4, dtype=np.float32), "sum")   # the others would wait here forever
print("unreachable on the failing rank", flush=True)
