"""The Inductor options a captured backward graph compiles with, and the context that sets them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ca_runtime._inductor_buffer_reuse import peak_keeping_reuse
from ca_runtime._inductor_passes import MULTIPLY_OUT_ADD_ALPHA, UNFUSE_LATE_ADDMM
from ca_runtime._torch_interop import inductor_config

__all__ = ["BACKWARD_INDUCTOR_OPTIONS", "backward_inductor_options"]

# [Note: Inductor options for backward graphs]
# Inductor's defaults are tuned for forward graphs. reorder_for_locality moves
# each kernel next to its first consumer; in a backward graph that issues a
# Linear's weight-grad mm before its input-grad mm (eager and AOTAutograd's
# graph have the input grad first). With it off, the MLP of bench/run.py ran
# faster in every interleaved run, and the transformer and the GPT-style
# decoder within noise (figures: bench/LOG.md, 2026-12-01). It changes the order Inductor
# schedules in, not what is computed (results can differ in rounding where
# the order changes a fusion, as with any Inductor setting). The options in
# BACKWARD_INDUCTOR_OPTIONS are set around a captured graph's first run, where
# a torch.compile'd graph compiles (a background compile copies that context),
# for whatever compiler_fn the user gave, except an option the user set
# themselves (in torch._inductor.config or its environment variable; options=
# of torch.compile are applied inside and win anyway). A compile Dynamo makes
# later, during a hit of a torch.compile'd graph (a guard failed, or a frame
# behind a Dynamo graph break compiles), gets them too: see [Note: Compiles
# during a hit keep the backward options] in _dynamo_direct.py.
# Two more keep a backward's peak memory at eager's (without them the bench's
# GPT-style decoder with Inductor held well above eager's peak; figures:
# bench/LOG.md, 2026-12-02):
# post_grad_custom_post_pass is ca_runtime's own pass, see [Note: An
# accumulated mm computed where its inputs are] (_inductor_passes.py), and
# allow_buffer_reuse is on with a rule of ours deciding each reuse, see
# [Note: Buffer reuse that keeps the peak] (_inductor_buffer_reuse.py):
# Inductor's own check kept a dead buffer until a later kernel wrote an
# output of its size, and in a backward the larger grads allocated in between
# (a 512x1536 MLP grad between two 512x384 ones) stacked on it. A user's own
# post_grad_custom_post_pass turns reuse off (ours is keyed by our pass).
# max_fusion_size 512 (Inductor's default 64 nodes per fused kernel): a
# parameter used at every step of an unrolled cell gets a grad reduction per
# step (an LSTMCell's biases: a sum over the batch), which Inductor fuses
# into one kernel at the end as in torch.compile's own backward of the model;
# at 64 it stopped at 29 of the LSTM's 48 steps and ran 19 reductions as
# kernels of their own (69 kernels per run against 49; the peak of live
# tensor bytes went from 0.139 to 0.063 MiB, bench/LOG.md, 2026-12-05).
# size_asserts off drops the assert_size_stride call Inductor's code makes for
# every graph input on every run (437 on the LSTM of bench/run.py, one per
# lifted tensor): what they check, each input's sizes and strides, is what
# Dynamo's guards checked just before, on every call (the OptimizedModule's
# cache lookup, or guard_manager.check in [Note: Calling Dynamo's cached code
# directly]); an input that fails them is recompiled for, never run. A hit of
# the LSTM ran 0.60-0.63x eager without them against 0.665-0.68x with them,
# the gated cell 0.61-0.64x against 0.69x (bench/LOG.md, 2026-12-05).
# post_grad_custom_pre_pass is ours too, for a wrong value, not for speed:
# see [Note: An add's alpha beside an mm] (_inductor_passes.py). A user's
# own pre pass replaces it.
#: Inductor options for a captured backward graph's compile; see the Note above.
BACKWARD_INDUCTOR_OPTIONS: dict[str, object] = {
    "reorder_for_locality": False,
    "allow_buffer_reuse": True,
    "post_grad_custom_post_pass": UNFUSE_LATE_ADDMM,
    "post_grad_custom_pre_pass": MULTIPLY_OUT_ADD_ALPHA,
    "size_asserts": False,
    "max_fusion_size": 512,
}


@contextlib.contextmanager
def backward_inductor_options() -> Iterator[None]:
    """BACKWARD_INDUCTOR_OPTIONS that the user has not set, patched into Inductor's config.

    Through ``_make_closure_patcher``, whose revert leaves an option unset
    again (``config.patch`` would restore it as if the user had set it).
    """
    config: Any = inductor_config()  # a config module: its methods are added at import
    is_default = getattr(config, "_is_default", None)
    unset = {
        name: value for name, value in BACKWARD_INDUCTOR_OPTIONS.items() if is_default and is_default(name)
    }
    # Reuse is ours to decide only with our pass, whose uuid keys Inductor's
    # cache for it; else off (see [Note: Buffer reuse that keeps the peak]).
    keep_peak = unset.get("allow_buffer_reuse") is True and "post_grad_custom_post_pass" in unset
    if "allow_buffer_reuse" in unset and not keep_peak:
        unset["allow_buffer_reuse"] = False
    with peak_keeping_reuse(keep_peak):
        if not unset:
            yield
            return
        revert = config._make_closure_patcher(**unset)()
        try:
            yield
        finally:
            revert()
