"""Fail `make setup` early, with a clear message, when the environment cannot serve."""

from __future__ import annotations

from importlib.metadata import entry_points, version


def main() -> None:
    import ray  # noqa: F401
    import sglang.srt.server_args  # noqa: F401  (imports sgl_kernel through the shim)
    import zarr  # noqa: F401

    from hsx_kernels import fp8_cpu  # noqa: F401  (the CPU FP8 quantizer's kernel, built at install)

    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if plugins.get("hidden_capture") != "patches:register":
        raise SystemExit(f"the capture plugin's entry point is not registered: {plugins}")
    print(
        "environment ok: "
        + ", ".join(f"{p} {version(p)}" for p in ("sglang", "torch", "ray", "zarr", "transformers"))
    )


if __name__ == "__main__":
    main()
