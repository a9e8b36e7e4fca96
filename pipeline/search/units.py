"""The units a precision search chooses formats for: the layers vLLM runs as one GEMM share a
format, so they are one unit.

The fusions are the model class's ``packed_modules_mapping`` in vLLM (e.g. Llama and Qwen2:
``qkv_proj`` = q, k, v and ``gate_up_proj`` = gate, up), read from vLLM itself, not from a
table here (docs/precision-search.md).
"""

from __future__ import annotations


def fuse(linear_names: list[str], packed: dict[str, list[str]]) -> dict[str, list[str]]:
    """Unit name -> its layers' module names, in model order. A layer named like a member of a
    fused group (``model.layers.0.self_attn.q_proj`` with ``qkv_proj`` = q, k, v) belongs to
    the unit of that group in the same parent (``model.layers.0.self_attn.qkv_proj``); every
    other layer is a unit of its own."""
    member_of = {member: fused for fused, members in packed.items() for member in members}
    units: dict[str, list[str]] = {}
    for name in linear_names:
        parent, _, leaf = name.rpartition(".")
        fused = member_of.get(leaf)
        unit = f"{parent}.{fused}" if fused and parent else name
        units.setdefault(unit, []).append(name)
    return units
