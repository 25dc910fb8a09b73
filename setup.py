from setuptools import find_packages, setup

setup(
    name="megatron-dilocox",
    version="0.1.0",
    description="Megatron-core GPT pretraining across slow-linked clusters with DiLoCoX outer sync",
    packages=find_packages(include=["megatron_dilocox", "megatron_dilocox.*"]),
    py_modules=["pretrain_gpt"],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",  # tested: 0.16.1 (Python 3.11), 0.19.2 (3.12)
        "numpy",
        "sentencepiece",
        "psutil",  # megatron.core.dist_checkpointing needs it but does not declare it
        "torchft==0.2.0",  # the fault-tolerant exchange between clusters (outer/cluster_exchange.py)
    ],
    extras_require={
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "hypothesis"],
    },
)
