"""The int2 format's four levels, in one place below both readers of them: the format itself
(``airquant.quant.int2``: quantize, dequantize, ``Int2Linear``) and its GPU kernels
(``airquant.quant.kernels.int2_triton`` / ``int2_gluon``). ``int2`` calls the kernels, so the kernels
take the levels from here rather than from ``int2`` (no import cycle between ``quant`` and ``quant.kernels``).
"""

from __future__ import annotations

# Lloyd-Max (1960) optimum 4-level quantizer for N(0, 1): centroids and the midpoints between them.
LLOYD_MAX_4 = (-1.5104, -0.4528, 0.4528, 1.5104)
THRESHOLDS = (-0.9816, 0.0, 0.9816)

# The levels as the Triton kernels evaluate them (airquant.quant.kernels.int2_triton), exact because the
# levels are symmetric: an odd cubic of u = code - 1.5, c = CUBIC_A*u + CUBIC_B*u^3 (fit at u = 0.5, 1.5).
CUBIC_B = (LLOYD_MAX_4[3] - 3 * LLOYD_MAX_4[2]) / (3.375 - 3 * 0.125)
CUBIC_A = (LLOYD_MAX_4[2] - 0.125 * CUBIC_B) / 0.5
