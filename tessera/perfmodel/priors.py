"""Prior uncertainties of the performance model (relative, 1 sigma), added where the
data cannot speak, and the confidence they turn into. Shared by the composed ``gpt``
estimates (``model``) and the profiled-workload ones (``workload``)."""

from __future__ import annotations

import math

EXTRAP_PER_LOG = 0.04   # per natural-log unit of extrapolation outside the profiled box
UNSEEN_MODULE = 0.02    # a module never profiled itself (a curve fitted on others)
COLOCATION = 0.04       # a colocation mode fitted from few pairs
RUN_TO_RUN = 0.03       # another run of the same configuration differs by ~3% (placement, host)
# A new measurement and the estimate (fitted from profiles measured the same way) each
# carry the host's measurement noise (ComputeFit.noise): their difference ~sqrt(2) of it.
NOISE_TO_ERROR = 2 ** 0.5
CONF_TOLERANCE = 0.10   # confidence = P(|relative error| < 10%) under a normal error


def confidence(rel_std: float) -> float:
    """P(|relative error| < CONF_TOLERANCE) for a normal error of ``rel_std``, in [0, 1]."""
    if rel_std <= 0:
        return 1.0
    return min(1.0, max(0.0, math.erf(CONF_TOLERANCE / (math.sqrt(2.0) * rel_std))))
