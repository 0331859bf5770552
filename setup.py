"""oslo-models: Hugging Face compatible model zoo with tensor, sequence, pipeline and data parallelism built in."""
from setuptools import find_packages, setup

setup(
    name="oslo-models",
    version="0.1.0",
    description="Hugging Face Transformers-compatible models with parallelism built in",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["oslo_models", "oslo_models.*"]),
    python_requires=">=3.10",
    # Floors are what the GPU machine has (torch 2.11, transformers 5.17, accelerate 1.15, triton 3.6);
    # no ceiling on torch so a pinned CPU wheel (Makefile) satisfies it without pulling CUDA builds.
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=0.24",
        "tokenizers>=0.19",
        "numpy>=1.24",
        "tqdm>=4.60",
        "pyyaml>=6.0",
    ],
    extras_require={
        "data": ["datasets>=2.18"],
        "triton": ["triton>=3.0"],
        "plot": ["matplotlib>=3.6"],
        "peft": ["peft>=0.17"],  # oslo_models.adapters (LoRA); imported only there
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],  # make docs
        "dev": ["datasets>=2.18", "triton>=3.0", "matplotlib>=3.6", "pytest>=7", "pytest-xdist>=3", "peft>=0.17",
                "hypothesis>=6.100", "ruff>=0.5", "trl>=1.16,<2",  # trl: tests/adapters/test_trl.py (~5 s)
                "parameterized>=0.9"],  # parameterized: transformers' common model tests import it
    },
    entry_points={"console_scripts": ["oslo-models=oslo_models.cli:main"]},
)
