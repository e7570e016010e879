"""Parallel training for the GPT workload over ``torch.distributed``.

Parts: ``context`` (process groups from a plan), ``comm`` (timed collectives and the
tensor-parallel autograd operators), ``tp`` (column/row-parallel layers and the
shard/unshard rules by parameter name), ``stage`` (the module one rank holds),
``pipeline`` (GPipe forward/backward and data-parallel gradient averaging).
The rank layout is in ``agent.runtime.plan``.
"""
