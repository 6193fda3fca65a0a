"""hybridrl: KL-regularized PPO/GRPO for LLMs on a Megatron-style 3D-parallel layout.

Install with ``pip install --no-build-isolation -e .`` after ``pip install torch==2.13.0``
(the Makefile does both): the csrc extension is compiled against the torch already installed,
so build isolation must be off or pip would pull a different torch into the build env.
"""

from setuptools import find_packages, setup


def _extensions():
    """(ext_modules, cmdclass) for the csrc kernels; owned by the kernels (csrc) code."""
    return [], {}


ext_modules, cmdclass = _extensions()

setup(
    name="hybridrl",
    version="0.1.0",
    description="3D-parallel RLHF (PPO/GRPO) with a zero-redundancy train->generation reshard",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridrl", "hybridrl.*"]),
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",
        "omegaconf>=2.3",
        "pyarrow>=14",
        "safetensors>=0.4",
        "numpy",
    ],
    extras_require={
        # GPU-only extras; apex is never listed (see shared DESIGN.md: PyPI's `apex` is unrelated).
        "gpu": ["sglang", "transformer-engine[pytorch]"],
        "test": ["pytest>=7", "ruff>=0.5", "transformers>=4.40", "einops", "ninja"],
    },
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
