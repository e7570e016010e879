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
- ``elems``: element-wise memory traffic (layer norms, GELU, residuals, attention's
  scores: ``ATTN_SCORE_ELEMS`` per score, cross-entropy over the vocabulary), in
  elements; under tp a block's share on sharded tensors (GELU, the qkv split,
  column-parallel biases: ``TP_SHARDED_ELEMS``) is divided by tp, the rest (layer
  norms, residuals) is replicated; tp > 1 adds the copies of what the block
  all-reduces (``TP_COPY_ELEMS``).
- ``ops``: blocks run (per-operator dispatch overhead dominates small models on CPU).
- ``grad_accum_elems(params, m)``: the element-wise work of accumulating m
  micro-batches' weight gradients (in backward, so part of the micro-batches' time).
Per step (once, whatever the micro-batches):
- ``params`` (AdamW's element-wise update), ``tensors`` (its per-tensor overhead),
  ``seq`` (the runtime's synthetic data source loops over positions),
- ``cold``: the ``elems`` of the step's micro-batches (m times one's) — the per-step
  work (gradient check, AdamW, ``zero_grad``) runs right after them and reads its
  tensors from where their working set evicted them, so it costs more after more
  tokens (measured: see FEATURES_REV),
- ``par_params``: of ``params``, those in tensors of more than ``PAR_GRAIN`` elements,
  whose per-step element-wise passes PyTorch splits over the quota's threads.
There is no constant per step: a constant column was one more unknown that two profiled
modules cannot tell apart from the per-tensor one (docs/estimator.md: the fit swung
between the two); what every step does whatever the model (the runtime's loop, its
progress event) lands on the per-tensor term.
"""

from __future__ import annotations

import numpy as np

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
# Attention's element-wise work per score (the (T, T) matrix of one head, full square):
# the runtime's attention (``F.scaled_dot_product_attention``, causal; on CPU the fused
# flash kernel) scales, masks, exponentiates and sums every score of the causal half
# forward, and recomputes them and forms their gradients backward. Measured per op
# (``python -m bench.op_costs``: torch profiler self time, one thread, 13 shapes of the
# accuracy benchmark's zoo, 2026-12-05): 3.9-12 ns per score forward + backward at
# T >= 32 (20 ns at T = 16; less at longer T, where the kernel's blocks skip more of the
# masked half), net of the attention FLOPs that ``flops`` prices 4.8 element units per
# score (median; one unit = the block's element-wise ops per token and hidden unit / 20,
# 1.16 ns there). It was 2: the D shapes at T = 128 read ~9 % low.
ATTN_SCORE_ELEMS = 5.0
# Gradient accumulation: with m > 1 micro-batches, backward adds each micro-batch's
# weight gradients into ``.grad`` (autograd's ``AccumulateGrad``: an in-place add per
# parameter tensor) m - 1 times per step. Measured per op (``python -m bench.op_costs``:
# ``AccumulateGrad`` + ``add_`` self time, 4 micro-batches against 1, 2026-12-05):
# 0.34-0.86 ns per parameter and extra micro-batch (less for wide tensors), against
# ~0.8 ns per unit of the fitted element-wise rate (``c_elems``): 0.75 units. Unpriced,
# the profiles' several-micro-batch points pulled the per-micro-batch overhead up for
# every other shape.
GRAD_ACCUM_ELEMS = 0.75

# The per-step work is slower after bigger micro-batches. Measured (one thread, the runtime's
# GPT, median of 20 steps, 2026-12-05): gradient check + AdamW + zero_grad of A (2 x 64)
# took 1.79 ms after 128-token micro-batches and 2.38 ms after 2048-token ones; of B
# (4 x 128) 6.52 ms after 64 tokens, 7.80 after 1024 — the same parameters, the same
# work. Touching 64 MB between backward and the check (evicting the caches) made the
# small case 0.14 / 0.59 ms slower: caches (and TLB) refilled after the micro-batches'
# working set are a third to a half of it. It follows the step's tokens more than one
# micro-batch's: 1024 tokens in 4 micro-batches of 256 cost A 2.13 ms (1 x 1024: 2.20,
# 1 x 256: 1.82), B 6.72 (7.30, 6.45) — GPipe holds all m micro-batches' activations
# until their backward — and the re-fit of the stored runs agrees (multi-rank 5.20 ->
# 4.93 % against one micro-batch's). Per step, the profiles' time outside forward +
# backward grew the same way (A 2.15 -> 3.08 ms from 128 to 1024 tokens), which the
# per-step columns could not carry, so the forward + backward rows of the fit pulled
# the per-micro-batch terms off the step times. ``cold`` prices it at a fitted rate per
# element-wise unit of the step's micro-batches, once per step.
# PyTorch's intra-op grain (``at::internal::GRAIN_SIZE``): an element-wise kernel over a
# tensor of more than this many elements runs on the intra-op threads, a smaller one on
# one (``at::parallel_for``: ``numiter > grain_size``, then min(threads, ceil(numel /
# grain)) threads — one at exactly the grain, e.g. B's 256 x 128 embedding and head
# tables, which counted as parallel until features revision 6). The per-step work over
# the parameters (gradient check + AdamW) measured at 1 and 2 threads (2026-12-05, fifth
# session; 20-30 tensors, median of 25 steps): 1000- and
# 8000-element tensors 0.97-0.98x (no speed-up: ~35 us per tensor either way),
# 65536-element ones 1.63x (1.75x net of the per-tensor part), 262144 2.03x, 2^20 1.84x.
# A 2-core profile of B (most parameters in such tensors) spent 5.97 ms outside its
# forward + backward where the 1-core twin spent 7.40; A (none) 2.63 vs 2.73 (run s15e).
PAR_GRAIN = 32768

# Revision of these counts. Fitted coefficients are seconds per unit of *these* counts:
# a fit made under another revision prices other counts (``ComputeFit.features``), and
# the estimator refits such a persisted model from its measurements. Bump it whenever a
# count changes. 2: ATTN_SCORE_ELEMS 2 -> 5, gradient accumulation priced. 3: ``cold``.
# 4: ``par_params``, no constant per step. 5: ``cold`` over the step's micro-batches.
# 6: ``par_params`` counts tensors of more than PAR_GRAIN elements (was: at least).
FEATURES_REV = 6

MB_FEATURES = ("flops", "elems", "ops", "mb")
STEP_FEATURES = ("params", "par_params", "tensors", "seq", "cold")
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
    # ~20 element-wise passes over (tok, h) per block, attention's scores (heads, T, T),
    # cross-entropy (softmax + grad) over the logits, embedding gather/scatter.
    block_elems = 20.0 * h * ((1.0 - TP_SHARDED_ELEMS) + TP_SHARDED_ELEMS / tp) + TP_COPY_ELEMS * h * (tp > 1)
    elems = tok * (layers * (block_elems + ATTN_SCORE_ELEMS * heads * seq / tp) + head * 3.0 * vocab + embed * 2.0 * h)
    ops = layers + 0.5 * (embed + head)
    return {"flops": flops, "elems": elems, "ops": ops + 0.0 * tok, "mb": 1.0 + 0.0 * tok}


def grad_accum_elems(params, micro_batches):
    """Element units of one step's gradient accumulation over ``micro_batches`` on a stage
    of ``params`` parameters (0 for one micro-batch): ``GRAD_ACCUM_ELEMS`` per parameter
    and micro-batch after the first."""
    return GRAD_ACCUM_ELEMS * params * np.maximum(np.asarray(micro_batches, dtype=float) - 1.0, 0.0)


def par_params(layers, hidden, vocab, seq_len, embed, head, tp=1):
    """Of ``stage_params``, the parameters in tensors of more than ``PAR_GRAIN`` elements
    (the blocks' four weight matrices, tp-sharded; the embedding, position and head
    tables). Biases and norms (at most 4 * hidden elements) count as below it: exact
    below hidden 8192."""
    h = np.asarray(hidden, dtype=float)

    def big(n):
        return n * (n > PAR_GRAIN)

    return (layers * (big(3.0 * h * h / tp) + big(h * h / tp) + 2.0 * big(4.0 * h * h / tp))
            + embed * (big(vocab * h) + big(seq_len * h)) + head * big(h * vocab))


def step_features(seq, layers, hidden, vocab, seq_len, embed, head, tp=1, mb_elems=0.0, micro_batches=1):
    """Per-step features of one stage (dict of arrays); ``mb_elems``: the ``elems`` of one
    of its micro-batches (``mb_features``), of which the step runs ``micro_batches``:
    ``cold`` is their product, the element-wise units of the step's micro-batches."""
    step_elems = mb_elems * np.asarray(micro_batches, dtype=float)
    params = stage_params(layers, hidden, vocab, seq_len, embed, head, tp)
    tensors = layers * TENSORS_PER_BLOCK + embed * 2 + head * 4
    return {"params": params, "par_params": par_params(layers, hidden, vocab, seq_len, embed, head, tp) + 0.0 * params,
            "tensors": tensors + 0.0 * params, "seq": seq + 0.0 * params, "cold": step_elems + 0.0 * params}


def activation_bytes(rows, seq, layers, hidden, heads, vocab, head, tp=1):
    """Activation memory kept for backward by one micro-batch on one stage (fp32).

    Korthikanti et al.'s per-layer count (34 s b h + 5 a s^2 b, in 2-byte units for
    fp16) doubled for fp32, tp-sharded parts divided by tp, plus the logits and
    their softmax on the last stage.
    """
    tok = rows * seq
    per_layer = tok * hidden * (10.0 + 24.0 / tp) + 5.0 * heads * seq * tok / tp
    return 2.0 * per_layer * layers + head * 2.0 * tok * vocab * BYTES_PER_ELEM
