"""The plugin's settings travel to every SGLang process through the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from patches.settings import ENV_QUANTIZE, CaptureSettings


def test_settings_round_trip_through_the_environment_and_a_bad_quantization_is_refused() -> None:
    settings = CaptureSettings(Path("/dev/shm/x"), "hsx-", 1 << 20, True, 4096, "fp8_e4m3")
    assert CaptureSettings.from_env(settings.to_env()) == settings
    plain = CaptureSettings(Path("/dev/shm/x"), "hsx-", 1 << 20, False)
    assert ENV_QUANTIZE not in plain.to_env()
    assert CaptureSettings.from_env(plain.to_env()) == plain
    with pytest.raises(ValueError, match="HIDDEN_CAPTURE_QUANTIZE='int4': expected one of"):
        CaptureSettings.from_env(plain.to_env() | {ENV_QUANTIZE: "int4"})
