"""The on-device path: a model exported as per-block weight files and programs (`export`, built
from the engine's own ops in `programs`), and the runner that trains from them alone (`runner`:
torch and safetensors only)."""
