"""megascale.training"""
