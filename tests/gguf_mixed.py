"""A copy of the embedded GGUF with its tensors re-quantized into several formats, as
llama.cpp's K-quant mixes are (a Q4_K_M of this model holds Q5_0, Q8_0, Q4_K and Q6_K): so
that the packed path's mixed projections (q/k/v in two formats) run end to end in the tests
without llama.cpp. gguf-py writes it (``GGUFWriter``) and quantizes (``gguf.quants``)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

MIX = {
    "attn_q": "Q5_0",
    "attn_k": "Q5_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q5_1",
    "ffn_up": "Q5_1",
    "ffn_down": "Q4_1",
}
"""Format of each layer tensor kind (every layer alike); the rest stay as stored."""


def write_mixed_gguf(src: Path, out: Path) -> Path:
    """Write ``src`` with the layer tensors re-quantized per :data:`MIX` into ``out``
    (kept if it exists); ``out``."""
    if out.is_file():
        return out
    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        parts = t.name.split(".")
        target = MIX.get(parts[2]) if t.name.startswith("blk.") else None
        if target is None:
            data, qtype = np.asarray(t.data), t.tensor_type
        else:
            rows = int(t.shape[1])
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, -1)
            qtype = gguf.GGMLQuantizationType[target]
            data = gguf.quants.quantize(values.astype(np.float32), qtype)
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    tmp.replace(out)
    return out
