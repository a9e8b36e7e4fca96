"""Which kernel library vLLM's CPU build loads here, and which ops it holds.

Run with the serving environment's Python (only vLLM and torch are imported), in the same
environment a vLLM server gets (so a forced ISA applies). Prints one JSON line:
``{"library": "_C_AVX2", "ops": ["cpu_gemm_wna16", ...]}``.
"""

import json


def main() -> None:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if torch.cpu._is_avx512_supported():
        library = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        library = "_C_AVX2"
    ops = sorted({name.split("::", 1)[1].split(".", 1)[0]
                  for name in torch._C._dispatch_get_all_op_names() if name.startswith("_C::")})
    print(json.dumps({"library": library, "ops": ops}))


if __name__ == "__main__":
    main()
