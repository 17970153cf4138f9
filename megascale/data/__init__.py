"""megascale.data"""
