"""Inductor's buffer reuse in captured backward graphs, only where it cannot raise the peak; see the Note."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

from ca_runtime._torch_interop import InductorReuseCandidate, install_inductor_reuse_rule

# [Note: Buffer reuse that keeps the peak]
# Inductor's code can hand a buffer that died to a later result of its size
# instead of freeing it and allocating anew (allow_buffer_reuse). In a
# small-op backward that is most of its allocations: the LSTM of
# bench/run.py makes 291 per run without reuse and 156 with it (an
# allocation and its free cost about 1 us on the bench machine). Inductor
# allows a reuse that holds the dead buffer's s bytes from its last reader i
# to the new buffer's node j when s plus its estimated peak over i+1..j-1 is
# within its estimated peak of the whole graph. That estimate frees every
# graph input after its last reader; in a captured backward many are not
# freed then (parameters and the views of them that nodes save, which the
# model holds; every saved tensor under retain_graph=True; a tensor the user
# keeps), so its later levels are too low, and a reuse it allowed raised the
# real peak: the bench's GPT-style decoder held a dead 512x384 grad across
# the larger grads of the next MLP block, 0.75 MiB above eager's peak
# (bench/LOG.md, 2026-12-02), and reuse was turned off for our graphs.
#
# Ours allows a reuse only where the real peak cannot rise, whatever holds
# the inputs. Let V(t) be Inductor's estimated level at node t plus the
# bytes of the inputs it has freed by t: the graph's own buffers at t plus
# all its inputs, a constant. The real level R(t) is the graph's own buffers
# (Inductor's code frees them after their last reader, as estimated) plus
# the inputs still really alive, which only ever get fewer. So for nodes
# k <= t, R(t) - R(k) <= V(t) - V(k), and with the reuse the range's levels
# stay at or below a real level already reached at some k <= i when
#     s + max of V over i+1..j-1  <=  max of V over 0..i:
# the graph's own buffers in the range plus the held one do not go above
# what they reached by the free. That is the rule (keeps_peak). A buffer
# allocated right after the node that freed one (j = i+1) always reuses it,
# as in Inductor. On the bench: the decoder's peak stays eager's (4.245
# MiB), the LSTM's allocations go from 291 to 156 (with max_fusion_size,
# [Note: Inductor options for backward graphs]) and the gated cell's from
# 382 to 319; what the rule refuses is a reuse across nodes whose own
# buffers rise above every earlier level.
#
# It applies while a graph of ours compiles with allow_buffer_reuse ours to
# set and post_grad_custom_post_pass ours (so that Inductor's cache keys the
# code by our pass's uuid, which hashes this file too); see
# _backward_inductor_options.py. The flag is a context variable: a
# background compile runs in a copy of the capture's context.

#: Whether the Inductor compile under way on this context is one of our backward graphs with reuse ours to set.
_KEEP_PEAK: contextvars.ContextVar[bool] = contextvars.ContextVar("ca_keep_peak_buffer_reuse", default=False)


#: Per memory plan: the largest V(k) over nodes 0..n for the n + 1 nodes read so far; see keeps_peak.
_reached: weakref.WeakKeyDictionary[object, list[int]] = weakref.WeakKeyDictionary()


def keeps_peak(candidate: InductorReuseCandidate) -> bool:
    """See [Note: Buffer reuse that keeps the peak]."""
    i, j = candidate.freed_after, candidate.allocated_at
    if j <= i + 1:
        return True
    level, freed_by = candidate.estimated_level, candidate.input_bytes_freed_by
    # V(t) = level(t) + freed_by(t - 1): an input counts in the level through its last reader.
    # freed_by never decreases: V over the range is at most its peak level plus freed_by(j - 2),
    # bounded here by freed_by(j - 1).
    in_range = level(i + 1, j - 1) + freed_by(j - 1)
    # The running maximum of V, read once per node. Levels only grow as
    # reuses are taken, and every one kept the real peak, so a maximum read
    # before a later reuse is still one the backward reaches.
    reached = _reached.setdefault(candidate.plan, [])
    while len(reached) <= i:
        k = len(reached)
        reached.append(max(level(k, k) + freed_by(k - 1), reached[-1] if reached else 0))
    return candidate.size + in_range <= reached[i]


@contextlib.contextmanager
def peak_keeping_reuse(applies: bool) -> Iterator[None]:
    """Inductor's reuse decided by keeps_peak in what compiles inside, if ``applies``."""
    if applies:
        install_inductor_reuse_rule(keeps_peak, _KEEP_PEAK.get)
    token = _KEEP_PEAK.set(applies)
    try:
        yield
    finally:
        _KEEP_PEAK.reset(token)
