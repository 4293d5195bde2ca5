"""Random LoRA adapters for the tiny model (router/tools/enginefleet/model.py), written here, no
download.

An adapter is a PEFT directory: `adapter_config.json` and `adapter_model.safetensors` holding
`lora_A` (rank x in) and `lora_B` (out x rank) for each layer's `q_proj`, `k_proj`, `v_proj` and
`o_proj`, small random float32 values from a seed (the same bytes for the same name and seed).
safetensors is a JSON header after its 8-byte little-endian length, then the raw tensors: written
by hand, so neither torch nor numpy is needed outside the engines' own venv. vLLM loads it with
`--enable-lora --max-lora-rank >= RANK` (`--lora-modules NAME=DIR`, or at run time).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import sys
import tempfile
from array import array
from pathlib import Path

from router.tools.enginefleet.model import CONFIG

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_READY = ".complete"


def _shapes() -> dict[str, tuple[int, int]]:
    hidden = int(CONFIG["hidden_size"])
    heads, kv_heads = int(CONFIG["num_attention_heads"]), int(CONFIG["num_key_value_heads"])
    head_dim = int(CONFIG["head_dim"])
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    out: dict[str, tuple[int, int]] = {}
    for layer in range(int(CONFIG["num_hidden_layers"])):
        for target in TARGETS:
            fan_in, fan_out = dims[target]
            stem = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            out[f"{stem}.lora_A.weight"] = (RANK, fan_in)
            out[f"{stem}.lora_B.weight"] = (fan_out, RANK)
    return out


def safetensors(tensors: dict[str, tuple[tuple[int, int], bytes]]) -> bytes:
    """The safetensors encoding of float32 tensors: name -> (shape, little-endian bytes)."""
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw + b"".join(d for _, d in tensors.values())


def write_adapter(cache: Path, name: str, base_model: Path | str, seed: int = 0) -> Path:
    """The adapter directory `cache/name` (written if absent, atomically); its path."""
    final = cache / name
    if (final / _READY).exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{name}:{seed}")
    tensors: dict[str, tuple[tuple[int, int], bytes]] = {}
    for key, (rows, cols) in _shapes().items():
        values = array("f", (rng.uniform(-0.05, 0.05) for _ in range(rows * cols)))
        if values.itemsize != 4:
            raise RuntimeError("float32 arrays are not 4 bytes here")
        tensors[key] = (
            (rows, cols),
            values.tobytes() if sys.byteorder == "little" else _swap(values),
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": str(base_model),
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "adapter_model.safetensors").write_bytes(safetensors(tensors))
        (tmp / _READY).write_text(name + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another writer got there first
            if not (final / _READY).exists():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _swap(values: array[float]) -> bytes:
    copy = array("f", values)
    copy.byteswap()
    return copy.tobytes()
