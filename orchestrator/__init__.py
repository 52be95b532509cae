"""deployctl: deploy very large LLMs onto small clusters of DGX Spark and RTX PRO 6000 hosts."""
__version__ = "0.1.0"
