from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from confkv.compress.config import parse_size
from confkv.server.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_file_states_every_setting_with_its_default():
    import yaml

    path = ROOT / "confkv" / "config" / "server.yaml"
    stated = yaml.safe_load(path.read_text())
    assert set(stated) == set(Settings.model_fields) - {"config"}  # `config` names the file itself
    assert set(stated["cluster"]) == set(Settings.model_fields["cluster"].annotation.model_fields)
    from_file = load_settings(["--config", str(path)])
    assert from_file.model_dump(exclude={"config"}) == Settings().model_dump(exclude={"config"})


def test_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9000\nmax_num_seqs: 4\nmax_cache_size: 1GiB\n")
    monkeypatch.setenv("CONFKV_MAX_NUM_SEQS", "6")
    s = load_settings(["--config", str(config), "--max-cache-size", "512", "--compression-enabled", "false"])
    assert (s.port, s.max_num_seqs, s.max_cache_size, s.compression_enabled) == (9000, 6, "512", False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096 * 2**20), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("50%", 500), ("1.5gib", 3 * 2**29)],
)
def test_parse_size(text, expected):
    assert parse_size(text, total_bytes=1000) == expected


@pytest.mark.parametrize("text", ["abc", "0", "-5", "150%", "12 parsecs"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="max_cache_size|percentage"):
        parse_size(text, total_bytes=1000)
    with pytest.raises(ValidationError):
        Settings(max_cache_size=text)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(["--config", str(tmp_path / "nope.yaml")])


def test_model_name_served_to_openai_clients(tmp_path):
    assert load_settings([]).model_name() == "SmolLM2-135M-Instruct"
    assert load_settings(["--model-path", str(tmp_path / "my-model")]).model_name() == "my-model"
    assert load_settings(["--served-model-name", "chat", "--model-path", str(tmp_path)]).model_name() == "chat"


def test_prefix_cache_warmup_takes_text_and_chats(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(
        "prefix_cache_warmup:\n  - You are a careful assistant.\n  - [{role: system, content: Answer briefly.}]\n"
    )
    warmup = load_settings(["--config", str(config)]).prefix_cache_warmup
    assert warmup[0] == "You are a careful assistant."
    assert warmup[1][0].role == "system" and warmup[1][0].content == "Answer briefly."
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefix_cache_warmup:\n  - [{role: robot, content: x}]\n")
    with pytest.raises(ValidationError):
        load_settings(["--config", str(bad)])
