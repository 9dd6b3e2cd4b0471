#!/usr/bin/env python3
"""Writes tests/fixtures/quant_vectors.json: f32 input rows and their quantisation
- by the `gguf` Python package (`gguf.quants.quantize`, llama.cpp's reference round-to-nearest
  quantisers in numpy) for F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 ("quantized_hex"; MXFP4
  is checked against llama.cpp's bytes too when LIBGGML is set), and
- by llama.cpp itself (`ggml_quantize_chunk` in libggml-base, no importance matrix, i.e. the
  `quantize_row_*_ref` functions) for Q2_K..Q6_K ("kquant_hex"), when LIBGGML points at a
  built libggml-base.so.
ferrum's quantisers must reproduce these bytes exactly.

Usage (from crates/ferrum-quantize; needs gguf, numpy):
  LIBGGML=/path/to/llama.cpp/build/bin/libggml-base.so python3 scripts/make_quant_vectors.py
"""
import ctypes
import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

rng = np.random.default_rng(20240611)
rows = [
    rng.standard_normal(256),                      # weights-like
    rng.uniform(-1.0, 1.0, 256),                   # uniform
    rng.standard_normal(256) * 1e-3 + 2e-3,        # small, offset (f16 scale precision)
    rng.standard_normal(256) * 40.0,               # large
    np.concatenate([np.zeros(32), rng.standard_normal(224)]),  # an all-zero block
    np.round(rng.standard_normal(256) * 8) / 8,    # values on a grid: exact ties
    np.where(rng.random(256) < 0.1, rng.standard_normal(256) * 20, rng.standard_normal(256)),  # outliers
    -np.abs(rng.standard_normal(256)),             # one-signed
]
x = np.stack(rows).astype(np.float32)

types = {
    "F16": T.F16,
    "BF16": T.BF16,
    "Q4_0": T.Q4_0,
    "Q4_1": T.Q4_1,
    "Q5_0": T.Q5_0,
    "Q5_1": T.Q5_1,
    "Q8_0": T.Q8_0,
    "MXFP4": T.MXFP4,
}
out = {
    "rows": x.shape[0],
    "row_len": x.shape[1],
    "input_f32_bits": x.view(np.uint32).reshape(-1).tolist(),
    "quantized_hex": {
        name: quantize(x, t).view(np.uint8).reshape(-1).tobytes().hex() for name, t in types.items()
    },
}
lib_path = os.environ.get("LIBGGML")
if lib_path:
    lib = ctypes.CDLL(lib_path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    out["kquant_hex"] = {}
    for name, t in {"Q2_K": T.Q2_K, "Q3_K": T.Q3_K, "Q4_K": T.Q4_K, "Q5_K": T.Q5_K, "Q6_K": T.Q6_K}.items():
        lib.ggml_quantize_init(int(t))
        buf = ctypes.create_string_buffer(x.size * 4)
        n = lib.ggml_quantize_chunk(int(t), x.ctypes.data, buf, 0, x.shape[0], x.shape[1], None)
        out["kquant_hex"][name] = buf.raw[:n].hex()
    # MXFP4 from llama.cpp too: it must be the bytes gguf-py gave.
    lib.ggml_quantize_init(int(T.MXFP4))
    buf = ctypes.create_string_buffer(x.size * 4)
    n = lib.ggml_quantize_chunk(int(T.MXFP4), x.ctypes.data, buf, 0, x.shape[0], x.shape[1], None)
    assert buf.raw[:n].hex() == out["quantized_hex"]["MXFP4"], "llama.cpp and gguf-py disagree on MXFP4"

here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "..", "tests", "fixtures", "quant_vectors.json")
with open(path, "w") as f:
    json.dump(out, f, separators=(",", ":"))
    f.write("\n")
print("wrote", os.path.normpath(path))
