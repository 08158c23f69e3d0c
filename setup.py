"""areal-tik: bitwise-identical rollout and training kernels for AReaL."""
from setuptools import find_packages, setup

setup(
    name="areal-tik",
    version="0.1.0",
    description="Unified Triton kernels so that AReaL rollout and training log-probs agree bit for bit",
    python_requires=">=3.11",
    packages=find_packages(include=["areal_tik", "areal_tik.*"]),
    install_requires=[
        "torch>=2.11",
        "triton>=3.6,<3.7",
        "numpy<2.4",
        "transformers>=5.0",
        "safetensors",
        "gguf",
    ],
    extras_require={
        "test": ["pytest>=8"],
    },
    entry_points={"console_scripts": ["areal-tik=areal_tik.cli:main"]},
)
