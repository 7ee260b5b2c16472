"""Drop-in nn.Modules: thin wrappers that hold parameters and call the functional ops."""
from __future__ import annotations
