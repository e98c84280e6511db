"""automicro: OOM-safe auto microbatching for MosaicML Composer on FSDP2."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _read(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as handle:
        return handle.read()


def _requirements(name: str) -> list[str]:
    return [line.split("#")[0].strip() for line in _read(name).splitlines() if line.split("#")[0].strip()]


# The version is kept in one place: automicro/__init__.py.
VERSION = re.search(r'^__version__ = "([^"]+)"', _read(os.path.join("automicro", "__init__.py")), re.M).group(1)

setup(
    name="automicro",
    version=VERSION,
    description="OOM-safe `device_train_microbatch_size: auto` for Composer on FSDP2",
    long_description=_read("README.md"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    keywords=["pytorch", "composer", "fsdp2", "microbatching", "llm", "distributed training"],
    # The main job's YAMLs (`python -m automicro.train tiny-cpu`) and llm-foundry's, with their data: one copy in
    # the repository's top-level configs/, carried in the wheel as automicro/configs/ (automicro.config.configs_dir).
    packages=find_packages(include=["automicro", "automicro.*"]) + ["automicro.configs"],
    package_dir={"automicro.configs": "configs"},
    package_data={"automicro.configs": ["*.yaml", "data/*/*.jsonl"]},
    entry_points={"console_scripts": ["automicro-train = automicro.train:cli"]},
    python_requires=">=3.10",
    install_requires=[
        "mosaicml==0.32.1",
        "omegaconf>=2.3",
        "wandb>=0.17,<0.29",  # Composer 0.32.1 WandBLogger calls run.get_url(), removed in wandb 0.29
    ],
    extras_require={
        "foundry": [
            "llm-foundry==0.22.0",  # python -m automicro.foundry (needs torch 2.7.0: llm-foundry pins torch<2.7.1)
        ],
        "hf": [
            "transformers>=4.51",  # automicro.hf.AutoMicrobatchTrainer (tested on 4.51, 5.17, 5.24)
            "accelerate>=1.6",  # the Trainer's own dependency; FSDP2 through accelerate from 1.6
        ],
        "lightning": [
            "pytorch-lightning>=2.6,<2.7",  # automicro.lightning.AutoMicrobatch (manual optimization on AutoStep)
        ],
        "kernels": [
            "liger-kernel>=0.8.5",  # the fused vocabulary head's CUDA backend (automicro.engine.head; tested on 0.8.5)
        ],
        "torchtitan": [
            "torchtitan==0.3.0",  # python -m automicro.torchtitan (needs torch >= 2.12: tested on 2.15)
        ],
        # make docs: the site from docs/ (mkdocs.yml), the API reference read from the source.
        "docs": _requirements(os.path.join("requirements", "docs.txt")),
        "plot": [
            "matplotlib>=3.7",  # scripts/plot_run.py
        ],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # make test runs two pytest workers (2-core CI: workers idle in launches)
            "hypothesis>=6.100",  # stateful property tests of the search policy
            "matplotlib>=3.7",  # tests/test_dashboard.py renders scripts/plot_run.py's PNG
            "transformers>=4.51,<4.52",  # tests with Hugging Face models built from a config (llm-foundry 0.22's pin)
            "accelerate>=1.6,<1.9",  # tests/test_hf_trainer.py (llm-foundry 0.22 pins accelerate<1.9)
            "huggingface-hub<0.34",  # llm-foundry 0.22's pin (accelerate would raise it)
            "pytorch-lightning==2.6.6",  # tests/test_lightning.py
            "build>=1.2",  # tests/test_package.py builds the wheel and the sdist
            "twine>=6.1",  # tests/test_package.py checks them
        ],
    },
)
