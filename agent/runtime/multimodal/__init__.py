"""The ``multimodal`` workload: encoder(s) + projector + GPT trained end to end,
multiplexed two ways.

Parts:
- ``data``     synthetic image/audio-text samples, modality-mix schedule (pure given a seed)
- ``reorder``  grouped reordering for the data loaders (pure)
- ``reshard``  encoder→LLM resharding plans, adaptive encoder:LLM split (pure)
- ``models``   ViT / audio encoders, projectors, the GPT backbone glue
- ``engine``   plain, temporal and colocated (quota'd, pipelined) single-process steps
- ``disagg``   disaggregated encoder/LLM ranks over torch.distributed (also runs coupled)
- ``workload`` ``run(spec, reporter) -> int``, the executor entry point
"""
