"""megascale.model"""
