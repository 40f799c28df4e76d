from pathlib import Path

import pytest

from elbowroom.config import ConfigError, Settings, load_settings
from elbowroom.units import GiB, MiB


def test_defaults_without_any_source(tmp_path: Path) -> None:
    s = load_settings({}, environ={"HOME": str(tmp_path)}, config_file=None)
    assert s.host == "127.0.0.1"
    assert s.port == 8000
    assert s.keep_alive == 300.0
    assert s.override_memory is None
    assert s.max_upload == 25 * MiB


def test_precedence_flags_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('port = 9000\nkeep_alive = 10\noverride_memory = "2GiB"\nkv_type = "q8_0"\n')
    env = {"ELBOWROOM_PORT": "9100", "ELBOWROOM_OVERRIDE_MEMORY": "8GiB"}
    s = load_settings({"port": 9200, "host": None}, environ=env, config_file=toml)
    assert s.port == 9200  # flag wins
    assert s.override_memory == 8 * GiB  # env beats toml
    assert s.keep_alive == 10.0  # toml beats default
    assert s.kv_type == "q8_0"
    assert s.host == "127.0.0.1"  # a None flag is "not given"


def test_env_parses_types(tmp_path: Path) -> None:
    env = {
        "ELBOWROOM_MEMORY_GUARD": "off",
        "ELBOWROOM_PRELOAD": "smollm2-135m, gemma3-270m",
        "ELBOWROOM_MODEL_PATHS": f"{tmp_path}/a:{tmp_path}/b",
        "ELBOWROOM_CTX": "2048",
    }
    s = load_settings({}, environ=env)
    assert s.memory_guard is False
    assert s.preload == ("smollm2-135m", "gemma3-270m")
    assert s.model_paths == (tmp_path / "a", tmp_path / "b")
    assert s.ctx == 2048


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ELBOWROOM_OVERRIDE_MEMORY": "lots"}, "override_memory"),
        ({"ELBOWROOM_KV_TYPE": "f32"}, "kv_type"),
        ({"ELBOWROOM_MEMORY_GUARD": "maybe"}, "memory_guard"),
        ({"ELBOWROOM_SOFT_FRACTION": "0.99"}, "soft_fraction"),
        ({"ELBOWROOM_KV_BLOCK_TOKENS": "0"}, "kv_block_tokens"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings({}, environ=env)


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load_settings({}, environ={}, config_file=toml)


def test_derived_paths(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.models_path == tmp_path / "models"
    assert s.measurements_path == tmp_path / "measured.json"


def test_event_loop_choice() -> None:
    """`event_loop`: auto takes uvloop when it is installed (it is a dependency here),
    asyncio is the standard loop, and a wrong value is refused by name."""
    import asyncio

    import uvloop

    from elbowroom.cli.server import loop_factory

    assert load_settings(environ={}).event_loop == "auto"
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    with pytest.raises(ConfigError, match="event_loop"):
        load_settings(environ={"ELBOWROOM_EVENT_LOOP": "trio"})


def test_a_removed_setting_is_refused_naming_why(tmp_path: Path) -> None:
    """direct_streams chose between two request paths; there is one now (server/stream/relay.py).
    A config that still names it learns that, wherever it is set."""
    toml = tmp_path / "config.toml"
    toml.write_text("direct_streams = false\n")
    for kwargs in (
        {"config_file": toml, "environ": {}},
        {"environ": {"ELBOWROOM_DIRECT_STREAMS": "false"}},
        {"flags": {"direct_streams": False}, "environ": {}},
    ):
        with pytest.raises(ConfigError, match=r"(?i)direct_streams.* was removed: every chat"):
            load_settings(**kwargs)  # type: ignore[arg-type]
