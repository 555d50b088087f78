"""The on-device path: a model exported as per-block weight files and ExecuTorch programs
(`export`, built from the engine's own ops in `programs`), and the drivers that train from them
alone: the native runner (runtime/, launched by `native`) and the Python one (`et_driver`, with
what it shares in `runner`: no model code)."""
