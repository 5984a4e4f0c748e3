"""A tensor-parallel worker process (``processes.WorkerProcess``): ``python -m cb_serve.executor``
with its pickled ``WorkerSpec`` on standard input."""

import logging
import pickle
import sys

from cb_serve.executor.worker import worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(levelname)s %(name)s: %(message)s")
    worker_main(pickle.load(sys.stdin.buffer))
