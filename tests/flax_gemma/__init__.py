"""Flax's gemma example (google/flax examples/gemma, commit 18f8f311c275d57f46d95e41b15aa97b454754c0).

The model files its ``Transformer`` needs, vendored as written (each file's
header names its edits) so that jaxdev's tests train gemma's own sharded
setup: ``tests/test_gemma_sharded.py``.
"""
