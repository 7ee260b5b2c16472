"""TileLang kernels, one file per family. Nothing here knows torch.library or validates input."""
