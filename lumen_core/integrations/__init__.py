"""Integrations with outside engines; each module needs its own extra (``ray``: ``[ray]``).

Nothing is imported here, so ``import lumen_core.integrations`` costs nothing and a missing
extra only fails the module that needs it.
"""
