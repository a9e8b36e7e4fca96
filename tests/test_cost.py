"""Cost per million tokens and machines for a target load (hand-worked), and the crossover."""

from __future__ import annotations

import pytest

from pipeline.core import hardware, tracking
from pipeline.core.artifacts import CostTarget, PointFigures, Price, Row
from pipeline.core.hardware import Gpu, Profile
from pipeline.core.speedup import Speedup, verdict_of
from pipeline.report import cost, crossover


def _row(max_concurrency: int, tps: float, rps: float, planned: int | None = None) -> Row:
    row = Row(name="int8", recipe="int8", scheme="S", format="int-quantized", precision="int8",
              weight_bytes=1, weight_ratio=0.5, serving="ok")
    row.capacity = {"workload": "capacity", "objective": "o", "outcome": "estimated",
                    tracking.SLO_MAX_CONCURRENCY: max_concurrency,
                    tracking.SLO_CAPACITY_LOW: max(max_concurrency - 2, 0),
                    tracking.SLO_CAPACITY_HIGH: max_concurrency + 3,
                    tracking.SLO_OUTPUT_TOKENS_PER_S: tps,
                    tracking.SLO_OUTPUT_TOKENS_PER_S + "_at_low": tps * 0.8,
                    tracking.SLO_OUTPUT_TOKENS_PER_S + "_at_high": tps * 1.25,
                    tracking.SLO_REQUESTS_PER_S: rps}
    if planned:
        from tests.test_compare import planned as plan_of

        row.plan = plan_of(planned)
    return row


def _price(per_hour: float, devices: int = 1) -> Price:
    return Price(price_per_hour=per_hour, price_per_device_hour=per_hour / devices,
                 devices=devices, example=False, source="test")


def test_cost_per_million_tokens_by_hand():
    # $3.00 an hour at 500 tokens/s: 1.8 M tokens an hour, so $1.666... per million
    assert cost.per_million_tokens(3.0, 500.0) == pytest.approx(3.0 / 1.8)
    figures = cost.figures(_row(10, 500.0, 30.0), CostTarget(), _price(3.0))
    assert figures is not None
    assert figures.usd_per_million_output_tokens == pytest.approx(1.6667, abs=1e-4)
    # the slowest run at the interval's low end (400 tok/s) is the dearest: $2.083; the
    # fastest at its high end (625) $1.333
    assert figures.usd_per_million_output_tokens_max == pytest.approx(3.0 / 1.44)
    assert figures.usd_per_million_output_tokens_min == pytest.approx(3.0 / 2.25)


def test_machines_for_a_target_load_round_up_and_say_what_is_planned():
    target = CostTarget(target_users=105, target_rps=61.0)
    figures = cost.figures(_row(10, 500.0, 30.0, planned=40), target, _price(3.0))
    assert figures is not None
    assert figures.machines_for_target_users == 11  # 105 users / 10 per machine
    assert figures.machines_for_target_rps == 3  # 61 req/s / 30 per machine
    assert figures.planned_devices_for_target_users_kv == 3  # 105 / 40 the KV cache holds


def test_no_capacity_at_the_objective_means_no_cost():
    assert cost.figures(_row(0, 0.0, 0.0), CostTarget(target_users=5), _price(3.0)) is None
    assert cost.figures(Row(name="x", recipe="x", scheme="S", format="f", precision="p",
                            weight_bytes=1, weight_ratio=1.0), CostTarget(), _price(3.0)) is None


FACTS = {"machine": "x86_64", "cpu_model": "x", "cores": 2, "cpu_flags": (),
         "vllm_cpu_isa": "native", "vllm": "0.32"}
H100 = Gpu(name="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability="9.0")


def test_an_eight_gpu_hosts_tp1_run_is_priced_as_one_gpu_and_tp4_as_four():
    node = Profile(target="cuda", **FACTS, gpus=(H100,) * 8)
    one = hardware.serving_devices(node, 1, 1)
    assert one["count"] == 1 and one["host_gpus"] == 8 and not one["mig"]
    priced = cost.price_of(CostTarget(), one)
    assert priced.price_per_hour == 3.0 and priced.example and priced.devices == 1
    assert "1 x h100-80gb's example price_per_device_hour" in priced.source
    four = cost.price_of(CostTarget(), hardware.serving_devices(node, 2, 2))
    assert four.price_per_hour == 12.0 and four.devices == 4
    assert cost.price_text(four) == "$12/h (4 x $3 per device-hour) example price"


def test_a_price_set_is_per_device_hour_and_a_tp4_server_pays_four():
    # one unit on every path: the user's price is per device, times the run's TP x PP GPUs
    node = Profile(target="cuda", **FACTS, gpus=(H100,) * 8)
    one = cost.price_of(CostTarget(price_per_device_hour=3.0), hardware.serving_devices(node))
    tp4 = cost.price_of(CostTarget(price_per_device_hour=3.0),
                        hardware.serving_devices(node, 4, 1))
    assert (one.price_per_hour, one.devices, one.example) == (3.0, 1, False)
    assert (tp4.price_per_hour, tp4.devices) == (12.0, 4)
    assert tp4.source.startswith("4 x PRICE_PER_DEVICE_HOUR")
    assert cost.price_text(tp4) == "$12/h (4 x $3 per device-hour)"
    # the preset path prices the same server the same: $3 per H100-hour either way
    assert cost.price_of(CostTarget(), hardware.serving_devices(node, 4, 1)
                         ).price_per_hour == tp4.price_per_hour
    # a CPU host is one device, priced by the host figure
    host = hardware.serving_devices(Profile(target="cpu", **FACTS))
    assert host["unit"] == "host" and host["count"] == 1
    assert cost.price_of(CostTarget(host_price_per_device_hour=0.2), host
                         ).price_per_hour == 0.2
    assert cost.price_text(cost.price_of(CostTarget(), host)) == "$0.1/h example price"


@pytest.mark.parametrize("old", ["price_per_hour", "host_price_per_hour"])
def test_the_old_price_names_are_refused_naming_the_new(old):
    with pytest.raises(ValueError, match=f"{old} is now {old.replace('hour', 'device_hour')}"):
        CostTarget.model_validate({old: 3.0})


def test_a_mig_slice_says_it_is_priced_as_the_whole_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5d1c-ab")
    devices = hardware.serving_devices(Profile(target="cuda", **FACTS, gpus=(H100,)))
    assert devices["mig"]
    assert "a MIG slice, priced as the whole GPU" in cost.price_of(CostTarget(), devices).source


def test_a_run_recorded_before_runs_kept_their_devices_is_priced_from_its_engine():
    from pipeline.core.artifacts import BenchSummary

    old = BenchSummary(baseline="b", target="cuda", engine={"tensor_parallel_size": 2},
                       hardware={"key": "cuda-h100", "gpus": [
                           {"name": H100.name, "memory_mib": H100.memory_mib}] * 8})
    assert cost.devices_of(old)["count"] == 2
    assert cost.price_of(CostTarget(), cost.devices_of(old)).price_per_hour == 6.0


def _sweep(*points: tuple[int, float, float, float]) -> dict[int, PointFigures]:
    """Load -> a speedup with its interval (point, low, high), as bench records them."""
    return {c: PointFigures(speedup=Speedup(s, lo, hi, 4, 0.95, verdict_of(lo, hi), 0.5))
            for c, s, lo, hi in points}


def test_crossover_is_interpolated_in_log_concurrency():
    # 1.5x at 1, 0.5x at 16: crosses 1 half way in log2, at 4
    sweep = _sweep((1, 1.5, 1.4, 1.6), (16, 0.5, 0.45, 0.55))
    assert crossover.crossings(sweep) == [pytest.approx(4.0)]
    text = crossover.sentence(sweep)
    assert text.startswith("faster than the baseline up to about 4.0 concurrent requests, "
                           "slower beyond")


def test_crossover_says_every_load_only_when_every_interval_agrees():
    assert crossover.sentence(_sweep((1, 0.77, 0.7, 0.8), (4, 0.73, 0.7, 0.76))).startswith(
        "slower than the baseline at every load measured (concurrency 1-4")
    # medians above 1 at both loads, but the interval at 1 straddles it: not "every load"
    unclear = crossover.sentence(_sweep((1, 1.05, 0.95, 1.1), (4, 1.2, 1.1, 1.3)))
    assert "at every load" not in unclear
    assert "inconclusive at 1 (1.05x [0.95, 1.10], n=4)" in unclear
    assert "faster at 4 (1.20x [1.10, 1.30], n=4)" in unclear
    assert crossover.sentence({}) == ""
