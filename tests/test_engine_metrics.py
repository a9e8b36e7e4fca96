from __future__ import annotations

from pipeline.serve import engine_metrics

METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",\
kv_cache_max_concurrency="45.5",kv_cache_memory_bytes="1073741824",\
kv_cache_size_tokens="46592",num_gpu_blocks="364"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="baseline"} 2048.0
vllm:prefix_cache_hits_total{engine="0",model_name="baseline"} 1536.0
process_resident_memory_bytes 3.1e+09
"""


def test_kv_cache_info_and_prefix_counters_from_metrics() -> None:
    samples = engine_metrics.parse(METRICS)
    info = engine_metrics.kv_cache_info(samples)
    assert info is not None
    assert (info.kv_cache_tokens, info.block_size, info.num_blocks) == (46592, 128, 364)
    assert info.max_concurrency == 45.5 and info.kv_cache_memory_bytes == 2**30
    assert engine_metrics.prefix_cache_counters(samples) == (2048.0, 1536.0)


def test_kv_cache_info_falls_back_to_the_log() -> None:
    log = ("INFO [kv_cache_utils.py:1] CPU KV cache size: 524,288 tokens\n"
           "INFO [kv_cache_utils.py:2] Maximum concurrency for 512 tokens per request: 1024.00x\n")
    info = engine_metrics.kv_cache_info([], log)
    assert info is not None and info.kv_cache_tokens == 524288 and info.max_concurrency == 1024.0
    assert engine_metrics.kv_cache_info([], "nothing here") is None
