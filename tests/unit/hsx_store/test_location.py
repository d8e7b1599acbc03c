"""Secrets never reach an error message: S3, Azure and GCS credentials, as options or in the
environment."""

from __future__ import annotations

import pytest

from hsx_store.location import describe_failure, mask_secrets

OPTIONS = {
    "aws_session_token": "FwoGZXIvYXdzEXAMPLESESSION",
    "azure_storage_account_key": "bXlBenVyZUFjY291bnRLZXk=",
    "azure_storage_sas_key": "sv=2024-01-01&sig=abcdef",
    "azure_client_secret": "client-secret-value",
    "google_service_account_key": '{"private_key": "-----BEGIN PRIVATE KEY-----"}',
    "bearer_token": "bearer-value",
    "region": "us-east-1",
}
ENV = {
    "AWS_SECRET_ACCESS_KEY": "env-aws-secret",
    "AZURE_STORAGE_ACCESS_KEY": "env-azure-key",
    "GOOGLE_SERVICE_ACCOUNT_KEY": "env-google-key",
}


def test_every_secret_option_and_variable_is_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    secrets = [v for k, v in OPTIONS.items() if k != "region"] + list(ENV.values())
    text = describe_failure("s3://bucket/s.zarr", RuntimeError(" | ".join(secrets)), OPTIONS)
    assert not any(secret in text for secret in secrets), text
    assert text.startswith("s3://bucket/s.zarr: RuntimeError: ***")
    assert mask_secrets("region us-east-1", OPTIONS) == "region us-east-1"  # not a secret


def test_short_values_do_not_mask_ordinary_text() -> None:
    assert mask_secrets("a key of abc", {"token": "abc"}) == "a key of abc"
