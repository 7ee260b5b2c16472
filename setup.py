from setuptools import find_packages, setup

setup(
    name="tilelang_ops",
    version="0.1.0",
    description="Hand-tuned TileLang GPU kernels as PyTorch custom ops (torch.ops.tileops.*)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tilelang_ops", "tilelang_ops.*"]),
    package_data={"tilelang_ops": ["csrc/*.cpp"]},  # the C++ call path, built on first import with CUDA
    python_requires=">=3.10",
    install_requires=["tilelang==0.1.15", "torch>=2.11", "tqdm"],
    extras_require={"test": ["pytest>=8", "hypothesis>=6"], "hf": ["transformers>=4.56"]},
    entry_points={"console_scripts": ["tileops=tilelang_ops.cli:main"]},
)
