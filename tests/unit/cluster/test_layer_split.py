"""The layer split (largest remainder, >= 1 layer per node) and the RPC bind rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from elbowroom.cluster.rpc import rpc_server_args
from elbowroom.cluster.split import SplitError, check_fits, split_layers, tensor_split
from elbowroom.rpc_bind import RpcBindError, check_rpc_bind

GiB = 1024**3


def test_split_is_proportional_with_largest_remainder() -> None:
    s = split_layers(30, {"a": 6 * GiB, "b": 3 * GiB, "c": 1 * GiB})
    assert dict(s.layers) == {"a": 18, "b": 9, "c": 3}
    s = split_layers(10, {"a": 5, "b": 3, "c": 2})  # quotas 5, 3, 2 exactly
    assert dict(s.layers) == {"a": 5, "b": 3, "c": 2}
    s = split_layers(7, {"a": 1, "b": 1, "c": 1})  # 2.33 each: one extra, to the first
    assert sum(s.layers.values()) == 7 and sorted(s.layers.values()) == [2, 2, 3]
    assert s.layers["a"] == 3


def test_remainders_decide_the_leftover_layers() -> None:
    # quotas: 30 * 0.55 = 16.5, 30 * 0.35 = 10.5, 30 * 0.1 = 3.0
    s = split_layers(30, {"a": 55, "b": 35, "c": 10})
    assert dict(s.layers) == {"a": 17, "b": 10, "c": 3}


def test_every_node_gets_at_least_one_layer() -> None:
    s = split_layers(10, {"a": 1000, "b": 1})
    assert dict(s.layers) == {"a": 9, "b": 1}
    assert s.ranges() == {"a": (0, 9), "b": (9, 10)}


@pytest.mark.parametrize("layers", [2, 3, 24, 30, 61])
@pytest.mark.parametrize("free", [{"a": 7, "b": 5}, {"a": 1, "b": 1, "c": 9}, {"x": 3}])
def test_split_always_sums_and_is_monotone(layers: int, free: dict[str, int]) -> None:
    if layers < len(free):
        pytest.skip("fewer layers than nodes")
    s = split_layers(layers, free)
    assert sum(s.layers.values()) == layers
    assert all(n >= 1 for n in s.layers.values())
    for x in free:  # more free memory never means fewer layers
        for y in free:
            if free[x] > free[y]:
                assert s.layers[x] >= s.layers[y]


def test_split_errors_name_the_fix() -> None:
    with pytest.raises(SplitError, match="use fewer nodes"):
        split_layers(1, {"a": 1, "b": 1})
    with pytest.raises(SplitError, match="no free memory"):
        split_layers(4, {"a": 1, "b": 0})
    with pytest.raises(SplitError, match="no node"):
        split_layers(4, {})
    s = split_layers(10, {"a": 5 * GiB, "b": GiB})
    check_fits(s, GiB // 2, {})
    with pytest.raises(SplitError, match="node a would hold"):
        check_fits(s, GiB, {})


def test_tensor_split_in_device_order() -> None:
    s = split_layers(30, {"a": 6, "b": 3, "c": 1})
    assert tensor_split(s, ["c", "a", "b"]) == "3,18,10"  # + the output layer, last
    with pytest.raises(SplitError, match="no device"):
        tensor_split(s, ["a", "b"])


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "10.1.2.3", "192.168.1.20", "172.16.0.5", "::1", "fd00::1"]
)
def test_rpc_binds_to_loopback_and_private(host: str) -> None:
    assert check_rpc_bind(host) == host


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("0.0.0.0", "every interface"),
        ("::", "every interface"),
        ("8.8.8.8", "public"),
        ("169.254.1.1", "public"),
        ("node1.lan", "not an IP"),
    ],
)
def test_rpc_refuses_everything_else(host: str, why: str) -> None:
    with pytest.raises(RpcBindError, match=why) as err:
        check_rpc_bind(host)
    assert "CVE-2026-34159" in str(err.value) or "not an IP" in str(err.value)


def test_rpc_server_command_line() -> None:
    args = rpc_server_args(Path("/bin/rpc-server"), "127.0.0.1", 50052, 2)
    assert args == ["/bin/rpc-server", "--host", "127.0.0.1", "--port", "50052", "-t", "2"]
    with pytest.raises(RpcBindError):
        rpc_server_args(Path("/bin/rpc-server"), "0.0.0.0", 50052)
