"""megascale.kernels"""
