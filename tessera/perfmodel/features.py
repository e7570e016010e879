"""Physical features of one rank's share of a GPT training step (pure arithmetic).

Contract: every function takes plain numbers *or* numpy arrays of equal shape (so the
same code serves one estimate and a batch of thousands) and returns the same kind.
Features are counts, not times: the compute model multiplies them by fitted seconds
per unit. They follow ``agent.runtime.model.GPT`` and the runtime's stage split
(``agent.runtime.plan.stage_layers``: earlier stages take the remainder; stage 0
embeds, the last stage runs ``ln_f``, ``head`` and the loss).

Per micro-batch (scale with the rows a rank computes):
- ``flops``: matmul FLOPs of forward + backward (3x forward), attention at half the
  T^2 work (causal), divided by tp for the sharded blocks.
- ``elems``: element-wise memory traffic (layer norms, GELU, softmax, residuals,
  cross-entropy over the vocabulary), in elements; under tp a block's share on
  sharded tensors (GELU, the qkv split, column-parallel biases: ``TP_SHARDED_ELEMS``)
  is divided by tp, the rest (layer norms, residuals) is replicated; tp > 1 adds the
  copies of what the block all-reduces (``TP_COPY_ELEMS``).
- ``ops``: blocks run (per-operator dispatch overhead dominates small models on CPU).
Per step (once, whatever the micro-batches):
- ``params`` (AdamW's element-wise update), ``tensors`` (its per-tensor overhead),
  ``seq`` (the runtime's synthetic data source loops over positions).
"""

from __future__ import annotations


# Parameter tensors of one block (ln1, qkv, proj, ln2, fc, out: weight + bias each).
TENSORS_PER_BLOCK = 12
BYTES_PER_ELEM = 4  # fp32 everywhere in the runtime
# The share of a block's element-wise traffic that tensor parallelism shards: the
# runtime's block (agent.runtime.parallel.tp.TPBlock) at tp=2 moves 0.785x the bytes of
# the full block outside its matmuls (1 - f/2 = 0.785: f = 0.43, counted per aten op
# over forward + backward, the same at hidden 64 and 192; the row-parallel biases'
# separate adds are in it). tests/unit/test_features_tp.py recounts it.
TP_SHARDED_ELEMS = 0.43
# Under tp > 1 the runtime copies every activation it all-reduces in forward and every
# gradient it all-reduces in backward (agent.runtime.parallel.comm: ``_ReduceFromTP``,
# ``_CopyToTP``: ``x.contiguous().clone()``, so that the in-place all-reduce never
# writes an autograd input): 4 copies of (tokens, hidden) per block, read and written —
# 8 elements per token and hidden unit, counted per aten op by tests/unit/test_features_tp.py.
TP_COPY_ELEMS = 8.0

MB_FEATURES = ("flops", "elems", "ops", "mb")
STEP_FEATURES = ("params", "tensors", "seq", "one")
ALL_FEATURES = MB_FEATURES + STEP_FEATURES


def block_params(hidden, tp=1):
    """Parameters of one (tp-sharded) block: 12h^2/tp matmul weights + biases + norms."""
    h = hidden
    return 12 * h * h / tp + (4 * h + 4 * h) / tp + 2 * h + 4 * h


def stage_params(layers, hidden, vocab, seq_len, embed, head, tp=1):
    """Parameters one rank holds for a stage of ``layers`` blocks (0/1 flags embed, head)."""
    h = hidden
    return layers * block_params(h, tp) + embed * (vocab * h + seq_len * h) + head * (2 * h + h * vocab + vocab)


def mb_features(rows, seq, layers, hidden, heads, vocab, embed, head, tp=1):
    """Per-micro-batch features of one stage (dict of arrays); ``rows`` = micro-batch rows."""
    tok = rows * seq
    h = hidden
    flops = 3.0 * 2.0 * tok * (layers * (12.0 * h * h / tp + seq * h / tp) + head * h * vocab)
    # ~20 element-wise passes over (tok, h) per block, softmax over (heads, T, T) / 2,
    # cross-entropy (softmax + grad) over the logits, embedding gather/scatter.
    block_elems = 20.0 * h * ((1.0 - TP_SHARDED_ELEMS) + TP_SHARDED_ELEMS / tp) + TP_COPY_ELEMS * h * (tp > 1)
    elems = tok * (layers * (block_elems + 2.0 * heads * seq / tp) + head * 3.0 * vocab + embed * 2.0 * h)
    ops = layers + 0.5 * (embed + head)
    return {"flops": flops, "elems": elems, "ops": ops + 0.0 * tok, "mb": 1.0 + 0.0 * tok}


def step_features(seq, layers, hidden, vocab, seq_len, embed, head, tp=1):
    """Per-step features of one stage (dict of arrays)."""
    params = stage_params(layers, hidden, vocab, seq_len, embed, head, tp)
    tensors = layers * TENSORS_PER_BLOCK + embed * 2 + head * 4
    return {"params": params, "tensors": tensors + 0.0 * params, "seq": seq + 0.0 * params,
            "one": 1.0 + 0.0 * params}


def activation_bytes(rows, seq, layers, hidden, heads, vocab, head, tp=1):
    """Activation memory kept for backward by one micro-batch on one stage (fp32).

    Korthikanti et al.'s per-layer count (34 s b h + 5 a s^2 b, in 2-byte units for
    fp16) doubled for fp32, tp-sharded parts divided by tp, plus the logits and
    their softmax on the last stage.
    """
    tok = rows * seq
    per_layer = tok * hidden * (10.0 + 24.0 / tp) + 5.0 * heads * seq * tok / tp
    return 2.0 * per_layer * layers + head * 2.0 * tok * vocab * BYTES_PER_ELEM
