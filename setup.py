"""The one compiled part of ckptstore, built where a C compiler is (pyproject.toml holds the
rest of the project's metadata).

``ckptstore.store._gather`` packs small leaves and checks them out of a pack with their
crc32c in one call per pack, and copies a state's small tensors into the staging arena many to
a call (see its source). It is optional: where it cannot be built, the install goes on and
ckptstore uses its Python loops and torch's own copies, which give the same bytes and
checksums.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ckptstore.store._gather",
            ["ckptstore/store/_gather.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
