# dpbench on a GPU, for reproducing the papers' tables.
#   docker build -t dpbench .
#   docker run --gpus all --ipc=host -v "$PWD/outputs:/workspace/outputs" dpbench
#   docker run --gpus all --ipc=host -v "$PWD/outputs:/workspace/outputs" -v "$PWD/data:/workspace/data" \
#       dpbench -m algo=dpadam,grape dataset=cifar10 model.size=base privacy.epsilon=1,8
# W&B stays offline unless you pass -e WANDB_MODE=online -e WANDB_API_KEY=...; mount
# ~/.cache/huggingface for pretrained RoBERTa/OPT weights (no weights are baked into the image).
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    WANDB_MODE=offline \
    DPBENCH_DATA=/workspace/data \
    PIP_NO_CACHE_DIR=1

WORKDIR /workspace
COPY pyproject.toml README.md ./
COPY dpbench ./dpbench
COPY conf ./conf

# Keep the image's CUDA build of torch/torchvision: pin them as constraints so pip never
# replaces them with another multi-GB wheel while installing dpbench's other dependencies.
RUN python -c "import torch, torchvision; print(f'torch=={torch.__version__.split(\"+\")[0]}'); print(f'torchvision=={torchvision.__version__.split(\"+\")[0]}')" > /tmp/constraints.txt \
 && python -m pip install -c /tmp/constraints.txt . \
 && dpbench --help > /dev/null

ENTRYPOINT ["dpbench"]
