"""The cost model: restore when cheaper, and learn from measurements."""

from __future__ import annotations

from elbowroom.kvcache.cost import CostModel, Tier


def test_restore_when_cheaper_than_recompute() -> None:
    cost = CostModel({Tier.RAM: 1e9, Tier.DISK: 1e8}, prefill_tps=100.0)
    # 50 MB at 1 GB/s = 0.05 s vs 2000 tokens at 100 tok/s = 20 s
    assert cost.estimate(Tier.RAM, 50_000_000, 2000).restore
    # 50 MB at 100 MB/s = 0.5 s vs 10 tokens = 0.1 s
    assert not cost.estimate(Tier.DISK, 50_000_000, 10).restore


def test_measurements_move_the_rates() -> None:
    cost = CostModel({Tier.RAM: 1e9, Tier.DISK: 1e8}, prefill_tps=100.0)
    for _ in range(30):
        cost.observe_restore(Tier.DISK, 10_000_000, 1.0)  # a slow disk: 10 MB/s
        cost.observe_prefill(10_000, 1.0)  # a fast prefill: 10k tok/s
    assert abs(cost.restore_bps(Tier.DISK) - 1e7) / 1e7 < 0.01
    assert abs(cost.prefill_tps - 1e4) / 1e4 < 0.01
    assert cost.restore_bps(Tier.RAM) == 1e9  # the other tier is untouched
    assert not cost.estimate(Tier.DISK, 50_000_000, 2000).restore


def test_noise_samples_are_ignored() -> None:
    cost = CostModel({Tier.RAM: 1e9, Tier.DISK: 1e8}, prefill_tps=100.0)
    cost.observe_restore(Tier.RAM, 1000, 0.0)
    cost.observe_prefill(0, 1.0)
    cost.observe_prefill(3, 1.0)  # a few tokens time the call overhead, not the prefill
    assert cost.restore_bps(Tier.RAM) == 1e9 and cost.prefill_tps == 100.0
