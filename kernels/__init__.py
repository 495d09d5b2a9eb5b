"""liger_kernels: our Triton kernels with PyTorch reference paths (installed from `kernels/`)."""
