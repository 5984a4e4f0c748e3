"""A tensor-parallel worker process (``processes.WorkerProcess``): ``python -m cb_serve.executor``
with its pickled ``WorkerSpec`` on standard input; or, with ``--forkserver FD``, the server that forks
them (``forkserver.ForkServer``), its requests on the socket ``FD``."""

import logging
import pickle
import sys

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(levelname)s %(name)s: %(message)s")
    if sys.argv[1:2] == ["--forkserver"]:
        from cb_serve.executor.forkserver import serve_forks

        serve_forks(int(sys.argv[2]))
    else:
        from cb_serve.executor.worker import worker_main

        worker_main(pickle.load(sys.stdin.buffer))
