"""The package's version: the C library's (capi/Cargo.toml), which the
loader checks at load and a test checks in the source tree."""

__version__ = "0.1.0"
