"""Fail `make setup` early, with a clear message, when the environment cannot serve; say
whether the optional CPU FP8 kernel was built (hsx_store/fp8.py warns where it was not)."""

from __future__ import annotations

from importlib.metadata import entry_points, version


def main() -> None:
    import ray  # noqa: F401
    import sglang.srt.server_args  # noqa: F401  (imports sgl_kernel through the shim)
    import zarr  # noqa: F401

    from hsx_store.fp8 import cpu_kernel

    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if plugins.get("hidden_capture") != "patches:register":
        raise SystemExit(f"the capture plugin's entry point is not registered: {plugins}")
    kernel = cpu_kernel()
    variants = "not built (the warning above)" if kernel is None else "/".join(kernel.variants())
    print(
        "environment ok: "
        + ", ".join(f"{p} {version(p)}" for p in ("sglang", "torch", "ray", "zarr", "transformers"))
        + f"; CPU FP8 kernel: {variants}"
    )


if __name__ == "__main__":
    main()
