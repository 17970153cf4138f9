"""megascale.checkpoint"""
