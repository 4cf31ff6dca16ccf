"""An offline check of a GPU node in one command (docs/gpu-check.md).

    python -m dpbench.tools.gpu_check wheelhouse DIR      # where the package registry is reachable
    sh DIR/gpu-check.sh [--out FILE]                      # on the node, offline: install, then check
    python -m dpbench.tools.gpu_check run --cpu           # the same pipeline at tiny shapes on the CPU

    wheelhouse.py  the wheelhouse and the node's offline install (standard library only)
    check.py       doctor, the engines against Opacus's, the published points; JSON and tables
    points.py      the published points: stand-in model and data, measurement, the oracle's prediction
"""
