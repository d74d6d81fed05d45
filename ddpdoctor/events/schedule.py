"""The sampled-step schedule both sides of the log share.

The runtime takes its expensive checks (fingerprints, per-parameter ready times) at these steps,
and the file writer keeps full per-bucket step records at them (``sinks.compact``): every rank
picks the same step indices, so ranks stay comparable bucket by bucket at every sampled step.
"""

from __future__ import annotations

#: The dense start always reaches this step (0, 1, 3), however short the interval is.
DENSE_AT_LEAST = 4
#: The runtime's default interval of sampled checks (``Options.check_every``), and the interval
#: at which the compact log keeps full step records.
DEFAULT_EVERY = 50


def is_sampled(step: int, every: int) -> bool:
    """Steps 0, 1, 3, 7, 15, ... (2**k - 1) below ``every`` (and always 0, 1, 3), and every
    ``every``-th step.

    A short run is sampled often (a divergence planted after step 5 of 30 is seen at 7 and 15),
    a long one costs one sample per ``every`` steps.
    """
    if step % every == 0:
        return True
    return step < max(every, DENSE_AT_LEAST) and (step + 1) & step == 0


def next_sampled(step: int, every: int) -> int:
    """The first sampled step (``is_sampled``) at or after ``step`` (>= 0)."""
    found = -(-step // every) * every  # the next multiple of ``every``
    dense = (1 << step.bit_length()) - 1  # the next 2**k - 1
    return dense if dense < min(found, max(every, DENSE_AT_LEAST)) else found
