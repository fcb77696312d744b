"""Builds the optional C helper ``deltackpt._native`` (everything else is in pyproject.toml).

``optional=True``: without a C compiler the install still succeeds and deltackpt uses its
numpy fallback (slower delta encoding, same bytes).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "deltackpt._native",
            ["deltackpt/_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
