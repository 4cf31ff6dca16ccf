# dpbench on a GPU, for reproducing the papers' tables (docs/papers.md).
#   docker build -t dpbench .
#   docker run --gpus all --ipc=host -v "$PWD/outputs:/workspace/outputs" -v "$PWD/data:/workspace/data" \
#       dpbench -m experiment=dpgrape_t7 device=cuda
#   docker run -v "$PWD/outputs:/workspace/outputs" --entrypoint dpbench-report dpbench outputs/multirun/dpgrape_t7
# Every dependency is pinned by constraints.txt (the file CI installs with); torch and torchvision
# are the base image's CUDA build, pinned by the image tag. W&B stays offline unless you pass
# -e WANDB_MODE=online -e WANDB_API_KEY=...; pretrained RoBERTa/OPT weights are not baked in: mount
# a Hugging Face cache at /home/dpbench/.cache/huggingface or pass model.path= / dataset.path=.
# The image runs as the unprivileged user `dpbench` (uid 1000): make mounted folders writable by it.
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    WANDB_MODE=offline \
    DPBENCH_DATA=/workspace/data \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/dpbench
COPY constraints.txt pyproject.toml README.md ./
COPY dpbench ./dpbench
COPY conf ./conf

# Keep the image's CUDA torch/torchvision: replace their pins in the constraints by the installed
# versions, so pip never swaps in another multi-GB wheel.
RUN grep -vE '^(torch|torchvision)==' constraints.txt > /tmp/constraints.txt \
 && python -c "import torch, torchvision; print(f'torch=={torch.__version__.split(\"+\")[0]}'); print(f'torchvision=={torchvision.__version__.split(\"+\")[0]}')" >> /tmp/constraints.txt \
 && python -m pip install --no-cache-dir -c /tmp/constraints.txt . \
 && rm /tmp/constraints.txt \
 && dpbench --help > /dev/null \
 && useradd --create-home --uid 1000 --shell /bin/bash dpbench \
 && mkdir -p /workspace/outputs /workspace/data \
 && chown -R 1000:1000 /workspace

USER 1000:1000
WORKDIR /workspace
ENTRYPOINT ["dpbench"]
