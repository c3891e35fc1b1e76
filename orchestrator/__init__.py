"""dejavu-triton: disaggregated prefill/decode serving (DejaVu + Splitwise) on Triton."""
