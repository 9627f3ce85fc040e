"""Entry point of the ``torch.backends`` group: registers "ddacomm" after a plain ``import torch``.

Must never raise (torch imports it at start-up) and must not load the extension eagerly.
"""


def register() -> None:
    try:
        from .backend_registration import register_backend
        register_backend()
    except Exception as e:  # noqa: BLE001 - a broken optional backend must not break `import torch`
        try:
            import warnings
            warnings.warn(f"commlib: registering the torch.distributed backend \"ddacomm\" failed "
                          f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - warnings configured as errors
            pass
