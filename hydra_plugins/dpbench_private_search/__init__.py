"""dpbench's private random hyperparameter search, a Hydra sweeper (`hydra/sweeper=private_search`).

Hydra finds sweepers by importing every module under the `hydra_plugins` namespace package (which
therefore has no __init__.py); `private_search.py` stores `PrivateSearchConf` in Hydra's ConfigStore.
It hands over to dpbench/study/ (sweep.py), where the study and its privacy arithmetic live.
"""
