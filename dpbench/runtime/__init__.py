"""What runs a run: the machinery around the algorithm's step, apart from the entry points, the
options and the registries at the package root.

    trainer.py          the one training loop (batches, steps, the ledger, evaluation, callbacks)
    checkpoint.py       checkpoint.pt: when it is written, the RNG states, the preemption signals
    algorithm_state.py  an algorithm's state in a checkpoint (what its class declares to keep)
    distributed.py      torchrun ranks: collectives, agreement, collective stops
    sharding.py         train.sharding=fsdp: FSDP2 wrapping, what runs sharded, the shard accumulators
    metering.py         peak memory, state bytes, throughput
    host_syncs.py       counts host syncs per step (the CPU stand-in for a GPU's stalls)
"""
