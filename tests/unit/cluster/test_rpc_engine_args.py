"""The split model's llama-server command line from the engine's own params, and each
node's settings from its environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from elbowroom.cluster.agent import node_settings
from elbowroom.config import Settings
from elbowroom.engines.llama_rpc import server_args
from elbowroom.rpc_bind import RpcBindError

xllamacpp = pytest.importorskip("xllamacpp")


def params() -> object:
    p = xllamacpp.CommonParams()
    p.model.path = "/m.gguf"
    p.n_ctx = 2048
    p.n_parallel = 2
    p.kv_unified = False
    p.cache_type_k = xllamacpp.ggml_type.GGML_TYPE_Q8_0
    p.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_Q8_0
    p.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED
    p.cache_ram_mib = 0
    p.hostnames = ["/tmp/x/engine.sock"]
    p.api_keys = ["secret"]
    p.cpuparams.n_threads = 2
    p.verbosity = 0
    return p


def test_server_args_mirror_the_engine_params() -> None:
    args = server_args(params(), Path("/bin/llama-server"), ["127.0.0.1:5", "10.0.0.2:6"], [20, 10])

    def val(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert val("-m") == "/m.gguf" and val("-c") == "2048" and val("--parallel") == "2"
    assert "--no-kv-unified" in args and val("--cache-type-k") == "q8_0" and val("-fa") == "on"
    assert val("--rpc") == "127.0.0.1:5,10.0.0.2:6" and val("--tensor-split") == "20,11"
    assert val("-ngl") == "999" and val("--fit") == "off" and val("--cache-ram") == "0"
    assert val("--host") == "/tmp/x/engine.sock" and val("--api-key") == "secret"
    assert val("-t") == "2" and "-v" not in args
    plain = server_args(params(), Path("/bin/llama-server"), [], [])
    assert "--rpc" not in plain and plain[plain.index("-ngl") + 1] == "0"


def test_server_args_refuse_a_public_rpc_endpoint() -> None:
    with pytest.raises(RpcBindError, match="CVE-2026-34159"):
        server_args(params(), Path("/bin/llama-server"), ["8.8.8.8:50052"], [30])


def test_node_settings_come_from_the_node_environment() -> None:
    head = Settings(override_memory=8 * 1024**3)
    assert node_settings(head, {}).override_memory is None  # the head's value is the head's
    node = node_settings(
        head, {"ELBOWROOM_OVERRIDE_MEMORY": "3GiB", "ELBOWROOM_RPC_HOST": "10.0.0.7"}
    )
    assert node.override_memory == 3 * 1024**3 and node.rpc_host == "10.0.0.7"
