"""Checking a store: `python -m cluster verify` (command.py) runs the store's own integrity
checks (hsx_store/integrity.py) and, given the model, the checks that need it on one patched
SGLang server (server.py): recompute.py and logprobs.py, whose shared opening is model_check.py.
Design and measured bounds: docs/design/verify.md."""

from cluster.verify.command import verify

__all__ = ["verify"]
