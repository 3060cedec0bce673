# The course in a container, for macOS and Windows (no Triton wheels there) or any machine with
# Docker or Podman. There is no GPU in here: the package runs its Triton kernels in Triton's CPU
# interpreter, exactly as on a laptop without a GPU.
#
#   docker build -t flashattn-course .
#   docker run --rm -it -p 8888:8888 flashattn-course      # JupyterLab: open the
#                                                           # http://127.0.0.1:8888/lab?token=... line it prints
#   docker run --rm flashattn-course pytest                 # the tests (about 3 min on 2 cores)
#
# Apple Silicon should build natively (linux/arm64): PyPI has triton 3.7.1 for manylinux_2_28_aarch64
# and PyTorch's CPU index carries aarch64 wheels. Failing that: docker build --platform linux/amd64.

ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# PyTorch's CPU-only build (about 190 MB) rather than PyPI's default, which on Linux is the CUDA
# build (about 2.7 GB with its nvidia-* wheels) and of no use without a GPU.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0
# The CPU build of torch pins no Triton (pip would take the newest); this is the one that
# torch 2.13.0's PyPI build pins, i.e. what a Linux learner gets from the README's command.
ARG TRITON_SPEC=triton==3.7.1
# Extras of pyproject.toml to install, comma-separated: the learner's (course) and the tests'.
# Not `instructor`: nbgrader's menus in a learner's JupyterLab only confuse (INSTRUCTORS.md).
ARG EXTRAS=course,test
# Debian packages to add, e.g. git (the dev container asks for it); none by default.
ARG APT_PACKAGES=

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN if [ -n "$APT_PACKAGES" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $APT_PACKAGES \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && useradd --create-home --uid 1000 --shell /bin/bash learner \
 && python3 -m venv /opt/venv \
 && mkdir /course \
 && chown -R learner:learner /opt/venv /course

# Everything below runs as the learner, who owns the venv (so `pip install` works later) and the
# course files (so notebooks can be saved).
USER learner
WORKDIR /course

# The two big wheels first, in their own layer: editing the course does not download them again.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && pip install --no-cache-dir "$TRITON_SPEC"

COPY --chown=learner:learner . /course

RUN echo "installing the package with extras [$EXTRAS]" \
 && pip install --no-cache-dir -e ".[$EXTRAS]" "$TRITON_SPEC" \
 && python3 -c "import flashattn, jupyterlab, pytest, xdist, nbval, torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| interpreter:', flashattn.runtime.INTERPRET)"

EXPOSE 8888
# JupyterLab at the repository's root, on the first lesson, reachable from the host through
# `-p 8888:8888`. It prints a URL with a fresh token; `-e JUPYTER_TOKEN=<something>` fixes it.
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", \
     "--LabApp.default_url=/lab/tree/notebooks/01_matrix_gradients.ipynb"]
