"""Which library multiplies activations by a weight on CPU, chosen per call.

PyTorch's CPU ``linear`` / ``mm`` run MKL's sgemm. PyTorch also bundles oneDNN, whose JIT kernels
are chosen from the instruction sets the CPU reports. On an AMD EPYC core with AVX-512 (one thread,
float32) MKL ran 40-50 GMAC/s and oneDNN 100-120 GMAC/s on products of a million multiply-adds and
more, measured one product at a time; oneDNN's fixed cost per call is about 11 µs against MKL's
1-3 µs. A weight of Qwen3-30B-A3B's width (2048 x 1536) took 1.6-3x less time through oneDNN at
every row count from 1 to 1,024.

Inside a decode step of the trained fixture (hidden 128), though, products of 1-8M multiply-adds
that oneDNN ran faster one at a time did not make the step faster: sent to oneDNN, the qkv products
of a batch of 32 (1M each) made the step 5-10% slower, the lm_head's (8M) left it unchanged. So a
product goes to oneDNN from ``ONEDNN_MIN_MACS`` = 8M multiply-adds (a real-width model's attention,
lm_head and busy experts, a prefill's products), when its weight is float32 on CPU and no gradient
is being recorded (oneDNN's linear has no backward here; calibration's gradient passes use MKL).
Both libraries accumulate in float32; their results differ in the last bits, as any two GEMM
blockings do, so a row's logits may differ in the last bits between batches above and below the
threshold.

Dense (non-expert) weights are also held in oneDNN's own blocked layout, packed once at load: this
costs the memory of those weights once more (attention, router, shared expert and lm_head: about 5%
of a fine-grained MoE's parameters), and a packed weight runs faster than a plain one at small row
counts.

Routed experts are most of a MoE's memory, so they are never held twice. A float expert matrix of at
least ``PACK_MIN_ELEMS`` elements is held *only* packed (``Packed``), and every product with it runs
in oneDNN, one row or many. Out of cache (a decode step streams every busy expert's weights),
packed matrices of 2^19 to 2^22 elements (Qwen3-30B-A3B's fc is 2048 x 1536) ran 1.25-1.6x faster
than MKL at one row and 1.9-2.8x at 2 to 8 rows; a plain weight read by oneDNN gained much less at
those row counts, and nothing on the down projection's layout. At 2^16 elements (the trained
fixture's 128 x 512) MKL was faster at one and two rows: oneDNN's fixed cost per call outweighs its
speed there, and the break-even sat near 2^18. A smaller matrix stays plain: MKL runs it, and
oneDNN reads the plain weight from ``EXPERT_MIN_ROWS`` rows and ``ONEDNN_MIN_MACS`` on (a prefill
block). Where a gradient is recorded, a packed matrix is unpacked for the call (an exact copy, the
same MKL product as a plain one), so gradients do not depend on the layout. Calibration reads
expert weights directly and loads its engine with ``pack_experts=False``.

oneDNN builds a kernel for every product shape it has not met before (hundreds of microseconds), so
each oneDNN product runs at a rounded row count (``rows_bucket``): prompts of every length then
reuse a few dozen kernels per weight.

``cpu_matmul="blas"`` (``EmbeddedEngine``) keeps every product on MKL.

An engine that computes in bfloat16 on CPU (``cpu_activations="model"`` for a bfloat16 checkpoint)
has no MKL path to choose: where the CPU has native bfloat16 instructions (AVX512-BF16, AMX) and
oneDNN runs them (``onednn_bf16_available``), every weight, dense and expert, is held packed for
oneDNN in bfloat16 and every product runs there. On the AVX-512 EPYC core above, a packed bfloat16
product ran 2-2.6x faster than the packed float32 one at Qwen3-30B-A3B's widths (1 to 128 rows),
and plain ``F.linear`` in bfloat16 2.4x slower than packed at one row.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .errors import InputError

CPU_MATMUL_MODES = ("auto", "blas")
# What an embedded engine computes in on CPU: float32, or the checkpoint's dtype (see above).
CPU_ACTIVATIONS = ("float32", "model")

# Multiply-adds from which a product goes to oneDNN (see above).
ONEDNN_MIN_MACS = 1 << 23
# Rows from which a routed expert's plain (unpacked) weight runs faster through oneDNN.
EXPERT_MIN_ROWS = 8
# Elements from which a routed expert's float matrix is held packed (see above).
PACK_MIN_ELEMS = 1 << 18
# The row count oneDNN lays a packed weight out for: the fastest of 1 and 32 at every row count from
# 1 to 64 measured.
_PACK_ROWS = 32


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build runs oneDNN's float32 linear on packed and plain weights and
    unpacks a packed weight exactly (checked once, on a small product)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=g), torch.randn(4, 16, generator=g)
        with torch.inference_mode():
            p = _pack(w)
            y = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            z = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            exact = torch.equal(p.to_dense(), w)
        return (exact and torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5)
                and torch.allclose(z, y, rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether this CPU has native bfloat16 instructions and oneDNN runs a packed bfloat16 linear that
    agrees with float32 (checked once, on a small product)."""
    try:
        if not (onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=g).bfloat16(), torch.randn(4, 16, generator=g).bfloat16()
        with torch.inference_mode():
            p = _pack(w)
            y = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            exact = torch.equal(p.to_dense(), w)
        return exact and y.dtype == torch.bfloat16 and torch.allclose(y.float(), x.float() @ w.float().t(),
                                                                       rtol=2e-2, atol=2e-2)
    except (AttributeError, RuntimeError):
        return False


def check_mode(mode: str) -> str:
    if mode not in CPU_MATMUL_MODES:
        raise InputError(f"cpu_matmul must be one of {', '.join(CPU_MATMUL_MODES)}, got {mode!r}")
    return mode


def uses_onednn(mode: str, w: torch.Tensor) -> bool:
    """Whether products with weight ``w`` may go to oneDNN under ``mode``."""
    if mode != "auto" or w.device.type != "cpu" or w.dim() != 2:
        return False
    if w.dtype == torch.bfloat16:
        return onednn_bf16_available()
    return w.dtype == torch.float32 and onednn_available()


def _recording(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


class Dense:
    """A dense weight ``w`` [out, in] and, where oneDNN may run it, its packed copy: ``self(x)`` is
    ``x @ w.T`` through the library this module chooses for the call."""

    __slots__ = ("w", "packed", "_min_numel")

    def __init__(self, w: torch.Tensor, mode: str):
        self.w = w
        self.packed = _pack(w) if uses_onednn(mode, w) else None
        # x.numel() from which a call holds ONEDNN_MIN_MACS multiply-adds (x.numel() * out of them);
        # bfloat16 has no faster library to leave small products to.
        self._min_numel = 0 if w.dtype == torch.bfloat16 else -(-ONEDNN_MIN_MACS // w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self._min_numel and self.packed is not None and not _recording(x):
            return onednn_linear(x, self.packed)
        return F.linear(x, self.w)


def rows_bucket(m: int) -> int:
    """The row count oneDNN runs a product of ``m`` rows at: ``m`` up to 16, else ``m`` rounded up to
    a multiple of 2^(bits(m) - 4), eight steps per doubling (at most 1/8 of the rows padding)."""
    return m if m <= 16 else -(-m >> (m.bit_length() - 4)) << (m.bit_length() - 4)


def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` through oneDNN (``w`` packed, or a plain [out, in] weight or view), its rows padded
    to ``rows_bucket``. oneDNN builds a kernel for every new shape it meets and keeps a bounded cache
    of them: a product of a row count not seen before took 280 us more than a seen one (fixture
    width, 256 rows, against 150 us for the product itself), and a prefill's experts and batches
    meet new row counts all the time. Rounded, a model meets at most about 8 per doubling."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    mb = rows_bucket(m)
    if mb != m:  # the padding rows' outputs are dropped; each output row reads only its own input row
        xp = x2.new_empty(mb, x2.shape[1])
        xp[:m] = x2
        xp[m:].zero_()
        x2 = xp
    y = torch.ops.mkldnn._linear_pointwise(x2, w, None, "none", [], "")
    if mb != m:
        y = y[:m]
    return y.reshape(*shape[:-1], y.shape[-1])


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)


class Packed:
    """A weight [out, in] held only in oneDNN's blocked layout: ``self(x)`` is ``x @ w.T`` through
    oneDNN at any row count, or, where autograd records, through MKL on the weight unpacked for the
    call (exactly ``w``, laid out [in, out] as a plain expert bank holds it, so the product and its
    gradient are the plain bank's bit for bit)."""

    __slots__ = ("p",)

    def __init__(self, w: torch.Tensor):
        self.p = _pack(w)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if _recording(x):
            return torch.matmul(x, self.plain().t().contiguous())
        y = onednn_linear(x, self.p)
        return y if out is None else out.copy_(y)

    def plain(self) -> torch.Tensor:
        """The weight [out, in] in its plain layout (a new tensor)."""
        return self.p.to_dense()


def packs(mode: str, w: torch.Tensor) -> bool:
    """Whether a routed expert's matrix ``w`` [out, in] is held packed under ``mode`` (a bfloat16 one
    whatever its size)."""
    return (w.numel() >= PACK_MIN_ELEMS or w.dtype == torch.bfloat16) and uses_onednn(mode, w)


def dense(w: torch.Tensor | None, mode: str) -> Dense | None:
    return None if w is None else Dense(w, mode)


def mm_t(x: torch.Tensor, w_t: torch.Tensor, onednn: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ ``w_t`` [K, N] (a routed expert's transposed weight), into ``out`` when given:
    through oneDNN (``onednn``: the weight may go there) for at least ``EXPERT_MIN_ROWS`` rows and
    ``ONEDNN_MIN_MACS`` multiply-adds, else MKL."""
    M = x.shape[0]
    if onednn and M >= EXPERT_MIN_ROWS and M * w_t.shape[0] * w_t.shape[1] >= ONEDNN_MIN_MACS and not _recording(x):
        y = onednn_linear(x, w_t.t())
        return y if out is None else out.copy_(y)
    return torch.mm(x, w_t) if out is None else torch.mm(x, w_t, out=out)


def product(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(x, w_t)`` for a weight made on the fly (a quantized format's dequantized weight,
    a quantization search's candidate): a 2-D float32 product on CPU goes through ``mm_t``'s choice,
    anything else through ``torch.matmul``."""
    if x.dim() == 2 and x.dtype == torch.float32 and uses_onednn("auto", w_t):
        return mm_t(x, w_t, True)
    return torch.matmul(x, w_t)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for a plain [N, K] weight made on the fly, as ``product`` chooses."""
    return product(x, w.t())


def matmul_for(mode: str):
    """The ``matmul`` a quantized format's ``linear`` gets under ``mode``: ``product`` ("auto"), or
    ``torch.matmul`` ("blas")."""
    return product if check_mode(mode) == "auto" else torch.matmul
