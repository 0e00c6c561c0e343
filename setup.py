"""Packaging: the core `smp` plus the frontends mapped in with package_dir (DESIGN.md layout)."""

from setuptools import setup

# The frontends live outside smp/ so the framework-free core is a separate tree;
# package_dir maps them into the smp namespace.
PACKAGE_DIR = {
    "smp": "smp",
    "smp.torch": "frontends/torch",
    "smp.tensorflow": "frontends/tensorflow",
}


def _packages() -> list[str]:
    import os

    found = []
    for name, root in PACKAGE_DIR.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, root)
                found.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return sorted(set(found))


setup(
    name="smp",
    version="0.1.0",
    description="Model-parallel training for PyTorch and TensorFlow with the SageMaker model parallelism v1 programming model",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir=PACKAGE_DIR,
    packages=_packages(),
    package_data={"smp": ["py.typed"], "smp.torch": ["py.typed"], "smp.tensorflow": ["py.typed"]},
    install_requires=[],
    extras_require={
        # Ranges, not pins: users keep their own (CUDA) torch.
        "torch": ["torch>=2.3", "numpy"],
        "hf": ["transformers>=5.0", "safetensors>=0.4", "accelerate>=1.0"],
        "mpi": ["mpi4py>=3.1"],
        # Keras 3 (TF >= 2.16); mpi4py is smp.tensorflow's transport.
        "tensorflow": ["tensorflow>=2.16", "mpi4py>=3.1", "numpy"],
        "dev": ["pytest>=8", "pytest-timeout>=2", "ruff>=0.5", "mypy>=1.10"],
    },
    entry_points={"console_scripts": ["smp=smp.cli:main"]},
    license="Apache-2.0",
)
