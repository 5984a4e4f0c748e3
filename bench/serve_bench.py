"""The serving benchmark, cb-serve and the HF baseline by default: ``cb_serve/benchmarks/serve.py``
(``cb-serve bench serve``, cb-serve alone by default) has the flags and what they measure."""

from cb_serve.benchmarks.serve import main

if __name__ == "__main__":
    main(default_systems="cb-serve,hf")
