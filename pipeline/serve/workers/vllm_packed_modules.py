"""The layers vLLM fuses into one GEMM for a model class: its ``packed_modules_mapping``.

Run with the serving environment's Python: ``python vllm_packed_modules.py LlamaForCausalLM``.
Prints one JSON line: ``{"architecture": ..., "packed": {"qkv_proj": ["q_proj", ...]}}``, or
``{"error": ...}`` when vLLM has no such architecture.
"""

import json
import sys


def main(architecture: str) -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(architecture)
    if cls is None:
        print(json.dumps({"error": f"vLLM has no model class {architecture!r}"}))
        return
    packed = getattr(cls, "packed_modules_mapping", None) or {}
    print(json.dumps({"architecture": architecture,
                      "packed": {k: list(v) for k, v in dict(packed).items()}}))


if __name__ == "__main__":
    main(sys.argv[1])
